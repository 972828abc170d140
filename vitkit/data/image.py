"""Decoding images, and the one evaluation preprocessing of a checkpoint (resize, centre crop, normalise).

A checkpoint's config names its preprocessing: img_size, crop_pct, interpolation, mean, std. Evaluation during
training, `vitkit eval`, `predict`, `explain` and the service all apply it the same way, as timm's eval
transform does: resize the shorter side to floor(size / crop_pct) (a non-square img_size: both sides to
floor(side / crop_pct)), crop the centre to img_size, scale to [0, 1], normalise. `eval_geometry` is that
geometry, once; `resize_crop` applies it to a decoded PIL image (files), `EvalTransform` to a batch of
same-sized uint8 images (the in-memory datasets).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import warnings
from pathlib import Path
from typing import ClassVar, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from .. import env
from ..errors import UsageError, VitkitError
from ..safety import open_regular

_PIL_INTERP = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}

# Images with more pixels than this are refused before they are decoded (a decompression bomb: a tiny PNG that
# declares 20000 x 20000 would take 1.2 GB as RGB). 64 Mpx: an 8192 x 8192 image, or a 48 Mpx photo, passes.
def max_image_pixels() -> int:
    return env.get("VITKIT_MAX_IMAGE_PIXELS")  # VITKIT_MAX_IMAGE_PIXELS, read at each use (`vitkit.env`)


class BadSample(NamedTuple):
    """What a dataset returns for a sample it cannot decode (unless strict): which one, and why."""

    name: str
    reason: str


class ImageDecodeError(VitkitError, ValueError):
    """An image file that is missing, truncated, not an image, or too large to decode safely."""


def load_image(source: str | Path | np.ndarray | Image.Image, in_chans: int = 3, max_pixels: int | None = None) -> Image.Image:
    """Open an image file (or wrap an array) as a PIL image in RGB (in_chans 3) or L (in_chans 1).

    A file that declares more than `max_pixels` (default VITKIT_MAX_IMAGE_PIXELS) is refused from its header,
    before any pixel is decoded."""
    limit = max_image_pixels() if max_pixels is None else max_pixels
    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, np.ndarray):
        arr = source
        if arr.dtype == np.uint16:  # 16 bits: 0..65535 onto 0..255 (`_eight_bit`), not clipped to white
            arr = _LUT16[arr]
        elif arr.dtype != np.uint8:
            arr = np.clip(arr * (255 if arr.max() <= 1.0 else 1), 0, 255).astype(np.uint8)
        img = Image.fromarray(arr)
    else:
        try:
            with warnings.catch_warnings(), contextlib.ExitStack() as stack:
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                if isinstance(source, (str, os.PathLike)):  # a regular file only: a FIFO would wait for a writer
                    fp = stack.enter_context(open_regular(source, error=ImageDecodeError))
                else:
                    fp = source
                with Image.open(fp) as f:
                    w, h = f.size
                    if w * h > limit:
                        raise ImageDecodeError(f"{source}: {w} x {h} = {w * h:,} pixels, over the limit of {limit:,}: "
                                               f"refused as a possible decompression bomb (VITKIT_MAX_IMAGE_PIXELS)")
                    f.load()  # decode now, so a truncated file fails here
                    img = f.copy()
        except (FileNotFoundError, IsADirectoryError, ImageDecodeError):
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # PIL's own, larger limits
            raise ImageDecodeError(f"{source}: {e}; over the limit of {limit:,} pixels: refused as a possible "
                                   f"decompression bomb (VITKIT_MAX_IMAGE_PIXELS)") from e
        except UnidentifiedImageError as e:
            raise ImageDecodeError(f"cannot decode image {source}: not an image format PIL identifies") from e
        except MemoryError:
            raise ImageDecodeError(f"cannot decode image {source}: decoding it ran out of memory") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageDecodeError(f"cannot decode image {source}: {e}") from e
    try:
        return _eight_bit(img).convert("L" if in_chans == 1 else "RGB")
    except MemoryError:
        raise ImageDecodeError(f"cannot convert image {_name(source)}: it ran out of memory") from None
    except (ValueError, OSError) as e:  # a mode PIL cannot make RGB of (LAB, ...)
        raise ImageDecodeError(f"cannot convert image {_name(source)} ({img.mode}) to "
                               f"{'L' if in_chans == 1 else 'RGB'}: {e}") from e


# 16-bit values onto 8 bits, rounded (v * 255 / 65535): what a 16-bit image shows on an 8-bit screen
_LUT16 = np.round(np.arange(65536, dtype=np.float64) * (255 / 65535)).astype(np.uint8)


def _name(source) -> str:
    return "(array)" if isinstance(source, np.ndarray) else "(image)" if isinstance(source, Image.Image) else str(source)


def _eight_bit(img: Image.Image) -> Image.Image:
    """A single-channel image of more than 8 bits as the 8-bit L image it shows (PIL's own `convert` clips such
    values at 255: a 16-bit image would be solid white). 16-bit (modes I;16, I;16B, I;16L, I;16N, and I, which PIL
    gives 16-bit PNGs and PGMs): 0..65535 onto 0..255, rounded (values outside clipped). 32-bit float (F, TIFF): as
    an array is read (`load_image`), [0, 1] scaled to 0..255 when every value lies in it, else clipped to 0..255;
    NaN is 0. PIL reads 16-bit RGB(A) and LA PNGs as 8-bit RGB(A) itself (the high byte of each value)."""
    if img.mode.startswith("I;16") or img.mode == "I":
        arr = np.asarray(img)
        if arr.dtype != np.uint16:
            arr = np.clip(arr, 0, 65535).astype(np.uint16)
        return Image.fromarray(_LUT16[arr], "L")
    if img.mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float32), nan=0.0, posinf=255.0, neginf=0.0)
        if arr.size and 0.0 <= float(arr.min()) and float(arr.max()) <= 1.0:
            arr = arr * 255.0
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    return img


def eval_geometry(in_hw: tuple[int, int], img_size: tuple[int, int], crop_pct: float = 1.0
                  ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The evaluation resize and crop of an image of size in_hw: ((resized h, w), (crop top, left)).

    As timm's eval transform (crop mode 'center'): a square img_size S resizes the shorter side to floor(S / crop_pct)
    and the longer in proportion, truncated (torchvision's Resize); a non-square (h, w) scales the image, keeping
    its aspect, until it covers (floor(h / crop_pct), floor(w / crop_pct)), rounded (timm's ResizeKeepRatio). The
    crop offsets are round((resized - size) / 2), as torchvision's CenterCrop."""
    ih, iw = in_hw
    h, w = img_size
    th, tw = math.floor(h / crop_pct), math.floor(w / crop_pct)
    if th == tw:
        if iw <= ih:
            rh, rw = int(th * ih / iw), th
        else:
            rh, rw = th, int(th * iw / ih)
    else:
        ratio = min(ih / th, iw / tw)
        rh, rw = round(ih / ratio), round(iw / ratio)
    if rh < h or rw < w:
        raise UsageError(f"crop_pct {crop_pct} resizes {in_hw} to {(rh, rw)}, smaller than the crop {img_size}")
    return (rh, rw), (int(round((rh - h) / 2.0)), int(round((rw - w) / 2.0)))


