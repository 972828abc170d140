"""Position embeddings (Sec. 3.1, App. D.4): learned 1-D, learned 2-D (row + column), fixed 2-D sin-cos, none.

Each module adds its embedding to the token sequence (B, T, D) whose first `num_prefix_tokens`
rows are the class token (if any), followed by the patch grid in row-major order.
(The relative variant lives inside attention: see `attention.RelativePositionBias`.)

`forward(x, grid)` takes the patch grid of this input: a grid other than the one the embedding was made for
(`dynamic_img_size`) gets the embedding resampled to it on the fly, as `resample` would (bilinear, the official
method), cached per grid for inference. Under torch.export / torch.compile the resampling is always in the graph,
so one exported program serves every input size (resampling to the same grid is exact: aligned corners).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UsageError
from .packing import resample_for_coords

# how a grid of position embeddings is resampled (`resample_pos_embed_grid`); a table of relative offsets
# (`attention.RelativePositionBias`) takes these and one more, "geometric" (`resample_offset_table`)
GRID_METHODS = ("bilinear", "bicubic", "bicubic_noaa", "bilinear_aa", "bicubic_corners", "bilinear_noaa")
RESAMPLE_METHODS = (*GRID_METHODS, "geometric")


def resample_pos_embed_grid(
    grid: torch.Tensor, new_size: tuple[int, int], method: str = "bilinear"
) -> torch.Tensor:
    """Resample a (gh, gw, D) grid of embeddings to (nh, nw, D).

    Args:
        method: "bilinear" is the official method (`scipy.ndimage.zoom(order=1)` on the grid, which
            equals bilinear interpolation with aligned corners); "bicubic" is timm's
            (bicubic, corners not aligned, antialiased: PyTorch's antialiased kernel, a = -0.5, at any scale);
            "bicubic_noaa" is PyTorch's plain bicubic (a = -0.75, no antialiasing), as transformers' Dinov2Model;
            "bilinear_aa" is PyTorch's antialiased bilinear, corners not aligned (SigLIP 2's NaFlex towers);
            "bicubic_corners" is plain bicubic with corners aligned (torchvision's `interpolate_embeddings`);
            "bilinear_noaa" is PyTorch's plain bilinear, corners not aligned (transformers' BEiT, of its relative
            position table). ("geometric" is a relative table's alone: `resample_offset_table`.)
    """
    if method == "geometric":
        raise UsageError("resampling method 'geometric' (timm's BEiT: the offsets spaced by a geometric "
                         "progression) is for a table of relative offsets; a grid of position embeddings takes one of "
                         f"{GRID_METHODS}")
    if method not in GRID_METHODS:
        raise UsageError(f"resampling method must be one of {RESAMPLE_METHODS}, got {method!r}")
    gh, gw, d = grid.shape
    if not torch.compiler.is_compiling() and (gh, gw) == tuple(new_size):
        return grid
    x = grid.permute(2, 0, 1)[None].float()  # (gh, gw, D) -> (1, D, gh, gw)
    if method == "bilinear":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=True)
    elif method == "bicubic_corners":
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=True)
    elif method == "bilinear_noaa":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=False)
    elif method == "bilinear_aa":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=False, antialias=True)
    else:
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=False, antialias=method == "bicubic")
    return x[0].permute(1, 2, 0).to(grid.dtype)  # (1, D, nh, nw) -> (nh, nw, D)


def geometric_offsets(src: int, dst: int) -> list[float]:
    """Where BEiT's resampling puts the `src` offsets of one axis of a relative table (src = 2g - 1: the offsets
    -(g - 1) .. g - 1) when the table is resampled to `dst` offsets (timm's `resize_rel_pos_bias_table`, after the
    unilm fine-tuning code): the centre stays at 0 and the steps outwards grow by a ratio r, 1, r, r^2, ...; r in
    [1.01, 1.5] is bisected (to 1e-6) so that the g - 1 steps reach no further than dst // 2, the new outermost offset.
    r is the bisection's last midpoint, so the reach may fall a hair either side of it. Increasing, length src."""
    n, reach = src // 2, dst // 2
    lo, hi = 1.01, 1.5
    ratio = (lo + hi) / 2.0
    while hi - lo > 1e-6:
        ratio = (lo + hi) / 2.0
        covered = (1.0 - ratio**n) / (1.0 - ratio)  # 1 + r + ... + r^(n-1): n steps
        if covered > reach:
            hi = ratio
        else:
            lo = ratio
    out, pos = [], 0.0
    for i in range(n):
        pos += ratio**i
        out.append(pos)
    return [-p for p in reversed(out)] + [0.0] + out


