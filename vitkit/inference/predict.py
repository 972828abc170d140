"""Top-k predictions for many images, with the checkpoint's own preprocessing (size, crop, mean, std) and class names.

Inputs (`gather_inputs`): image files, folders (every image below them, sorted), CSV lists (`path,label` rows, as
the datasets read them: `vitkit.data.datasets.csv_list`) and shard sets (`vitkit data pack`: one split, or every
split of a set), mixed in any order; the records follow that order. Images are decoded by a few threads ahead of
the model, a bounded number of batches at a time (`predict_batches`), and the records of each batch come out as
soon as it is done: `run` writes them to a file or stdout (JSON lines, a JSON array, CSV or a table), flushed per
batch, with a progress line on stderr, a clean stop on SIGTERM/SIGINT after the batch in hand, and `resume`, which
reads what an earlier run of the same command wrote and carries on after it.

A record: {"image": NAME, "top": [{"index", "label", "probability"}, ...]}, or {"image": NAME, "error": WHY} for an
input that could not be read. The "top" entries are `top_classes`, the function the service (`vitkit serve`)
answers with too. In a file (`out`) of the resumable formats (jsonl, csv) each record also says what made it, its
"run" (`run_fingerprint`: the model's weights and config, the preprocessing, top-k, TTA, precision, backend, device,
max_patches), so that `resume` carries on only a file this command wrote with these settings.
"""
from __future__ import annotations

import csv
import hashlib
import http.client
import io
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TextIO

import numpy as np
import torch
from torch import nn

from ..data.datasets import IMAGE_EXTS, csv_paths, is_shards, is_shards_split
from ..data.image import EvalTransform, decode_for, load_image, to_uint8_tensor
from ..data.naflex import PackTransform
from ..data.shards import FORMAT, ShardDataset, fetch_small
from ..errors import UsageError, VitkitError
from ..evaluation.metrics import check_tta, tta_log_probs
from ..machine.device import resolve_device
from ..machine.precision import autocast
from ..machine.threads import Governor
from ..models.layers.packing import pack
from ..cache import WriteError, check_output, open_output, write_failure
from ..download import sha256_of
from ..safety import open_regular, parse_json, read_bytes
from .backends import ExportedModel, PackageModel, inference_engine, load_for_inference

log = logging.getLogger(__name__)

FORMATS = ("table", "json", "jsonl", "csv")
RESUMABLE = ("jsonl", "csv")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".jsonlines": "jsonl", ".json": "json", ".csv": "csv",
            ".txt": "table"}
# the decoding threads' priority (Linux `nice`, per thread): they take the cores the model's forward leaves idle, and
# do not preempt its OpenMP threads, whose barriers would then wait for them (measured: 1,000 640x480 JPEGs into a
# 28-px model on 2 cores, 2.3 s at the model's priority, 1.7 s at nice 10; model-bound 28-px PNGs 1.5 s -> 1.4 s)
DECODE_NICE = 10
CSV_HEADER = ["image", "rank", "index", "label", "probability", "error", "run"]  # run: on each image's first row
# what reading a shard sample's bytes may raise (as `ShardDataset.__getitem__` catches): that sample's error record
_SHARD_UNREADABLE = (VitkitError, OSError, ValueError, MemoryError, http.client.HTTPException)
# what decoding one image may raise: that image's error record, the others go on (MemoryError: an image that asks
# for more than this process has)
_UNDECODABLE = (VitkitError, OSError, ValueError, MemoryError)


# ---- the record, shared with the service ----------------------------------------------------------------------

def top_classes(probs, names: Sequence[str], k: int) -> list[dict]:
    """One image's `k` most probable classes, most probable first (ties: the lower index), as the records of
    `vitkit predict` and the answers of `vitkit serve` hold them: [{"index", "label", "probability"}, ...].
    probs: the image's class probabilities (a 1-D array or tensor)."""
    if isinstance(probs, torch.Tensor):
        probs = probs.detach().float().cpu().numpy()
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    order = np.argsort(-p, kind="stable")[: max(1, min(int(k), len(p)))]
    return [{"index": int(i), "label": str(names[i]), "probability": float(p[i])} for i in order]


