"""Batches of images of different sizes and aspect ratios (NaViT, Dehghani et al. 2023; SigLIP 2's NaFlex towers).

A ViT is a sequence model: an image of any size whose sides are multiples of the patch size is a sequence of
(H / P) * (W / P) patches, with no need to squash it to one square first. A *packed batch* holds one image per row,
each row padded to the longest:

    patches (B, L, P*P*C)  each image's patches, row-major over its own grid, every patch flattened (ph, pw, C)
                           (channel fastest: the layout timm's NaFlex loader and transformers' SigLIP 2 processor use)
    coords  (B, L, 2)      each patch's (row, column) in its image's grid
    valid   (B, L) bool    True for an image's patches, False for the padding after them

An image's grid is read back from its coordinates (the largest + 1, as timm does), so the three tensors are the whole
input. The model gives each image its own position embedding (the learned grid resampled to that image's grid, per
token: `interp_weights`), lets every token attend to its own image's tokens only (`key_mask`) and pools per image.
Padding costs compute but changes nothing: an image alone and the same image in a packed batch give the same output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ...errors import UsageError


@dataclass
class PackedBatch:
    """A padded batch of patch sequences, one image per row (see the module's docstring)."""

    patches: torch.Tensor
    coords: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        p, c, v = self.patches, self.coords, self.valid
        if p.ndim != 3 or c.shape != (*p.shape[:2], 2) or v.shape != p.shape[:2]:
            raise UsageError(f"a packed batch is patches (B, L, P*P*C), coords (B, L, 2) and valid (B, L); got "
                             f"{tuple(p.shape)}, {tuple(c.shape)}, {tuple(v.shape)}")
        if v.dtype != torch.bool:
            self.valid = v.bool()
        if c.dtype not in (torch.int32, torch.int64):
            self.coords = c.long()
        if not torch.compiler.is_compiling() and p.numel():  # values (eager only: a traced graph takes them on trust)
            if not bool(self.valid.any(1).all()):
                raise UsageError("a packed batch has a row without any valid patch (every row holds one image)")
            if int(self.coords.min()) < 0:
                raise UsageError("a packed batch has a negative patch coordinate")

    def __len__(self) -> int:
        return self.patches.shape[0]

    def to(self, device=None, dtype=None) -> "PackedBatch":
        return PackedBatch(self.patches.to(device=device, dtype=dtype), self.coords.to(device), self.valid.to(device))

    def grids(self) -> list[tuple[int, int]]:
        """Each image's patch grid (rows, columns)."""
        return [tuple(int(v) for v in g) for g in grid_sizes(self.coords, self.valid)]

    def padding(self) -> int:
        """Padding tokens in the batch (compute spent on nothing)."""
        return int(self.valid.numel() - self.valid.sum())


def patchify(img: torch.Tensor, patch_size: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """One image (C, H, W), H and W multiples of the patch size -> its patches (N, ph*pw*C) and grid (gh, gw)."""
    if img.ndim != 3:
        raise UsageError(f"an image is (C, H, W), got shape {tuple(img.shape)}")
    c, h, w = img.shape
    ph, pw = patch_size
    if h % ph or w % pw or not h or not w:
        raise UsageError(f"image of size {h}x{w}: both sides must be positive multiples of the patch size {ph}x{pw} "
                         f"(vitkit.models.layers.packing.resize_to_patches gives the size at a patch budget, aspect ratio kept)")
    gh, gw = h // ph, w // pw
    x = img.reshape(c, gh, ph, gw, pw).permute(1, 3, 2, 4, 0)  # (gh, gw, ph, pw, C)
    return x.reshape(gh * gw, ph * pw * c), (gh, gw)


def grid_coords(gh: int, gw: int, device=None) -> torch.Tensor:
    """(gh * gw, 2): the (row, column) of every patch of a grid, row-major."""
    ys, xs = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    return torch.stack([ys, xs], dim=-1).reshape(-1, 2)


def pack(images: Sequence[torch.Tensor], patch_size: tuple[int, int], length: int | None = None) -> PackedBatch:
    """Images (each (C, H, W), any sizes that are multiples of the patch size) -> one PackedBatch.

    Args:
        length: pad every row to this many patches (one shape per batch size: the packed GEMMs keep their packing,
            a compiled or exported model sees one shape); None: the longest image's.
    """
    if not len(images):
        raise UsageError("nothing to pack: no images")
    seqs = [patchify(im, patch_size) for im in images]
    longest = max(s.shape[0] for s, _ in seqs)
    L = length if length is not None else longest
    if longest > L:
        raise UsageError(f"an image of {longest} patches does not fit a packed length of {L}")
    ref = seqs[0][0]
    patches = ref.new_zeros(len(seqs), L, ref.shape[1])
    coords = torch.zeros(len(seqs), L, 2, dtype=torch.long, device=ref.device)
    valid = torch.zeros(len(seqs), L, dtype=torch.bool, device=ref.device)
    for i, (s, (gh, gw)) in enumerate(seqs):
        n = s.shape[0]
        patches[i, :n], coords[i, :n], valid[i, :n] = s, grid_coords(gh, gw, ref.device), True
    return PackedBatch(patches, coords, valid)


def from_spatial_shapes(patches: torch.Tensor, spatial_shapes: torch.Tensor, mask: torch.Tensor | None = None
                        ) -> PackedBatch:
    """transformers' SigLIP 2 inputs (pixel_values (B, L, P*P*C), spatial_shapes (B, 2), pixel_attention_mask
    (B, L)) as a PackedBatch."""
    B, L = patches.shape[:2]
    coords = torch.zeros(B, L, 2, dtype=torch.long, device=patches.device)
    valid = torch.zeros(B, L, dtype=torch.bool, device=patches.device)
    for i, (gh, gw) in enumerate(spatial_shapes.tolist()):
        coords[i, : gh * gw], valid[i, : gh * gw] = grid_coords(gh, gw, patches.device), True
    if mask is not None and not torch.equal(mask.bool(), valid):
        raise UsageError("pixel_attention_mask does not mark the first h * w patches of each row as its image's")
    return PackedBatch(patches, coords, valid)


def as_packed(x, patch_size: tuple[int, int]) -> PackedBatch:
    """What a model's forward accepts besides an image tensor: a list of images, a PackedBatch, or the dict of
    timm's NaFlex collator ('patches', 'patch_coord', 'patch_valid')."""
    if isinstance(x, PackedBatch):
        return x
    if isinstance(x, dict):
        try:
            return PackedBatch(x["patches"], x["patch_coord"], x["patch_valid"])
        except KeyError as e:
            raise UsageError(f"a packed batch as a dict needs 'patches', 'patch_coord' and 'patch_valid': no {e}") from None
    if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x):
        return pack(x, patch_size)
    raise UsageError(f"expected an image batch (B, C, H, W), a list of images (C, H, W), a PackedBatch or a dict of "
                     f"patches, patch_coord and patch_valid; got {type(x).__name__}")


def grid_sizes(coords: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, 2): each row's grid (rows, columns), its largest valid coordinate + 1."""
    return coords.masked_fill(~valid[..., None], 0).amax(dim=1) + 1


def key_mask(valid: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """(B, 1, 1, p + L) bool for attention: every query may read its own image's tokens (its prefix tokens and its
    valid patches), never the padding. Padding queries read the image too, so no row is empty (no NaN); their
    outputs are never used."""
    if prefix:
        valid = torch.cat([valid.new_ones(valid.shape[0], prefix), valid], dim=1)
    return valid[:, None, None, :]


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, L, D), (B, L) -> (B, D): the mean of each row's valid tokens."""
    w = valid.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp(min=1)


# ---- position embeddings resampled per token -------------------------------------------------------------------


def _cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def interp_weights(pos: torch.Tensor, size: torch.Tensor, src: int, method: str) -> torch.Tensor:
    """The weights with which a resampled grid's entry `pos` (of `size` along this axis) reads the `src` entries of
    the learned one: (...,) -> (..., src). The same numbers `F.interpolate` computes for one axis, so a 2-D
    resampling is the outer product of two such rows, per token, with no loop over the images' sizes (and an ONNX
    export keeps it):

    - "bilinear": the official method (scipy's order-1 zoom: bilinear, corners aligned);
    - "bilinear_aa": PyTorch's antialiased bilinear, corners not aligned (SigLIP 2, timm's NaFlex SigLIP);
    - "bicubic": PyTorch's antialiased bicubic (a = -0.5), corners not aligned (timm);
    - "bicubic_noaa": PyTorch's plain bicubic (a = -0.75, borders clamped; transformers' DINOv2);
    - "bicubic_corners": the same with corners aligned (torchvision's `interpolate_embeddings`).
    """
    pos, size = pos.float(), size.float()
    j = torch.arange(src, dtype=torch.float32, device=pos.device)
    if method == "bilinear":
        center = pos * (src - 1) / (size - 1).clamp(min=1)
        return (1 - (j - center[..., None]).abs()).clamp(min=0)
    scale = src / size
    if method in ("bilinear_aa", "bicubic"):  # PyTorch's separable antialiased kernel (upsample_aa)
        support_scale = scale.clamp(min=1)[..., None]
        center = (scale * (pos + 0.5))[..., None]
        x = (j - center + 0.5) / support_scale
        w = (1 - x.abs()).clamp(min=0) if method == "bilinear_aa" else _cubic(x, -0.5)
        return w / w.sum(-1, keepdim=True)
    if method in ("bicubic_noaa", "bicubic_corners"):  # four taps around the source position, indices clamped
        center = (scale * (pos + 0.5) - 0.5 if method == "bicubic_noaa" else
                  pos * (src - 1) / (size - 1).clamp(min=1))
        base = center.floor()
        t = center - base
        w = torch.zeros(*pos.shape, src, device=pos.device)
        for k in range(-1, 3):
            idx = (base + k).clamp(0, src - 1).long()
            w.scatter_add_(-1, idx[..., None], _cubic(t - k, -0.75)[..., None])
        return w
    raise UsageError(f"resampling method must be bilinear, bilinear_aa, bicubic, bicubic_noaa or bicubic_corners, "
                     f"got {method!r}")


def resample_for_coords(table: torch.Tensor, coords: torch.Tensor, sizes: torch.Tensor, method: str,
                        square: bool = False) -> torch.Tensor:
    """A learned grid of embeddings (gh, gw, D), resampled to each token's image grid and read at its coordinate:
    coords (B, L, 2), sizes (B, 2) -> (B, L, D). Equals `resample_pos_embed_grid` to each image's grid, then the
    entry at each coordinate. `square`: resample to (m, m), m the image's longer side in patches, and read the
    top-left (h, w) part (timm's aspect-preserving `pos_embed_ar_preserving`)."""
    gh, gw, d = table.shape
    sizes = sizes[:, None, :].expand(-1, coords.shape[1], -1)  # (B, L, 2)
    if square:
        sizes = sizes.amax(-1, keepdim=True).expand_as(sizes)
    wy = interp_weights(coords[..., 0], sizes[..., 0], gh, method)  # (B, L, gh)
    wx = interp_weights(coords[..., 1], sizes[..., 1], gw, method)  # (B, L, gw)
    w = (wy[..., :, None] * wx[..., None, :]).flatten(-2)  # (B, L, gh * gw)
    return (w @ table.reshape(gh * gw, d).float()).to(table.dtype)  # (B, L, D)


def resize_to_patches(h: int, w: int, patch_size: tuple[int, int], max_patches: int) -> tuple[int, int]:
    """The size (H', W'), multiples of the patch size, closest to (h, w)'s aspect ratio with at most `max_patches`
    patches (and at least one row and one column): the largest scale s with floor(h s / P) * floor(w s / P) <=
    max_patches. Small images are scaled up to the budget too, as NaFlex does."""
    if max_patches < 1:
        raise UsageError(f"max_patches must be >= 1, got {max_patches}")
    if h < 1 or w < 1:
        raise UsageError(f"an image of size {h}x{w} has no pixels")
    ph, pw = patch_size
    lo, hi = 0.0, math.sqrt(max_patches * ph * pw / (h * w)) * 2 + 1.0

    def grid(s: float) -> tuple[int, int]:
        return max(1, int(h * s / ph)), max(1, int(w * s / pw))

    for _ in range(50):  # bisection on the scale: the patch count only grows with it
        mid = (lo + hi) / 2
        gh, gw = grid(mid)
        if gh * gw <= max_patches:
            lo = mid
        else:
            hi = mid
    gh, gw = grid(lo)
    while gh * gw > max_patches:  # the (1, n) floor can exceed a tiny budget for a very long image
        gh, gw = (gh, gw - 1) if gw >= gh else (gh - 1, gw)
    return gh * ph, gw * pw
