"""Decoding one image and the evaluation preprocessing a checkpoint asks for (resize, centre crop, normalise)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

_PIL_INTERP = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}


class ImageDecodeError(ValueError):
    """An image file that is missing, truncated or not an image."""


def load_image(source: str | Path | np.ndarray | Image.Image, in_chans: int = 3) -> Image.Image:
    """Open an image file (or wrap an array) as a PIL image in RGB (in_chans 3) or L (in_chans 1)."""
    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, np.ndarray):
        arr = source
        if arr.dtype != np.uint8:
            arr = np.clip(arr * (255 if arr.max() <= 1.0 else 1), 0, 255).astype(np.uint8)
        img = Image.fromarray(arr)
    else:
        try:
            with Image.open(source) as f:
                f.load()  # decode now, so a truncated file fails here
                img = f.copy()
        except FileNotFoundError:
            raise
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ImageDecodeError(f"cannot decode image {source}: {e}") from e
    return img.convert("L" if in_chans == 1 else "RGB")


def preprocess(
    img: Image.Image,
    img_size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    crop_pct: float = 1.0,
    interpolation: str = "bilinear",
) -> torch.Tensor:
    """Resize so the crop covers `crop_pct` of the shorter side, centre-crop to img_size, scale to [0, 1], normalise.

    Returns a (C, H, W) float32 tensor.
    """
    h, w = img_size
    scale_h, scale_w = math.floor(h / crop_pct), math.floor(w / crop_pct)
    iw, ih = img.size
    s = max(scale_h / ih, scale_w / iw)  # resize the shorter side to cover the crop
    nw, nh = max(w, round(iw * s)), max(h, round(ih * s))
    img = img.resize((nw, nh), _PIL_INTERP.get(interpolation, Image.BILINEAR))
    left, top = (nw - w) // 2, (nh - h) // 2
    img = img.crop((left, top, left + w, top + h))
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
    x = x[None] if x.ndim == 2 else x.permute(2, 0, 1)  # (H, W, C) -> (C, H, W)
    m = torch.tensor(mean, dtype=torch.float32)[: x.shape[0], None, None]
    sd = torch.tensor(std, dtype=torch.float32)[: x.shape[0], None, None]
    return (x - m) / sd
