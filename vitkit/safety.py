"""Limits on what untrusted bytes may claim, and the one error path for reading them.

vitkit reads files from strangers (checkpoints, configs, dataset shards over HTTP) and request bodies from the
network. Two rules hold for every such read:

1. **Limits before allocation.** What a file claims (an array's shape and dtype, a zip entry's uncompressed size, a
   shard's byte range, a model's size from its config, a document's nesting) is checked against what it can be,
   and against the memory this process has, before anything of that size is read or allocated. A violation names
   the file and the field.
2. **One error path.** Every parse of untrusted bytes runs inside `untrusted(what)`: the libraries' own exceptions
   (zip, json, yaml, PIL, safetensors, numpy, torch), and MemoryError or RecursionError caused by the input, become
   one vitkit error naming the file, which the CLI prints as one line (`vitkit: error: ...`, exit 2).

3. **Regular files only.** Every file vitkit is handed is opened through `open_regular`: a FIFO, socket or device
   (or a folder where a file is expected) is refused by name from its `stat` before anything blocks on it (a FIFO
   opened for reading waits for a writer forever).
4. **Every fetch has a deadline.** Besides the per-read timeout, each network fetch (a download, a shard's index
   or byte range) runs under one wall-clock budget (`Deadline`: VITKIT_FETCH_DEADLINE_S plus its size at
   VITKIT_FETCH_MIN_RATE); a server that sends one byte at a time is cut off when it passes, naming the URL.

The limits are generous for real models (ViT-22B's largest tensor is 0.6 GB in fp32) and each can be raised by an
environment variable.
"""
from __future__ import annotations

import contextlib
import errno
import http.client
import io
import json
import math
import numbers
import os
import resource
import socket
import stat
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from . import env
from .errors import CheckpointError, UsageError, VitkitError
import dataclasses
import yaml


# The limits are environment knobs (`vitkit.env`: VITKIT_MAX_TENSOR_BYTES, VITKIT_MAX_TEXT_BYTES, VITKIT_MAX_NESTING,
# VITKIT_MAX_NODES, VITKIT_MAX_COMPRESSION_RATIO, VITKIT_MAX_SAMPLE_BYTES), each read where it is used: a bad value is
# a UsageError naming it then, never an error at import. `safety.MAX_TENSOR_BYTES` and the like still read them.
_KNOB_CONSTANTS = {"MAX_TENSOR_BYTES": "VITKIT_MAX_TENSOR_BYTES", "MAX_TEXT_BYTES": "VITKIT_MAX_TEXT_BYTES",
                   "MAX_NESTING": "VITKIT_MAX_NESTING", "MAX_NODES": "VITKIT_MAX_NODES",
                   "MAX_COMPRESSION_RATIO": "VITKIT_MAX_COMPRESSION_RATIO",
                   "MAX_SAMPLE_BYTES": "VITKIT_MAX_SAMPLE_BYTES", "FETCH_DEADLINE_S": "VITKIT_FETCH_DEADLINE_S",
                   "FETCH_MIN_RATE": "VITKIT_FETCH_MIN_RATE"}