def _linear_weights(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """(len(dst), len(src)) weights that read values given at the increasing positions `src` at the positions `dst`:
    linear between the two neighbours, the end value beyond either end (float64)."""
    m = src.numel()
    w = torch.zeros(dst.numel(), m, dtype=torch.float64)
    if m == 1:
        return w + 1.0
    t = dst.clamp(src[0], src[-1])
    left = (torch.searchsorted(src, t, right=True) - 1).clamp(0, m - 2)  # src[left] <= t <= src[left + 1]
    frac = (t - src[left]) / (src[left + 1] - src[left])
    rows = torch.arange(dst.numel())
    w[rows, left] = 1.0 - frac
    w[rows, left + 1] += frac
    return w


def resample_offset_table(cells: torch.Tensor, new_size: tuple[int, int], method: str = "bilinear") -> torch.Tensor:
    """Resample a table of relative offsets (2gh - 1, 2gw - 1, H), the offset (0, 0) at its centre, to
    (2nh - 1, 2nw - 1, H).

    Args:
        method: one of `GRID_METHODS`, the table taken as a grid (`resample_pos_embed_grid`: transformers' BEiT's is
            "bilinear_noaa"), or "geometric", timm's BEiT's (`resize_rel_pos_bias_table` without scipy): each axis's
            old offsets moved apart along a geometric progression (`geometric_offsets`) and the new integer offsets
            read between them linearly, the outermost value beyond them. Once the shape changes, both axes are
            remapped, also one whose length stays (its progression is then r = 1.01: not the identity), as timm does.
    """
    if method != "geometric":
        return resample_pos_embed_grid(cells, new_size, method)
    sh, sw, _ = cells.shape
    if not torch.compiler.is_compiling() and (sh, sw) == tuple(new_size):
        return cells

    def axis(src: int, dst: int) -> torch.Tensor:  # (dst, src): the weights of one axis
        where = torch.tensor(geometric_offsets(src, dst), dtype=torch.float32).double()  # timm's grid, in float32
        half = dst // 2
        return _linear_weights(where, torch.arange(-half, half + 1, dtype=torch.float64))

    wy = axis(sh, new_size[0]).to(cells.device, torch.float32)
    wx = axis(sw, new_size[1]).to(cells.device, torch.float32)
    return torch.einsum("ys,sth,xt->yxh", wy, cells.float(), wx).to(cells.dtype)


def sincos_2d(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding (as big_vision's posemb_sincos_2d): (gh * gw, D), D divisible by 4."""
    if dim % 4:
        raise UsageError(f"sincos_2d position embedding needs a width divisible by 4, got {dim}")
    gh, gw = grid_size
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64), indexing="ij")
    omega = torch.arange(dim // 4, dtype=torch.float64) / max(dim // 4 - 1, 1)
    omega = 1.0 / temperature**omega  # (D/4,)
    y = y.flatten()[:, None] * omega[None, :]  # (N, D/4)
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()  # (N, D)


def sincos_at(coords: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """`sincos_2d` at given (row, column) coordinates (..., 2) -> (..., D)."""
    omega = torch.arange(dim // 4, dtype=torch.float64, device=coords.device) / max(dim // 4 - 1, 1)
    omega = 1.0 / temperature**omega  # (D/4,)
    y = coords[..., :1].double() * omega  # (..., D/4)
    x = coords[..., 1:].double() * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=-1).float()


def tracing() -> bool:
    """Inside torch.compile / torch.export: shapes are symbolic, so no Python branch on them and no cache."""
    return torch.compiler.is_compiling()


class _GridCache:
    """Embeddings resampled for other grids, kept while the weights they came from do not change (inference
    only: with gradients the resampling must stay in the autograd graph)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def get(self, grid: tuple, params: list[torch.Tensor], make):
        if tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            return make()
        key = tuple((p.data_ptr(), p._version) for p in params)
        hit = self.entries.get(grid)
        if hit is None or hit[0] != key:
            value = make()
            value = tuple(v.detach() for v in value) if isinstance(value, tuple) else value.detach()
            hit = self.entries[grid] = (key, value)
        return hit[1]


def _same_grid(grid, own) -> bool:
    return grid is None or (not tracing() and tuple(grid) == tuple(own))


class LearnedPosEmbed1d(nn.Module):
    """The paper's default: one learned vector per sequence position, `weight` (1, T, D), init normal(0.02)."""

    def __init__(self, grid_size: tuple[int, int], dim: int, num_prefix_tokens: int) -> None:
        super().__init__()
        self.grid_size, self.num_prefix_tokens = tuple(grid_size), num_prefix_tokens
        self.weight = nn.Parameter(torch.empty(1, num_prefix_tokens + grid_size[0] * grid_size[1], dim))
        self.method = "bilinear"  # how another grid is resampled from this one (the model's `pos_resample`)
        self.square = False  # ... and `pos_resample_square`
        nn.init.normal_(self.weight, std=0.02)
        self._cache = _GridCache()

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        if _same_grid(grid, self.grid_size):
            return x + self.weight
        return x + self._cache.get(tuple(grid), [self.weight], lambda: self.for_grid(grid))

    def for_grid(self, grid: tuple[int, int]) -> torch.Tensor:
        """(1, p + nh * nw, D): the embedding for another grid, the class position kept."""
        p, (gh, gw) = self.num_prefix_tokens, self.grid_size
        w = self.weight[0]
        if self.square:  # timm's aspect-preserving NaFlex: the square of the longer side, its top-left part
            m = max(grid)
            patches = resample_pos_embed_grid(w[p:].reshape(gh, gw, -1), (m, m), self.method)[: grid[0], : grid[1]]
        else:
            patches = resample_pos_embed_grid(w[p:].reshape(gh, gw, -1), grid, self.method)  # (nh, nw, D)
        return torch.cat([w[:p], patches.flatten(0, 1)])[None]

    def grid(self) -> torch.Tensor:
        """(gh * gw, D): the patch positions only."""
        return self.weight[0, self.num_prefix_tokens :]

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor, method: str = "bilinear",
                   square: bool = False) -> torch.Tensor:
        """A packed batch's patch embeddings (B, L, D): each image's grid resampled from the learned one
        (`packing.resample_for_coords`)."""
        gh, gw = self.grid_size
        return resample_for_coords(self.grid().reshape(gh, gw, -1), coords, sizes, method, square)

    def prefix_embed(self) -> torch.Tensor | None:
        """(1, p, D): the prefix tokens' positions, or None when the embedding covers the patches alone."""
        return self.weight[:, : self.num_prefix_tokens] if self.num_prefix_tokens else None

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        p, (gh, gw) = self.num_prefix_tokens, self.grid_size
        w = self.weight.data[0]
        if self.square:  # timm's aspect-preserving NaFlex: the square of the longer side, its top-left part
            m = max(new_grid)
            grid = resample_pos_embed_grid(w[p:].reshape(gh, gw, -1), (m, m), method)[: new_grid[0], : new_grid[1]]
        else:
            grid = resample_pos_embed_grid(w[p:].reshape(gh, gw, -1), new_grid, method)  # (nh, nw, D)
        self.weight = nn.Parameter(torch.cat([w[:p], grid.flatten(0, 1)])[None])  # class position kept
        self.grid_size = tuple(new_grid)


class LearnedPosEmbed2d(nn.Module):
    """App. D.4 '2-D': a row embedding and a column embedding of D/2 each, concatenated per patch.

    Prefix tokens (the class token) get their own learned vectors, `prefix` (1, p, D).
    """

    def __init__(self, grid_size: tuple[int, int], dim: int, num_prefix_tokens: int) -> None:
        super().__init__()
        if dim % 2:
            raise UsageError(f"learned_2d position embedding needs an even width, got {dim}")
        self.grid_size, self.num_prefix_tokens = tuple(grid_size), num_prefix_tokens
        self.row = nn.Parameter(torch.empty(grid_size[0], dim // 2))
        self.col = nn.Parameter(torch.empty(grid_size[1], dim // 2))
        self.prefix = nn.Parameter(torch.empty(1, num_prefix_tokens, dim)) if num_prefix_tokens else None
        for p in (self.row, self.col, self.prefix):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def grid(self, size: tuple[int, int] | None = None) -> torch.Tensor:
        """(N, D): each patch's row and column embeddings, for this grid or another (`size`, resampled per axis)."""
        row, col = self.row, self.col
        if not _same_grid(size, self.grid_size):
            row = resample_pos_embed_grid(row[:, None, :], (size[0], 1))[:, 0]  # (gh, 1, D/2) -> (nh, D/2)
            col = resample_pos_embed_grid(col[:, None, :], (size[1], 1))[:, 0]
        gh, gw = row.shape[0], col.shape[0]
        rows = row[:, None, :].expand(gh, gw, -1)  # (gh, gw, D/2)
        cols = col[None, :, :].expand(gh, gw, -1)
        return torch.cat([rows, cols], dim=-1).flatten(0, 1)  # (gh, gw, D) -> (N, D)

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor, method: str = "bilinear",
                   square: bool = False) -> torch.Tensor:
        """(B, L, D): each patch's row and column embeddings, resampled per axis to its image's grid."""
        rows = resample_for_coords(self.row[:, None, :], coords * coords.new_tensor([1, 0]),  # column 0 of (gh, 1)
                                   sizes * sizes.new_tensor([1, 0]) + sizes.new_tensor([0, 1]), method)
        cols = resample_for_coords(self.col[None, :, :], coords * coords.new_tensor([0, 1]),  # row 0 of (1, gw)
                                   sizes * sizes.new_tensor([0, 1]) + sizes.new_tensor([1, 0]), method)
        return torch.cat([rows, cols], dim=-1)

    def prefix_embed(self) -> torch.Tensor | None:
        return self.prefix

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        pe = self.grid(grid)[None]  # (1, N, D)
        if self.prefix is not None:
            pe = torch.cat([self.prefix, pe], dim=1)  # (1, T, D)
        return x + pe

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        def one_axis(t: torch.Tensor, n: int) -> torch.Tensor:
            return resample_pos_embed_grid(t.data[:, None, :], (n, 1), method)[:, 0]  # (g, 1, D/2) -> (n, D/2)

        self.row = nn.Parameter(one_axis(self.row, new_grid[0]))
        self.col = nn.Parameter(one_axis(self.col, new_grid[1]))
        self.grid_size = tuple(new_grid)


class SinCosPosEmbed2d(nn.Module):
    """Fixed (not learned) 2-D sin-cos embedding of the patch grid; the class token gets none."""

    def __init__(self, grid_size: tuple[int, int], dim: int, num_prefix_tokens: int) -> None:
        super().__init__()
        self.grid_size, self.num_prefix_tokens, self.dim = tuple(grid_size), num_prefix_tokens, dim
        self.register_buffer("pe", sincos_2d(self.grid_size, dim)[None], persistent=False)  # (1, N, D)

    def grid(self) -> torch.Tensor:
        return self.pe[0]

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor, method: str = "bilinear",
                   square: bool = False) -> torch.Tensor:
        """(B, L, D): the fixed embedding of each patch's (row, column), as `sincos_2d` gives it for its grid."""
        return sincos_at(coords, self.dim)

    def prefix_embed(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        pe = self.pe if _same_grid(grid, self.grid_size) else sincos_2d(tuple(grid), self.dim)[None].to(x.device)
        p = self.num_prefix_tokens
        if p == 0:
            return x + pe
        return torch.cat([x[:, :p], x[:, p:] + pe], dim=1)

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        self.grid_size = tuple(new_grid)
        self.pe = sincos_2d(self.grid_size, self.dim)[None].to(self.pe.device)


class NoPosEmbed(nn.Module):
    """App. D.4 'no positional information': the tokens are a bag of patches."""

    def __init__(self, grid_size: tuple[int, int], dim: int, num_prefix_tokens: int) -> None:
        super().__init__()
        self.grid_size = tuple(grid_size)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        return x

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor, method: str = "bilinear",
                   square: bool = False) -> torch.Tensor | None:
        return None

    def prefix_embed(self) -> torch.Tensor | None:
        return None

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        self.grid_size = tuple(new_grid)
