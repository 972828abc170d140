"""What the model attends to: attention rollout (Abnar & Zuidema 2020; Fig. 6 and App. D.8 of the ViT paper),
gradient-weighted rollout, per-layer/per-head maps and the mean attention distance (Fig. 7 right, App. D.7).

Attention is computed explicitly only in the layers asked for, one layer at a time; every other layer
keeps the fused kernel. Nothing here uses hooks.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from ..models.vit import resolve_layers
from ..errors import UsageError
from ..models.swin import window_reverse


def require_vit(model: nn.Module) -> None:
    if not hasattr(model, "blocks") or not hasattr(model, "embed"):
        raise UsageError(f"{type(model).__name__} has no attention layers: this analysis needs a ViT or a hybrid")


def iter_attention(model: nn.Module, x: torch.Tensor, layers: Sequence[int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (layer, softmax attention (B, H, T, T)) for the layers asked for, one at a time."""
    require_vit(model)
    wanted = resolve_layers(layers, len(model.blocks))
    if not wanted:
        return
    grid, rope = model.grid_for(x), model.rope_for(x)
    h = model.embed(x)
    for i, blk in enumerate(model.blocks):
        if i in wanted:
            h, attn = blk(h, return_attention=True, grid=grid, rope=rope)
            yield i, attn
        else:
            h = blk(h, grid=grid, rope=rope)
        if i >= max(wanted):
            return


def rollout(attentions: Sequence[torch.Tensor], discard_ratio: float = 0.0, head_fusion: str = "mean",
            num_prefix_tokens: int = 1) -> torch.Tensor:
    """Attention rollout: fuse the heads, optionally zero the lowest attentions, add the identity for the
    residual, renormalise the rows, and multiply through the layers (first to last).

    Args:
        attentions: per layer (B, H, T, T) softmax weights, or (B, T, T) already fused.
        discard_ratio: the fraction of the lowest attentions (per row, prefix tokens kept) set to zero.
        head_fusion: "mean", "max" or "min" over heads.
    Returns: (B, T, T): how much each output token draws on each input token.
    """
    result = None
    for a in attentions:
        if a.ndim == 4:
            a = {"mean": a.mean(1), "max": a.amax(1), "min": a.amin(1)}[head_fusion]  # (B, T, T)
        a = a.float()
        if discard_ratio > 0:
            flat = a.clone()
            keep = flat[..., :num_prefix_tokens].clone()
            k = int(flat.shape[-1] * discard_ratio)
            if k:
                low = flat.topk(k, dim=-1, largest=False).indices
                flat.scatter_(-1, low, 0.0)
            flat[..., :num_prefix_tokens] = keep  # never discard the class token's column
            a = flat
        eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
        a = (a + eye) / 2
        a = a / a.sum(-1, keepdim=True)
        result = a if result is None else a @ result
    if result is None:
        raise UsageError("rollout needs at least one layer of attention")
    return result


def token_map(joint: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """(B, T, T) rollout -> (B, gh, gw): the class token's row, or for gap models the mean over patch rows,
    over the patch columns, normalised to a maximum of 1."""
    p = num_prefix_tokens
    rows = joint[:, 0, p:] if p else joint[:, :, p:].mean(1)  # (B, N)
    m = rows.reshape(-1, *grid_size)
    return m / m.amax(dim=(1, 2), keepdim=True).clamp(min=1e-12)


def attention_rollout(model: nn.Module, x: torch.Tensor, discard_ratio: float = 0.0, head_fusion: str = "mean") -> torch.Tensor:
    """(B, gh, gw) rollout maps for images x."""
    with torch.no_grad():
        fused = [a.mean(1) if head_fusion == "mean" else a for _, a in iter_attention(model, x)]
    c = model.config
    return token_map(rollout(fused, discard_ratio, head_fusion, c.num_prefix_tokens), c.grid_size, c.num_prefix_tokens)


def register_attention(model: nn.Module, x: torch.Tensor, head_fusion: str = "mean") -> dict[str, torch.Tensor]:
    """Where a model with register tokens (Darcet et al. 2023) puts attention on them, apart from the patch maps.

    Returns {"class_to_registers" (B, L, H, R): the class token's attention to each register, per layer and head;
    "patches_to_registers" (B, L, R): the patch tokens' mean attention to each register, per layer;
    "rollout_registers" (B, R) and "rollout_patches" (B,): the share of the class token's rollout on each register
    and on the patches together}. Without a class token the class rows are absent."""
    require_vit(model)
    c = model.config
    if not c.reg_tokens:
        raise UsageError("this model has no register tokens")
    p, r0 = c.num_prefix_tokens, c.num_prefix_tokens - c.reg_tokens  # registers: prefix columns r0 .. p-1
    per_layer, from_patches = [], []
    with torch.no_grad():
        layers = [a for _, a in iter_attention(model, x)]
    for a in layers:
        if c.class_token:
            per_layer.append(a[:, :, 0, r0:p])  # (B, H, R)
        from_patches.append(a[:, :, p:, r0:p].mean(dim=(1, 2)))  # (B, R)
    out = {"patches_to_registers": torch.stack(from_patches, 1)}
    if c.class_token:
        out["class_to_registers"] = torch.stack(per_layer, 1)
        joint = rollout(layers, head_fusion=head_fusion, num_prefix_tokens=p)
        out["rollout_registers"], out["rollout_patches"] = joint[:, 0, r0:p], joint[:, 0, p:].sum(-1)
    return out


def grad_rollout(model: nn.Module, x: torch.Tensor, class_index: int | Sequence[int] | None = None,
                 discard_ratio: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient-weighted rollout for a class: each layer's attention weighted by d(logit)/d(attention),
    negatives clipped, heads averaged, then rolled out. Returns (maps (B, gh, gw), class indices (B,))."""
    require_vit(model)
    c = model.config
    out = model.forward_intermediates(x, attention=True)
    logits = out["logits"]
    idx = logits.argmax(-1) if class_index is None else torch.as_tensor(class_index, device=logits.device).expand(len(x))
    attns = [out["attention"][i] for i in sorted(out["attention"])]
    grads = torch.autograd.grad(logits.gather(1, idx.view(-1, 1)).sum(), attns)
    fused = [(a * g).clamp(min=0).mean(1).detach() for a, g in zip(attns, grads)]
    # rows of a gradient-weighted map need not sum to 1; rollout renormalises after adding the identity
    fused = [f / f.sum(-1, keepdim=True).clamp(min=1e-12) for f in fused]
    joint = rollout(fused, discard_ratio, num_prefix_tokens=c.num_prefix_tokens)
    return token_map(joint, c.grid_size, c.num_prefix_tokens), idx


def layer_head_maps(model: nn.Module, x: torch.Tensor, layers: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """{layer: (B, H, gh, gw)}: the class token's (or for gap, the mean patch's) attention to every patch, per head."""
    c = model.config
    p = c.num_prefix_tokens
    maps = {}
    with torch.no_grad():
        for i, a in iter_attention(model, x, layers):
            rows = a[:, :, 0, p:] if p else a[:, :, p:, p:].mean(2)  # (B, H, N)
            maps[i] = rows.reshape(*rows.shape[:2], *c.grid_size)
    return maps


def patch_distances(grid_size: tuple[int, int], patch_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between patch centres."""
    gh, gw = grid_size
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float64) * patch_size[0],
                            torch.arange(gw, dtype=torch.float64) * patch_size[1], indexing="ij")
    pts = torch.stack([ys.flatten(), xs.flatten()], 1)  # (N, 2)
    return torch.cdist(pts, pts)