def __getattr__(name: str) -> Any:
    """The former module constants (MAX_TENSOR_BYTES, ...): the knob's value now."""
    if name in _KNOB_CONSTANTS:
        return env.get(_KNOB_CONSTANTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit


def memory_budget() -> int:
    """Bytes this process may still allocate: the machine's available memory, or what is left under RLIMIT_AS
    when a lower address-space limit is set."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            used = 0
        left = max(soft - used, 0)
        avail = left if avail is None else min(avail, left)
    return avail if avail is not None else 1 << 62


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_alloc(nbytes: int, what: str, error: type[VitkitError] = CheckpointError) -> None:
    """Refuse to allocate `nbytes` for `what` when this process does not have them."""
    budget = memory_budget()
    if nbytes > budget:
        raise error(f"{what} needs {gib(nbytes)}, more than the {gib(budget)} of memory this process has left: refused "
                    f"before allocating")


def check_tensor(name: str, shape: tuple, itemsize: int, what: str) -> int:
    """The bytes an array of `shape` takes as float32 (or its own itemsize if larger); refused over the limit or
    with a negative or non-integer dimension."""
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{what}: tensor {name!r} has an invalid shape {shape}")
    nbytes, limit = math.prod(shape) * max(itemsize, 4), env.get("VITKIT_MAX_TENSOR_BYTES")
    if nbytes > limit:
        raise CheckpointError(f"{what}: tensor {name!r} claims shape {tuple(shape)} ({gib(nbytes)}), over the limit of "
                              f"{gib(limit)} for one tensor (no published ViT has one that large; "
                              f"VITKIT_MAX_TENSOR_BYTES raises it)")
    return nbytes


def check_zip_entry(info, what: str) -> None:
    """A zip entry whose uncompressed size is far beyond its compressed one: a decompression bomb."""
    ratio = env.get("VITKIT_MAX_COMPRESSION_RATIO")
    if info.file_size > 16 << 20 and info.file_size > ratio * max(info.compress_size, 1):
        raise CheckpointError(f"{what}: entry {info.filename!r} expands from {gib(info.compress_size)} to "
                              f"{gib(info.file_size)} ({info.file_size // max(info.compress_size, 1)}x): refused as a "
                              f"decompression bomb (real checkpoints compress less than {ratio}x; "
                              f"VITKIT_MAX_COMPRESSION_RATIO raises it)")


def check_tree(obj: Any, what: str, error: type[VitkitError] = UsageError) -> Any:
    """A parsed JSON/YAML document within MAX_NESTING levels and MAX_NODES values (shared YAML aliases count every
    time they are reached, as a walk over the document would reach them)."""
    stack, nodes = [(obj, 1)], 0
    max_nodes, max_nesting = env.get("VITKIT_MAX_NODES"), env.get("VITKIT_MAX_NESTING")
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise error(f"{what}: more than {max_nodes:,} values (YAML aliases can multiply a small file): refused")
        if isinstance(node, (dict, list, tuple)):
            if depth > max_nesting:
                raise error(f"{what}: nested more than {max_nesting} levels deep: refused")
            children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return obj


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _refuse_irregular(path: str | Path, what: str | None, mode: int, error: type[VitkitError]) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):  # as open() says it, so that the callers that expect IsADirectoryError keep working
        raise IsADirectoryError(errno.EISDIR, "a folder where a file was expected", str(what or path))
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), f"not a regular file (mode {mode:#o})")
    raise error(f"{what or path}: {kind}, not a regular file: refused (vitkit reads regular files only: reading "
                f"from a pipe, socket or device can wait forever)")


def open_regular(path: str | Path, what: str | None = None, error: type[VitkitError] = UsageError) -> io.BufferedReader:
    """`path` opened for reading in binary, if it is a regular file (a symlink to one is); the one door every reader
    of a file vitkit is handed goes through. A FIFO, socket or device is refused as `error` naming `what` (or the
    path), a folder as IsADirectoryError, from `os.stat` before it is opened and again from `fstat` of what was
    opened (with O_NONBLOCK: opening a FIFO without it waits for a writer). FileNotFoundError and PermissionError
    pass through."""
    _refuse_irregular(path, what, os.stat(path).st_mode, error)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        _refuse_irregular(path, what, os.fstat(fd).st_mode, error)  # replaced since the stat: checked on what is open
        if nonblock:
            os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
        f.raw.name = os.fspath(path)  # named as open(path) names it (PIL's and numpy's messages show it)
        return f
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | Path, what: str | None = None, error: type[VitkitError] = UsageError) -> Path:
    """`path`, checked as `open_regular` checks it, for a library that opens the path itself (safetensors, torch,
    onnx, OpenVINO)."""
    open_regular(path, what, error).close()
    return Path(path)


def read_bytes(path: str | Path, what: str | None = None, limit: int | None = None,
               error: type[VitkitError] = UsageError, knob: str = "VITKIT_MAX_TEXT_BYTES") -> bytes:
    """A small file's bytes (a config, an index), a regular file only (`open_regular`), refused from its size
    before it is read: over `limit` bytes, by default the value of the environment knob `knob`."""
    limit = env.get(knob) if limit is None else limit
    with open_regular(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise error(f"{what or path}: {gib(max(size, len(data)))}, over the limit of {gib(limit)} for a file of this "
                    f"kind ({knob} raises it)")
    return data


# ---- network fetches: an overall deadline besides the per-read timeout ---------------------------------------

def fetch_budget(nbytes: int | None = None) -> float:
    """Seconds a fetch of `nbytes` may take in all: VITKIT_FETCH_DEADLINE_S (default 60) plus `nbytes` at
    VITKIT_FETCH_MIN_RATE bytes per second (default 100 kB/s: a 350 MB ViT-B in an hour). Read from the
    environment at each fetch."""
    floor = env.get("VITKIT_FETCH_DEADLINE_S")
    return floor + max(nbytes or 0, 0) / env.get("VITKIT_FETCH_MIN_RATE")


class Deadline:
    """The wall-clock budget of one network fetch (`fetch_budget` of its size), besides the per-read timeout: a
    server that answers one byte every few seconds never trips a per-read timeout, but it does this. Used as a
    context around the fetch; the sockets it `watch`es (every connection made through `open_url` or
    `http_connection`) are shut down when the budget passes, so that a read blocked on them returns at once, and the
    fetch then raises `exceeded()`. `expect(n)` raises the budget to that of n bytes once the size is known
    (capped by the caller at the most it will read)."""

    def __init__(self, url: str, nbytes: int | None = None) -> None:
        self.url, self.expected = url, max(nbytes or 0, 0)
        self.start = time.monotonic()
        self.expired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._active = False

    @property
    def seconds(self) -> float:
        return fetch_budget(self.expected)

    def remaining(self) -> float:
        return self.start + self.seconds - time.monotonic()

    def expect(self, nbytes: int) -> None:
        """The fetch will read `nbytes` (a Content-Length, capped by the caller): its budget grows to fit them."""
        with self._lock:
            self.expected = max(self.expected, int(nbytes))

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            if self.expired:
                _shut(sock)
            elif self._active:
                self._socks.append(sock)
        return sock

    def __enter__(self) -> "Deadline":
        with self._lock:
            self._active = True
            self._arm()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active = False
            self._socks.clear()
            if self._timer is not None:
                self._timer.cancel()

    def _arm(self) -> None:
        # at most a day at a time (a long budget re-arms in _fire): a Timer past threading.TIMEOUT_MAX would raise
        self._timer = threading.Timer(min(max(self.remaining(), 0.0), 86400.0) + 0.01, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._active:
                return
            if self.remaining() > 0:  # the budget grew since it was armed
                self._arm()
                return
            self.expired = True
            for sock in self._socks:
                _shut(sock)

    def check(self) -> None:
        """Raise `exceeded()` once the budget has passed."""
        if self.expired or self.remaining() <= 0:
            self.expired = True
            raise self.exceeded()

    def exceeded(self, error: type[Exception] = TimeoutError) -> Exception:
        floor, rate = env.get("VITKIT_FETCH_DEADLINE_S"), env.get("VITKIT_FETCH_MIN_RATE")
        size = f", plus {self.expected:,} bytes at VITKIT_FETCH_MIN_RATE={rate:,.0f} B/s" if self.expected else ""
        return error(f"{self.url}: no complete answer within the fetch's deadline of {self.seconds:.3g} s "
                     f"(VITKIT_FETCH_DEADLINE_S={floor:g}{size}): the server sends too slowly or has stalled; cut off "
                     f"after {time.monotonic() - self.start:.1f} s")


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: under TLS too, without touching its state


def _watched(base: type) -> type:
    class Watched(base):
        """An HTTP(S) connection whose socket its current `deadline` watches; connecting takes at most what is left
        of the deadline."""

        deadline: Deadline | None = None

        def __init__(self, *args, deadline: Deadline | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.deadline = deadline
            self._create_connection = self._create

        def _create(self, address, timeout=None, source_address=None, *args):
            dl = self.deadline
            if dl is not None:
                left = dl.remaining()
                if left <= 0:
                    raise dl.exceeded()
                timeout = left if timeout is None else min(timeout, left)
            sock = socket.create_connection(address, timeout, source_address, *args)
            sock.settimeout(self.timeout)  # the per-read timeout from here on
            return dl.watch(sock) if dl is not None else sock

        def connect(self) -> None:
            super().connect()
            if self.deadline is not None:  # under TLS a new socket object holds the connection: watch that one too
                self.deadline.watch(self.sock)

        def watch_with(self, deadline: Deadline) -> None:
            """Watch this (kept-alive) connection with another fetch's deadline."""
            self.deadline = deadline
            if self.sock is not None:
                deadline.watch(self.sock)

    Watched.__name__ = Watched.__qualname__ = f"Watched{base.__name__}"
    return Watched


WatchedHTTPConnection = _watched(http.client.HTTPConnection)
WatchedHTTPSConnection = _watched(http.client.HTTPSConnection)


def http_connection(scheme: str, netloc: str, timeout: float, deadline: Deadline | None = None):
    """An http.client connection to `netloc` whose sockets `deadline` (and later `watch_with`'s) watches."""
    cls = WatchedHTTPSConnection if scheme == "https" else WatchedHTTPConnection
    return cls(netloc, timeout=timeout, deadline=deadline)


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(WatchedHTTPConnection, req, deadline=self.deadline)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(WatchedHTTPSConnection, req, context=self._context, deadline=self.deadline)


def open_url(url: str | urllib.request.Request, deadline: Deadline, timeout: float, *handlers):
    """urllib's `urlopen` (proxies, redirects, TLS as it does them, and any extra `handlers`), every connection it
    makes watched by `deadline` (enter it first) and each read under the per-read `timeout`."""
    opener = urllib.request.build_opener(*handlers, _DeadlineHTTP(deadline), _DeadlineHTTPS(deadline))
    return opener.open(url, timeout=timeout)


def parse_json(data: str | bytes, what: str, error: type[VitkitError] = UsageError) -> Any:
    """JSON from untrusted bytes: size, nesting and values bounded; any failure is `error` naming `what`."""
    limit = env.get("VITKIT_MAX_TEXT_BYTES")
    if len(data) > limit:
        raise error(f"{what}: {gib(len(data))} of JSON, over the limit of {gib(limit)} "
                    f"(VITKIT_MAX_TEXT_BYTES)")
    with untrusted(what, error):
        return check_tree(json.loads(data), what, error)


def parse_yaml(text: str, what: str, error: type[VitkitError] = UsageError) -> Any:
    """YAML with the safe loader (no Python tags): size, nesting and values bounded."""
    limit = env.get("VITKIT_MAX_TEXT_BYTES")
    if len(text) > limit:
        raise error(f"{what}: {gib(len(text))} of YAML, over the limit of {gib(limit)} "
                    f"(VITKIT_MAX_TEXT_BYTES)")
    with untrusted(what, error):
        try:
            return check_tree(yaml.safe_load(text), what, error)
        except yaml.constructor.ConstructorError as e:
            raise error(f"{what}: {e.problem or e} (vitkit reads plain YAML only: Python tags such as !!python/... "
                        f"are refused)") from e
        except yaml.YAMLError as e:
            raise error(f"{what}: not valid YAML ({' '.join(str(e).split())})") from e


def _renamed(e: VitkitError, what: str) -> VitkitError:
    try:
        new = type(e)(f"{what}: {e}")
    except Exception:  # noqa: BLE001 - an error type with another signature keeps its own message
        return e
    new.__cause__ = e.__cause__
    return new


@contextlib.contextmanager
def untrusted(what: str, error: type[VitkitError] = CheckpointError) -> Iterator[None]:
    """Run a parse of untrusted bytes: any failure ends as `error` (or the vitkit error raised inside) naming
    `what`. MemoryError and RecursionError are refusals here: the input asked for them."""
    try:
        yield
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, KeyboardInterrupt):
        raise
    except VitkitError as e:
        if what in str(e):
            raise
        raise _renamed(e, what) from e.__cause__
    except MemoryError:
        raise error(f"{what}: reading it ran out of memory (it claims more than this process can hold): "
                    f"refused") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply to read: refused") from None
    except Exception as e:
        detail = " ".join(str(e).split())[:500]
        raise error(f"{what}: cannot be read ({type(e).__name__}: {detail})") from e