# ---- inputs ---------------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """The images to classify, in order: a name per image (its record's "image") and where its bytes are (a path,
    or (shard set number, sample) for a sample of `shards[n]`)."""

    names: list[str] = field(default_factory=list)
    sources: list = field(default_factory=list)
    shards: list = field(default_factory=list)  # ShardDataset per shard split named

    def __len__(self) -> int:
        return len(self.names)

    def add_file(self, path: str) -> None:
        self.names.append(path)
        self.sources.append(path)


def _vitkit_index(path: Path) -> bool:
    """Whether `path` is a shard index `vitkit data pack` wrote (a web page's index.json is not)."""
    if not path.is_file():
        return False
    try:
        index = parse_json(read_bytes(path), str(path))
    except VitkitError:
        return False
    return isinstance(index, dict) and index.get("format") == FORMAT


def _shard_splits(location: str) -> list[str] | None:
    """The shard split(s) `location` names: itself (a folder or URL holding index.json), or the train/, val/ and
    test/ splits of a shard set (`vitkit data pack`); None when it is no shard location."""
    remote = location.startswith(("http://", "https://", "file://"))
    if remote:

        try:
            fetch_small(location.rstrip("/") + "/index.json")
            return [location.rstrip("/")]
        except (OSError, VitkitError):  # no index.json there: a set's root, perhaps
            pass
    elif _vitkit_index(Path(location) / "index.json"):
        return [location.rstrip("/")]
    if not is_shards(location) or (not remote and not _vitkit_index(Path(location) / "train" / "index.json")):
        return None  # a folder of images, whatever other index.json it holds
    splits = [location.rstrip("/") + "/" + s for s in ("train", "val", "test") if is_shards_split(location, s)]
    if not splits:
        raise UsageError(f"{location}: no shard index (index.json) in it or in its train/, val/ or test/")
    return splits


def gather_inputs(items: Iterable[str | Path], warn: Callable[[str], None] | None = None) -> Inputs:
    """Image files, folders (every file with an image extension below them, `datasets.IMAGE_EXTS`, sorted), CSV
    lists (`path` or `path,label` rows, the labels ignored: `datasets.csv_paths`, relative paths from the CSV's
    folder) and shard locations (a
    split folder or URL with index.json, or a shard set root: its train/, val/ and test/), in the order given. A
    path that does not exist stays a file: its record says so. `warn` hears of a folder without images."""
    out = Inputs()
    for item in items:
        s = os.fspath(item)
        splits = _shard_splits(s) if s.startswith(("http://", "https://", "file://")) or Path(s).is_dir() else None
        if splits is not None:

            for loc in splits:
                ds = ShardDataset.open(loc)
                out.shards.append(ds)
                n = len(out.shards) - 1
                out.names.extend(f"{loc}#{i:09d}" for i in range(len(ds)))  # the sample's key in its tar
                out.sources.extend((n, i) for i in range(len(ds)))
        elif Path(s).is_dir():
            found = sorted(p for p in Path(s).rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())
            if not found and warn:
                warn(f"{s}: no images (files named {', '.join(sorted(IMAGE_EXTS))}) in this folder or below it")
            for p in found:
                out.add_file(str(p))
        elif s.lower().endswith(".csv") and Path(s).is_file():
            for p in csv_paths(s):
                out.add_file(p)
        else:
            out.add_file(s)
    return out


# ---- decoding ahead of the model --------------------------------------------------------------------------------

class _Batch:
    def __init__(self, indices: list[int]) -> None:
        self.indices, self.results = indices, [None] * len(indices)
        self.left, self.lock, self.done = len(indices), threading.Lock(), threading.Event()
        if not indices:
            self.done.set()

    def put(self, pos: int, value) -> None:
        self.results[pos] = value
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()


class _Prefetch:
    """`fn(i)` for the indices of each batch, computed by `workers` threads at most `depth` batches ahead of
    the consumer (the memory bound), handed out in order. workers 0: computed by the consumer, when it asks."""

    def __init__(self, fn: Callable[[int], object], batches: Iterable[list[int]], workers: int, depth: int,
                 stop: Callable[[], bool] | None = None) -> None:
        self.fn, self.batches, self.workers, self.stop = fn, iter(batches), workers, stop
        self.pending: deque[_Batch] = deque()
        self.todo: deque = deque()
        self.cv = threading.Condition()
        self.closed = False
        if workers > 0:
            for _ in range(depth):
                self._submit()
            # not daemons: a daemon thread still inside a torch op (resizing, packing) when the interpreter exits
            # aborts the process ("terminate called without an active exception", SIGABRT); close() joins them,
            # and every read they make is bounded (regular files only; fetches under a deadline)
            self.threads = [threading.Thread(target=self._work, name=f"vitkit-decode-{i}", daemon=False)
                            for i in range(workers)]
            for t in self.threads:
                t.start()

    def _submit(self) -> None:
        idx = next(self.batches, None)
        if idx is None:
            return
        b = _Batch(list(idx))
        self.pending.append(b)
        with self.cv:
            self.todo.extend((b, pos, i) for pos, i in enumerate(b.indices))
            self.cv.notify_all()

    def _work(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # SIGINT/SIGTERM go to the main thread, which holds them while it writes
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        if DECODE_NICE and sys.platform == "linux":  # a thread's own priority (elsewhere it would be the process's)
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + DECODE_NICE))
            except OSError:
                pass
        while True:
            with self.cv:
                while not self.todo and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                b, pos, i = self.todo.popleft()
            try:
                value = self.fn(i)
            except BaseException as e:  # noqa: BLE001 - a bug in decoding: raised in the consumer
                value = _Raised(e)
            b.put(pos, value)

    def __iter__(self) -> Iterator[tuple[list[int], list]]:
        if self.workers == 0:
            for idx in self.batches:
                yield list(idx), [self.fn(i) for i in idx]
            return
        while self.pending:
            b = self.pending.popleft()
            self._submit()
            while not b.done.wait(0.1):  # a stop asked for while an input is slow to read: no wait for it
                if self.stop and self.stop():
                    raise Stopped()
            for r in b.results:
                if isinstance(r, _Raised):
                    raise r.error
            yield b.indices, b.results

    def close(self) -> None:
        """Drop the work not started and let the threads end: each finishes the image in hand, then is joined."""
        with self.cv:
            self.closed = True
            self.todo.clear()
            self.cv.notify_all()
        for t in getattr(self, "threads", []):
            t.join()


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Stopped(Exception):
    """A stop (SIGTERM, SIGINT) asked for while the next batch was still being read."""


