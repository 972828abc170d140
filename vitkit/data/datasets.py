"""Datasets: Fashion-MNIST (idx files), CIFAR-10/100 (python archives), ImageFolder trees and CSV lists.

Small datasets are held in memory as uint8 (N, C, H, W) and batched by index; folder datasets are
decoded in DataLoader workers. Every source yields uint8 batches; augmentation runs on the batch,
on the training device (see `augment.py`).

Every kind of dataset answers the same questions itself, so that no caller asks which kind it holds:
`decodes` (files decoded at a model's size, or images held at their native size and resized on the batch),
`for_model(config, max_patches)` (the split as that model reads it), `select(classes, n, device)` (a run's choice
of classes and smoke-run cut), `take(indices)` (a held-out part), `in_chans` (for the grey-to-RGB rule,
`image.replicate_channels`). `vitkit.data.splits` is the one entrance that uses them.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import gzip
import importlib.util
import io
import logging
import math
import pickle
import random
import signal
import struct
import tarfile
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..cache import cache_dir
from ..download import download as fetch
from ..errors import CheckpointError, UsageError, VitkitError
from ..models.layers.packing import resize_to_patches
from ..models.layers.patch_embed import to_2tuple
from .. import env
from ..safety import open_regular
from .augment import alternate_flip, flip_coins
from .image import (_PIL_INTERP, BadSample, DecodedFiles, ImageDecodeError, load_image, replicate_channels, resize_float,
                    sample_geometry, to_uint8_tensor)
from .shards import ShardDataset, fetch_small

log = logging.getLogger(__name__)

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
# Zalando's own repository, over https; the MD5s are the ones the dataset publishes (its README, torchvision).
FASHION_MNIST_URL = "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion"
FASHION_MNIST_MD5 = {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                     "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
                     "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
                     "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_URLS = {"cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
              "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"}
CIFAR_MD5 = {"cifar10": "c58f30108f718f92721af3b95e74349a", "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}  # as published


class DatasetError(VitkitError, ValueError):
    """A dataset that cannot be found or used as asked."""


@dataclass
class InMemoryDataset:
    """uint8 images (N, C, H, W) and int64 labels (N,), with class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str = ""

    decodes: ClassVar[bool] = False  # held at their native size: batches are resized to a model's on the device

    def __len__(self) -> int:
        return len(self.labels)

    def for_model(self, config, max_patches: int | None = None) -> "InMemoryDataset":
        """As a model reads it: unchanged (the batch transform resizes)."""
        return self

    def select(self, classes: list[int] | None = None, n: int | None = None, device=None) -> "InMemoryDataset":
        """These classes only (relabelled), the first n of a fixed shuffle, on `device` (None: where it is)."""
        ds = self.with_classes(classes).subset(n)
        return ds.to(device) if device is not None else ds

    def take(self, idx: torch.Tensor, name: str | None = None) -> "InMemoryDataset":
        """The samples at `idx` (a held-out part)."""
        idx = idx.to(self.labels.device)
        return InMemoryDataset(self.images[idx], self.labels[idx], self.classes, self.name if name is None else name)

    def batch(self, idx: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The uint8 images and labels at `idx`, on `device`."""
        idx = idx.to(self.images.device)
        return self.images[idx].to(device, non_blocking=True), self.labels[idx].to(device, non_blocking=True)

    @property
    def in_chans(self) -> int:
        return self.images.shape[1]

    @property
    def img_size(self) -> tuple[int, int]:
        return tuple(self.images.shape[-2:])

    def subset(self, n: int | None) -> "InMemoryDataset":
        """The first n samples per a fixed shuffle (stratification by luck; for smoke runs)."""
        if n is None or n >= len(self):
            return self
        idx = torch.randperm(len(self), generator=torch.Generator().manual_seed(0))[:n]
        return InMemoryDataset(self.images[idx], self.labels[idx], self.classes, self.name)

    def with_classes(self, keep: list[int] | None) -> "InMemoryDataset":
        """Only the images of these classes, relabelled 0..k-1 in the order given."""
        if keep is None:
            return self
        bad = [c for c in keep if not 0 <= c < len(self.classes)]
        if bad:
            raise DatasetError(f"classes {bad} are not in {self.name}'s 0..{len(self.classes) - 1}")
        remap = torch.full((len(self.classes),), -1, dtype=torch.long)
        remap[torch.tensor(keep)] = torch.arange(len(keep))
        mask = remap[self.labels.cpu()] >= 0
        idx = torch.nonzero(mask).flatten().to(self.labels.device)
        return InMemoryDataset(self.images[idx], remap.to(self.labels.device)[self.labels[idx]],
                               [self.classes[c] for c in keep], f"{self.name} (classes {keep})")

    def to(self, device: torch.device | str) -> "InMemoryDataset":
        return InMemoryDataset(self.images.to(device), self.labels.to(device), self.classes, self.name)


@dataclass
class VarSizeDataset:
    """uint8 images of any sizes, each (C, H, W), with int64 labels (N,) and class names (native aspect ratios:
    `vitkit.data.naflex`)."""

    images: list[torch.Tensor]
    labels: torch.Tensor
    classes: list[str]
    name: str = ""

    decodes: ClassVar[bool] = False  # held at their own sizes: resized (and packed) on the batch

    def __len__(self) -> int:
        return len(self.images)

    @property
    def in_chans(self) -> int:
        return self.images[0].shape[0]

    @property
    def img_size(self) -> tuple[int, int]:
        """The largest height and width (no one size: a reference for a model's grid)."""
        return max(im.shape[1] for im in self.images), max(im.shape[2] for im in self.images)

    def subset(self, n: int | None) -> "VarSizeDataset":
        return self if n is None or n >= len(self) else VarSizeDataset(self.images[:n], self.labels[:n], self.classes, self.name)

    def with_classes(self, keep: list[int] | None) -> "VarSizeDataset":
        if keep is None:
            return self
        idx = [i for i, y in enumerate(self.labels.tolist()) if y in keep]
        remap = {c: j for j, c in enumerate(keep)}
        return VarSizeDataset([self.images[i] for i in idx], torch.tensor([remap[int(self.labels[i])] for i in idx]),
                              [self.classes[c] for c in keep], self.name)

    def to(self, device) -> "VarSizeDataset":
        return self  # images stay on the host; packed batches move

    def select(self, classes: list[int] | None = None, n: int | None = None, device=None) -> "VarSizeDataset":
        """These classes only (relabelled), the first n (the images stay on the host)."""
        return self.with_classes(classes).subset(n)

    def take(self, idx: torch.Tensor, name: str | None = None) -> "VarSizeDataset":
        return VarSizeDataset([self.images[i] for i in idx.tolist()], self.labels[idx], self.classes,
                              self.name if name is None else name)

    def batch(self, idx: torch.Tensor, device) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A list of images (of different sizes: packed by the transform) and the labels on `device`."""
        return [self.images[i] for i in idx.tolist()], self.labels[idx].to(device, non_blocking=True)

    def for_model(self, config, max_patches: int | None = None):
        """Packed at their own aspect ratios with `max_patches`; without, every image resized to the model's
        square size (`squared`), as a fixed-size pipeline reads them."""
        return self if max_patches else self.squared(config.img_size)

    def squared(self, size: Sequence[int]) -> InMemoryDataset:
        """Every image resized to one square size (its aspect ratio lost): what a fixed-size pipeline does."""
        x = torch.stack([(resize_float(im.float() / 255, tuple(size)) * 255).round().to(torch.uint8) for im in self.images])
        return InMemoryDataset(x, self.labels, self.classes, self.name + f" (resized to {size[0]}x{size[1]})")


def aspect_crops(images: torch.Tensor, labels: torch.Tensor, classes: list[str], seed: int,
                 ratio: tuple[float, float] = (1 / 3, 3.0), name: str = "") -> VarSizeDataset:
    """Every image (N, C, H, W) cut to the largest box of a random aspect ratio (width / height, log-uniform in
    `ratio`) at a random position: a dataset whose aspect ratios vary, the same for a seed."""
    rng = random.Random(seed)
    _, _, h, w = images.shape
    out = []
    for im in images:
        a = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        ch, cw = (h, max(1, round(h * a))) if a * h <= w else (max(1, round(w / a)), w)
        top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
        out.append(im[:, top:top + ch, left:left + cw].clone())
    return VarSizeDataset(out, labels.clone(), list(classes), name)


def data_roots(data_dir: str | Path | None, name: str) -> list[Path]:
    """Where to look for a named dataset: --data-dir, $VITKIT_DATA, Debian's /usr/share/datasets, the cache."""
    roots = []
    for base in (data_dir, env.get("VITKIT_DATA")):
        if base:
            roots += [Path(base) / name, Path(base)]
    roots += [Path("/usr/share/datasets") / name]

    roots.append(cache_dir() / "data" / name)
    return roots


def _read_idx(path: Path) -> np.ndarray:
    try:
        with open_regular(path, error=DatasetError) as raw, (gzip.GzipFile(fileobj=raw) if path.suffix == ".gz"
                                                             else contextlib.nullcontext(raw)) as f:
            cap = env.get("VITKIT_MAX_TENSOR_BYTES")
            data = f.read(cap + 1)  # a gzip bomb stops here, not at the memory's end
        if len(data) > cap:
            raise DatasetError(f"{path}: decompresses to more than {cap:,} bytes (VITKIT_MAX_TENSOR_BYTES)")
        magic, = struct.unpack(">I", data[:4])
        ndim = magic & 0xFF
        if (magic >> 8) != 0x08:
            raise DatasetError(f"{path}: not an idx file of uint8 (magic {magic:#x})")
        shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
        arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
        if arr.size != math.prod(shape):
            raise DatasetError(f"{path}: truncated idx file ({arr.size} of {math.prod(shape)} bytes)")
        return arr.reshape(shape)
    except (OSError, EOFError, struct.error, zlib.error, ValueError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from e


def _find(roots: list[Path], stem: str) -> Path | None:
    for r in roots:
        for cand in (r / stem, r / f"{stem}.gz"):
            if cand.exists():
                return cand
    return None


def load_fashion_mnist(split: str = "train", data_dir: str | Path | None = None, download: bool = True) -> InMemoryDataset:
    """Fashion-MNIST from its idx files (gzipped or not); downloaded from the official URL if found nowhere."""
    roots = data_roots(data_dir, "fashion-mnist")
    arrays = []
    for stem in FASHION_MNIST_FILES[split]:
        path = _find(roots, stem)
        if path is None:
            if not download:
                raise DatasetError(f"Fashion-MNIST file {stem}(.gz) not found in {[str(r) for r in roots]}")
            dest = roots[-1] / f"{stem}.gz"
            try:
                path = fetch(f"{FASHION_MNIST_URL}/{stem}.gz", dest, md5=FASHION_MNIST_MD5[f"{stem}.gz"])
            except CheckpointError as e:
                raise DatasetError(f"Fashion-MNIST not found locally ({', '.join(str(r) for r in roots[:-1])}; on Debian: "
                                   f"apt-get install dataset-fashion-mnist) and the download failed: {e}") from e
        arrays.append(_read_idx(path))
    images, labels = arrays
    if len(images) != len(labels):
        raise DatasetError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels")
    return InMemoryDataset(torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels.astype(np.int64)),
                           list(FASHION_MNIST_CLASSES), "fashion-mnist")


class _CifarUnpickler(pickle.Unpickler):
    """Only what CIFAR's archives hold: dicts, lists, bytes, str, ints and numpy arrays. Anything else is refused."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR archive")


def _cifar_batch(raw: bytes) -> dict:
    return _CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()


def load_cifar(name: str = "cifar10", split: str = "train", data_dir: str | Path | None = None, download: bool = True) -> InMemoryDataset:
    """CIFAR-10/100 from the python archive (cifar-10-python.tar.gz), read with a restricted unpickler."""
    roots = data_roots(data_dir, name)
    fname = CIFAR_URLS[name].rsplit("/", 1)[1]
    archive = next((r / fname for r in roots if (r / fname).exists()), None)
    if archive is None:
        if not download:
            raise DatasetError(f"{fname} not found in {[str(r) for r in roots]}")
        try:
            archive = fetch(CIFAR_URLS[name], roots[-1] / fname, md5=CIFAR_MD5[name])
        except CheckpointError as e:
            raise DatasetError(f"{name} not found locally and the download failed: {e}") from e
    want = ["test"] if split == "test" else (["train"] if name == "cifar100" else [f"data_batch_{i}" for i in range(1, 6)])
    meta_name = "batches.meta" if name == "cifar10" else "meta"
    xs, ys, classes = [], [], None
    try:
        with open_regular(archive, error=DatasetError) as raw, tarfile.open(fileobj=raw) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            for w in want:
                d = _cifar_batch(tar.extractfile(members[w]).read())
                xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(d[b"labels" if name == "cifar10" else b"fine_labels"], dtype=np.int64))
            meta = _cifar_batch(tar.extractfile(members[meta_name]).read())
            key = b"label_names" if name == "cifar10" else b"fine_label_names"
            classes = [c.decode() for c in meta[key]]
    except (tarfile.TarError, KeyError, EOFError, pickle.UnpicklingError, OSError) as e:
        raise DatasetError(f"cannot read {archive} as a {name} python archive: {e}") from e
    return InMemoryDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)), classes, name)


# ---- files on disk: ImageFolder trees and CSV lists --------------------------------------------------

@dataclass
class FileDataset(DecodedFiles, Dataset):
    """(path, label) pairs decoded in DataLoader workers to uint8 (C, H, W) at the model's size, with the model's
    evaluation geometry (`vitkit.data.image.resize_crop`: shorter side to img_size / crop_pct, centre crop), or
    for training with `with_train_crop` random-resized crops of the full-resolution image (`sample_geometry`).

    A file that cannot be decoded (or declares more than VITKIT_MAX_IMAGE_PIXELS) gives None and is counted by
    the collate function, unless `strict`. `configured(model_config)` sets the size and geometry from a model.
    """

    samples: list[tuple[str, int]]
    classes: list[str]
    img_size: tuple[int, int] = (224, 224)
    in_chans: int = 3
    strict: bool = False
    name: str = ""
    crop_pct: float = 1.0
    interpolation: str = "bilinear"
    train_crop: tuple | None = None  # (scale, ratio, seed, epoch): random-resized crops at full resolution
    max_patches: int | None = None  # native aspect ratio (data.max_patches): resized to this many patches of patch_size
    patch_size: tuple[int, int] = (16, 16)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            img = load_image(path, self.in_chans)
        except (ImageDecodeError, OSError) as e:
            if self.strict:
                raise ImageDecodeError(f"{path}: {e}") from e
            return BadSample(str(path), str(e))
        if self.max_patches:  # its own aspect ratio at the patch budget (training crops: on the batch, PackAugment)
            h, w = resize_to_patches(img.height, img.width, self.patch_size, self.max_patches)
            return to_uint8_tensor(img.resize((w, h), _PIL_INTERP.get(self.interpolation, _PIL_INTERP["bilinear"]))), label
        return to_uint8_tensor(sample_geometry(img, self, i)), label

    def packed(self, max_patches: int | None, patch_size) -> "FileDataset":
        """Decoded at each image's own aspect ratio, resized to at most `max_patches` patches (None: the model's size)."""
        return dataclasses.replace(self, max_patches=max_patches, patch_size=tuple(patch_size))

    def for_model(self, config, max_patches: int | None = None) -> "FileDataset":
        """Decoded as `config`'s model reads it (`configured`), with `max_patches` at each image's own aspect ratio."""
        ds = self.configured(config)
        return ds.packed(max_patches, config.patch_size) if max_patches else ds

    def take(self, idx: torch.Tensor, name: str | None = None) -> "FileDataset":
        return dataclasses.replace(self, samples=[self.samples[i] for i in idx.tolist()], name=self.name if name is None else name)

    @property
    def labels(self) -> torch.Tensor:
        return torch.tensor([s[1] for s in self.samples])


_REPORTED: set[str] = set()  # the bad samples named so far in this process: each is named once


def collate_skip_bad(batch: list):
    """Stack the good samples; the bad ones (`BadSample`) are returned as a list, to be counted and named."""
    good = [b for b in batch if not isinstance(b, BadSample)]
    bad = [b for b in batch if isinstance(b, BadSample)]
    if not good:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.long), bad
    xs, ys = zip(*good)
    if len({x.shape for x in xs}) > 1:  # images at their own sizes (data.max_patches): a list, packed later
        return list(xs), torch.tensor(ys, dtype=torch.long), bad
    return torch.stack(xs), torch.tensor(ys, dtype=torch.long), bad


def _report_bad(bad: list[BadSample]) -> int:
    """Name each undecodable sample once per process (on stderr); the number skipped in this batch."""
    for b in bad:
        if b.name not in _REPORTED:
            _REPORTED.add(b.name)
            log.warning(f"skipped an undecodable image, {b.name}: {b.reason}")
    return len(bad)


def image_folder(root: str | Path, classes: list[str] | None = None, **kw) -> FileDataset:
    """root/<class>/<image>: one folder per class, sorted names give the label order."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"image folder {root} does not exist")
    found = sorted(d.name for d in root.iterdir() if d.is_dir())
    classes = classes or found
    missing = sorted(set(found) - set(classes))
    if missing:
        raise DatasetError(f"{root} has class folders {missing} that are not among the classes {classes}")
    samples = [(str(p), classes.index(d)) for d in found for p in sorted((root / d).rglob("*")) if p.suffix.lower() in IMAGE_EXTS]
    return FileDataset(samples, list(classes), name=str(root), **kw)


def csv_list(path: str | Path, classes: list[str] | None = None, **kw) -> FileDataset:
    """A CSV of `path,label` rows (a header row is allowed); labels are class names or integers.

    Relative paths are read relative to the CSV's folder.
    """
    path = Path(path)
    rows = _csv_rows(path, labels=True)
    names = classes or sorted({lab for _, lab in rows}, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else s))
    idx = {c: i for i, c in enumerate(names)}
    samples = []
    for p, lab in rows:
        if lab not in idx:
            raise DatasetError(f"{path}: label {lab!r} is not among the classes {names}")
        samples.append((str(p if Path(p).is_absolute() else path.parent / p), idx[lab]))
    return FileDataset(samples, list(names), name=str(path), **kw)


