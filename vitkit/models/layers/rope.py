"""2-D rotary position embeddings (RoPE, Su et al. 2021, made axial for images by EVA-02, arXiv 2303.11331).

Every head's query and key vectors of the patch tokens are rotated in pairs of channels by angles that grow
with the patch's row (the first half of the frequencies) and column (the second half): attention logits then
depend on the relative offset of two patches. The prefix tokens (class, registers) are not rotated.

Layout (EVA-02 / timm's `RotaryEmbeddingCat`, "interleaved"): for head width d there are d/4 frequencies
f_i = T^(-i / (d/4)); a patch at (y, x) has angles [y f_0 .. y f_{d/4-1}, x f_0 .. x f_{d/4-1}], each used for
one adjacent channel pair (c_2j, c_2j+1): (a, b) -> (a cos - b sin, b cos + a sin).
With `ref_grid` (EVA-02: the 16x16 grid of pre-training), coordinates are scaled by ref / grid, so a model
fine-tuned or run at another resolution sees the angles' range it was trained with.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import UsageError


def rope_angles(grid: tuple[int, int], head_dim: int, ref_grid: tuple[int, int] | None = None,
                temperature: float = 10000.0) -> torch.Tensor:
    """(N, head_dim / 2): the rotation angle of every channel pair of every patch, row-major over the grid."""
    if head_dim % 4:
        raise UsageError(f"2-D rotary embeddings need a head width divisible by 4, got {head_dim}")
    nb = head_dim // 4
    bands = 1.0 / temperature ** (torch.arange(nb, dtype=torch.float32) / nb)  # (d/4,)
    axes = [torch.arange(n, dtype=torch.float32) for n in grid]
    if ref_grid is not None:
        axes = [t / n * r for t, n, r in zip(axes, grid, ref_grid)]
    yx = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)  # (gh, gw, 2)
    return (yx[..., None] * bands).flatten(2).flatten(0, 1)  # (gh, gw, 2, d/4) -> (N, d/2)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x (..., N, d) by the angles whose sin and cos are (N, d) (each value twice)."""
    rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)  # (a, b) -> (-b, a) per pair
    return (x * cos + rotated * sin).to(x.dtype)


class RotaryEmbedding2d(nn.Module):
    """sin and cos (each (N, head_dim)) for a patch grid: the model's own, cached, or any other on the fly."""

    def __init__(self, head_dim: int, grid: tuple[int, int], ref_grid: tuple[int, int] | None = None,
                 temperature: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.ref_grid, self.temperature = head_dim, ref_grid, temperature
        self.grid_size = tuple(grid)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, grid: tuple[int, int] | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        grid = tuple(grid or self.grid_size)
        key = (grid, str(device))
        hit = None if torch.compiler.is_compiling() else self._cache.get(key)
        if hit is None:
            ang = rope_angles(grid, self.head_dim, self.ref_grid, self.temperature).repeat_interleave(2, -1)  # (N, d)
            hit = (ang.sin().to(device), ang.cos().to(device))
            if not torch.compiler.is_compiling():
                self._cache[key] = hit
        return hit

    def for_coords(self, coords: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed batch's (sin, cos), each (B, 1, L, head_dim): every patch's angles at its (row, column), scaled
        by ref_grid / its own image's grid as `rope_angles` scales a whole grid."""
        nb = self.head_dim // 4
        bands = 1.0 / self.temperature ** (torch.arange(nb, dtype=torch.float32, device=coords.device) / nb)
        yx = coords.float()  # (B, L, 2)
        if self.ref_grid is not None:
            yx = yx / sizes[:, None, :].float() * yx.new_tensor(self.ref_grid)
        ang = (yx[..., None] * bands).flatten(-2).repeat_interleave(2, -1)[:, None]  # (B, 1, L, d)
        return ang.sin(), ang.cos()

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        """Nothing learned to resample: the model's grid changes, the angles follow (scaled by ref_grid)."""
        self.grid_size = tuple(new_grid)
