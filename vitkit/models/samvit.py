"""SAM's image encoder (Kirillov et al. 2023, arXiv 2304.02643, Sec. 3 and App. A): the plain ViT backbone of ViTDet
(Li et al. 2022, arXiv 2203.16527, Sec. 3), read top to bottom. The tokens stay a map (B, H, W, D) all the way.

    image (B, C, H, W)
      -> patches: conv P x P, stride P                                               (B, gh, gw, D)
      -> + a learned position embedding on the patch grid (1, gh, gw, D); at another grid it is resampled (bicubic,
         antialiased, as timm's `resample_abs_pos_embed_nhwc`)
      -> blocks, pre-norm as the ViT's: x + Attn(LN(x)), then x + MLP(LN(x))
           attention inside non-overlapping M x M windows (the map zero-padded to a multiple of M first), except in
           the global blocks (`global_attn_indexes`: every depth/4-th in the released models), which attend over the
           whole map                                                                ViTDet Sec. 3, "window attention"
           each attention adds decomposed relative positions (MViTv2, Li et al. 2022, Eq. 4): the logit of a query q
           at (y, x) and a key at (y', x') gains q . R_h[y - y'] + q . R_w[x - x'], with learned tables R_h (2h - 1, hd)
           and R_w (2w - 1, hd) per block (h x w: the window, or the map in a global block); a table of another length
           is resampled linearly to the map it meets (as SAM's `get_rel_pos`)
      -> neck: conv 1x1 D -> C, LayerNorm over channels, conv 3x3 C -> C, LayerNorm     (B, C, gh, gw)   App. A
         (neck_chans=0: a LayerNorm over D alone, timm's samvit_base_patch16_224)
      -> head: the mean over the map, dropout, Linear (timm's ClassifierHead; SAM's own encoders have none)

The model takes any input whose sides are multiples of the patch: the position embedding and the global blocks'
tables are resampled on the fly, as timm's `VisionTransformerSAM` does (`set_img_size` resamples them once, for a
model loaded at another size). Parameter names follow timm's, except the neck's and the head's (`vitkit/checkpoints/
timm_sam.py` maps them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..errors import UsageError
from ..safety import check_alloc, check_sizes, check_types
from .layers import DropPath, LayerNorm, Linear, Mlp
from .layers.patch_embed import to_2tuple
from .layers.pos_embed import resample_pos_embed_grid
from .layers.tracing import is_fx_tracing
from .timm_api import TimmModelApi, check_avg_pool, check_class_names, check_num_classes

NECK_EPS = 1e-6  # the neck's LayerNorms (SAM's LayerNorm2d, timm's): not the blocks' eps


@dataclass
class SamViTConfig:
    """Everything that defines SAM's image encoder. Serialised into every vitkit checkpoint.

    Args:
        img_size: the resolution the position embedding and the global blocks' tables are laid out for (1024 in SAM).
        patch_size, in_chans: the patch (16) and the input channels.
        num_classes: classes of the head (0: `model(x)` returns the pooled neck features, as SAM's encoders).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the ViT's sizes (B: 768, 12, 12; L: 1024, 24, 16;
            H: 1280, 32, 16; MLP ratio 4).
        window_size: M, the side of the attention windows (14 in SAM); None: every block global.
        global_attn_indexes: the blocks attending over the whole map ((2, 5, 8, 11) in SAM's B).
        use_abs_pos: a learned position embedding on the patch grid; use_rel_pos: the decomposed relative positions.
        neck_chans: C, the neck's width (256 in SAM); 0: no neck, a LayerNorm over D before the head.
        norm_eps: the blocks' LayerNorm eps (1e-5, PyTorch's default, as SAM and timm).
        drop_rate, attn_drop_rate, drop_path_rate: dropout (after the embedding, in the blocks, before the head),
            attention dropout, stochastic depth (linear over the blocks).
        mean, std, interpolation, crop_pct, class_names: the preprocessing the weights expect, and the classes.
    """

    img_size: tuple[int, int] = (1024, 1024)
    patch_size: tuple[int, int] = (16, 16)
    in_chans: int = 3
    num_classes: int = 0
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    window_size: int | None = 14
    global_attn_indexes: tuple[int, ...] = (2, 5, 8, 11)
    use_abs_pos: bool = True
    use_rel_pos: bool = True
    neck_chans: int = 256
    norm_eps: float = 1e-5
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    interpolation: str = "bicubic"
    crop_pct: float = 1.0
    class_names: list[str] | None = field(default=None, repr=False)
    arch: str = "samvit"

    def __post_init__(self) -> None:
        self.img_size, self.patch_size = to_2tuple(self.img_size), to_2tuple(self.patch_size)
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        self.global_attn_indexes = tuple(sorted(set(self.global_attn_indexes)))
        check_types(self)
        check_sizes(self)
        if self.embed_dim % self.num_heads:
            raise UsageError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        for size, p in zip(self.img_size, self.patch_size):
            if size % p:
                raise UsageError(f"img_size {self.img_size} is not divisible by the patch size {self.patch_size}")
        bad = [i for i in self.global_attn_indexes if not 0 <= i < self.depth]
        if bad:
            raise UsageError(f"global_attn_indexes {bad}: blocks 0 .. {self.depth - 1} exist")
        if not 0 <= self.neck_chans <= 65536:
            raise UsageError(f"neck_chans={self.neck_chans}: must be in [0, 65536] (0: no neck)")
        if int(self.embed_dim * self.mlp_ratio) < 1:
            raise UsageError(f"mlp_ratio {self.mlp_ratio}: the MLP of width int({self.embed_dim} * ratio) has no units")
        if self.class_names is not None and self.num_classes and len(self.class_names) != self.num_classes:
            raise UsageError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        self._check_attention_memory()

    def _check_attention_memory(self) -> None:
        """The attention's scores at batch 1, per head, refused before the model is built when this process cannot
        hold them: a windowed block's (the map zero-padded to multiples of M: Hp x Wp queries, M x M keys each), a
        global block's ((gh gw)^2). A window larger than the grid is SAM's own case (14 at a small image: the map
        padded to one window); a window of 1024 on a 5x5 grid pads to a million tokens."""
        gh, gw = self.grid_size
        if self.window_size is not None and self.window_size > max(gh, gw, 64):
            raise UsageError(f"window_size {self.window_size} on the {gh}x{gw} patch grid: a window can be at most "
                             f"{max(gh, gw, 64)} patches wide, the grid's longer side or 64 (SAM's is 14, the map "
                             f"padded to one window where the grid is smaller)")
        if self.window_size is not None and len(self.global_attn_indexes) < self.depth:
            m = self.window_size
            hp, wp = -(-gh // m) * m, -(-gw // m) * m
            check_alloc(hp * wp * m * m * 4, f"SAM ViT window_size {m} on the {gh}x{gw} patch grid (padded to "
                        f"{hp}x{wp}: attention scores {hp * wp} x {m * m} per head)", UsageError)
        if self.window_size is None or self.global_attn_indexes:
            n = gh * gw
            check_alloc(n * n * 4, f"SAM ViT global attention on the {gh}x{gw} patch grid (attention scores {n} x "
                        f"{n} per head)", UsageError)

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])

    @property
    def num_features(self) -> int:
        return self.neck_chans or self.embed_dim

    def block_window(self, i: int) -> int | None:
        """Block i's window side, or None for a global block."""
        return None if self.window_size is None or i in self.global_attn_indexes else self.window_size

    def to_dict(self) -> dict:
        return asdict(self)


# ---- windows and relative positions -------------------------------------------------------------------------------

def window_partition(x: torch.Tensor, win: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(B, H, W, C) -> (B * nW, M, M, C), the map zero-padded at the bottom and right to (Hp, Wp), multiples of M."""
    B, H, W, C = x.shape
    ph, pw = -H % win, -W % win
    x = F.pad(x, (0, 0, 0, pw, 0, ph))
    Hp, Wp = H + ph, W + pw
    x = x.view(B, Hp // win, win, Wp // win, win, C)  # (B, Hp/M, M, Wp/M, M, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, win, win, C), (Hp, Wp)  # (B * nW, M, M, C)


def window_unpartition(windows: torch.Tensor, win: int, hw: tuple[int, int], padded: tuple[int, int]) -> torch.Tensor:
    """(B * nW, M, M, C) -> (B, H, W, C): the inverse of `window_partition`, the padding cut off."""
    (H, W), (Hp, Wp) = hw, padded
    C = windows.shape[-1]
    x = windows.view(-1, Hp // win, Wp // win, win, win, C)  # (B, Hp/M, Wp/M, M, M, C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(-1, Hp, Wp, C)  # (B, Hp, Wp, C)
    return x[:, :H, :W]


def resize_rel_table(table: torch.Tensor, n: int) -> torch.Tensor:
    """A table of offsets (L, hd) resampled to n rows, linearly, corners not aligned (SAM's `get_rel_pos`)."""
    if table.shape[0] == n:
        return table
    return F.interpolate(table.T[None], size=n, mode="linear")[0].T  # (L, hd) -> (1, hd, L) -> (1, hd, n) -> (n, hd)


def rel_pos_rows(table: torch.Tensor, size: int) -> torch.Tensor:
    """One axis's table (L, hd) -> (size, size, hd): the row of every (query, key) pair's offset q - k, the table
    resampled to 2 size - 1 offsets first where it has another length."""
    table = resize_rel_table(table, 2 * size - 1)
    pos = torch.arange(size, device=table.device)
    return table[pos[:, None] - pos[None, :] + size - 1]  # (size, size, hd)


def decomposed_rel_pos(q: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """q (B, nH, N, hd) on an h x w map -> the bias (B, nH, N, N): q . R_h[y - y'] + q . R_w[x - x'] (MViTv2 Eq. 4),
    with q unscaled."""
    h, w = hw
    B, nh, N, hd = q.shape
    r_q = q.reshape(B, nh, h, w, hd)
    by_row = torch.einsum("bnhwc,hkc->bnhwk", r_q, rel_pos_rows(rel_h, h))  # (B, nH, h, w, h')
    by_col = torch.einsum("bnhwc,wkc->bnhwk", r_q, rel_pos_rows(rel_w, w))  # (B, nH, h, w, w')
    return (by_row[..., :, None] + by_col[..., None, :]).reshape(B, nh, N, N)  # (B, nH, h*w, h'*w')


class SamAttention(nn.Module):
    """Multi-head self-attention over a map (B, h, w, C) (a window, or the whole map), with decomposed relative
    positions on an (rows x cols) layout where `rel_size` is given."""

    def __init__(self, dim: int, num_heads: int, rel_size: tuple[int, int] | None, *, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.attn_drop, self.proj_drop = attn_drop, nn.Dropout(proj_drop)
        if rel_size is not None:  # zeros at first, as SAM's: the positions are learned
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_size[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_size[1] - 1, self.head_dim))
        else:
            self.rel_pos_h = self.rel_pos_w = None

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        """x (B', h, w, C) -> (B', h, w, C) [, weights (B', nH, N, N)]."""
        B, h, w, C = x.shape
        N = h * w
        qkv = self.qkv(x.reshape(B, N, C)).view(B, N, 3, self.num_heads, self.head_dim)  # (B', N, 3, nH, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B', nH, N, hd)
        bias = None if self.rel_pos_h is None else decomposed_rel_pos(q, self.rel_pos_h, self.rel_pos_w, (h, w))
        drop = self.attn_drop if self.training else 0.0
        attn = None
        if return_attention or torch.compiler.is_exporting():
            logits = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)  # (B', nH, N, N)
            attn = (logits if bias is None else logits + bias).softmax(-1)
            out = F.dropout(attn, drop) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)  # (B', nH, N, hd)
        out = out.transpose(1, 2).reshape(B, h, w, C)  # (B', nH, N, hd) -> (B', h, w, C)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attention else out


class SamBlock(nn.Module):
    """x + Attn(LN(x)) (in windows, or global), then x + MLP(LN(x)), on the map (B, H, W, D)."""

    def __init__(self, c: SamViTConfig, i: int, drop_path: float) -> None:
        super().__init__()
        d = c.embed_dim
        self.window = c.block_window(i)
        rel = (self.window, self.window) if self.window else c.grid_size
        self.norm1 = LayerNorm(d, eps=c.norm_eps)
        self.attn = SamAttention(d, c.num_heads, rel if c.use_rel_pos else None, qkv_bias=c.qkv_bias,
                                 attn_drop=c.attn_drop_rate, proj_drop=c.drop_rate)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = LayerNorm(d, eps=c.norm_eps)
        self.mlp = Mlp(d, int(d * c.mlp_ratio), drop=c.drop_rate)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        B, H, W, D = x.shape
        h = self.norm1(x)
        if self.window:
            h, padded = window_partition(h, self.window)  # (B * nW, M, M, D)
        out = self.attn(h, return_attention)
        h, attn = out if return_attention else (out, None)
        if self.window:
            h = window_unpartition(h, self.window, (H, W), padded)  # (B, H, W, D)
        x = x + self.drop_path1(h)
        x = x + self.drop_path2(self.mlp(self.norm2(x).reshape(B, H * W, D))).reshape(B, H, W, D)
        return (x, attn) if return_attention else x


def channel_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm over the channels of a (B, C, H, W) map (SAM's LayerNorm2d)."""
    return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # (B, C, H, W) -> (B, H, W, C) -> back


class SamNeck(nn.Module):
    """(B, H, W, D) -> (B, C, H, W): conv 1x1, LayerNorm, conv 3x3, LayerNorm (no biases); or, with no width C,
    the LayerNorm over D alone."""

    def __init__(self, dim: int, chans: int) -> None:
        super().__init__()
        if chans:
            self.conv1 = nn.Conv2d(dim, chans, kernel_size=1, bias=False)
            self.norm1 = LayerNorm(chans, eps=NECK_EPS)
            self.conv2 = nn.Conv2d(chans, chans, kernel_size=3, padding=1, bias=False)
            self.norm2 = LayerNorm(chans, eps=NECK_EPS)
        else:
            self.norm = LayerNorm(dim, eps=NECK_EPS)
        self.chans = chans

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.chans:
            return self.norm(x).permute(0, 3, 1, 2)  # (B, H, W, D) -> (B, D, H, W)
        x = channel_norm(self.norm1, self.conv1(x.permute(0, 3, 1, 2)))  # (B, H, W, D) -> (B, C, H, W)
        return channel_norm(self.norm2, self.conv2(x))


class SamPatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, H/P, W/P, D): a conv with kernel = stride = P; any H, W that are multiples of P."""

    def __init__(self, c: SamViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(c.in_chans, c.embed_dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.in_chans, self.patch_size = c.in_chans, c.patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fx_tracing() and (x.ndim != 4 or x.shape[1] != self.in_chans or x.shape[2] % self.patch_size[0]
                                    or x.shape[3] % self.patch_size[1] or not x.shape[2] or not x.shape[3]):
            raise UsageError(f"expected input of shape (B, {self.in_chans}, H, W) with H and W multiples of the patch "
                             f"size {self.patch_size}, got {tuple(x.shape)}")
        return self.proj(x).permute(0, 2, 3, 1)  # (B, D, gh, gw) -> (B, gh, gw, D)


class SamVisionTransformer(TimmModelApi, nn.Module):
    """SAM's image encoder: build it with `vitkit.create_model("samvit_base_patch16")` or `vitkit.load(...)`.

    timm's model API (`TimmModelApi`, docs/timm.md): num_classes, pretrained_cfg, get_classifier, reset_classifier
    (num_classes, global_pool), no_weight_decay, group_matcher, ..."""

    def __init__(self, config: SamViTConfig) -> None:
        super().__init__()
        c = self.config = config
        self.patch_embed = SamPatchEmbed(c)
        if c.use_abs_pos:
            self.pos_embed = nn.Parameter(torch.zeros(1, *c.grid_size, c.embed_dim))  # (1, gh, gw, D)
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(c.drop_rate)
        dpr = [c.drop_path_rate * i / max(c.depth - 1, 1) for i in range(c.depth)]  # stochastic depth, linear
        self.blocks = nn.ModuleList(SamBlock(c, i, dpr[i]) for i in range(c.depth))
        self.neck = SamNeck(c.embed_dim, c.neck_chans)
        self.head_drop = nn.Dropout(c.drop_rate)
        self.num_features = c.num_features
        self.head = self._new_head(c.num_classes)
        self.grad_checkpointing = False
        self.lowp_stream = False  # the ViT's switch; this model's stream stays as autocast leaves it

    def _new_head(self, num_classes: int) -> nn.Module:
        if not num_classes:
            return nn.Identity()
        head = Linear(self.num_features, num_classes)
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
        return head

    def _run(self, blk: nn.Module, x: torch.Tensor, **kw):
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, **kw)
        return blk(x, **kw)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the patch map with its positions (B, gh, gw, D)."""
        x = self.patch_embed(x)
        if self.pos_embed is not None:
            x = x + resample_pos_embed_grid(self.pos_embed[0], tuple(x.shape[1:3]), "bicubic")[None]
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the neck's map (B, C', H/P, W/P) (C' = neck_chans, or D without a neck)."""
        x = self._embed(x)
        for blk in self.blocks:
            x = self._run(blk, x)
        return self.neck(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The map (B, C', h, w) -> its mean (B, C') -> logits (B, K)."""
        x = x.mean(dim=(2, 3))
        return x if pre_logits else self.head(self.head_drop(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, *, attention: bool = True) -> dict:
        """Every block's output map {i: (B, gh, gw, D)} and, if asked, its attention {i: (B, nW, nH, N, N)} (nW = 1
        in a global block; a window's N = M^2, padding included), the neck's features and the logits."""
        tokens, attn = {}, {}
        h = self._embed(x)
        for i, blk in enumerate(self.blocks):
            if attention:
                h, a = blk(h, return_attention=True)
                attn[i] = a.view(x.shape[0], -1, *a.shape[1:])  # (B * nW, nH, N, N) -> (B, nW, nH, N, N)
            else:
                h = blk(h)
            tokens[i] = h
        feats = self.neck(h)
        out = {"tokens": tokens, "features": feats, "logits": self.forward_head(feats)}
        if attention:
            out["attention"] = attn
        return out

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _fixed_input_size(self) -> bool:
        return False  # any multiple of the patch: the positions resampled on the fly

    def reset_classifier(self, num_classes: int, global_pool: str | None = None,
                         class_names: list[str] | None = None) -> None:
        """A new head (truncated normal, std 0.02), in timm's order (`global_pool`: 'avg', the mean, is the only
        pooling; None keeps it), class names by keyword."""
        num_classes = check_num_classes(num_classes)
        names = check_class_names(num_classes, class_names, global_pool)
        self._set_global_pool(global_pool)
        self.config.num_classes, self.config.class_names = num_classes, names
        w = self.patch_embed.proj.weight
        self.head = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)

    def _set_global_pool(self, global_pool: str | None) -> None:
        check_avg_pool(global_pool, "SAM ViT")

    @property
    def global_pool(self) -> str:
        return "avg"

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups for layer-wise LR decay: the embeddings, then each block; the neck and the head
        last (no pattern), as timm's `VisionTransformerSAM`."""
        return dict(stem=r"^pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None)])

    def set_img_size(self, img_size: int | tuple[int, int], method: str | None = None) -> None:
        """Lay the model out for another resolution: the position embedding resampled to the new grid (bicubic,
        antialiased: timm's; `method` as for `resample_pos_embed_grid`), the global blocks' relative tables linearly
        to the new map (what the forward does on the fly at that size, done once). Windowed blocks keep theirs."""
        new = replace(self.config, img_size=to_2tuple(img_size))
        grid = new.grid_size
        with torch.no_grad():
            if self.pos_embed is not None:
                resampled = resample_pos_embed_grid(self.pos_embed[0], grid, method or "bicubic")[None]
                self.pos_embed = nn.Parameter(resampled.contiguous())
            for blk in self.blocks:
                if blk.window or blk.attn.rel_pos_h is None:
                    continue
                for name, size in (("rel_pos_h", grid[0]), ("rel_pos_w", grid[1])):
                    resized = resize_rel_table(getattr(blk.attn, name), 2 * size - 1)  # as the forward would
                    setattr(blk.attn, name, nn.Parameter(resized.contiguous()))
        self.config = new

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size=None) -> None:
        """timm's `set_input_size`: `set_img_size` (the patch is kept)."""
        self._check_patch_size(patch_size)
        if img_size is not None:
            self.set_img_size(img_size)
