"""Datasets too large for memory or one disk: WebDataset-layout tar shards, with an index for random access.

    OUT/train/shard-000000.tar    members {key}.{jpg|png|...} (the image's bytes) and {key}.cls (its class, decimal),
    OUT/train/shard-000000.idx    consecutive per sample, as the `webdataset` library and other tar readers expect;
    OUT/train/index.json          .idx: int64 (n, 3) = (image offset, image size, class) per sample of that tar;
    OUT/test/...                  index.json: classes, channels, and every shard's name and sample count.

`pack` writes them from an ImageFolder, a CSV or a built-in dataset. `ShardDataset` reads them from a local
folder, a `file://` URL or an `http(s)://` URL (HTTP Range requests for each image: nothing is downloaded whole)
as a map-style dataset (each fetch, an index or one image's bytes, within its deadline: `vitkit.safety.Deadline`;
a folder's files regular files only: `vitkit.safety.open_regular`): every sample has an index, so the trainer's sampler (a global order per (seed, epoch),
each rank its slice of every batch, DataLoader workers whole batches) reads every sample exactly once per epoch
and resumes mid-epoch exactly, as for images in folders. benchmarks/NOTES.md section 19 compares this reader with
webdataset, litdata and HF datasets' streaming on resume, splitting over nodes and throughput.
"""
from __future__ import annotations

import dataclasses
import http.client
import io
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import UsageError, VitkitError
from .. import env
from ..safety import (Deadline, http_connection, open_regular, open_url, parse_json,
                      read_bytes, untrusted)
from .image import BadSample, DecodedFiles, ImageDecodeError, load_image, sample_geometry, to_uint8_tensor

FORMAT = "vitkit-shards"
IMAGE_EXT = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")


# ---- reading ----------------------------------------------------------------------------------------------

class _Bytes:
    """Byte ranges of shard files, local or over HTTP(S) (one kept-alive connection per host and process)."""

    def __init__(self) -> None:
        self.pid, self.files, self.conns = os.getpid(), {}, {}

    def read(self, url: str, offset: int, size: int) -> bytes:
        if os.getpid() != self.pid:  # a DataLoader worker: file handles and sockets are not shared across a fork
            self.__init__()
        if url.startswith(("http://", "https://")):
            return self._http(url, offset, size)
        path = url[len("file://"):] if url.startswith("file://") else url
        fd = self.files.get(path)
        if fd is None:  # a regular file only (a FIFO would wait for a writer); kept open, read with pread
            with open_regular(path, error=ImageDecodeError) as f:
                fd = self.files[path] = os.dup(f.fileno())
        end = os.fstat(fd).st_size
        if offset + size > end:
            raise ImageDecodeError(f"{path}: the index claims bytes {offset:,}-{offset + size:,} of a file of {end:,}")
        return os.pread(fd, size, offset)

    def _http(self, url: str, offset: int, size: int, tries: int = 3) -> bytes:
        """Bytes offset..offset+size-1 of `url` by a Range request, retried on a dropped connection; all the tries
        together within one deadline (`safety.Deadline`: a server that sends one byte at a time is cut off)."""
        u = urllib.parse.urlsplit(url)
        key = (u.scheme, u.netloc)
        with Deadline(url, size) as deadline:
            for attempt in range(tries):
                conn = self.conns.get(key)
                if conn is None:
                    conn = self.conns[key] = http_connection(u.scheme, u.netloc, READ_TIMEOUT_S)
                conn.watch_with(deadline)
                try:
                    conn.request("GET", u.path + (f"?{u.query}" if u.query else ""), headers={"Range": f"bytes={offset}-{offset + size - 1}"})
                    r = conn.getresponse()
                    data = r.read(size + 1)  # never more than was asked for, whatever the server sends
                    deadline.check()  # a read cut short by the deadline
                    if r.status == 206 and len(data) == size:
                        return data
                    raise OSError(f"{url}: HTTP {r.status} for bytes {offset}-{offset + size - 1} ({len(data)} bytes)")
                except (http.client.HTTPException, OSError) as e:
                    conn.close()
                    self.conns.pop(key, None)
                    if deadline.expired:
                        raise deadline.exceeded() from (None if isinstance(e, TimeoutError) else e)
                    if attempt == tries - 1:
                        raise
                    time.sleep(0.1 * (attempt + 1))
        raise AssertionError("unreachable")