def _csv_rows(path: Path, labels: bool) -> list[tuple[str, str | None]]:
    """(path, label) per row of a CSV list (a header row is allowed); without `labels` a path alone is a row."""
    rows: list[tuple[str, str | None]] = []
    with io.TextIOWrapper(open_regular(path, error=DatasetError), newline="") as f:
        reader = csv.reader(f)
        try:
            for row in reader:
                if not row or row[0].strip().lower() in ("path", "file", "filename", "image"):
                    continue
                if labels and len(row) < 2:
                    raise DatasetError(f"{path} line {reader.line_num}: row {str(row)[:200]} is not 'path,label'")
                rows.append((row[0].strip(), row[1].strip() if len(row) > 1 else None))
        except csv.Error as e:  # a field over csv's limit (128 KiB), a NUL byte
            raise DatasetError(f"{path} line {reader.line_num}: not a CSV list of image paths "
                               f"({' '.join(str(e).split())[:200]}): refused") from None
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not a CSV list of image paths (not {e.encoding} text: {e.reason}): "
                               f"refused") from None
    return rows


def csv_paths(path: str | Path) -> list[str]:
    """The image paths of a CSV list, `path` or `path,label` rows (labels ignored: prediction), relative paths read
    relative to the CSV's folder."""
    path = Path(path)
    return [str(p if Path(p).is_absolute() else path.parent / p) for p, _ in _csv_rows(path, labels=False)]