class _Decoder:
    """Input i -> the model's input, decoded as the checkpoint asks (`decode_for`: uint8 at its size, or with
    max_patches float at its own aspect ratio within the patch budget), or the reason it cannot be read (a str)."""

    def __init__(self, inputs: Inputs, config, max_patches: int | None) -> None:
        self.inputs, self.config = inputs, config
        self.locks = [threading.Lock() for _ in inputs.shards]  # a shard set's reader (files, HTTP) is not shared
        self.packer = None
        if max_patches:

            self.packer = PackTransform.for_model(config, max_patches)

    def __call__(self, i: int):
        src = self.inputs.sources[i]
        if isinstance(src, tuple):  # a shard sample: its bytes, read as `ShardDataset` reads them
            n, j = src
            try:
                with self.locks[n]:
                    data, _ = self.inputs.shards[n].raw(j)
            except _SHARD_UNREADABLE as e:
                return str(e)
            src = io.BytesIO(data)
        try:
            if self.packer is not None:  # its own aspect ratio at the patch budget
                return self.packer.image(to_uint8_tensor(load_image(src, self.config.in_chans)))
            return decode_for(src, self.config)  # the checkpoint's eval geometry
        except _UNDECODABLE as e:
            msg = str(e) if not isinstance(e, MemoryError) else f"{self.inputs.names[i]}: decoding it ran out of memory"
            return msg.replace(str(src), self.inputs.names[i]) if isinstance(src, io.BytesIO) else msg


# ---- the model over batches -------------------------------------------------------------------------------------

def batch_ranges(n: int, batch_size: int, start: int = 0) -> list[list[int]]:
    """The batches of inputs [start, n): always the same boundaries (multiples of batch_size) whatever `start` is,
    so that a resumed run computes every image in the batch an uninterrupted one would (the same floats)."""
    first = start - start % batch_size
    return [list(range(max(s, start), min(s + batch_size, n))) for s in range(first, n, batch_size)]


@torch.no_grad()
def predict_batches(model: nn.Module, inputs: Inputs, *, top_k: int = 5, batch_size: int = 32, tta: str = "none",
                    precision: str = "fp32", max_patches: int | None = None, start: int = 0, num_workers: int = 2,
                    stop: Callable[[], bool] | None = None) -> Iterator[list[dict]]:
    """The records of inputs [start, n), a batch at a time, in input order (see the module's docstring).

    num_workers: threads decoding images ahead of the model (0: decoded in this thread), at most max(2, num_workers)
        batches ahead (the memory bound: never more decoded images than those batches and the one in the model).
    stop: polled while waiting for a slow input; when it answers True, `Stopped` is raised.
    tta, precision, max_patches: as `predict`.
    On the CPU, torch's thread count follows the cores other processes leave, batch by batch
    (`vitkit.machine.threads.Governor`), and is put back at the end.
    """
    check_tta(tta)  # before any image is read
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    c = model.config
    transform = EvalTransform.for_model(c, geometry=False)  # decode_for already resized and cropped
    names = c.class_names or [str(i) for i in range(c.num_classes)]
    device = getattr(model, "device", None) or next(model.parameters()).device  # a BackendModel names its own
    model.eval()
    prefetch = _Prefetch(_Decoder(inputs, c, max_patches), batch_ranges(len(inputs), batch_size, start),
                         max(0, num_workers), depth=max(2, num_workers), stop=stop)
    governor = Governor() if torch.device(device).type == "cpu" else None
    try:
        for indices, decoded in prefetch:
            good = [(pos, x) for pos, x in enumerate(decoded) if isinstance(x, torch.Tensor)]
            tops: dict[int, list[dict]] = {}
            if good:
                if max_patches:

                    x = pack([t for _, t in good], tuple(c.patch_size), length=max_patches).to(device)
                else:
                    x = transform(torch.stack([t for _, t in good])).to(device)  # the checkpoint's eval transform
                if governor is not None:
                    governor.step()
                with autocast(precision, device):
                    probs = tta_log_probs(model, x, tta).float().exp().cpu().numpy()  # (B, K)
                tops = {pos: top_classes(p, names, top_k) for (pos, _), p in zip(good, probs)}
            yield [{"image": inputs.names[i], "top": tops[pos]} if pos in tops else
                   {"image": inputs.names[i], "error": decoded[pos]} for pos, i in enumerate(indices)]
    finally:
        prefetch.close()
        if governor is not None:
            governor.close()


