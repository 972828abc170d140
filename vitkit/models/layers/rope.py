"""2-D rotary position embeddings (RoPE, Su et al. 2021, made 2-D for images): EVA-02's, ROPE-ViT's, the Perception
Encoder's and DINOv3's.

Every head's query and key vectors of the patch tokens are rotated in pairs of channels by angles that grow with the
patch's coordinates: attention logits then depend on the relative offset of two patches. The prefix tokens (class,
registers) are not rotated. A patch's angles are its two coordinates times a set of frequencies; the families differ
in the coordinates, the frequencies and the channel layout:

- "eva" (axial; EVA-02 arXiv 2303.11331, ROPE-ViT-Axial arXiv 2403.13298, Perception Encoder arXiv 2504.13181; timm's
  `RotaryEmbeddingCat`): coordinates are the patch indices (+ `offset`: PE counts from 1), scaled by ref / grid with
  a `ref_grid` (EVA-02's 16x16 pre-training grid, PE's) so that another resolution sees the angles' range it was
  trained with. d/4 frequencies f_i = T^(-i / (d/4)); angles [c0 f_0 .. c0 f_{d/4-1}, c1 f_0 .. c1 f_{d/4-1}].
- "dinov3" (DINOv3 arXiv 2508.10104): coordinates are the patch centres normalised to [-1, 1] on each axis
  ((i + 0.5) / n * 2 - 1), so any grid spans the same range; periods T^(i / (d/4)), angles 2 pi c / period.
- "mixed" (ROPE-ViT-Mixed): learned frequencies, a 2-D vector per channel pair, per head and per block
  (`freqs`, (2, depth, heads, d/2)): angle = c0 fx + c1 fy. Each block gets its own angles.

(c0, c1) is (row, column) with indexing "ij" and (column, row) with "xy" (ROPE-ViT, PE). Layouts: "interleaved"
(adjacent channel pairs (c_2j, c_2j+1): (a, b) -> (a cos - b sin, b cos + a sin)) or "half" (rotate-half, DINOv3:
channel j pairs with j + d/2).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import UsageError

ROPE_KINDS = ("eva", "mixed", "dinov3")


def _axis(idx: torch.Tensor, n, ref: int | None, kind: str, offset: float) -> torch.Tensor:
    """One axis's coordinate values of patch indices `idx` on an axis of `n` patches."""
    if kind == "dinov3":
        return 2.0 * ((idx + 0.5 + offset) / n) - 1.0  # the patch centre in [-1, 1]
    v = idx + offset
    return v / n * ref if ref is not None else v


def _layout(a: torch.Tensor, half: bool) -> torch.Tensor:
    """Per-pair values (..., d/2) -> (..., d): [a0, a0, a1, a1, ..] interleaved, [a0, a1, .., a0, a1, ..] half."""
    return torch.cat([a, a], dim=-1) if half else a.repeat_interleave(2, -1)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, half: bool = False) -> torch.Tensor:
    """Rotate channel pairs of x (..., N, d) by the angles whose sin and cos are (..., N, d) (`_layout`'s layout)."""
    if half:
        a, b = x.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)  # channel j pairs with j + d/2
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)  # (a, b) -> (-b, a) per pair
    return (x * cos + rotated * sin).to(x.dtype)