# The most pixels the resize before the centre crop may make. An image of an absurd aspect ratio (1 x 50,000,000
# pixels, a 97 KB PNG) would be resized to 16 x 800,000,000 before its 16 x 16 centre is cut (38 GB): beyond this,
# only the crop's own region is resized, straight to the crop (the same pixels within rounding, without the rest).
MAX_RESIZE_PIXELS = 64 * 1024 * 1024


def resize_crop(img: Image.Image, img_size: tuple[int, int], crop_pct: float = 1.0, interpolation: str = "bilinear") -> Image.Image:
    """The evaluation geometry (`eval_geometry`) applied to a PIL image: an img_size PIL image. Memory is bounded
    by the image and the crop: a resize that would make more than MAX_RESIZE_PIXELS (an absurd aspect ratio)
    resizes the crop's region of the image alone (PIL's `box`: the crop of the whole resize, computed for the
    crop's pixels only)."""
    (rh, rw), (top, left) = eval_geometry((img.height, img.width), tuple(img_size), crop_pct)
    h, w = img_size
    resample = _PIL_INTERP.get(interpolation, Image.BILINEAR)
    if rh * rw > MAX_RESIZE_PIXELS:
        sy, sx = img.height / rh, img.width / rw  # source pixels per resized pixel
        box = (left * sx, top * sy, min((left + w) * sx, img.width), min((top + h) * sy, img.height))
        return img.resize((w, h), resample, box=box)
    if (rh, rw) != (img.height, img.width):
        img = img.resize((rw, rh), resample)
    return img.crop((left, top, left + w, top + h))


