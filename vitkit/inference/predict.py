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
answers with too.
"""
from __future__ import annotations

import csv
import http.client
import io
import json
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
from ..data.image import EvalTransform, ImageDecodeError, decode_for, load_image, to_uint8_tensor
from ..data.naflex import PackTransform
from ..data.shards import FORMAT, ShardDataset, fetch_small
from ..errors import UsageError, VitkitError
from ..evaluation.metrics import check_tta, tta_log_probs
from ..machine.device import resolve_device
from ..machine.precision import autocast
from ..models.layers.packing import pack
from ..safety import open_regular, parse_json, read_bytes
from .backends import PackageModel, inference_engine, load_for_inference

FORMATS = ("table", "json", "jsonl", "csv")
RESUMABLE = ("jsonl", "csv")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".jsonlines": "jsonl", ".json": "json", ".csv": "csv",
            ".txt": "table"}
# the decoding threads' priority (Linux `nice`, per thread): they take the cores the model's forward leaves idle, and
# do not preempt its OpenMP threads, whose barriers would then wait for them (measured: 1,000 640x480 JPEGs into a
# 28-px model on 2 cores, 2.3 s at the model's priority, 1.7 s at nice 10; model-bound 28-px PNGs 1.5 s -> 1.4 s)
DECODE_NICE = 10
CSV_HEADER = ["image", "rank", "index", "label", "probability", "error"]
# what reading a shard sample's bytes may raise (as `ShardDataset.__getitem__` catches): that sample's error record
_SHARD_UNREADABLE = (VitkitError, OSError, ValueError, MemoryError, http.client.HTTPException)


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
        except (ImageDecodeError, OSError) as e:
            msg = str(e)
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
    try:
        for indices, decoded in prefetch:
            good = [(pos, x) for pos, x in enumerate(decoded) if isinstance(x, torch.Tensor)]
            tops: dict[int, list[dict]] = {}
            if good:
                if max_patches:

                    x = pack([t for _, t in good], tuple(c.patch_size), length=max_patches).to(device)
                else:
                    x = transform(torch.stack([t for _, t in good])).to(device)  # the checkpoint's eval transform
                with autocast(precision, device):
                    probs = tta_log_probs(model, x, tta).float().exp().cpu().numpy()  # (B, K)
                tops = {pos: top_classes(p, names, top_k) for (pos, _), p in zip(good, probs)}
            yield [{"image": inputs.names[i], "top": tops[pos]} if pos in tops else
                   {"image": inputs.names[i], "error": decoded[pos]} for pos, i in enumerate(indices)]
    finally:
        prefetch.close()


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


def format_records(fmt: str, records: list[dict], first: bool) -> str:
    """The text of some records in a format (`first`: the first records of the output, for json's commas)."""
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in records)
    if fmt == "json":
        return "".join(("" if first and n == 0 else ",\n") + json.dumps(r) for n, r in enumerate(records))
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for r in records:
            if "error" in r:
                w.writerow([r["image"], "", "", "", "", r["error"]])
            for rank, t in enumerate(r.get("top", []), 1):
                w.writerow([r["image"], rank, t["index"], t["label"], f"{t['probability']:.6f}", ""])
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