def mean_attention_distance_from(attn: torch.Tensor, dist: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(B, H, T, T) attention -> (B, H): per head, the attention-weighted pixel distance between a query patch
    and the patches it attends to (weights renormalised over patch keys), averaged over query patches."""
    p = num_prefix_tokens
    w = attn[:, :, p:, p:].double()  # (B, H, N, N)
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-12)
    return (w * dist.to(w.device)).sum(-1).mean(-1)  # (B, H)


def mean_attention_distance(model: nn.Module, batches: Callable[[], Iterator[torch.Tensor]] | Sequence[torch.Tensor]) -> torch.Tensor:
    """(depth, heads) mean attention distance in pixels, averaged over every image of `batches`.

    Memory is bounded by one layer's attention of one batch.
    """
    require_vit(model)
    c = model.config
    dist = patch_distances(c.grid_size, c.patch_size)
    total = torch.zeros(len(model.blocks), c.num_heads, dtype=torch.float64)
    n = 0
    with torch.no_grad():
        for x in (batches() if callable(batches) else batches):
            for i, a in iter_attention(model, x):
                total[i] += mean_attention_distance_from(a, dist, c.num_prefix_tokens).sum(0).cpu()
            n += len(x)
    if n == 0:
        raise UsageError("no images to measure the attention distance on")
    return (total / n).float()


def grad_cam(model: nn.Module, x: torch.Tensor, class_index: int | Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grad-CAM (Selvaraju et al. 2017) for a CNN without attention (the BiT baseline): the final feature map
    weighted per channel by the mean gradient of the class logit, summed, negatives clipped, normalised to a
    maximum of 1. Returns (maps (B, h, w), class indices (B,))."""
    with torch.enable_grad():
        feats = model.forward_features(x).detach().requires_grad_(True)  # (B, F, h, w); a Swin's (B, h, w, F)
        logits = model.forward_head(feats)
        idx = logits.argmax(-1) if class_index is None else torch.as_tensor(class_index, device=logits.device).expand(len(x))
        (grad,) = torch.autograd.grad(logits.gather(1, idx.view(-1, 1)).sum(), feats)
    if getattr(model.config, "arch", "") == "swin":  # channels last: the same map
        feats, grad = feats.permute(0, 3, 1, 2), grad.permute(0, 3, 1, 2)
    cam = (grad.mean(dim=(2, 3), keepdim=True) * feats).sum(1).clamp(min=0).detach()  # (B, h, w)
    return cam / cam.amax(dim=(1, 2), keepdim=True).clamp(min=1e-12), idx


def swin_window_maps(model: nn.Module, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """A Swin's attention, window by window: {block: (B, h, w)}, how much attention each token receives from the
    queries of its own window (mean over heads and queries), laid back on the block's map (the shift undone),
    normalised to a maximum of 1 per image. Windows show as tiles; a shifted block's tiles straddle the others'."""
    with torch.no_grad():
        attn = model.forward_intermediates(x, attention=True)["attention"]
    maps = {}
    for i, blk in enumerate(model.blocks):
        a = attn[i]  # (B, nW, H, N, N)
        recv = a.mean(dim=(2, 3))  # (B, nW, N): mean over heads and queries
        m = window_reverse(recv.reshape(-1, recv.shape[-1], 1), blk.win, *blk.grid)[..., 0]  # (B, h, w)
        if any(blk.shift):
            m = torch.roll(m, shifts=blk.shift, dims=(1, 2))
        maps[i] = m / m.amax(dim=(1, 2), keepdim=True).clamp(min=1e-12)
    return maps