# The bounds of a model config's sizes: far beyond any published model, small enough that a hostile or mistyped
# number is refused by name before the model is built (`build_model` then checks the whole model against memory).
SIZE_BOUNDS = {
    "img_size": (1, 16384), "patch_size": (1, 4096), "in_chans": (1, 256), "num_classes": (0, 10_000_000),
    "embed_dim": (1, 65536), "depth": (0, 1024), "num_heads": (1, 4096), "mlp_dim": (1, 1 << 20),
    "representation_size": (1, 65536), "reg_tokens": (0, 4096), "depths": (0, 1024), "window_size": (1, 1024),
    "layers": (0, 1024), "width_factor": (1, 64), "channels": (1, 1 << 20), "stem_width": (1, 1 << 16),
    "hybrid_layers": (0, 1024), "rope_ref_grid": (1, 16384), "rel_pos_dim": (1, 65536),
    "conv_stem": (1, 1 << 16), "conv_stem_kernels": (1, 4096), "conv_stem_strides": (1, 4096),
}


# The bounds of a model config's real-valued settings, by field name (ViTConfig, SwinConfig, ResNetV2Config; every
# loader builds one of these, so every path gets them): a value outside gives non-finite outputs or a model that cannot
# be built, and is refused by name. (lo, hi, brackets): "[" / "]" include the bound, "(" / ")" exclude it.
#   eps of a norm or weight standardisation: 0 divides by zero on a constant input (NaN), below 1e-30 it is 0 in
#       float32 or bfloat16, negative takes the root of a negative variance;
#   rope_temperature (the RoPE base, DINOv3's rope_theta): periods T^(i/n) with T <= 0 are 0 or NaN (angles
#       c / 0); T under 1e-6 underflows float32 on the way; any T in [1e-6, 1e12] gives finite angles;
#   dropout and stochastic depth rates: 1 drops everything (DropPath divides by its keep probability: 0);
#   std: the preprocessing divides by it; crop_pct: the resize before the crop divides by it;
#   mlp_ratio (Swin): the hidden width int(C * ratio) must be a width; hybrid_width: the ResNet's width factor.
VALUE_BOUNDS = {
    "norm_eps": (1e-30, 1.0, "[]"), "hybrid_ws_eps": (1e-30, 1.0, "[]"), "hybrid_gn_eps": (1e-30, 1.0, "[]"),
    "ws_eps": (1e-30, 1.0, "[]"), "gn_eps": (1e-30, 1.0, "[]"),
    "rope_temperature": (1e-6, 1e12, "[]"), "rope_offset": (-1e6, 1e6, "[]"), "init_values": (-1e6, 1e6, "[]"),
    "drop_rate": (0.0, 1.0, "[)"), "attn_drop_rate": (0.0, 1.0, "[)"), "drop_path_rate": (0.0, 1.0, "[)"),
    "mlp_ratio": (0.0, 1024.0, "(]"), "hybrid_width": (0.0, 64.0, "(]"), "crop_pct": (0.0, 1.0, "(]"),
    "mean": (-1e6, 1e6, "[]"), "std": (0.0, 1e6, "(]"),
}