def predict(model: nn.Module, images: Sequence[str | Path], top_k: int = 5, batch_size: int = 32, tta: str = "none",
            precision: str = "fp32", max_patches: int | None = None, num_workers: int = 0) -> list[dict]:
    """One record per image: {"image", "top": [{"index", "label", "probability"}, ...]}, or {"image", "error"} if
    unreadable. `images`: files, folders, CSV lists and shard sets (`gather_inputs`).

    tta: test-time augmentation (`vitkit.evaluation.tta_views`): probabilities averaged over the views.
    precision: fp32 | bf16 | fp16 (autocast), as resolved by `vitkit.machine.precision`.
    max_patches: native aspect ratio (NaFlex): each image resized, keeping its aspect ratio, to at most this many
        patches, the batch packed into one forward (`vitkit.data.naflex`); None: the checkpoint's square size.
    num_workers: threads decoding ahead of the model (0: none).
    """
    check_tta(tta)
    out: list[dict] = []
    for batch in predict_batches(model, gather_inputs(images), top_k=top_k, batch_size=batch_size, tta=tta,
                                 precision=precision, max_patches=max_patches, num_workers=num_workers):
        out.extend(batch)
    return out


# ---- output formats ---------------------------------------------------------------------------------------------

def resolve_format(fmt: str, out: str | None) -> str:
    """The output format: `fmt`, or for "auto" the suffix of `out` (.jsonl, .ndjson, .json, .csv, .txt), else table."""
    if fmt != "auto":
        if fmt not in FORMATS:
            raise UsageError(f"format must be one of auto, {', '.join(FORMATS)}, got {fmt!r}")
        return fmt
    if out is None:
        return "table"
    suffix = Path(out).suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"cannot tell the format from the name {out} (.jsonl, .json, .csv or .txt): add --format "
                         f"jsonl, json, csv or table")
    return SUFFIXES[suffix]


def format_records(fmt: str, records: list[dict], first: bool, run: str | None = None) -> str:
    """The text of some records in a format (`first`: the first records of the output, for json's commas). `run`
    (`run_fingerprint`): what made them, written into each record of the resumable formats (jsonl: a "run" field;
    csv: the run column of each image's first row)."""
    if fmt == "jsonl":
        return "".join(json.dumps({**r, "run": run} if run is not None else r) + "\n" for r in records)
    if fmt == "json":
        return "".join(("" if first and n == 0 else ",\n") + json.dumps(r) for n, r in enumerate(records))
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for r in records:
            if "error" in r:
                w.writerow([r["image"], "", "", "", "", r["error"], run or ""])
            for rank, t in enumerate(r.get("top", []), 1):
                w.writerow([r["image"], rank, t["index"], t["label"], f"{t['probability']:.6f}", "",
                            (run or "") if rank == 1 else ""])
        return buf.getvalue()
    lines = []
    for r in records:
        if "error" in r:
            lines.append(f"{r['image']}: ERROR {r['error']}\n")
            continue
        lines.append(f"{r['image']}\n")
        lines.extend(f"  {t['probability']:7.2%}  {t['label']}\n" for t in r["top"])
    return "".join(lines)


def _head(fmt: str) -> str:
    if fmt == "csv":
        return ",".join(CSV_HEADER) + "\n"
    return "[\n" if fmt == "json" else ""


def _tail(fmt: str, any_records: bool) -> str:
    return ("\n]\n" if any_records else "]\n") if fmt == "json" else ""


# ---- what made a file's records ------------------------------------------------------------------------------------

def model_digest(model: nn.Module) -> str:
    """16 hex digits of the model's weights and config (`machine.engine.weights_digest`), or of the file of a
    compiled package (whose weights are in it)."""
    from ..machine.engine import weights_digest

    if getattr(model, "digest", None):  # a compiled package: its SHA-256, taken when it was opened (not read again)
        return model.digest[:16]
    path = getattr(model, "path", None)  # an exported model (`backends.ExportedModel`)
    if isinstance(path, Path) and not any(True for _ in model.parameters()):
        return sha256_of(path)[:16]
    return weights_digest(model)[:16]


