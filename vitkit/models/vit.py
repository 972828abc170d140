"""The Vision Transformer of "An Image Is Worth 16x16 Words" (arXiv 2010.11929), read top to bottom.

    image (B, C, H, W)
      -> patches: conv, kernel = stride = P         (B, N, D)     Eq. 1, or a ResNet first (hybrid)
      -> prepend the learnable [class] token        (B, 1 + N, D)
      -> add the position embedding, dropout
      -> L pre-norm blocks: x + MSA(LN(x)); x + MLP(LN(x))          Eq. 2, 3
      -> final LayerNorm on every token                              Eq. 4
      -> pool: the class token ('token') or the mean of all tokens ('gap')
      -> [pre-logits Linear + tanh] -> head Linear (zero-initialised)

Images of different sizes and aspect ratios run as one packed batch (NaViT, SigLIP 2's NaFlex: `forward_packed`,
`layers/packing.py`): a row of patches per image, each with its own resampled position grid, attention masked to its
own tokens and pooled alone.

The ViTs that followed (DeiT-III, DINOv2, SigLIP, EVA-02, CLIP) are the same encoder with a few options, each a
config field that is off by default (so the paper's models are unchanged; `vit_config.GROUPS` sorts them into
position, tokens, pooling, norms and attention/MLP variants), each a small module in `layers/`, built by the
factories of `vit_layers.py` and handed to this model and its blocks:
LayerScale on both residual branches (`init_values`), register tokens after the class token (`reg_tokens`), a
position embedding over the patches alone (`no_embed_class`), a LayerNorm before the blocks (`pre_norm`, CLIP) and a
patch embedding without bias (`patch_bias`, CLIP), qk-norm, a LayerNorm inside attention (`attn_norm`) and inside
the MLP (`mlp_norm`), the SwiGLU MLP (`mlp_layer`), 2-D rotary embeddings (`rope`: EVA-02's and ROPE-ViT's axial ones,
ROPE-ViT's learned per-block frequencies, DINOv3's normalised coordinates), CLIP's quick GELU (`act`), and pooling by
attention (`classifier='map'`, SigLIP; the Perception Encoder's with its own heads) or by the mean with a norm after
it (`fc_norm`). The 2025 backbones add RMSNorm, a norm on the patch tokens and no projection biases (`norm`,
`patch_norm`, `proj_bias`: AIMv2) and no final norm (`final_norm`: PE's aligned towers); residual post-norm blocks
(`res_post_norm`: EVA-02-CLIP-E) and grouped-query attention (`num_kv_heads`: Sapiens2).

Every forward (features, logits, the class-token-only last block, intermediates, packed, masked patch prediction)
runs the blocks through one loop, `VisionTransformer._encode`. Beside this file: the config (`vit_config.py`), the
layers it asks for (`vit_layers.py`: the block, `layers/block.py`, gets the layers `make_block` builds), packed
batches (`packed.py`) and masked patch prediction (`mpp.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from .layers import Attention, Linear, PatchDropout, RelativePositionBias, RelativePositionMlp
from .layers.attention import check_impl
from .layers.block import Block
from .layers.mlp import lecun_normal_
from .layers.packing import PackedBatch, as_packed
from .layers.patch_embed import to_2tuple
from .layers.tracing import is_fx_tracing
from .mpp import MaskedPatchPrediction, mpp_layers
from .packed import PackedForward
from .timm_api import VIT_POOL_NAMES, TimmModelApi, check_class_names, check_num_classes, vit_classifier
from .vit_config import ViTConfig
from .vit_layers import (
    make_attn_pool,
    make_block,
    make_shared_rel_pos,
    make_patch_embed,
    make_pos_embed,
    make_prefix_tokens,
    make_rope,
    norm_or_identity,
)
from ..errors import UsageError
from ..safety import check_alloc


def resolve_layers(layers: int | Sequence[int] | None, depth: int) -> set[int]:
    """Block indices from `forward_intermediates`-style arguments: None for all, an int n for the last n, or a
    sequence of indices (negative counts from the end). An index outside [-depth, depth) is a ValueError."""
    if layers is None:
        return set(range(depth))
    if isinstance(layers, int):
        if not 0 <= layers <= depth:
            raise UsageError(f"asked for the last {layers} layers of a model of depth {depth}")
        return set(range(depth - layers, depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise UsageError(f"layer index {bad[0]} is out of range for a model of depth {depth} "
                         f"(valid: {-depth} to {depth - 1})")
    return {i % depth for i in layers}


# torch.fx with dynamic_img_size: the patch grid is read from the input's shape when the traced module runs, so what
# depends on it (the position embedding resampled to it, the rotary angles; the relative bias's table in
# `layers/block.py`) is one call each in the graph, run with the real grid (as `pad_same` in resnet.py), instead of
# Python branches on traced sizes.
def _pos_embed_at(pos_embed: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    return pos_embed(x, tuple(grid))


def _rope_at(rope: nn.Module, grid: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope(tuple(grid), device=like.device)


torch.fx.wrap("_pos_embed_at")
torch.fx.wrap("_rope_at")


class PreLogits(nn.Module):
    """The pre-training head's hidden layer: Linear(D, R) + tanh (Sec. 3.1, App. B.1.1)."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.fc = Linear(dim, size)
        lecun_normal_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class VisionTransformer(PackedForward, MaskedPatchPrediction, TimmModelApi, nn.Module):
    """ViT, and with `hybrid_layers` set, the ResNet + ViT hybrid. Build it with `vitkit.create_model`.

    timm's model API (`TimmModelApi`, docs/timm.md): num_classes, pretrained_cfg, get_classifier, reset_classifier
    (num_classes, global_pool), set_input_size, no_weight_decay, group_matcher, embed_dim, num_prefix_tokens, ..."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = self.config = config
        # the layers each option changes are built by `vit_layers`, once; in this order (a seeded model's init)
        self.patch_embed = make_patch_embed(c)  # Eq. 1 (on a ResNet's feature map for a hybrid)
        self.cls_token, self.dist_token, self.reg_token = make_prefix_tokens(c)  # the [class] token (DeiT's, registers)
        self.pos_embed = make_pos_embed(c)  # E_pos
        self.rope = make_rope(c)  # None without rotary embeddings
        self.pos_drop = nn.Dropout(c.drop_rate)
        self.patch_drop = PatchDropout(c.patch_drop_rate, c.num_prefix_tokens)  # token dropping in training
        self.norm_pre = norm_or_identity(c, c.pre_norm)  # CLIP's ln_pre
        self.shared_rel_pos = make_shared_rel_pos(c)  # None unless one relative position MLP serves every block
        self.blocks = nn.ModuleList(make_block(c, i, self.shared_rel_pos) for i in range(c.depth))  # Eq. 2-3
        self.norm = norm_or_identity(c, c.final_norm and not c.fc_norm)  # Eq. 4
        self.fc_norm = norm_or_identity(c, c.fc_norm)  # after the mean instead (fc_norm)
        self.attn_pool = make_attn_pool(c)  # classifier 'map'
        self.pre_logits = PreLogits(c.embed_dim, c.representation_size) if c.representation_size else nn.Identity()
        self.head_drop = nn.Dropout(c.drop_rate)
        self.num_features = c.representation_size or c.embed_dim
        self.head = self._new_head(c.num_classes)
        self.head_dist = self._new_head(c.num_classes) if c.distilled else None
        self.distilled_training = False  # set by the trainer: in training, return both heads' logits
        if c.mpp:
            self.mask_token, self.mpp_head = mpp_layers(c.embed_dim, c.in_chans)  # masked patch prediction (mpp.py)
        # Two speed switches, per instance (timm decides `fused_attn` per instance in the same way):
        # - lowp_stream: under autocast the tokens between blocks stay fp32 (the position embedding promotes
        #   them), so every norm, residual add and GELU runs in fp32 with a cast in front of every Linear. True
        #   keeps the stream in the autocast dtype, as pure-bf16 training does (1.2x faster training on a CPU at
        #   small widths, 1.1-1.2x for B/16 on an H100; benchmarks/NOTES.md sections 8 and 11); weights,
        #   gradients and the optimizer stay fp32. The trainer sets it from `run.lowp_stream`.
        # - last_block_cls_only: with the class token as the classifier the head reads one token, so `forward`
        #   runs the last block's queries, output projection and MLP on the class token alone (keys and values
        #   still from every token): the same logits and gradients, ~6.5% fewer FLOPs for a 12-layer model.
        #   `forward` falls back to the full last block whenever something could see the difference: a forward
        #   hook or pre-hook on the last block or any module inside it, or torch.fx tracing (feature extraction).
        self.lowp_stream = False
        self.last_block_cls_only = True
        # Activation checkpointing (`set_grad_checkpointing`): each block's activations are recomputed in the
        # backward instead of kept, trading ~a third more compute for memory that no longer grows with depth.
        self.grad_checkpointing = False

    def _new_head(self, num_classes: int) -> nn.Module:
        if not num_classes:
            return nn.Identity()
        head = Linear(self.num_features, num_classes)
        nn.init.zeros_(head.weight)  # the official head is zero-initialised
        nn.init.zeros_(head.bias)
        return head

    # ---- the forward pass, split as features / pooling / head -------------------------------------

    def grid_for(self, x: torch.Tensor) -> tuple[int, int] | None:
        """The patch grid of an input batch when the model takes any size (dynamic_img_size), else None."""
        return self.patch_embed.grid_for(x) if self.config.dynamic_img_size else None

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Image (B, C, H, W) -> the input sequence of the encoder (B, T, D), position added."""
        grid = self.grid_for(x)
        return self._add_tokens(self.patch_embed(x), grid)  # (B, N, D) -> (B, T, D)

    def _add_tokens(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """Patch tokens (B, N, D) -> (B, p + N, D): the class (distillation, register) tokens prepended, position
        added (to the patches alone with no_embed_class), then the pre-norm where there is one (CLIP)."""
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.config.no_embed_class:
            x = self._add_pos(x, grid)  # (B, N, D)
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # (B, p + N, D)
        if not self.config.no_embed_class:
            x = self._add_pos(x, grid)
        x = self.norm_pre(self.pos_drop(x))
        if self.lowp_stream and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def _add_pos(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        if grid is not None and is_fx_tracing():  # one traced call, resampling to the grid the input has
            return _pos_embed_at(self.pos_embed, x, grid)
        return self.pos_embed(x, grid)

    def rope_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary embedding's (sin, cos) for an image batch's patch grid, or None for a model without one."""
        if self.rope is None:
            return None
        if is_fx_tracing():  # the angles for the grid the input has, one traced call (none of them cached here)
            sincos = _rope_at(self.rope, self.patch_embed.grid_for(x), x)
            return sincos[0], sincos[1]
        return self.rope(self.patch_embed.grid_for(x), device=x.device)

    def _run(self, blk: Block, x: torch.Tensor, **kw) -> torch.Tensor:
        """One block; with `set_grad_checkpointing` in training, its activations recomputed in the backward."""
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, **kw)
        return blk(x, **kw)

    def _encode(self, h: torch.Tensor, *, grid: tuple[int, int] | None = None, rope: tuple | None = None,
                mask: torch.Tensor | None = None, keep: set[int] = frozenset(), attention: bool = False,
                norm_kept: bool = False, cls_only_last: bool = False) -> tuple[torch.Tensor, dict, dict]:
        """The encoder, every forward's one loop over the blocks: tokens (B, T, D) -> (the last block's output
        before the final norm, {i: block i's output} for i in `keep` (after the final norm with `norm_kept`),
        {i: block i's softmax attention (B, H, T, T)} for i in `keep` when `attention`).

        grid, rope: the input's patch grid (dynamic_img_size) and rotary angles; mask: a packed batch's keys
        (B, 1, 1, T). cls_only_last: the last block runs its queries, projection and MLP on the prefix tokens alone
        (`last_block_cls_only`): its output is then (B, p, D)."""
        tokens, attn = {}, {}
        last = len(self.blocks) - 1
        per_block = rope is not None and self.rope.per_block  # ROPE-ViT-Mixed: (sin, cos) of each block's frequencies
        rope_all = rope
        for i, blk in enumerate(self.blocks):
            if per_block:
                rope = (rope_all[0][i], rope_all[1][i])  # each (heads, N, hd), or (B, heads, L, hd) packed
            # the prefix tokens, all the head reads: (B, 1, D), (B, 2, D) with DeiT's distillation token,
            # (B, 1 + R, D) with R registers
            queries = self.config.num_prefix_tokens if cls_only_last and i == last else None
            if attention and i in keep:
                h, attn[i] = self._run(blk, h, return_attention=True, grid=grid, rope=rope, mask=mask)
            else:
                h = self._run(blk, h, queries=queries, grid=grid, rope=rope, mask=mask)
            if i in keep:
                tokens[i] = self.norm(h) if norm_kept else h
        return h, tokens, attn

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """All tokens after the final norm: (B, C, H, W) -> (B, T, D)."""
        h = self.patch_drop(self.embed(x))  # (B, T, D); in training with patch_drop_rate (B, p + K, D)
        return self.norm(self._encode(h, grid=self.grid_for(x), rope=self.rope_for(x))[0])


    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D): the class token, the mean of the patch tokens, or their attention pooling."""
        if self.config.classifier == "token":
            return x[:, 0]
        if self.attn_pool is not None:  # over the patches, or every token (pool_prefix: timm's Eva, PE)
            return self.attn_pool(x if self.config.pool_prefix else x[:, self.config.num_prefix_tokens :])
        return self.fc_norm(x[:, self.config.num_prefix_tokens :].mean(dim=1))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, T, D) -> logits (B, K); with `pre_logits`, the head's input (B, R or D).

        A distilled model (DeiT) has two: the class token's head and the distillation token's. Its logits are their
        mean, or both, as a pair, in training with `distilled_training` (the trainer's distillation loss)."""
        if self.head_dist is not None:
            cls, dist = x[:, 0], x[:, 1]
            if pre_logits:
                return (cls + dist) / 2
            logits, logits_dist = self.head(self.head_drop(cls)), self.head_dist(self.head_drop(dist))
            if self.training and self.distilled_training:
                return logits, logits_dist
            return (logits + logits_dist) / 2
        x = self.pre_logits(self.pool(x))
        if pre_logits:
            return x
        return self.head(self.head_drop(x))

    def _cls_only_last_block(self) -> bool:
        """Whether `forward` may run the last block on the class token alone (see `last_block_cls_only`)."""
        if not (self.last_block_cls_only and self.config.classifier == "token" and len(self.blocks)):
            return False
        if is_fx_tracing():
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.blocks[-1].modules())

    def forward(self, x, mpp_pixels: torch.Tensor | None = None, mpp_generator: torch.Generator | None = None):
        """Image (B, C, H, W) -> logits (B, num_classes), or pooled features if num_classes == 0.
        Images of different sizes (a list of (C, H, W), sides multiples of the patch size), a `PackedBatch` or the
        dict of timm's NaFlex collator: one packed forward, `forward_packed`.
        With `mpp_pixels` (the images in [0, 1]): masked patch prediction, `forward_mpp` (through forward, so that
        DDP and FSDP2 see the call)."""
        if isinstance(x, (list, tuple, dict, PackedBatch)):
            if self.training and self.config.patch_drop_rate:
                raise UsageError(f"patch_drop_rate={self.config.patch_drop_rate} drops tokens from batches of one size: "
                                 "a packed batch of mixed sizes trains without it (set patch_drop_rate=0)")
            return self.forward_packed(as_packed(x, self.config.patch_size))
        if mpp_pixels is not None and not is_fx_tracing():  # fx traces the classifier; mpp through forward_mpp
            return self.forward_mpp(x, mpp_pixels, mpp_generator)
        if not self._cls_only_last_block():
            return self.forward_head(self.forward_features(x))
        h = self._encode(self.patch_drop(self.embed(x)), grid=self.grid_for(x), rope=self.rope_for(x),
                         cls_only_last=True)[0]
        return self.forward_head(self.norm(h))  # (B, p, D): the prefix tokens alone

    def forward_intermediates(
        self, x: torch.Tensor, layers: int | Sequence[int] | None = None, *, attention: bool = True,
        patch_grid: bool = False, norm: bool = False,
    ) -> dict:
        """Run the model and keep, for the layers asked for, their output tokens and attention weights.

        Args:
            x: images (B, C, H, W), or a packed batch of mixed sizes (a list of images, a PackedBatch): then
                "valid" (B, L) is returned too, and each row's attention covers its own tokens only.
            layers: block indices (negative counts from the end), an int n for the last n blocks,
                or None for all. Only these blocks compute attention explicitly; every other block
                keeps the fused kernel.
            attention: also return the softmax attention weights of those layers.
            patch_grid: also return those layers' patch tokens as a feature map (B, D, gh, gw) (dense features:
                segmentation, depth, correspondence heads read these) and their prefix tokens (B, p, D).
            norm: apply the final norm to the kept tokens (as DINOv2's and timm's dense features do).

        Returns:
            a dict with "tokens" {layer: (B, T, D)} (block outputs, before the final norm unless `norm`),
            "attention" {layer: (B, H, T, T)} (if asked), "patch_grid" {layer: (B, D, gh, gw)} and "prefix"
            {layer: (B, p, D)} (if asked), "features" (B, T, D) after the final norm, and "logits".
        """
        wanted = resolve_layers(layers, len(self.blocks))
        packed = isinstance(x, (list, tuple, dict, PackedBatch))
        if packed:  # images of different sizes: the attention over each row's own tokens (padding keys get 0)
            if patch_grid:
                raise UsageError("patch_grid needs one grid per batch; a packed batch has one per image (use its "
                                 "coords to place the tokens)")
            batch = as_packed(x, self.config.patch_size)
            h, mask, rope = self.embed_packed(batch)
            grid = None
        else:
            grid, rope, mask = self.grid_for(x), self.rope_for(x), None
            h = self.embed(x)
        h, tokens, attn = self._encode(h, grid=grid, rope=rope, mask=mask, keep=wanted, attention=attention,
                                       norm_kept=norm)
        feats = self.norm(h)
        if packed:
            out = {"tokens": tokens, "features": feats, "logits": self.forward_head_packed(feats, batch.valid),
                   "valid": batch.valid}
            if attention:
                out["attention"] = attn
            return out
        out = {"tokens": tokens, "features": feats, "logits": self.forward_head(feats)}
        if attention:
            out["attention"] = attn
        if patch_grid:
            gh, gw = self.patch_embed.grid_for(x)
            p = self.config.num_prefix_tokens
            out["prefix"] = {i: t[:, :p] for i, t in tokens.items()}  # (B, T, D) -> (B, p, D)
            out["patch_grid"] = {i: t[:, p:].transpose(1, 2).reshape(t.shape[0], t.shape[2], gh, gw)  # (B, N, D) -> (B, D, gh, gw)
                                 for i, t in tokens.items()}
        return out

    # ---- changing the model after construction --------------------------------------------------

    def set_dynamic_img_size(self, enable: bool = True) -> None:
        """Accept any H x W divisible by the patch size (see ViTConfig.dynamic_img_size)."""
        self.config.dynamic_img_size = self.patch_embed.dynamic = enable

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward instead of storing them (training memory)."""
        self.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None,
                         class_names: list[str] | None = None) -> None:
        """A new zero-initialised head, as for fine-tuning (Sec. 3.2), in timm's order: `global_pool` ('token',
        'avg', 'map'; None keeps it) changes the pooling as timm's does (`_set_global_pool`); class names by keyword."""
        num_classes = check_num_classes(num_classes)
        names = check_class_names(num_classes, class_names, global_pool)
        if global_pool is not None:
            self._set_global_pool(global_pool)
        self.config.num_classes, self.config.class_names = num_classes, names
        w = self.patch_embed.proj.weight
        self.head = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)
        if self.head_dist is not None:
            self.head_dist = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)

    def _set_global_pool(self, global_pool: str) -> None:
        """Pool as timm's `global_pool` names it, the norms where they are (timm's reset_classifier): 'avg' the mean
        of the patch tokens, 'token' the class token (a model with one, whose norm comes before the pooling), 'map'
        only where the model has its attention pooling (timm cannot add one either); leaving 'map' drops it."""
        c = self.config
        new = vit_classifier(global_pool)
        if new == c.classifier:
            return
        if new == "map":
            raise UsageError("global_pool='map': this model has no attention pooling, and it cannot be added after "
                             "construction (in timm neither): create the model with global_pool='map'")
        if c.distilled:
            raise UsageError("a distilled model (DeiT) pools its class and distillation tokens: "
                             "global_pool='token' only")
        if new == "token" and not c.class_token:
            raise UsageError("global_pool='token' needs a class token; this model has none (class_token=False)")
        if new == "token" and c.fc_norm:
            raise UsageError("global_pool='token': this model normalises after pooling (fc_norm, timm's default for "
                             "'avg'), which vitkit applies to the mean alone; create the model with "
                             "global_pool='token'")
        pool = dict(pool_heads=None, pool_mlp_dim=None, pool_prefix=False)  # the attention pooling's, gone with it
        dataclasses.replace(c, classifier=new, **pool)  # the config's own checks, before anything changes
        c.classifier = new
        for k, v in pool.items():
            setattr(c, k, v)
        self.attn_pool = None

    def set_img_size(self, img_size: int | tuple[int, int], method: str | None = None) -> None:
        """Change the input resolution, keeping the patch size; the position embedding is resampled in 2-D.

        Args:
            method: how the position grid is resampled (`layers.pos_embed.RESAMPLE_METHODS`); default: the
                checkpoint's own (`config.pos_resample`: "bilinear" for the official code, "bicubic" for timm,
                "bicubic_noaa" for most transformers classes), as recorded when it was loaded.
        """
        c = self.config
        method = method or c.pos_resample
        new = to_2tuple(img_size)
        for s, p in zip(new, c.patch_size):
            if isinstance(s, bool) or not isinstance(s, int) or s < p or s % p:
                raise UsageError(f"img_size {new} is not a positive multiple of patch_size {c.patch_size}")
        rel = [m for m in self.modules() if isinstance(m, (RelativePositionBias, RelativePositionMlp))]
        if rel:  # each block's (T, T) int64 index (and its (2, N, N) offsets while built) and resampled table (or
            # the MLP's (2gh - 1, 2gw - 1, 2) offsets)
            (nh, nw), heads = (s // p for s, p in zip(new, c.patch_size)), c.num_heads
            n, t = nh * nw, nh * nw + rel[0].num_prefix_tokens
            nbytes = len(rel) * (t * t * 8 + (2 * nh - 1) * (2 * nw - 1) * max(heads, 2) * 4) + 2 * n * n * 8
            check_alloc(nbytes, f"the relative position tables of {len(rel)} block(s) at img_size {new}", UsageError)
        c.img_size = new
        self.patch_embed.img_size = new
        self.patch_embed.grid_size = c.grid_size
        self.patch_embed.num_patches = c.grid_size[0] * c.grid_size[1]
        self.pos_embed.resample(c.grid_size, method)
        if self.rope is not None:
            self.rope.resample(c.grid_size)
        for rel_pos in (m for m in self.modules() if isinstance(m, (RelativePositionBias, RelativePositionMlp))):
            rel_pos.resample(c.grid_size, method)  # one per block (or the model's one, shared)

    def set_attention_impl(self, impl: str = "auto") -> None:
        """How every attention layer of this model computes softmax(q k^T) v: "auto" (picked per call), "sdpa" (the
        fused kernel) or "explicit" (matmul + softmax) (`layers.attention.ATTENTION_IMPLS`; tests, benchmarks)."""
        impl = check_impl(impl)
        for attn in (m for m in self.modules() if isinstance(m, Attention)):
            attn.impl = impl

    # ---- timm's names (timm_api.TimmModelApi has the ones every family shares) -----------------------------------

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class token, DeiT's distillation token, the registers."""
        return self.config.num_prefix_tokens

    @property
    def has_class_token(self) -> bool:
        return bool(self.config.class_token)

    @property
    def global_pool(self) -> str:
        """timm's name of the pooling: 'token', 'avg' or 'map' (vitkit's classifier 'token', 'gap', 'map')."""
        return VIT_POOL_NAMES[self.config.classifier]

    @property
    def dynamic_img_size(self) -> bool:
        return self.config.dynamic_img_size

    def _fixed_input_size(self) -> bool:
        return not self.config.dynamic_img_size

    def _classifier_names(self) -> str | tuple[str, ...]:
        return ("head", "head_dist") if self.head_dist is not None else "head"

    @property
    def _first_conv(self) -> str:
        if self.config.conv_stem is not None:  # timm's name too (its ConvStem's first layer)
            return "patch_embed.backbone.0.conv"
        return "patch_embed.proj" if self.config.hybrid_layers is None else "patch_embed.backbone.stem.conv"

    def set_input_size(self, img_size: int | tuple[int, int] | None = None,
                       patch_size: int | tuple[int, int] | None = None) -> None:
        """timm's name: `set_img_size(img_size)` (the position embedding resampled by the checkpoint's own method);
        a patch size other than the model's is refused (timm resamples the kernel; vitkit does not)."""
        self._check_patch_size(patch_size)
        if img_size is not None:
            self.set_img_size(img_size)

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups for layer-wise LR decay (`timm_api.layer_groups`): the embeddings (patch
        embedding, a hybrid's ResNet, the tokens, the position embedding, ROPE-ViT's learned frequencies, the
        pre-norm) first, then one group per
        block, the final norm with the last block, the pooling and head last (no pattern). `coarse` changes nothing
        (as in timm's ViT)."""
        return dict(stem=r"^(?:cls_token|reg_token|dist_token|mask_token|pos_embed|patch_embed|norm_pre|rope\.)",
                    blocks=[(r"^blocks\.(\d+)\.", None), (r"^norm\.", (99999,))])
