"""The Swin Transformer (Liu et al. 2021, arXiv 2103.14030), read top to bottom: the ViT's other descendant, with
locality and hierarchy built in where the ViT learns them from data.

    image (B, C, H, W)
      -> patches: conv 4x4 stride 4, LayerNorm                      (B, H/4, W/4, C)      Sec. 3.1
      -> 4 stages; stage s > 0 starts with patch merging: each 2x2 group of tokens concatenated (4C), LayerNorm,
         Linear 4C -> 2C: half the resolution, twice the width                 (B, H/2^(s+2), W/2^(s+2), 2^s C)
         each stage: blocks in pairs, pre-norm as the ViT's:
           x + W-MSA(LN(x)), x + MLP(LN(x))      attention inside non-overlapping M x M windows      Eq. 3
           x + SW-MSA(LN(x)), x + MLP(LN(x))     the same after a cyclic shift of the map by M/2, so that windows
                                                  straddle the previous ones; a mask keeps tokens that the shift
                                                  brought together from far apart from attending to each other
         every window attention adds a learned bias per head for each relative offset (dy, dx) in [-M+1, M-1]^2
                                                                                                Eq. 4
      -> LayerNorm, the mean over all tokens, Linear head

A stage whose map is no larger than the window uses one window of the map's size and no shift (as the paper's code).
The map of every stage must divide into its windows: `SwinConfig` checks the resolution it is built for, and a
model is built for one resolution (`set_img_size` / `vitkit.load(..., img_size=)` rebuild the windows for another,
resampling each relative-position table bicubically where a stage's window changes, as the paper's code does for
384 px). Module and parameter names follow timm's `swin_transformer` (patch merging at the start of stages 1-3), so
timm files map one to one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..errors import UsageError
from ..safety import check_sizes, check_types
from .layers import DropPath, LayerNorm, Linear, Mlp
from .layers.attention import _CPU_BF16_NATIVE, check_impl
from .layers.patch_embed import to_2tuple
from .layers.pos_embed import resample_pos_embed_grid
from .layers.tracing import is_fx_tracing
from .timm_api import TimmModelApi, check_avg_pool, check_class_names, check_num_classes


@dataclass
class SwinConfig:
    """Everything that defines a Swin Transformer. Serialised into every vitkit checkpoint.

    Args:
        img_size: the input resolution the windows are laid out for.
        patch_size: the stem's patch (4 in every published model).
        in_chans, num_classes: input channels; classes of the head (0: `model(x)` returns the pooled features).
        embed_dim: C, the first stage's width (96 T/S, 128 B, 192 L); stage s has 2^s C.
        depths, num_heads: blocks and heads per stage.
        window_size: M, the window's side (7 at 224, 12 at 384).
        mlp_ratio: the MLP's width over the stage's.
        qkv_bias, drop_rate, attn_drop_rate, drop_path_rate, norm_eps: as for the ViT (stochastic depth linear
            over all blocks; LayerNorm eps 1e-5, PyTorch's default, as the paper's code).
        mean, std, interpolation, crop_pct, class_names: the preprocessing the weights expect, and the classes.
    """

    img_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (4, 4)
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    norm_eps: float = 1e-5
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    interpolation: str = "bicubic"
    crop_pct: float = 0.9
    class_names: list[str] | None = field(default=None, repr=False)
    arch: str = "swin"

    def __post_init__(self) -> None:
        check_types(self)
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        self.img_size, self.patch_size = to_2tuple(self.img_size), to_2tuple(self.patch_size)
        self.depths, self.num_heads = tuple(self.depths), tuple(self.num_heads)
        check_sizes(self)
        if len(self.depths) != len(self.num_heads) or not self.depths:
            raise UsageError(f"depths {self.depths} and num_heads {self.num_heads}: one entry per stage, both")
        for s, heads in enumerate(self.num_heads):
            if self.stage_dim(s) % heads:
                raise UsageError(f"stage {s}'s width {self.stage_dim(s)} is not divisible by its {heads} heads")
        for size, p in zip(self.img_size, self.patch_size):
            if size % p:
                raise UsageError(f"img_size {self.img_size} is not divisible by the patch size {self.patch_size}")
        for s in range(len(self.depths)):
            grid, (win, _) = self.stage_grid(s), self.stage_window(s)
            if grid[0] % win[0] or grid[1] % win[1]:
                raise UsageError(f"img_size {self.img_size}: stage {s}'s {grid[0]}x{grid[1]} map does not divide into "
                                 f"{win[0]}x{win[1]} windows; use a size whose patch grid is {self.window_size} x 2^"
                                 f"{len(self.depths) - 1} x k per side (224 for window 7, 384 for window 12)")
        if self.class_names is not None and self.num_classes and len(self.class_names) != self.num_classes:
            raise UsageError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    def stage_dim(self, s: int) -> int:
        return self.embed_dim * 2**s

    @property
    def num_features(self) -> int:
        return self.stage_dim(len(self.depths) - 1)

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])

    def stage_grid(self, s: int) -> tuple[int, int]:
        """The token map of stage s: the patch grid halved s times (rounded up, as patch merging pads odd maps)."""
        h, w = self.grid_size
        for _ in range(s):
            h, w = (h + 1) // 2, (w + 1) // 2
        return (h, w)

    def stage_window(self, s: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(window, shift) of stage s's shifted blocks: a map no larger than the window is one window, unshifted."""
        grid = self.stage_grid(s)
        win = tuple(min(g, self.window_size) for g in grid)
        shift = tuple(0 if g <= self.window_size else self.window_size // 2 for g in grid)
        return win, shift

    def to_dict(self) -> dict:
        return asdict(self)


# ---- windows ------------------------------------------------------------------------------------------------------

def window_partition(x: torch.Tensor, win: tuple[int, int]) -> torch.Tensor:
    """(B, H, W, C) -> (B * nW, wh * ww, C): the map cut into windows, each window's tokens row-major."""
    B, H, W, C = x.shape
    x = x.view(B, H // win[0], win[0], W // win[1], win[1], C)  # (B, H/wh, wh, W/ww, ww, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, win[0] * win[1], C)  # (B * nW, wh * ww, C)


def window_reverse(windows: torch.Tensor, win: tuple[int, int], H: int, W: int) -> torch.Tensor:
    """(B * nW, wh * ww, C) -> (B, H, W, C): the inverse of `window_partition`."""
    C = windows.shape[-1]
    x = windows.view(-1, H // win[0], W // win[1], win[0], win[1], C)  # (B, H/wh, W/ww, wh, ww, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, C)


def relative_position_index(win: tuple[int, int]) -> torch.Tensor:
    """(N, N), N = wh * ww: for every pair of a window's tokens, the row of their offset (dy, dx) in the table of
    (2wh - 1)(2ww - 1) offsets."""
    ys, xs = torch.meshgrid(torch.arange(win[0]), torch.arange(win[1]), indexing="ij")
    coords = torch.stack([ys, xs]).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N)
    return (rel[0] + win[0] - 1) * (2 * win[1] - 1) + (rel[1] + win[1] - 1)


def shift_mask(grid: tuple[int, int], win: tuple[int, int], shift: tuple[int, int]) -> torch.Tensor:
    """(nW, N, N): 0 between tokens of the same region of the shifted map, -100 between tokens that the cyclic shift
    brought into one window from opposite edges (the paper's code; exp(-100) is 0 in float32)."""
    img = torch.zeros(grid)
    label = 0
    for hs in (slice(0, -win[0]), slice(-win[0], -shift[0]), slice(-shift[0], None)):
        for ws in (slice(0, -win[1]), slice(-win[1], -shift[1]), slice(-shift[1], None)):
            img[hs, ws] = label
            label += 1
    regions = window_partition(img[None, :, :, None], win)[..., 0]  # (nW, N)
    diff = regions[:, None, :] - regions[:, :, None]  # (nW, N, N)
    return torch.zeros_like(diff).masked_fill(diff != 0, -100.0)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned bias per head for every relative offset (Eq. 4)."""

    def __init__(self, dim: int, num_heads: int, win: tuple[int, int], *, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.win = num_heads, dim // num_heads, tuple(win)
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.attn_drop, self.proj_drop = attn_drop, nn.Dropout(proj_drop)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * win[0] - 1) * (2 * win[1] - 1), num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(self.win), persistent=False)
        self.impl = "auto"  # "sdpa" / "explicit" force a path: `SwinTransformer.set_attention_impl` (tests, benchmarks)

    def _explicit_is_faster(self, q: torch.Tensor) -> bool:
        """As the ViT's attention (`layers/attention.py`): on a CPU with native bf16, in bf16 with gradients, plain
        matmul + softmax beats the fused kernel, whose bf16 backward is slow."""
        if self.impl != "auto":
            return self.impl == "explicit"
        if is_fx_tracing():  # no device or dtype to read: the fused kernel, as the ViT's attention
            return False
        return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad and _CPU_BF16_NATIVE

    def bias(self) -> torch.Tensor:
        """(H, N, N): the relative-position bias of every pair of a window's tokens."""
        n = self.win[0] * self.win[1]
        return self.relative_position_bias_table[self.relative_position_index.flatten()].view(n, n, -1).permute(2, 0, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, return_attention: bool = False):
        """x: windows (B * nW, N, C); mask: (nW, N, N) for shifted windows. -> (B * nW, N, C) [, weights (B * nW, H, N, N)]"""
        Bw, N, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(Bw, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B*nW, H, N, hd)
        bias = self.bias()[None]  # (1, H, N, N)
        if mask is not None:
            nw = mask.shape[0]
            bias = (bias + mask[:, None]).repeat(Bw // nw, 1, 1, 1)  # (nW, H, N, N) per image -> (B*nW, H, N, N)
        bias = bias.to(q.dtype)
        drop = self.attn_drop if self.training else 0.0
        attn = None
        # torch.export (ONNX): the explicit path; the fused kernel with a float mask does not decompose for ONNX
        if return_attention or torch.compiler.is_exporting() or self._explicit_is_faster(q):
            attn = ((q * self.head_dim**-0.5) @ k.transpose(-2, -1) + bias).softmax(-1)  # (B*nW, H, N, N)
            out = F.dropout(attn, drop) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)  # (B*nW, H, N, hd)
        out = out.transpose(1, 2).reshape(Bw, N, C)  # (B*nW, H, N, hd) -> (B*nW, N, C)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attention else out


class SwinBlock(nn.Module):
    """x + (S)W-MSA(LN(x)), then x + MLP(LN(x)), on the map (B, H, W, C)."""

    def __init__(self, c: SwinConfig, stage: int, shifted: bool, drop_path: float) -> None:
        super().__init__()
        dim = c.stage_dim(stage)
        self.grid = c.stage_grid(stage)
        self.win, shift = c.stage_window(stage)
        self.shift = shift if shifted else (0, 0)
        self.norm1 = LayerNorm(dim, eps=c.norm_eps)
        self.attn = WindowAttention(dim, c.num_heads[stage], self.win, qkv_bias=c.qkv_bias,
                                    attn_drop=c.attn_drop_rate, proj_drop=c.drop_rate)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = LayerNorm(dim, eps=c.norm_eps)
        self.mlp = Mlp(dim, int(dim * c.mlp_ratio), drop=c.drop_rate)
        self.drop_path2 = DropPath(drop_path)
        mask = shift_mask(self.grid, self.win, self.shift) if any(self.shift) else None
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        B, H, W, C = x.shape
        if not is_fx_tracing() and (H, W) != tuple(self.grid):
            raise UsageError(f"this Swin block is laid out for a {self.grid[0]}x{self.grid[1]} map, got {H}x{W}: "
                             f"build or load the model at the input's size (img_size=)")
        h = self.norm1(x)
        if any(self.shift):
            h = torch.roll(h, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))  # cyclic shift up-left
        out = self.attn(window_partition(h, self.win), self.attn_mask, return_attention)  # (B*nW, N, C)
        h, attn = out if return_attention else (out, None)
        h = window_reverse(h, self.win, H, W)  # (B, H, W, C)
        if any(self.shift):
            h = torch.roll(h, shifts=self.shift, dims=(1, 2))
        x = x + self.drop_path1(h)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return (x, attn) if return_attention else x


class PatchMerging(nn.Module):
    """(B, H, W, C) -> (B, H/2, W/2, 2C): each 2x2 group concatenated (4C: [0,0], [1,0], [0,1], [1,1]), LayerNorm,
    Linear without bias. An odd map is padded with zeros first."""

    def __init__(self, dim: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = LayerNorm(4 * dim, eps=norm_eps)
        self.reduction = Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        H, W = x.shape[1], x.shape[2]
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)  # (B, H/2, W/2, 4C)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, c: SwinConfig, stage: int, drop_paths: list[float]) -> None:
        super().__init__()
        self.downsample = PatchMerging(c.stage_dim(stage - 1), c.norm_eps) if stage else nn.Identity()
        self.blocks = nn.ModuleList(SwinBlock(c, stage, shifted=i % 2 == 1, drop_path=dp) for i, dp in enumerate(drop_paths))


class PatchEmbedNorm(nn.Module):
    """(B, C, H, W) -> (B, H/P, W/P, D): a conv with kernel = stride = P, then LayerNorm."""

    def __init__(self, c: SwinConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(c.in_chans, c.embed_dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.norm = LayerNorm(c.embed_dim, eps=c.norm_eps)
        self.in_chans, self.img_size = c.in_chans, c.img_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fx_tracing() and (x.ndim != 4 or x.shape[1] != self.in_chans
                                    or tuple(x.shape[2:]) != tuple(self.img_size)):
            raise UsageError(f"expected input of shape (B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), "
                             f"got {tuple(x.shape)}")
        return self.norm(self.proj(x).permute(0, 2, 3, 1))  # (B, D, gh, gw) -> (B, gh, gw, D)


class SwinTransformer(TimmModelApi, nn.Module):
    """Swin: build it with `vitkit.create_model("swin_t")` or `vitkit.load(...)`.

    timm's model API (`TimmModelApi`, docs/timm.md): num_classes, pretrained_cfg, get_classifier, reset_classifier
    (num_classes, global_pool), set_input_size, no_weight_decay, group_matcher, ..."""

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        c = self.config = config
        self.patch_embed = PatchEmbedNorm(c)
        total = sum(c.depths)
        dpr = [c.drop_path_rate * i / max(total - 1, 1) for i in range(total)]  # stochastic depth over all blocks
        starts = [sum(c.depths[:s]) for s in range(len(c.depths))]
        self.layers = nn.ModuleList(SwinStage(c, s, dpr[starts[s]:starts[s] + d]) for s, d in enumerate(c.depths))
        self.norm = LayerNorm(c.num_features, eps=c.norm_eps)
        self.head_drop = nn.Dropout(c.drop_rate)
        self.num_features = c.num_features
        self.head = self._new_head(c.num_classes)
        self.grad_checkpointing = False
        self.lowp_stream = False  # the ViT's switch; Swin's stream stays as autocast leaves it

    def set_attention_impl(self, impl: str = "auto") -> None:
        """How every window attention of this model computes softmax(q k^T + bias) v: "auto" (picked per call),
        "sdpa" (the fused kernel) or "explicit" (matmul + softmax) (`layers.attention.ATTENTION_IMPLS`)."""
        impl = check_impl(impl)
        for attn in (m for m in self.modules() if isinstance(m, WindowAttention)):
            attn.impl = impl

    def _new_head(self, num_classes: int) -> nn.Module:
        if not num_classes:
            return nn.Identity()
        head = Linear(self.num_features, num_classes)
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
        return head

    @property
    def blocks(self) -> list[SwinBlock]:
        """Every block, in order (the stages flattened): what FSDP2 shards, and what attention maps are read from."""
        return [b for stage in self.layers for b in stage.blocks]

    def _run(self, blk: nn.Module, x: torch.Tensor, **kw):
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, **kw)
        return blk(x, **kw)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the last stage's map after the final norm (B, H/32, W/32, 8C)."""
        x = self.patch_embed(x)
        for stage in self.layers:
            x = stage.downsample(x)
            for blk in stage.blocks:
                x = self._run(blk, x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The map (B, h, w, D) -> the mean token (B, D) -> logits (B, K)."""
        x = x.mean(dim=(1, 2))
        return x if pre_logits else self.head(self.head_drop(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, *, attention: bool = True) -> dict:
        """Every block's output map {i: (B, h, w, C)} and, if asked, its window attention {i: (B, nW, H, N, N)}
        (windows of the shifted map for shifted blocks), the final features and the logits."""
        tokens, attn = {}, {}
        h = self.patch_embed(x)
        i = 0
        for stage in self.layers:
            h = stage.downsample(h)
            for blk in stage.blocks:
                if attention:
                    h, a = blk(h, return_attention=True)
                    attn[i] = a.view(x.shape[0], -1, *a.shape[1:])  # (B * nW, H, N, N) -> (B, nW, H, N, N)
                else:
                    h = blk(h)
                tokens[i] = h
                i += 1
        feats = self.norm(h)
        out = {"tokens": tokens, "features": feats, "logits": self.forward_head(feats)}
        if attention:
            out["attention"] = attn
        return out

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None,
                         class_names: list[str] | None = None) -> None:
        """A new head (truncated normal, std 0.02, as the paper's code), in timm's order (`global_pool`: 'avg', the
        mean, is the only pooling; None keeps it), class names by keyword."""
        num_classes = check_num_classes(num_classes)
        names = check_class_names(num_classes, class_names, global_pool)
        self._set_global_pool(global_pool)
        self.config.num_classes, self.config.class_names = num_classes, names
        w = self.norm.weight
        self.head = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)

    def _set_global_pool(self, global_pool: str | None) -> None:
        check_avg_pool(global_pool, "Swin")

    @property
    def global_pool(self) -> str:
        return "avg"

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups for layer-wise LR decay (`timm_api.layer_groups`): the patch embedding, then each
        block (a stage's patch merging with its first block; each stage with `coarse`), the final norm with the last,
        the head last (no pattern); timm's own patterns, the module names being timm's."""
        return dict(stem=r"^patch_embed", blocks=r"^layers\.(\d+)" if coarse else [
            (r"^layers\.(\d+)\.downsample", (0,)), (r"^layers\.(\d+)\.\w+\.(\d+)", None), (r"^norm\.", (99999,))])

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size=None,
                       window_size: int | tuple[int, int] | None = None, window_ratio: int | None = None,
                       always_partition: bool | None = None) -> None:
        """timm's `set_input_size`: lay the windows out for another resolution. The window: `window_size`, else the
        new patch grid // `window_ratio`, else (timm's default) the window scaled with the grid, so that every stage
        keeps its window-to-map ratio (7 at 224 -> 12 at 384). vitkit's windows are square, one size for all stages;
        the relative-position tables are resampled where the window changes (`set_img_size`)."""
        self._check_patch_size(patch_size)
        if always_partition:
            raise UsageError("always_partition=True: vitkit's Swin uses one window for a stage whose map is no larger "
                             "than the window (timm's default, always_partition=False)")
        c = self.config
        new = to_2tuple(img_size) if img_size is not None else tuple(c.img_size)
        grid = (new[0] // c.patch_size[0], new[1] // c.patch_size[1])
        if window_size is not None:
            sizes = {window_size} if isinstance(window_size, int) else set(to_2tuple(window_size))
        elif window_ratio is not None:
            sizes = {max(1, g // window_ratio) for g in grid}
        else:
            sizes = {max(1, c.window_size * g // old) for g, old in zip(grid, c.grid_size)}
        if len(sizes) != 1:
            raise UsageError(f"windows of {sorted(sizes)} per side: vitkit's Swin has square windows; pass "
                             f"window_size= (an int) for img_size {new}")
        self.set_img_size(new, window_size=sizes.pop())

    def set_img_size(self, img_size: int | tuple[int, int], method: str = "bicubic_noaa",
                     window_size: int | None = None) -> None:
        """Lay the windows out for another resolution (and window size: 7 -> 12 for 384 px, as the paper fine-tunes).
        A stage whose window changes gets its relative-position tables resampled (plain bicubic, as the paper's code
        does for 384; `method` as for `resample_pos_embed_grid`)."""
        new = replace(self.config, img_size=to_2tuple(img_size),  # checks that every stage divides into windows
                      window_size=window_size or self.config.window_size)
        with torch.random.fork_rng(devices=[]):  # the new layout's throwaway init leaves the caller's RNG as it was
            fresh = SwinTransformer(new).to(self.norm.weight.device)
        sd = resample_swin_tables(self.state_dict(), fresh, method)
        fresh.load_state_dict(sd)
        self.config = new
        self.patch_embed, self.layers = fresh.patch_embed, fresh.layers


def resample_swin_tables(sd: dict[str, torch.Tensor], model: SwinTransformer, method: str = "bicubic_noaa"
                         ) -> dict[str, torch.Tensor]:
    """`sd` with each relative-position table resampled to `model`'s window where the sizes differ."""
    own = model.state_dict()
    out = dict(sd)
    for k, v in sd.items():
        if k.endswith("relative_position_bias_table") and k in own and v.shape != own[k].shape:
            win = model.get_submodule(k.rsplit(".", 1)[0]).win
            old = round(v.shape[0] ** 0.5)
            if old * old != v.shape[0]:
                raise UsageError(f"{k}: a table of {v.shape[0]} offsets is not a square window's")
            out[k] = resample_pos_embed_grid(v.reshape(old, old, -1), (2 * win[0] - 1, 2 * win[1] - 1),
                                             method).reshape(-1, v.shape[1])
    return out