def run_fingerprint(model: nn.Module, *, top_k: int, tta: str = "none", precision: str = "fp32",
                    backend: str = "torch", device: str = "cpu", max_patches: int | None = None,
                    weights: str | None = None) -> str:
    """What the records of a run depend on, as one line of `key=value` fields (the "run" of each record in jsonl
    and csv): `model`, a digest of the weights and config (`machine.engine.weights_digest`; a compiled package's
    file); `preprocess`, a digest of the checkpoint's input geometry and normalisation (img_size, crop_pct,
    interpolation, mean, std, channels); then top_k (the classes kept, as `run` clamps it), tta, precision (as
    resolved), backend, device (its type) and max_patches. `resume` compares it field by field, so that its
    refusal names what differs. weights: `model_digest(model)`, when it was taken already."""
    c = model.config
    weights = weights or model_digest(model)
    pre = [list(c.img_size), getattr(c, "crop_pct", 1.0), getattr(c, "interpolation", "bilinear"), list(c.mean),
           list(c.std), c.in_chans]
    k = max(1, min(int(top_k), c.num_classes))
    fields = {"model": weights, "preprocess": hashlib.blake2b(json.dumps(pre).encode(), digest_size=4).hexdigest(),
              "top_k": k, "tta": tta, "precision": precision, "backend": backend, "device": device,
              "max_patches": max_patches or "none"}
    return " ".join(f"{key}={str(v).replace(' ', '_')}" for key, v in fields.items())


_RUN_WORDS = {"model": "another checkpoint (its weights or config)", "preprocess": "another preprocessing (image "
              "size, crop, interpolation, mean or std)"}


def _run_fields(run: str) -> dict[str, str]:
    return dict(part.split("=", 1) if "=" in part else (part, "") for part in run.split())


def run_differences(theirs: str, ours: str) -> str:
    """What differs between two `run_fingerprint`s, in words: "top_k 3 there, 2 now; ..."."""
    a, b = _run_fields(theirs), _run_fields(ours)
    out = []
    for key in dict.fromkeys([*b, *a]):
        if a.get(key) != b.get(key):
            what = _RUN_WORDS.get(key, key)
            out.append(f"{what}: {a.get(key, '(none)')} there, {b.get(key, '(none)')} now")
    return "; ".join(out) or "another run"


# ---- resuming -----------------------------------------------------------------------------------------------------

@dataclass
class Done:
    """What an earlier run left in an output file: where each complete record ends in it (`ends[j]`: the byte
    offset after input j's record; `start`: after the header), and the inputs among them that could not be read."""

    start: int = 0
    ends: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.ends)

    def offset(self, count: int) -> int:
        """Where the records after the first `count` begin."""
        return self.ends[count - 1] if count else self.start


def _lines(data: bytes) -> list[tuple[str, int, bool]]:
    """The file's lines: (text, its length in bytes, whether it ended with a newline: a last one without is the
    line being written when the run was killed)."""
    parts = data.split(b"\n")
    last = len(parts) - 1
    return [(p.decode("utf-8", "surrogateescape") + ("\n" if n < last else ""), len(p) + (n < last), n < last)
            for n, p in enumerate(parts) if p or n < last]


