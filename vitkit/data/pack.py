"""`vitkit data pack`: a dataset (Fashion-MNIST, CIFAR-10, an ImageFolder, a CSV list) written as a shard set that
`vitkit.data.shards.ShardDataset` reads: tar shards of encoded images, an index of each sample's byte range, and
index.json naming the classes and shards of each split."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from PIL import Image

from ..cache import atomic_write, check_output
from ..errors import UsageError
from ..safety import read_bytes
from .datasets import FileDataset, InMemoryDataset, csv_list, load_dataset
from .shards import FORMAT

def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add one member; returns the offset of its data in the tar."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - ((len(data) + 511) // 512) * 512  # data starts where its 512-byte blocks start


def write_split(samples: Iterator[tuple[bytes, str, int]], out: Path, classes: list[str], in_chans: int,
                shard_size: int = 1000, name: str = "") -> dict:
    """Write (image bytes, extension, class) samples as tar shards of `shard_size` samples, their .idx files and
    index.json; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    shards, rows, tar, n = [], [], None, 0

    def close() -> None:
        tar.close()
        idx = np.asarray(rows, dtype=np.int64).reshape(-1, 3)

        def save_idx(p: Path) -> None:
            with open(p, "wb") as f:  # a file object: np.save would add ".npy" to the temporary file's name
                np.save(f, idx, allow_pickle=False)

        atomic_write(out / f"{shards[-1]['name'][:-4]}.idx.npy", save_idx)
        shards[-1]["nsamples"] = len(rows)

    for data, ext, label in samples:
        if n % shard_size == 0:
            if tar is not None:
                close()
            shards.append({"name": f"shard-{len(shards):06d}.tar"})
            tar, rows = tarfile.open(check_output(out / shards[-1]["name"]), "w", format=tarfile.USTAR_FORMAT), []
        key = f"{n:09d}"
        offset = _tar_member(tar, f"{key}.{ext}", data)
        _tar_member(tar, f"{key}.cls", str(label).encode())
        rows.append((offset, len(data), label))
        n += 1
    if tar is not None:
        close()
    index = {"format": FORMAT, "version": 1, "name": name, "classes": list(classes), "in_chans": in_chans,
             "num_samples": n, "shards": shards}
    atomic_write(out / "index.json", lambda p: p.write_text(json.dumps(index, indent=1)))
    return index


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def pack(src: str, out: str | Path, shard_size: int = 1000, data_dir: str | None = None,
         progress: Callable[[str], None] | None = None) -> dict:
    """Write a dataset as shards: `src` is a built-in dataset (fashion-mnist, cifar10, digits, ...: its images as
    PNG), an ImageFolder root (train/ and val/ or test/: the files' own bytes) or a CSV of path,label. Returns
    {split: index}."""
    out = Path(out)
    root = Path(src)
    if root.suffix.lower() == ".csv":
        splits = {"train": csv_list(root)}
    else:
        spec = load_dataset(src, data_dir, test_dir=None)
        splits = {"train": spec.train, "test": spec.test}
    written = {}
    for split, ds in splits.items():
        if isinstance(ds, InMemoryDataset):
            imgs = ds.images.cpu().numpy()
            labels = ds.labels.cpu().tolist()
            samples = ((_png(imgs[i, 0] if imgs.shape[1] == 1 else imgs[i].transpose(1, 2, 0)), "png", labels[i])
                       for i in range(len(labels)))
            chans = ds.in_chans
        elif isinstance(ds, FileDataset):
            samples = ((read_bytes(p, knob="VITKIT_MAX_SAMPLE_BYTES"),
                        Path(p).suffix.lower().lstrip(".") or "jpg", lab) for p, lab in ds.samples)
            chans = ds.in_chans
        else:
            raise UsageError(f"cannot pack {type(ds).__name__}")
        written[split] = write_split(samples, out / split, ds.classes, chans, shard_size, name=f"{src}:{split}")
        if progress:
            progress(f"{split}: {written[split]['num_samples']} samples in {len(written[split]['shards'])} shards -> {out / split}")
    return written
