"""Data at native aspect ratio (NaFlex): every image resized, keeping its aspect ratio, to a budget of patches
(`data.max_patches`), then packed with the others of its batch into one `PackedBatch` (`vitkit.models.layers.packing`).

- Images of any size come from any dataset kind; in memory, `datasets.VarSizeDataset` (and `datasets.aspect_crops`,
  the test set whose aspect ratios vary: "fashion-mnist-crops").
- `PackTransform`: a batch of uint8 images (a list, or a (B, C, H, W) tensor) -> a PackedBatch at the patch budget,
  normalised: evaluation, `predict`, serving.
- `PackAugment`: the same for training, after augmentations that keep the aspect ratio (a random crop of the image's
  own aspect ratio and area `scale`, horizontal flips).

Batches are drawn by the same sampler as fixed-size data (`iterate_batches`: one order per (seed, epoch), a slice per
rank, `start_step` for an exact resume). Every image of a batch has between ~0.8 and 1.0 x max_patches patches after
the budget resize, and every row is padded to max_patches, as timm's NaFlex collator pads to its max_seq_len: one
shape per batch size, so the packed GEMMs keep their packing (an MKL-packed weight is packed for one row count) and a
compiled model sees one shape. The padding costs a few per cent (`benchmarks/naflex.py` measures it).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import UsageError
from ..models.layers.packing import PackedBatch, pack, resize_to_patches
from .image import normalize, resize_float as _resize

__all__ = ["PackTransform", "PackAugment", "hflip_packed"]


class PackTransform:
    """uint8 images (a list of (C, H, W), or a (B, C, H, W) batch) -> a normalised PackedBatch, each image resized to
    at most `max_patches` patches, its aspect ratio kept (`resize_to_patches`)."""

    def __init__(self, max_patches: int, patch_size: Sequence[int], mean: Sequence[float], std: Sequence[float], *,
                 replicate_to: int | None = None, sized: bool = False) -> None:
        if max_patches < 1:
            raise UsageError(f"data.max_patches must be >= 1, got {max_patches}")
        self.max_patches, self.patch_size = int(max_patches), tuple(patch_size)
        self.mean, self.std, self.replicate_to = tuple(mean), tuple(std), replicate_to
        self.sized = sized  # the images were decoded at the budget already (`FileDataset.packed`): no second resize

    @classmethod
    def for_model(cls, config, max_patches: int, *, replicate_to: int | None = None, sized: bool = False) -> "PackTransform":
        return cls(max_patches, config.patch_size, config.mean, config.std, replicate_to=replicate_to, sized=sized)

    def size_for(self, h: int, w: int) -> tuple[int, int]:
        (ph, pw), n = self.patch_size, self.max_patches
        if self.sized and h % ph == 0 and w % pw == 0 and (h // ph) * (w // pw) <= n:
            return h, w
        return resize_to_patches(h, w, self.patch_size, n)

    def image(self, img: torch.Tensor) -> torch.Tensor:
        """One uint8 (C, H, W) -> float (C, H', W') at the patch budget, normalised."""
        x = img.float() / 255
        if self.replicate_to and x.shape[0] == 1:
            x = x.expand(self.replicate_to, -1, -1)
        size = self.size_for(x.shape[1], x.shape[2])
        return normalize(_resize(x, size), self.mean, self.std)

    def __call__(self, batch) -> PackedBatch:
        return pack([self.image(im) for im in batch], self.patch_size, length=self.max_patches)


class PackAugment(PackTransform):
    """Training: per image a random crop of its own aspect ratio (area fraction U(scale)) and a horizontal flip
    (p = 0.5), then the budget resize and packing. Returns (PackedBatch, labels), as `BatchAugment` does."""

    def __init__(self, max_patches: int, patch_size, mean, std, *, scale: tuple[float, float] = (0.35, 1.0),
                 hflip: bool = True, replicate_to: int | None = None) -> None:
        super().__init__(max_patches, patch_size, mean, std, replicate_to=replicate_to)
        self.scale, self.hflip = tuple(scale), hflip

    def __call__(self, batch, y: torch.Tensor, g: torch.Generator) -> tuple[PackedBatch, torch.Tensor]:
        out = []
        u = torch.rand(len(batch), 4, generator=g, device=g.device).cpu().tolist()  # area, top, left, flip
        for img, (area, top, left, flip) in zip(batch, u):
            _, h, w = img.shape
            s = math.sqrt(self.scale[0] + (self.scale[1] - self.scale[0]) * area)  # the same factor on both sides
            ch, cw = max(1, round(h * s)), max(1, round(w * s))
            y0, x0 = int(top * (h - ch + 1)), int(left * (w - cw + 1))
            img = img[:, y0:y0 + ch, x0:x0 + cw]
            if self.hflip and flip < 0.5:
                img = img.flip(-1)
            out.append(self.image(img))  # the crop back to the budget (sized=False: always resized)
        return pack(out, self.patch_size, length=self.max_patches), y


def hflip_packed(batch: PackedBatch, patch_size: Sequence[int]) -> PackedBatch:
    """Every image of a packed batch flipped left-right: each patch mirrored and moved to the mirrored column (the
    model reads positions from the coordinates, so the order of the tokens does not matter)."""
    B, L, n = batch.patches.shape
    ph, pw = patch_size
    w = batch.coords.masked_fill(~batch.valid[..., None], 0)[..., 1].amax(1, keepdim=True) + 1  # (B, 1): each grid's width
    patches = batch.patches.reshape(B, L, ph, pw, n // (ph * pw)).flip(3).reshape(B, L, n)  # (ph, pw, C): mirror pw
    coords = batch.coords.clone()
    coords[..., 1] = torch.where(batch.valid, w - 1 - coords[..., 1], coords[..., 1])
    return PackedBatch(patches, coords, batch.valid)