READ_TIMEOUT_S = 60  # for each read of a shard server; each fetch as a whole has its deadline (safety.Deadline)


def fetch_small(url: str, limit: int | None = None) -> bytes:
    """A small file (index.json, a .idx.npy) from a folder or URL, refused over `limit` bytes without reading more;
    over HTTP within its deadline (`safety.Deadline`), a folder's a regular file only (`safety.open_regular`).
    `limit` None: VITKIT_MAX_TEXT_BYTES."""
    limit = env.get("VITKIT_MAX_TEXT_BYTES") if limit is None else limit
    if url.startswith(("http://", "https://")):
        deadline = Deadline(url)
        try:
            with deadline, open_url(url, deadline, READ_TIMEOUT_S) as r:
                length = r.headers.get("Content-Length")
                if length and length.isdigit():
                    deadline.expect(min(int(length), limit + 1))
                data = r.read(limit + 1)
                deadline.check()  # a body cut short by the deadline reads as a short one
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise FileNotFoundError(f"{url}: HTTP 404 Not Found") from e
            raise UsageError(f"cannot fetch {url}: {e}") from e
        except (OSError, http.client.HTTPException, ValueError) as e:
            if deadline.expired:
                raise deadline.exceeded(UsageError) from None
            raise UsageError(f"cannot fetch {url}: {e}") from e
        if len(data) > limit:
            raise UsageError(f"{url}: over the limit of {limit:,} bytes for a file of this kind: refused")
        return data
    return read_bytes(url[len("file://"):] if url.startswith("file://") else url, url, limit)


_SHARD_NAME = re.compile(r"[\w.-]+\.tar")


def _check_index(index, location: str) -> None:
    """A shard set's index.json as vitkit writes it: refused by field otherwise (a shard name outside the folder,
    a negative count, ...)."""
    what = f"{location}/index.json"
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise UsageError(f"{what} is not a vitkit shard index (format {got!r})")
    classes, shards, chans = index.get("classes"), index.get("shards"), index.get("in_chans")
    if not isinstance(classes, list) or not 1 <= len(classes) <= 10_000_000:
        raise UsageError(f"{what}: 'classes' must be a list of 1 or more class names")
    if not isinstance(chans, int) or isinstance(chans, bool) or not 1 <= chans <= 256:
        raise UsageError(f"{what}: 'in_chans' must be an integer in [1, 256], got {chans!r}")
    if not isinstance(shards, list):
        raise UsageError(f"{what}: 'shards' must be a list")
    for i, sh in enumerate(shards):
        name, n = (sh.get("name"), sh.get("nsamples")) if isinstance(sh, dict) else (None, None)
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or name.startswith("."):
            raise UsageError(f"{what}: shard {i}'s name {name!r} is not a .tar file name inside the folder")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 1 << 40:
            raise UsageError(f"{what}: shard {name}'s 'nsamples' must be an integer >= 0, got {n!r}")


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