def read_done(path: str | Path, fmt: str, names: Sequence[str], k: int, run: str | None = None) -> Done:
    """The records an earlier run wrote to `path` (jsonl or csv), checked against the inputs and what made them:
    record j must be input j's, with `k` classes or an error, and (given `run`, a `run_fingerprint`) name the same
    run, which a file of another checkpoint or other settings does not (the refusal names what differs), nor one
    written before records named their run. A last line cut short (a kill while writing) is left out, and with it a
    record whose rows are not all there, but only where it is the start of the record this command writes next
    (the only thing a kill leaves there): a file vitkit did not write is never cut. Anything else that is not such
    a record is a UsageError: the file is then not this command's output, and nothing is written to it."""
    with open_regular(path) as f:  # the results file is ours, but a FIFO there must not block
        lines = _lines(f.read())
    done = Done()
    again = "remove it or write to another --out"

    def check(image: str, line_no: int) -> None:
        j = done.count
        if j >= len(names):
            raise UsageError(f"{path} holds more records than there are inputs ({len(names)}): not this command's "
                             f"output; {again}")
        if image != names[j]:
            raise UsageError(f"{path} line {line_no}: the record of {image!r}, where this command's input {j + 1} is "
                             f"{names[j]!r}: other inputs or another order; {again}")

    def check_run(value, line_no: int) -> None:
        if run is None or value == run:
            return
        if not isinstance(value, str) or not value:
            raise UsageError(f"{path} line {line_no}: a record that does not name the checkpoint and settings that "
                             f"made it (no run: written by an earlier vitkit, or by another program), so it cannot be "
                             f"resumed safely; {again}")
        raise UsageError(f"{path} line {line_no}: written by another checkpoint or with other settings "
                         f"({run_differences(value, run)}): its records would mix with this command's; {again}")

    def cut(text: str, prefix: str, n: int) -> None:
        """A last line cut short: left out if it is the start of what this command writes there (`prefix`)."""
        if not (prefix.startswith(text) or text.startswith(prefix)):
            raise UsageError(f"{path} line {n}: its last line ({len(text.encode('utf-8', 'surrogateescape')):,} "
                             f"bytes, no newline) is not the start of a record of this command: not its output, "
                             f"left as it is; {again}")

    offset = 0
    if fmt == "jsonl":
        for n, (text, size, whole) in enumerate(lines, 1):
            if not whole:  # the line being written when the run was killed, if it starts as input j's record does
                cut(text, '{"image": ' + json.dumps(names[done.count]) if done.count < len(names) else "\0", n)
                break
            try:
                rec = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                raise UsageError(f"{path} line {n} is not a JSON record: not this command's output; {again}") from None
            if isinstance(rec, dict):  # first: a record of other settings (another --top-k) is named as such
                check_run(rec.get("run"), n)
            if not isinstance(rec, dict) or not isinstance(rec.get("image"), str) or not (
                    "error" in rec or (isinstance(rec.get("top"), list) and len(rec["top"]) == k)):
                raise UsageError(f"{path} line {n} is not a record of this command (an image with {k} classes, or "
                                 f"an error): another --top-k, or another command's file; {again}")
            check(rec["image"], n)
            offset += size
            if "error" in rec:
                done.failed.append(done.count)
            done.ends.append(offset)
        return done
    # csv: the header, then per image `k` rows ranked 1..k, or one error row; a row may span lines (a quoted newline);
    # the first row of each image names the run
    texts = [t for t, _, _ in lines]
    reader = csv.reader(texts)
    consumed, group = 0, []
    header = ",".join(CSV_HEADER)

    def next_prefix() -> str:  # how the row this command writes next begins
        if consumed == 0:
            return header
        if done.count >= len(names):
            return "\0"
        buf = io.StringIO()
        csv.writer(buf, lineterminator="").writerow([names[done.count], ""])
        return buf.getvalue()

    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            if reader.line_num < len(lines) or lines[-1][2]:  # not at the last line, cut short: not vitkit's CSV
                raise UsageError(f"{path} line {consumed + 1}: not CSV this command writes ({e}); {again}") from None
            cut("".join(texts[consumed:]), next_prefix(), consumed + 1)
            break
        if not lines[reader.line_num - 1][2]:  # its last line was cut short
            cut("".join(texts[consumed:]), next_prefix(), consumed + 1)
            break
        offset += sum(size for _, size, _ in lines[consumed:reader.line_num])
        line_no, consumed = consumed + 1, reader.line_num
        if line_no == 1:
            if row != CSV_HEADER:
                old = row == CSV_HEADER[:-1]
                raise UsageError(f"{path} does not start with the header {header}"
                                 + (" (an earlier vitkit's, whose records do not name the checkpoint and settings "
                                    "that made them, so it cannot be resumed safely)" if old else
                                    ": not this command's output") + f"; {again}")
            done.start = offset
            continue
        if len(row) != len(CSV_HEADER) or (row[5] == "" and row[1] != str(len(group) + 1)) or (
                group and row[0] != group[0][0]) or (group and row[5] != "") or (group and row[6] != ""):
            raise UsageError(f"{path} line {line_no}: not the next row of this command's CSV (ranks 1 to {k} per "
                             f"image, or one error row): another --top-k, or another command's file; {again}")
        if not group:  # an image's first row: its input, and the run
            check_run(row[6], line_no)
            check(row[0], line_no)
        if row[5] != "":  # an error row: the image's whole record
            check(row[0], line_no)
            done.failed.append(done.count)
            done.ends.append(offset)
            continue
        group.append(row)
        if len(group) == k:
            check(row[0], line_no)
            done.ends.append(offset)
            group = []
    return done


# ---- progress -----------------------------------------------------------------------------------------------------