def mixed_freqs_init(head_dim: int, depth: int, num_heads: int, temperature: float) -> torch.Tensor:
    """ROPE-ViT-Mixed's initial frequencies (2, depth, heads, d/2): the axial magnitudes, each head and block
    turned by a random angle (the second half of the pairs a quarter turn further)."""
    mag = 1.0 / temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)  # (d/4,)
    turn = torch.rand(depth, num_heads, 1) * 2 * math.pi
    fx = torch.cat([mag * torch.cos(turn), mag * torch.cos(turn + math.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(turn), mag * torch.sin(turn + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy])  # (2, depth, heads, d/2)


class RotaryEmbedding2d(nn.Module):
    """(sin, cos) for a patch grid, each (N, head_dim) (the model's grid cached, any other on the fly), or with
    kind "mixed" each (depth, heads, N, head_dim): block i reads [i]."""

    def __init__(self, head_dim: int, grid: tuple[int, int], ref_grid: tuple[int, int] | None = None,
                 temperature: float = 10000.0, *, kind: str = "eva", indexing: str = "ij", offset: float = 0.0,
                 half: bool = False, depth: int = 0, num_heads: int = 0) -> None:
        super().__init__()
        if kind not in ROPE_KINDS:
            raise UsageError(f"rope must be one of {ROPE_KINDS}, got {kind!r}")
        if head_dim % 4:
            raise UsageError(f"2-D rotary embeddings need a head width divisible by 4, got {head_dim}")
        self.head_dim, self.ref_grid, self.temperature = head_dim, ref_grid, temperature
        self.kind, self.indexing, self.offset, self.half = kind, indexing, offset, half
        self.grid_size = tuple(grid)
        self.per_block = kind == "mixed"
        self.freqs = nn.Parameter(mixed_freqs_init(head_dim, depth, num_heads, temperature)) if self.per_block else None
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _coords(self, rows: torch.Tensor, cols: torch.Tensor, sizes: torch.Tensor | tuple) -> torch.Tensor:
        """Patch indices (...,) and their grids' (rows, cols) -> coordinate values (..., 2) in the channel order."""
        ref = self.ref_grid or (None, None)
        y = _axis(rows, sizes[0], ref[0], self.kind, self.offset)
        x = _axis(cols, sizes[1], ref[1], self.kind, self.offset)
        return torch.stack([x, y] if self.indexing == "xy" else [y, x], dim=-1)

    def _angles(self, c: torch.Tensor) -> torch.Tensor:
        """Coordinates (..., N, 2) -> angles (..., N, d/2), or (depth, ..., heads, N, d/2) for "mixed"."""
        nb = self.head_dim // 4
        i = torch.arange(nb, dtype=torch.float32, device=c.device)
        if self.kind == "dinov3":
            periods = self.temperature ** (i / nb)  # (d/4,)
            return (2 * math.pi * c[..., None] / periods).flatten(-2)  # (..., N, 2, d/4) -> (..., N, d/2)
        if self.kind == "eva":
            bands = 1.0 / self.temperature ** (i / nb)  # (d/4,)
            return (c[..., None] * bands).flatten(-2)
        f = self.freqs.float()  # (2, depth, heads, d/2)
        lead = c.shape[:-2]  # () for a grid, (B,) for a packed batch
        fx = f[0].reshape(f.shape[1], *[1] * len(lead), f.shape[2], 1, f.shape[3])  # (depth, [1,] heads, 1, d/2)
        fy = f[1].reshape(fx.shape)
        c = c[..., None, :, :]  # (..., 1, N, 2): broadcast over heads
        return c[..., 0, None] * fx + c[..., 1, None] * fy  # (depth, ..., heads, N, d/2)

    def _sincos(self, ang: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _layout(ang.sin(), self.half), _layout(ang.cos(), self.half)

    def forward(self, grid: tuple[int, int] | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        grid = tuple(grid or self.grid_size)
        key = (grid, str(device))
        # angles of learned frequencies are recomputed every call (they train); none are cached under inference_mode
        # (inference tensors would then reach a later training step's autograd)
        learned = self.per_block
        keep = not (learned or torch.compiler.is_compiling() or torch.is_inference_mode_enabled())
        hit = self._cache.get(key) if keep else None
        if hit is None:
            dev = self.freqs.device if learned else device
            rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float32, device=dev),
                                        torch.arange(grid[1], dtype=torch.float32, device=dev), indexing="ij")
            c = self._coords(rows.flatten(), cols.flatten(), grid)  # (N, 2), row-major over the grid
            hit = self._sincos(self._angles(c))
            if not learned:
                hit = (hit[0].to(device), hit[1].to(device))
                if keep:
                    self._cache[key] = hit
        return hit

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed batch's (sin, cos): every patch's angles at its (row, column) of its own image's grid, each
        (B, 1, L, head_dim), or (depth, B, heads, L, head_dim) for "mixed"."""
        yx = coords.float()  # (B, L, 2)
        s = sizes.float()[:, None, :]  # (B, 1, 2)
        c = self._coords(yx[..., 0], yx[..., 1], (s[..., 0], s[..., 1]))  # (B, L, 2)
        sin, cos = self._sincos(self._angles(c))
        return (sin, cos) if self.per_block else (sin[:, None], cos[:, None])

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        """Nothing to resample: the model's grid changes, the angles follow (each family's coordinates at the new
        grid, as the original computes them)."""
        self.grid_size = tuple(new_grid)