def random_resized_crop_box(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                            rng: random.Random) -> tuple[int, int, int, int]:
    """Inception-style random-resized-crop on a (height, width) image: a box (top, left, h, w) of area fraction
    U(scale) and log-uniform aspect ratio w/h in `ratio`, at a uniform position; after 10 misses the centre crop of
    the largest box whose ratio is in range (torchvision's algorithm)."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainCrops:
    """For a file dataset (a dataclass with `train_crop`): random-resized training crops, per epoch."""

    def with_train_crop(self, scale: tuple[float, float], ratio: tuple[float, float], seed: int):
        """Training crops: each image random-resized-cropped at its full resolution, then resized to img_size."""
        return dataclasses.replace(self, train_crop=(tuple(scale), tuple(ratio), seed, 0))

    def for_epoch(self, epoch: int):
        """This epoch's crops (the same dataset when it has none)."""
        return self if self.train_crop is None else dataclasses.replace(self, train_crop=(*self.train_crop[:3], epoch))


class DecodedFiles(TrainCrops):
    """What the datasets that decode image files themselves share (`FileDataset`, `ShardDataset`: dataclasses with
    img_size, crop_pct, interpolation and `train_crop`): they decode at a model's size with its evaluation geometry,
    so their batches need normalising only, and their training crops are cut from the full-resolution image."""

    decodes: ClassVar[bool] = True  # batches arrive at the model's size (in-memory kinds: False, resized on the batch)

    def configured(self, config):
        """These files, decoded as `config` (a model's) asks: its img_size, crop_pct and interpolation."""
        return dataclasses.replace(self, img_size=tuple(config.img_size), crop_pct=getattr(config, "crop_pct", 1.0),
                                   interpolation=getattr(config, "interpolation", "bilinear"))

    def for_model(self, config, max_patches: int | None = None):
        """This split as `config`'s model reads it (`configured`); a kind that can decode at native aspect ratios
        overrides this for `max_patches`."""
        return self.configured(config)

    def select(self, classes: list[int] | None = None, n: int | None = None, device=None):
        """Files are read whole, where they are: `n` (a smoke run's cut of an in-memory set) does not apply, and
        choosing classes is for in-memory datasets."""
        if classes is not None:
            raise UsageError("data.classes selects classes of an in-memory dataset (fashion-mnist, cifar, digits)")
        return self


def sample_geometry(img: Image.Image, ds, index: int) -> Image.Image:
    """A file dataset's sample at its model's size: the evaluation geometry, or, for a training set given a
    `train_crop` (scale, ratio, seed, epoch), a random-resized crop of the full-resolution image, drawn from
    (seed, epoch, index) alone: the same crop whatever the number of processes or workers, and on a resume."""
    if ds.train_crop is None:
        return resize_crop(img, tuple(ds.img_size), ds.crop_pct, ds.interpolation)
    scale, ratio, seed, epoch = ds.train_crop
    rng = random.Random((seed * 1_000_003 + epoch) * 1_000_000_007 + index)
    top, left, h, w = random_resized_crop_box(img.height, img.width, scale, ratio, rng)
    return img.resize((ds.img_size[1], ds.img_size[0]), _PIL_INTERP.get(ds.interpolation, Image.BILINEAR),
                      box=(left, top, left + w, top + h))