class Progress:
    """A progress line on stderr: redrawn in place on a terminal (at most 10 times a second), otherwise a plain line
    at every tenth of the images and at least every `every_s` seconds."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True, every_s: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.start_done, self.done, self.enabled, self.every_s = total, done, done, enabled, every_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = self.last = time.perf_counter()
        self.shown = ""
        self.next_tenth = (math.floor(10 * done / total) + 1) if total else 11

    def _line(self) -> tuple[str, float]:
        run = self.done - self.start_done
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = run / dt
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if math.isfinite(left) else "--:--:--"
        frac = self.done / self.total if self.total else 1.0
        return f"{self.done:,}/{self.total:,} images ({frac:.0%}), {rate:,.0f} img/s, ETA {eta}", frac

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        text, frac = self._line()
        if self.tty:
            if now - self.last >= 0.1 or self.done >= self.total:
                bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
                self._draw(f"vitkit: predict [{bar}] {text}")
                self.last = now
        elif self.done >= self.total or 10 * self.done >= self.next_tenth * self.total or now - self.last >= self.every_s:
            print(f"vitkit: predict: {text}", file=self.stream, flush=True)
            self.next_tenth = math.floor(10 * self.done / self.total) + 1 if self.total else 11
            self.last = now

    def _draw(self, line: str) -> None:
        pad = " " * max(0, len(self.shown) - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self.shown = line

    def clear(self) -> None:
        """Take the line off the terminal (before something else is printed there)."""
        if self.enabled and self.tty and self.shown:
            self.stream.write("\r" + " " * len(self.shown) + "\r")
            self.stream.flush()
            self.shown = ""

    def redraw(self) -> None:
        if self.enabled and self.tty and not self.shown and self.done > self.start_done:
            text, frac = self._line()
            self._draw(f"vitkit: predict [{'#' * int(frac * 24) + '.' * (24 - int(frac * 24))}] {text}")

    def end(self) -> None:
        if self.enabled and self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# ---- the command --------------------------------------------------------------------------------------------------

@dataclass
class Summary:
    """How a `run` ended: images in all, those done by an earlier run (resume), those classified now, the
    unreadable ones (all, resumed ones included), the signal that stopped it (None: it finished)."""

    total: int
    resumed: int
    done_now: int
    failed: list[str]
    seconds: float
    stopped: int | None = None

    def done_line(self, out: str | None = None) -> str:
        """The line a finished run ends with on stderr: images, time, rate, and where the records are."""
        rate = self.done_now / max(self.seconds, 1e-9)
        resumed = f" ({self.resumed:,} done earlier)" if self.resumed else ""
        where = f"; records in {out}" if out else ""
        return f"vitkit: predict: {self.done_now:,} images in {self.seconds:.1f} s ({rate:,.0f} img/s){resumed}{where}"


class _Signals:
    """SIGTERM and SIGINT set a flag (the loop stops after the batch in hand); a second SIGINT interrupts at once.
    Output is written with both blocked, so a batch's records are written whole."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.old: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self.old[s] = signal.signal(s, self._on)
            except ValueError:  # not the main thread: no handlers
                break
        return self

    def _on(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)

    def stop(self) -> bool:
        return self.signum is not None


class _Blocked:
    SIGS = {signal.SIGTERM, signal.SIGINT}

    def __enter__(self):
        if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGS)
        else:
            self.old = None
        return self

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


def run(model: nn.Module, inputs: Inputs, *, out: str | None = None, fmt: str = "table", resume: bool = False,
        top_k: int = 5, batch_size: int = 32, tta: str = "none", precision: str = "fp32",
        max_patches: int | None = None, num_workers: int = 2, progress: bool = True,
        stdout: TextIO | None = None, fingerprint: str | None = None) -> Summary:
    """Classify `inputs` and write their records as they come (to `out`, else stdout) in `fmt`, flushed per batch,
    with a progress line on stderr. resume: keep the records an earlier run of the same command wrote to `out`
    (`read_done`) and carry on after them, so that the file ends as that of a run never stopped (the batch the
    earlier run was in the middle of is done again whole, at the same batch boundaries); a file of another
    checkpoint or other settings is refused, untouched. SIGTERM/SIGINT stop it after the batch in hand, its records
    written (a JSON array is closed). `out` must be missing or a regular file (`cache.check_output`: a FIFO,
    device or link is refused before anything is opened); a write the system refuses (a full disk) is a
    `WriteError`, the records before it kept. fingerprint: the records' run (`run_fingerprint`; by default this
    model's, on the torch backend at `precision`), written into each record of a jsonl or csv `out`."""
    stdout = stdout or sys.stdout
    if fmt not in FORMATS:
        raise UsageError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if resume and out is None:
        raise UsageError("--resume continues the file named by --out: add --out FILE")
    if resume and fmt not in RESUMABLE:
        raise UsageError(f"--resume continues a jsonl or csv file, not {fmt}: write to --out FILE.jsonl or FILE.csv")
    check_tta(tta)
    if out is not None:
        check_output(out)  # a FIFO (which would block), a device, a folder or a link: refused before anything
    k = max(1, min(top_k, model.config.num_classes))
    if fingerprint is None and out is not None and fmt in RESUMABLE:
        device = getattr(model, "device", None) or next(model.parameters(), torch.empty(0)).device
        fingerprint = run_fingerprint(model, top_k=top_k, tta=tta, precision=precision, device=torch.device(device).type,
                                      max_patches=max_patches)
    done = read_done(out, fmt, inputs.names, k, fingerprint) if resume and Path(out).is_file() else None
    start = 0
    if done is not None:
        start = done.count if done.count == len(inputs) else done.count - done.count % batch_size
    failed = [inputs.names[j] for j in (done.failed if done else []) if j < start]
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        # resumed: a record cut short, and the rest of its batch, are cut off and done again
        keep = done.offset(start) if done is not None and (start or done.start) else 0
        sink, head = open_output(out, keep), not keep
    else:
        sink, head = stdout, True
    bar = Progress(len(inputs), start, enabled=progress)
    share_terminal = out is None and bar.tty and bool(getattr(stdout, "isatty", lambda: False)())
    summary = Summary(len(inputs), start, 0, failed, 0.0)
    first = True
    write_failed = False

    def write(text: str) -> None:
        nonlocal write_failed
        if not text:
            return
        with _Blocked():  # a batch's records whole, whatever signal comes
            if share_terminal:
                bar.clear()
            try:
                sink.write(text)
                sink.flush()
            except OSError as e:
                failed_write = write_failure(e, out) if sink is not stdout else None
                if failed_write is None:
                    raise
                write_failed = True
                raise WriteError(f"{failed_write}; the records of the {start + summary.done_now:,} images before "
                                 f"are kept (the same command with --resume carries on)") from e

    try:
        with _Signals() as sig:
            if head:
                write(_head(fmt))
            try:
                for records in predict_batches(model, inputs, top_k=top_k, batch_size=batch_size, tta=tta,
                                               precision=precision, max_patches=max_patches, start=start,
                                               num_workers=num_workers, stop=sig.stop):
                    write(format_records(fmt, records, first, fingerprint if out is not None else None))
                    first = False
                    failed.extend(r["image"] for r in records if "error" in r)
                    summary.done_now += len(records)
                    bar.update(len(records))
                    if share_terminal:
                        bar.redraw()
                    if sig.stop():
                        break
            except Stopped:
                pass
            summary.stopped = sig.signum
            write(_tail(fmt, not first))
    except BrokenPipeError:  # stdout closed by its reader (`| head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout.fileno())
        os.close(devnull)
        summary.stopped = getattr(signal, "SIGPIPE", 13)
    finally:
        bar.end()
        if sink is not stdout:
            try:
                sink.close()
            except OSError:
                if not write_failed:  # the text a failed write left in the buffer fails again: said once, above
                    raise
    summary.seconds = bar.elapsed()
    return summary