def read_done(path: str | Path, fmt: str, names: Sequence[str], k: int) -> Done:
    """The records an earlier run wrote to `path` (jsonl or csv), checked against the inputs: record j must be
    input j's, with `k` classes or an error. A last line cut short (a kill while writing), and with it a record
    whose rows are not all there, is left out. Anything else that is not such a record is a UsageError: the file is
    then not this command's output, and nothing is written to it."""
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

    offset = 0
    if fmt == "jsonl":
        for n, (text, size, whole) in enumerate(lines, 1):
            if not whole:
                break  # the line being written when the run was killed
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                raise UsageError(f"{path} line {n} is not a JSON record: not this command's output; {again}") from None
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
    # csv: the header, then per image `k` rows ranked 1..k, or one error row; a row may span lines (a quoted newline)
    texts = [t for t, _, _ in lines]
    reader = csv.reader(texts)
    consumed, group = 0, []
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error:
            break  # a quoted field cut short by a kill
        if not lines[reader.line_num - 1][2]:
            break  # its last line was cut short
        offset += sum(size for _, size, _ in lines[consumed:reader.line_num])
        line_no, consumed = consumed + 1, reader.line_num
        if line_no == 1:
            if row != CSV_HEADER:
                raise UsageError(f"{path} does not start with the header {','.join(CSV_HEADER)}: not this command's "
                                 f"output; {again}")
            done.start = offset
            continue
        if len(row) != len(CSV_HEADER) or (row[5] == "" and row[1] != str(len(group) + 1)) or (
                group and row[0] != group[0][0]) or (group and row[5] != ""):
            raise UsageError(f"{path} line {line_no}: not the next row of this command's CSV (ranks 1 to {k} per "
                             f"image, or one error row): another --top-k, or another command's file; {again}")
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
        stdout: TextIO | None = None) -> Summary:
    """Classify `inputs` and write their records as they come (to `out`, else stdout) in `fmt`, flushed per batch,
    with a progress line on stderr. resume: keep the records an earlier run of the same command wrote to `out`
    (`read_done`) and carry on after them, so that the file ends as that of a run never stopped (the batch the
    earlier run was in the middle of is done again whole, at the same batch boundaries). SIGTERM/SIGINT stop it
    after the batch in hand, its records written (a JSON array is closed)."""
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
    k = max(1, min(top_k, model.config.num_classes))
    done = read_done(out, fmt, inputs.names, k) if resume and Path(out).is_file() else None
    start = 0
    if done is not None:
        start = done.count if done.count == len(inputs) else done.count - done.count % batch_size
    failed = [inputs.names[j] for j in (done.failed if done else []) if j < start]
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        if done is not None and (start or done.start):
            os.truncate(out, done.offset(start))  # a record cut short, and the rest of its batch: done again
            sink, head = open(out, "a", encoding="utf-8", errors="surrogateescape", newline=""), False
        else:
            sink, head = open(out, "w", encoding="utf-8", errors="surrogateescape", newline=""), True
    else:
        sink, head = stdout, True
    bar = Progress(len(inputs), start, enabled=progress)
    share_terminal = out is None and bar.tty and bool(getattr(stdout, "isatty", lambda: False)())
    summary = Summary(len(inputs), start, 0, failed, 0.0)
    first = True

    def write(text: str) -> None:
        if not text:
            return
        with _Blocked():  # a batch's records whole, whatever signal comes
            if share_terminal:
                bar.clear()
            sink.write(text)
            sink.flush()

    try:
        with _Signals() as sig:
            if head:
                write(_head(fmt))
            try:
                for records in predict_batches(model, inputs, top_k=top_k, batch_size=batch_size, tta=tta,
                                               precision=precision, max_patches=max_patches, start=start,
                                               num_workers=num_workers, stop=sig.stop):
                    write(format_records(fmt, records, first))
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
            sink.close()
    summary.seconds = bar.elapsed()
    return summary


def predict_images(images: Sequence[str], checkpoint: str, *, top_k: int = 3, out: str | None = None,
                   format: str = "auto", resume: bool = False, batch_size: int = 32, num_workers: int = 2,
                   progress: bool = True, tta: str = "none", device: str = "auto", precision: str = "auto",
                   backend: str = "torch", max_patches: int | None = None, stdout: TextIO | None = None) -> Summary:
    """`vitkit predict` as a function: gather `images` (files, folders, CSV lists, shard sets), load `checkpoint`,
    choose the engine (`inference.backends.inference_engine`) and `run` them, the records written to `out` (else
    stdout) in `format`. The arguments are the command's (`vitkit predict --help`)."""
    fmt = resolve_format(format, out)
    check_tta(tta)
    if batch_size < 1 or num_workers < 0 or top_k < 1:
        raise UsageError("--batch-size and --top-k must be >= 1, --num-workers >= 0")
    if resume and out is None:
        raise UsageError("--resume continues the file named by --out: add --out FILE")
    if resume and fmt not in ("jsonl", "csv"):
        raise UsageError(f"--resume continues a jsonl or csv file, not {fmt}: write to --out FILE.jsonl or FILE.csv")
    inputs = gather_inputs(images, warn=lambda m: print(f"vitkit: warning: {m}", file=sys.stderr, flush=True))
    if not len(inputs):
        raise UsageError(f"no images in {', '.join(images)}")
    model, backend = load_for_inference(checkpoint, backend)
    if max_patches and backend != "torch":
        raise UsageError("--max-patches runs packed batches on eager torch (--backend torch)")
    dev = resolve_device("cpu" if isinstance(model, PackageModel) and device == "auto" else device)
    model = model.to(dev)
    runner, prec, _ = inference_engine(model, dev, precision, backend, min(len(inputs), batch_size))
    return run(runner, inputs, out=out, fmt=fmt, resume=resume, top_k=top_k, batch_size=batch_size, tta=tta,
               precision=prec, max_patches=max_patches, num_workers=num_workers, progress=progress, stdout=stdout)