@dataclass
class ShardDataset(DecodedFiles, torch.utils.data.Dataset):
    """One split of a shard set, by sample index. Decodes like `FileDataset`: at the model's size with its
    evaluation geometry (`configured`), a corrupt or oversized image is None (skipped and counted) unless strict."""

    location: str  # a folder or URL with index.json
    classes: list[str]
    counts: list[int]  # samples per shard
    shard_names: list[str]
    labels_all: np.ndarray = field(repr=False)  # the class of every sample, from the .idx files
    img_size: tuple[int, int] = (224, 224)
    in_chans: int = 3
    strict: bool = False
    name: str = ""
    crop_pct: float = 1.0
    interpolation: str = "bilinear"
    train_crop: tuple | None = None  # (scale, ratio, seed, epoch): random-resized crops at full resolution
    indices: np.ndarray | None = field(default=None, repr=False)  # a subset of the split (a held-out part)

    def __post_init__(self) -> None:
        self._starts = np.concatenate([[0], np.cumsum(self.counts)])
        self._idx: dict[int, np.ndarray] = {}
        self._bytes = _Bytes()

    @classmethod
    def open(cls, location: str, **kw) -> "ShardDataset":
        index = parse_json(fetch_small(_join(location, "index.json")), f"{location}/index.json")
        _check_index(index, location)
        names = [s["name"] for s in index["shards"]]
        counts = [s["nsamples"] for s in index["shards"]]
        labels = (np.concatenate([cls._read_idx(location, n, c, len(index["classes"]))[:, 2] for n, c in zip(names, counts)])
                  if names else np.zeros(0, np.int64))
        return cls(location, list(index["classes"]), counts, names, labels, in_chans=kw.pop("in_chans", index["in_chans"]),
                   name=kw.pop("name", location), **kw)

    @staticmethod
    def _read_idx(location: str, shard: str, nsamples: int | None = None, num_classes: int | None = None) -> np.ndarray:
        """A shard's (offset, size, class) rows: nsamples of them (when given), classes in range, offsets and sizes
        >= 0; a row whose bytes lie past the tar or over the per-sample cap is refused when it is read."""
        url = _join(location, shard[:-4] + ".idx.npy")
        limit = 4096 + 24 * nsamples if nsamples is not None else None
        with untrusted(url, UsageError):
            rows = np.load(io.BytesIO(fetch_small(url, limit)), allow_pickle=False)
        if rows.dtype.kind not in "iu" or rows.ndim != 2 or rows.shape[1] != 3 or (
                nsamples is not None and rows.shape[0] != nsamples):
            raise UsageError(f"{url}: expected {nsamples if nsamples is not None else 'n'} rows of 3 integers "
                             f"(offset, size, class), got {rows.dtype} {rows.shape}")
        rows = rows.astype(np.int64)
        if len(rows) and (rows[:, :2].min() < 0 or (num_classes is not None and not 0 <= rows[:, 2].min() <= rows[:, 2].max() < num_classes)):
            raise UsageError(f"{url}: a negative offset or size, or a class outside 0..{(num_classes or 1) - 1}")
        return rows

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else int(self._starts[-1])

    @property
    def labels(self) -> torch.Tensor:
        lab = self.labels_all if self.indices is None else self.labels_all[self.indices]
        return torch.from_numpy(np.asarray(lab, dtype=np.int64))

    @property
    def samples(self) -> list[tuple[str, int]]:  # (key, label) pairs, as FileDataset's (path, label)
        return [(f"{i:09d}", int(lab)) for i, lab in zip(range(len(self)), self.labels.tolist())]

    def raw(self, i: int) -> tuple[bytes, int]:
        """The image bytes and class of sample i (of this split, or of its subset)."""
        g = int(self.indices[i]) if self.indices is not None else i
        s = int(np.searchsorted(self._starts, g, side="right") - 1)
        if s not in self._idx:
            self._idx[s] = self._read_idx(self.location, self.shard_names[s], self.counts[s], len(self.classes))
        offset, size, label = self._idx[s][g - self._starts[s]]
        cap = env.get("VITKIT_MAX_SAMPLE_BYTES")
        if size > cap:
            raise ImageDecodeError(f"{self.shard_names[s]}: sample {i} claims {size:,} bytes, over the per-sample limit "
                                   f"of {cap:,} (VITKIT_MAX_SAMPLE_BYTES)")
        return self._bytes.read(_join(self.location, self.shard_names[s]), int(offset), int(size)), int(label)

    def __getitem__(self, i: int):
        try:
            data, label = self.raw(i)
            img = load_image(io.BytesIO(data), self.in_chans)
        except (VitkitError, OSError, ValueError, MemoryError, http.client.HTTPException) as e:
            if self.strict:
                raise ImageDecodeError(f"{self.name} sample {i}: {e}") from e
            return BadSample(f"{self.name} sample {i}", str(e))
        return to_uint8_tensor(sample_geometry(img, self, i)), label

    # for_model: `configured` (DecodedFiles); shards have no native-aspect decoding, a packed model's transform resizes

    def take(self, idx: torch.Tensor, name: str | None = None) -> "ShardDataset":
        """The samples at `idx` of this split (a held-out part)."""
        return self.subset(idx.numpy(), name)

    def subset(self, keep: np.ndarray, name: str | None = None) -> "ShardDataset":
        base = self.indices if self.indices is not None else np.arange(len(self))
        return dataclasses.replace(self, indices=base[np.asarray(keep)], name=name or self.name)