def to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image -> uint8 (C, H, W)."""
    t = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
    return t[None] if t.ndim == 2 else t.permute(2, 0, 1)  # (H, W, C) -> (C, H, W)


def resize_float(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """float (C, H, W) in [0, 1] -> (C, *size), antialiased bilinear (as the square path's `EvalTransform`)."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0].clamp(0, 1)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Float images in [0, 1] (..., C, H, W) -> (x - mean) / std per channel."""
    c = x.shape[-3]
    m = torch.tensor(mean, dtype=torch.float32, device=x.device)[:c, None, None]
    s = torch.tensor(std, dtype=torch.float32, device=x.device)[:c, None, None]
    return (x - m) / s


def preprocess(img: Image.Image, img_size: tuple[int, int], mean: Sequence[float], std: Sequence[float], *,
               crop_pct: float = 1.0, interpolation: str = "bilinear") -> torch.Tensor:
    """One decoded image -> the model's input (C, H, W) float32: `resize_crop`, then scale and normalise."""
    x = to_uint8_tensor(resize_crop(img, tuple(img_size), crop_pct, interpolation)).float() / 255
    return normalize(x, mean, std)


def decode_for(path: str | Path, config) -> torch.Tensor:
    """An image file decoded and resized/cropped as `config` (a model's) asks: uint8 (C, H, W) at its img_size."""
    img = load_image(path, config.in_chans)
    return to_uint8_tensor(resize_crop(img, tuple(config.img_size), config.crop_pct, config.interpolation))


class EvalTransform:
    """A batch of uint8 images (B, C, H, W) -> the model's input: the evaluation geometry (unless the images were
    already decoded at the model's size by `resize_crop`: geometry=False), scaling and normalisation.

    Args:
        replicate_to: repeat a single grey channel this many times (grey data into an RGB checkpoint).
    """

    def __init__(self, img_size: tuple[int, int], mean: Sequence[float], std: Sequence[float], *, crop_pct: float = 1.0,
                 interpolation: str = "bilinear", replicate_to: int | None = None, geometry: bool = True) -> None:
        self.img_size, self.mean, self.std = tuple(img_size), tuple(mean), tuple(std)
        self.crop_pct, self.interpolation, self.replicate_to, self.geometry = crop_pct, interpolation, replicate_to, geometry

    @classmethod
    def for_model(cls, config, *, replicate_to: int | None = None, geometry: bool = True) -> "EvalTransform":
        return cls(config.img_size, config.mean, config.std, crop_pct=getattr(config, "crop_pct", 1.0),
                   interpolation=getattr(config, "interpolation", "bilinear"), replicate_to=replicate_to, geometry=geometry)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / 255
        if self.replicate_to and x.shape[1] == 1:
            x = x.expand(-1, self.replicate_to, -1, -1)
        if self.geometry:
            (rh, rw), (top, left) = eval_geometry(tuple(x.shape[-2:]), self.img_size, self.crop_pct)
            if (rh, rw) != tuple(x.shape[-2:]):
                mode = self.interpolation if self.interpolation in ("bilinear", "bicubic") else "nearest"
                kw = dict(align_corners=False, antialias=True) if mode != "nearest" else {}
                x = F.interpolate(x, size=(rh, rw), mode=mode, **kw).clamp(0, 1)
            x = x[..., top:top + self.img_size[0], left:left + self.img_size[1]]
        elif tuple(x.shape[-2:]) != self.img_size:
            raise UsageError(f"images of size {tuple(x.shape[-2:])} were expected at the model's size {self.img_size}")
        return normalize(x, self.mean, self.std)


# timm's `create_transform` keywords that only its training transform reads (ignored for evaluation, as timm ignores
# them), and those whose non-default value changes the evaluation output (refused: vitkit has no such path)
_TIMM_TRAIN_ONLY = ("no_aug", "train_crop_mode", "scale", "ratio", "hflip", "vflip", "color_jitter", "color_jitter_prob",
                    "grayscale_prob", "gaussian_blur_prob", "auto_augment", "re_prob", "re_mode", "re_count",
                    "re_num_splits", "separate")
_TIMM_EVAL_DEFAULTS = {"crop_border_pixels": None, "tf_preprocessing": False, "use_prefetcher": False,
                       "normalize": True, "naflex": False, "patchify": False}


class ImageTransform:
    """One PIL image -> the model's input (C, H, W) float32, as vitkit evaluates it (`preprocess`: `resize_crop`,
    then scale and normalise); what `create_transform` returns."""

    def __init__(self, img_size: tuple[int, int], mean: Sequence[float], std: Sequence[float], *, in_chans: int = 3,
                 crop_pct: float = 1.0, interpolation: str = "bilinear") -> None:
        self.img_size, self.mean, self.std, self.in_chans = tuple(img_size), tuple(mean), tuple(std), in_chans
        self.crop_pct, self.interpolation = crop_pct, interpolation

    def __call__(self, img: Image.Image) -> torch.Tensor:
        mode = "RGB" if self.in_chans == 3 else "L"
        img = img if img.mode == mode else _eight_bit(img).convert(mode)
        return preprocess(img, self.img_size, self.mean, self.std, crop_pct=self.crop_pct,
                          interpolation=self.interpolation)

    def __repr__(self) -> str:
        return (f"ImageTransform(img_size={self.img_size}, crop_pct={self.crop_pct}, "
                f"interpolation={self.interpolation!r}, mean={self.mean}, std={self.std})")


def create_transform(input_size: int | tuple[int, int] | tuple[int, int, int] = 224, is_training: bool = False, *,
                     interpolation: str = "bilinear", mean: Sequence[float] = (0.485, 0.456, 0.406),
                     std: Sequence[float] = (0.229, 0.224, 0.225), crop_pct: float | None = None,
                     crop_mode: str | None = None, **timm_kwargs) -> ImageTransform:
    """timm's `timm.data.create_transform(**data_config)` for evaluation: a callable PIL image -> (C, H, W) tensor,
    the evaluation preprocessing vitkit itself applies (resize the shorter side to floor(size / crop_pct), centre
    crop, scale to [0, 1], normalise). Takes what `vitkit.resolve_data_config` returns.

    Args:
        input_size: S, (H, W) or (C, H, W), as timm's.
        is_training: refused: vitkit's training augmentations are the training presets' (`vitkit train`).
        interpolation: "bilinear", "bicubic" or "nearest" (PIL's resize, as timm's).
        mean, std, crop_pct, crop_mode: timm's defaults (ImageNet's mean and std, crop_pct 0.875); crop_mode
            "center" only.
        **timm_kwargs: timm's training-only keywords are ignored, as timm ignores them for evaluation; the others
            (tf_preprocessing, use_prefetcher, normalize, naflex, ...) only at timm's defaults.
    """
    if is_training:
        raise UsageError("create_transform(is_training=True): vitkit's training augmentations are the training "
                         "presets' (vitkit train); this is the evaluation transform")
    for k, v in timm_kwargs.items():
        if k in _TIMM_TRAIN_ONLY:
            continue
        if k not in _TIMM_EVAL_DEFAULTS:
            raise UsageError(f"create_transform: unknown keyword {k!r}")
        if v != _TIMM_EVAL_DEFAULTS[k]:
            raise UsageError(f"create_transform({k}={v!r}): vitkit's evaluation transform has only timm's default "
                             f"({_TIMM_EVAL_DEFAULTS[k]!r})")
    if crop_mode not in (None, "center"):
        raise UsageError(f"crop_mode {crop_mode!r}: vitkit's evaluation crops the centre ('center') only")
    if interpolation not in _PIL_INTERP:
        raise UsageError(f"interpolation {interpolation!r}: one of {sorted(_PIL_INTERP)}")
    size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
    in_chans, hw = (size[0], size[1:]) if len(size) == 3 else (3, size)
    if in_chans not in (1, 3) or len(mean) != in_chans or len(std) != in_chans:
        raise UsageError(f"input_size {tuple(input_size) if not isinstance(input_size, int) else input_size} with "
                         f"mean {tuple(mean)}, std {tuple(std)}: 1 or 3 channels, one mean and std per channel")
    return ImageTransform(hw, mean, std, in_chans=in_chans, crop_pct=0.875 if crop_pct is None else crop_pct,
                          interpolation=interpolation)


def replicate_channels(data_chans: int, model_chans: int) -> int | None:
    """The one grey-to-RGB rule: a 1-channel dataset fed to a 3-channel model has its grey channel repeated 3 times
    (the `replicate_to` of the batch transforms); None where nothing is repeated (the channels agree, or no rule
    makes one into the other: the caller that needs them to agree says so)."""
    return 3 if data_chans == 1 and model_chans == 3 else None