def _in_bounds(v: Any, lo: float, hi: float, brackets: str) -> bool:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        return False
    return (v >= lo if brackets[0] == "[" else v > lo) and (v <= hi if brackets[1] == "]" else v < hi)


def _fits(value: Any, base: str) -> bool:
    if base == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if base == "bool":
        return isinstance(value, (bool, numbers.Integral)) and value in (0, 1)
    if base == "str":
        return isinstance(value, str)
    if base.startswith(("tuple[", "list[")):  # a tuple field also takes one value (img_size=224)
        inner = base[base.index("[") + 1:].split(",")[0].rstrip("]").strip()
        items = value if isinstance(value, (list, tuple)) else (value,) if base.startswith("tuple[") else None
        return items is not None and len(items) <= 4096 and all(_fits(v, inner) for v in items)
    return True


def check_types(config: Any) -> None:
    """Every field of a model config dataclass holds a value of its declared type (ints, finite floats, booleans,
    strings, tuples of them; None only where the field allows it): a UsageError names the field otherwise. Run
    before any conversion, so that a file's or an override's wrong value is refused by name."""
    for f in dataclasses.fields(config):
        ann = f.type if isinstance(f.type, str) else str(f.type)
        value, optional = getattr(config, f.name), "None" in ann
        base = ann.replace("| None", "").replace("None |", "").strip()
        if value is None and (optional or f.default is None):
            continue
        if value is None or not _fits(value, base):
            raise UsageError(f"{type(config).__name__}.{f.name}={str(value)[:100]!r}: must be {ann}")


def check_sizes(config: Any) -> None:
    """Every size field of a model config: integers within SIZE_BOUNDS (one value or each of a tuple); every
    real-valued setting within VALUE_BOUNDS; a UsageError names the field otherwise."""
    for name, (lo, hi) in SIZE_BOUNDS.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
                raise UsageError(f"{type(config).__name__}.{name}={value!r}: must be "
                                 f"{'integers' if isinstance(value, (tuple, list)) else 'an integer'} in [{lo}, {hi}]")
    for name in ("mean", "std"):
        value = getattr(config, name, None)
        if value is not None and (not 1 <= len(value) <= 256 or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                                                        for v in value)):
            raise UsageError(f"{type(config).__name__}.{name}={value!r}: must be 1 to 256 finite numbers")
    for name, (lo, hi, brackets) in VALUE_BOUNDS.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        if not all(_in_bounds(v, lo, hi, brackets) for v in (value if isinstance(value, (tuple, list)) else (value,))):
            each = "numbers" if isinstance(value, (tuple, list)) else "a number"
            raise UsageError(f"{type(config).__name__}.{name}={value!r}: must be {each} in {brackets[0]}{lo:g}, "
                             f"{hi:g}{brackets[1]} (a value outside gives non-finite outputs or no model)")