def predict_images(images: Sequence[str], checkpoint: str, *, top_k: int = 3, out: str | None = None,
                   format: str = "auto", resume: bool = False, batch_size: int = 32, num_workers: int = 2,
                   progress: bool = True, tta: str = "none", device: str = "auto", precision: str = "auto",
                   backend: str = "torch", max_patches: int | None = None, stdout: TextIO | None = None,
                   trust_package: bool = False) -> Summary:
    """`vitkit predict` as a function: gather `images` (files, folders, CSV lists, shard sets), load `checkpoint`,
    choose the engine (`inference.backends.inference_engine`) and `run` them, the records written to `out` (else
    stdout) in `format`. The arguments are the command's (`vitkit predict --help`)."""
    fmt = resolve_format(format, out)
    check_tta(tta, packed=bool(max_patches))
    if out is not None:
        check_output(out)  # before the model loads: a FIFO, device, folder or link as --out is refused at once
    if batch_size < 1 or num_workers < 0 or top_k < 1:
        raise UsageError("--batch-size and --top-k must be >= 1, --num-workers >= 0")
    if resume and out is None:
        raise UsageError("--resume continues the file named by --out: add --out FILE")
    if resume and fmt not in ("jsonl", "csv"):
        raise UsageError(f"--resume continues a jsonl or csv file, not {fmt}: write to --out FILE.jsonl or FILE.csv")
    inputs = gather_inputs(images, warn=log.warning)
    if not len(inputs):
        raise UsageError(f"no images in {', '.join(images)}")
    model, backend = load_for_inference(checkpoint, backend, trust_package)
    if getattr(model.config, "num_classes", 1) == 0:
        raise UsageError(f"{checkpoint} has no classifier head (num_classes=0): use `vitkit features` for its "
                         f"features, or a checkpoint with a head to predict classes")
    if isinstance(model, torch.nn.Module):  # a NaN/inf weight would print non-JSON NaN probabilities: refused by name
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise UsageError(f"{checkpoint}: tensor {name} holds NaN or infinite values: not a usable checkpoint")
    if max_patches and backend != "torch":
        raise UsageError("--max-patches runs packed batches on eager torch (--backend torch)")
    dev = resolve_device("cpu" if isinstance(model, (PackageModel, ExportedModel)) and device == "auto" else device)
    weights = model_digest(model) if out is not None and fmt in RESUMABLE else None  # on the CPU, before it moves
    model = model.to(dev)
    runner, prec, _ = inference_engine(model, dev, precision, backend, min(len(inputs), batch_size))
    runs = None
    if weights is not None:  # what made the records: the model, and the engine and precision it runs on
        choice = getattr(runner, "choice", None)
        engine_backend, engine_prec = (choice.backend, choice.precision) if choice is not None else (
            ("aoti", runner.precision) if isinstance(runner, PackageModel) else
            (runner.backend, "fp32") if isinstance(runner, ExportedModel) else ("torch", prec))
        runs = run_fingerprint(model, top_k=top_k, tta=tta, precision=engine_prec, backend=engine_backend,
                               device=dev.type, max_patches=max_patches, weights=weights)
    return run(runner, inputs, out=out, fmt=fmt, resume=resume, top_k=top_k, batch_size=batch_size, tta=tta,
               precision=prec, max_patches=max_patches, num_workers=num_workers, progress=progress, stdout=stdout,
               fingerprint=runs)