def check_classes(labels: torch.Tensor, classes: list[str], what: str) -> None:
    """An empty or one-class dataset cannot train a classifier: say so clearly."""
    if len(labels) == 0:
        raise DatasetError(f"{what} is empty")
    n = int(torch.unique(labels).numel())
    if n < 2:
        raise DatasetError(f"{what} has a single class ({classes[int(labels[0])] if classes else labels[0]}); need at least two")
    if int(labels.max()) >= len(classes):
        raise DatasetError(f"{what} has label {int(labels.max())} but only {len(classes)} classes")


def split_holdout(ds: InMemoryDataset | FileDataset, fraction: float, seed: int = 0):
    """(train, held-out) parts of a training set: `fraction` of each class (at least one image of every class
    with two or more) chosen by a fixed shuffle, so every run and every resume holds out the same images."""
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"a held-out fraction must be between 0 and 1, got {fraction}")
    labels = ds.labels.cpu()
    g = torch.Generator().manual_seed(seed)
    held = []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        if len(idx) > 1:
            idx = idx[torch.randperm(len(idx), generator=g)]
            held.append(idx[: min(len(idx) - 1, max(1, round(fraction * len(idx))))])
    mask = torch.zeros(len(labels), dtype=torch.bool)
    mask[torch.cat(held)] = True
    keep, out = torch.nonzero(~mask).flatten(), torch.nonzero(mask).flatten()
    return ds.take(keep), ds.take(out, ds.name + " (held out)")


# ---- batching ------------------------------------------------------------------------------------------

def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def iterate_batches(
    data: InMemoryDataset | FileDataset,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    start_step: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world: int = 1,
    hflip_alternate: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(uint8 images on device, labels, samples skipped) per step, in a fixed order per (seed, epoch).

    `batch_size` is the global batch: with `world` processes, rank `rank` gets its contiguous slice of every
    global batch (batch_size / world samples), so the sample order is a function of (seed, epoch) alone, whatever
    the number of processes. `start_step` skips the global batches already seen, for an exact resume inside an
    epoch. DataLoader workers (folder datasets) split the batches among themselves: every sample is read once.
    `hflip_alternate` (a set held in memory): each image mirrored where its coin of `seed` differs from the epoch's
    parity (`vitkit.data.augment.alternate_flip`, for `aug.hflip_alternate`).
    """
    if batch_size % world:
        raise UsageError(f"the global batch {batch_size} does not split over {world} processes")
    n, per_rank = len(data), batch_size // world
    order = epoch_permutation(n, seed, epoch) if shuffle else torch.arange(n)
    steps = n // batch_size if drop_last else -(-n // batch_size)
    order = order[start_step * batch_size : steps * batch_size if drop_last else n]
    batches = [order[i : i + batch_size][rank * per_rank : (rank + 1) * per_rank] for i in range(0, len(order), batch_size)]
    if hasattr(data, "for_epoch"):  # files cropped at full resolution: this epoch's crops
        data = data.for_epoch(epoch)
    if not hflip_alternate:
        yield from load_batches(data, batches, num_workers, device)
        return
    if getattr(data, "decodes", True):  # a decoding loader may leave out a bad file: the coins would not line up
        raise UsageError("aug.hflip_alternate mirrors the images of a training set held in memory; image folders "
                         "draw their flips at random: set aug.hflip_alternate=false")
    coins = flip_coins(n, seed)
    for idx in batches:
        x, y = data.batch(idx, device)
        yield alternate_flip(x, coins[idx], epoch), y, 0


def eval_index_batches(n: int, batch_size: int, rank: int = 0, world: int = 1, lockstep: bool = False
                       ) -> list[tuple[torch.Tensor, bool]]:
    """Evaluation batches of sample indices for one rank, each with whether it counts: rank r takes the contiguous
    range [r * n // world, (r + 1) * n // world), so every sample is counted exactly once, whatever n. With
    `lockstep` every rank runs as many batches as the busiest one (FSDP2 ranks must all run each forward): the
    extra ones hold sample 0 and do not count."""
    lo, hi = rank * n // world, (rank + 1) * n // world
    batches = [(torch.arange(i, min(i + batch_size, hi)), True) for i in range(lo, hi, batch_size)]
    if lockstep:
        most = -((-((n + world - 1) // world)) // batch_size)  # ceil(ceil(n / world) / batch_size)
        batches += [(torch.zeros(1, dtype=torch.long), False)] * (most - len(batches))
    return batches


def _ignore_sigint(worker_id: int) -> None:
    """A DataLoader worker leaves Ctrl-C to the main process (a terminal sends it to every process of the job), which
    finishes the step in hand and saves it on a first one (`vitkit.training.trainer`) and ends the workers itself: a
    forked worker would run the trainer's handler too (its notice twice), a spawned one would end mid-batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def load_batches(data, batches: list[torch.Tensor], num_workers: int, device) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Index batches -> (uint8 images, labels, samples skipped) on `device`: an in-memory kind indexes itself
    (`batch`), files are decoded in DataLoader workers."""
    if not getattr(data, "decodes", True):
        for idx in batches:
            yield *data.batch(idx, device), 0
        return
    loader = DataLoader(data, batch_sampler=[b.tolist() for b in batches], num_workers=num_workers,
                        collate_fn=collate_skip_bad, persistent_workers=False, pin_memory=torch.device(device).type == "cuda",
                        worker_init_fn=_ignore_sigint if num_workers else None)
    for x, y, bad in loader:
        x = x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
        yield x, y.to(device, non_blocking=True), _report_bad(bad)


@dataclass
class DataSpec:
    """What `load_dataset` returns: train and test sets, classes, channels, native size, normalisation."""

    train: InMemoryDataset | FileDataset
    test: InMemoryDataset | FileDataset
    classes: list[str]
    in_chans: int
    img_size: tuple[int, int]
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    extra: dict = field(default_factory=dict)
    val: object = None  # a part of the training set held out for the periodic evaluations (`splits.training_data`)


def _mean_std(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    x = images[: min(len(images), 20000)].float() / 255
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(x.std(dim=(0, 2, 3)).tolist())


DIGITS_CLASSES = [str(i) for i in range(10)]


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (images (1797, 8, 8) in 0..16, targets (1797,)). The digits.csv.gz inside the
    installed scikit-learn package is read as it is (64 pixels, then the label, on each row) without importing
    scikit-learn, whose import is most of a small run's data time (benchmarks/NOTES.md section 60); a file missing
    or not of that form is left to `sklearn.datasets.load_digits`."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):  # a module planted in sys.modules without a spec
        spec = None
    if spec is not None and spec.origin:  # a regular package: its own folder, never a relative path
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        with contextlib.suppress(OSError, ValueError, EOFError, zlib.error), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's warning on an empty file: falls back below
            with gzip.open(path, "rt") as f:
                rows = np.loadtxt(f, delimiter=",", ndmin=2)
            if rows.shape == (1797, 65) and ((rows >= 0) & (rows <= 16) & (rows == rows.round())).all():
                return rows[:, :64].reshape(-1, 8, 8), rows[:, 64].astype(np.int64)
    try:
        from sklearn.datasets import load_digits as sk_digits  # optional: scikit-learn, for this dataset only
    except ImportError as e:
        raise DatasetError("the 'digits' dataset needs scikit-learn (pip install scikit-learn)") from e
    d = sk_digits()
    return d.images, d.target.astype(np.int64)


def load_digits(split: str = "train", n_train: int = 1500) -> InMemoryDataset:
    """scikit-learn's 8x8 handwritten digits (1797 images): the first 1500 (fixed shuffle) train, the rest test."""
    images, target = _digits_arrays()
    x = torch.from_numpy((images * 16).clip(0, 255).astype(np.uint8))[:, None]  # (N, 1, 8, 8), 0..16 -> 0..255
    y = torch.from_numpy(target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    idx = order[:n_train] if split == "train" else order[n_train:]
    return InMemoryDataset(x[idx], y[idx], list(DIGITS_CLASSES), "digits")


def is_shards(location: str) -> bool:
    """A shard set (`vitkit data pack`): an http(s) or file URL, or a folder whose train/ holds index.json."""
    if location.startswith(("http://", "https://", "file://")):
        return True
    return (Path(location) / "train" / "index.json").exists()


def is_shards_split(location: str, split: str) -> bool:
    if location.startswith(("http://", "https://")):

        try:
            fetch_small(location.rstrip("/") + f"/{split}/index.json")
            return True
        except OSError:
            return False
    path = location[len("file://"):] if location.startswith("file://") else location
    return (Path(path) / split / "index.json").exists()


def folder_test_split(root: str | Path) -> Path | None:
    """The evaluation split of an ImageFolder root: val/, else test/ (the trainer and `vitkit eval` both use it)."""
    return next((Path(root) / s for s in ("val", "test") if (Path(root) / s).is_dir()), None)


def load_dataset(
    name: str,
    data_dir: str | None = None,
    *,
    img_size: tuple[int, int] | None = None,
    in_chans: int | None = None,
    strict_images: bool = False,
    test_dir: str | None = None,
) -> DataSpec:
    """A dataset by name ("fashion-mnist", "fashion-mnist-crops": its images cut to random aspect ratios, "cifar10",
    "cifar100", "digits"), an ImageFolder root (with train/ and
    val/ or test/ inside, or `test_dir`), a CSV list (`train.csv`; `test_dir` names the test CSV), or a shard set
    written by `vitkit data pack` (a folder, or a file:// or http(s):// URL, with train/ and val/ or test/)."""
    if name in ("fashion-mnist", "fashion_mnist", "fmnist"):
        train, test = load_fashion_mnist("train", data_dir), load_fashion_mnist("test", data_dir)
    elif name == "fashion-mnist-crops":  # every image cut to a random aspect ratio in [1/3, 3] (a fixed draw per split)
        train, test = load_fashion_mnist("train", data_dir), load_fashion_mnist("test", data_dir)
        mean, std = _mean_std(train.images)
        train = aspect_crops(train.images, train.labels, train.classes, seed=1, name=name)
        test = aspect_crops(test.images, test.labels, test.classes, seed=2, name=name + " (test)")
        check_classes(train.labels, train.classes, f"training set {name}")
        return DataSpec(train, test, train.classes, 1, (28, 28), mean, std)
    elif name in ("cifar10", "cifar100"):
        train, test = load_cifar(name, "train", data_dir), load_cifar(name, "test", data_dir)
    elif name == "digits":
        train, test = load_digits("train"), load_digits("test")
    else:
        root = Path(name)
        size = to_2tuple(img_size) if img_size else (224, 224)
        kw = dict(img_size=size, in_chans=in_chans or 3, strict=strict_images)
        if is_shards(name):

            if in_chans is None:
                del kw["in_chans"]  # the shards' own
            train = ShardDataset.open(name.rstrip("/") + "/train", **kw)
            kw["in_chans"] = train.in_chans
            test_loc = test_dir or next((name.rstrip("/") + "/" + s for s in ("val", "test") if is_shards_split(name, s)), None)
            if test_loc is None:
                raise DatasetError(f"{name}: no val/ or test/ shards next to train/ (or pass test_dir=)")
            test = ShardDataset.open(test_loc, **kw)
            if test.classes != train.classes:
                raise DatasetError(f"{test_loc} has classes {test.classes}, the training shards {train.classes}")
        elif root.suffix.lower() == ".csv":
            train = csv_list(root, **kw)
            if not test_dir:
                raise DatasetError("a CSV training list needs a test list too (test_dir=)")
            test = csv_list(test_dir, classes=train.classes, **kw)
        elif root.is_dir():
            tr = root / "train" if (root / "train").is_dir() else root
            te = Path(test_dir) if test_dir else folder_test_split(root)
            if te is None:
                raise DatasetError(f"{root}: no val/ or test/ folder next to train/ (or pass test_dir=)")
            train = image_folder(tr, **kw)
            test = image_folder(te, classes=train.classes, **kw)
        else:
            raise DatasetError(f"unknown dataset {name!r}: not fashion-mnist, cifar10, cifar100, a folder or a .csv")
        check_classes(train.labels, train.classes, f"training set {train.name}")
        if len(test) == 0:
            raise DatasetError(f"test set {test.name} is empty")
        return DataSpec(train, test, train.classes, train.in_chans, size, (0.5,) * train.in_chans, (0.5,) * train.in_chans)
    check_classes(train.labels, train.classes, f"training set {name}")
    mean, std = _mean_std(train.images)
    spec = DataSpec(train, test, train.classes, train.in_chans, train.img_size, mean, std)
    if in_chans and in_chans != spec.in_chans:
        if replicate_channels(spec.in_chans, in_chans):
            spec.extra["replicate_channels"] = replicate_channels(spec.in_chans, in_chans)
            spec.in_chans, spec.mean, spec.std = in_chans, mean * in_chans, std * in_chans
        else:
            raise DatasetError(f"{name} has {spec.in_chans} channels; cannot make {in_chans}")
    if len(test) == 0:
        raise DatasetError(f"test set of {name} is empty")
    return spec
