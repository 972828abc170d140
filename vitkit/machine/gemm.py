"""The fastest float32 GEMM this CPU runs, picked by measurement (and remembered per CPU model and torch version).

`F.linear` on a CPU goes to MKL, which on some CPUs runs far below the machine's peak (AMD Zen 5: its AVX2 code,
~200 GFLOP/s on 2 cores, where oneDNN reaches ~470). torch ships three paths for y = x W^T + b:

    mkl            F.linear: MKL's sgemm, the weight re-packed inside every call
    mkl-packed     torch.ops.mkl._mkl_linear on a weight packed once (_mkl_reorder_linear_weight)
    onednn-packed  torch.ops.mkldnn._linear_pointwise on a weight reordered once (_reorder_linear_weight), the
                   path Inductor's freezing uses

and two for a training step's weight gradient dW = dY^T X, whose operands are both activations (nothing to pack):

    mkl            torch.mm
    onednn         oneDNN's GEMM called as a linear layer on the transposed views (it reads the strides)

A training step repacks each weight after every update, so its choice (kinds "train" for the forward, "train-t" for
the input gradient dX = dY W, whose weight W^T is copied before it is packed) times each path with its packing in
every call: a packed path trains only where it wins more than its packing costs.

`choose(k, n, rows[, kind])` times the available ones on the problem and returns the fastest; the choice never
makes a machine slower, since plain MKL is a candidate. A path whose op is missing (a build without MKL or
oneDNN), fails or computes something else is simply not a candidate. The choices are cached in memory and in
$VITKIT_HOME/gemm/<cpu>[-caps-<ISA caps>]-<torch>-t<threads>.json, so each shape is measured once per machine (0.15 s a path).
A choice measured while other processes used the CPU (`threads.LoadWatch`) holds for this process only: it is not
written there, and one line says so.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from .. import env
from ..cache import cache_dir, read_json_cache, write_json_cache
from . import cpu
from . import threads as thread_policy
from .device import sync

log = logging.getLogger(__name__)

PATHS = ("mkl", "mkl-packed", "onednn-packed")
LINEAR_KINDS = ("linear", "train", "train-t")  # y = x W^T + b: inference, a training forward, a training dX = dY W
WGRAD_PATHS = ("mkl", "onednn")  # the weight gradient dW = dY^T X: both operands activations, nothing to prepack
_CHOICES: dict[tuple, str] = {}
_RATES: dict[tuple, dict[str, float]] = {}
_LOADED = False
_UNSAVED: set[tuple] = set()  # choices measured under load: this process's only
# "mkl" | "mkl-packed" | "onednn-packed": skip the measurement (tests, A/Bs); None: measure; FROM_ENV (the default):
# VITKIT_GEMM's value when `choose` runs (`vitkit.env`). Tests set this attribute; any other value is refused by name.
FROM_ENV = "from VITKIT_GEMM"
FORCE: str | None = FROM_ENV


def forced() -> str | None:
    """The path FORCE (or VITKIT_GEMM) forces, or None; a value that is not one of PATHS is a UsageError."""
    if FORCE == FROM_ENV:
        return env.get("VITKIT_GEMM")
    return None if FORCE is None else env.parse("VITKIT_GEMM", str(FORCE))


def available(path: str) -> bool:
    if path == "mkl":
        return True
    if path == "mkl-packed":
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")
    if path == "onednn-packed":
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return False


def wgrad_available(path: str) -> bool:
    if path == "onednn":
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return path == "mkl"


def wgrad(path: str, gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = gy^T x, (n, rows) @ (rows, k) -> (n, k), on `path`: "mkl" is `torch.mm`; "onednn" is oneDNN's GEMM
    called as a linear layer with input gy^T and weight x^T (transposed views: oneDNN reads the strides)."""
    if path == "onednn":
        return torch.ops.mkldnn._linear_pointwise(gy.t(), x.t(), None, "none", [], "")
    return gy.t().mm(x)


def pack(path: str, w: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The weight (n, k) in the path's own layout (None for plain MKL)."""
    if path == "mkl-packed":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    if path == "onednn-packed":
        return torch.ops.mkldnn._reorder_linear_weight(w, rows)
    return None


def run(path: str, x: torch.Tensor, packed: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """x (..., k) -> (..., n) on `path` with its packed weight."""
    if path == "mkl-packed":
        return torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
    if path == "onednn-packed":
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return F.linear(x, w, b)


def _cache_file() -> Path:
    return cache_dir() / "gemm" / f"{cpu.machine_key()}.json"


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    try:
        for row in read_json_cache(_cache_file(), []):
            key = tuple(row["shape"])
            if len(key) == 5:  # (kind, k, n, rows, threads); anything else is from another version: measured again
                _CHOICES[key], _RATES[key] = row["path"], row["gflops"]
    except (KeyError, TypeError):
        pass


def _save() -> None:
    path = _cache_file()
    merged: dict[tuple, dict] = {}
    try:  # another process may have measured other shapes since this one read the file: keep them
        for row in read_json_cache(path, []):
            if len(row["shape"]) == 5:
                merged[tuple(row["shape"])] = row
    except (KeyError, TypeError):
        pass
    merged.update({k: {"shape": list(k), "path": p, "gflops": _RATES.get(k, {})} for k, p in _CHOICES.items()
                   if k not in _UNSAVED})
    write_json_cache(path, list(merged.values()), indent=1)  # a read-only home: measured again next time


def _bucket(rows: int) -> int:
    """Row counts grouped by powers of two: a choice holds for batches of the same order."""
    return 1 << max(0, (rows - 1).bit_length())


MAX_CALLS = 500  # a round of a tiny problem (calls under 0.1 ms) ends after this many calls, not at its time


def measure(k: int, n: int, rows: int, seconds: float = 0.15, rounds: int = 3, kind: str = "linear") -> dict[str, float]:
    """GFLOP/s of every available path on a problem: the best of `rounds` interleaved rounds per path, so that a
    neighbour's burst of load does not decide the choice. A round lasts seconds / rounds, or MAX_CALLS calls where
    those take less (a 10-us problem is timed over 500 calls, not 5,000).
    kind "linear": y = x W^T + b with x (rows, k), W (n, k), its packing excluded; "train": the same with W packed
    again in every call (a training step's forward); "train-t": the same with W a transposed view, copied and
    packed in every call (a training step's dX = dY W); "wgrad": dW = dY^T X with dY (rows, n), X (rows, k)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    # a FLOP counter or any other dispatch mode around the first call must not see (or count) the measurement
    with _disable_current_modes(), torch.no_grad():
        if kind == "wgrad":
            gy = torch.randn(rows, n, generator=g)
            ref = gy.t().mm(x)
            cands = {p: (lambda p=p: wgrad(p, gy, x)) for p in WGRAD_PATHS if wgrad_available(p)}
        else:
            ref = F.linear(x, w, b)
            src = w.t().contiguous().t() if kind == "train-t" else w  # train-t: W^T's storage, read transposed
            cands = {}
            for path in PATHS:
                if available(path):
                    try:
                        p = pack(path, src.contiguous(), rows)
                    except (RuntimeError, AttributeError):  # an op this build lacks, or one that refuses the shape
                        continue
                    if kind == "linear":
                        cands[path] = (lambda path=path, p=p: run(path, x, p, w, b, rows))
                    else:  # the packing (and train-t's copy) in every call, as a step repacks after each update
                        cands[path] = (lambda path=path: run(path, x, pack(path, src.contiguous(), rows), src, b, rows))
        for path, fn in cands.items():
            try:
                if (fn() - ref).abs().max() > 1e-3 * ref.abs().max():
                    continue  # a path that computes something else is no candidate
            except (RuntimeError, AttributeError):
                continue
            calls[path] = fn
        best = {path: 0.0 for path in calls}
        for _ in range(rounds):
            for path, fn in calls.items():
                done, t0 = 0, time.perf_counter()
                while done < 2 or (time.perf_counter() - t0 < seconds / rounds and done < MAX_CALLS):
                    fn()
                    done += 1
                best[path] = max(best[path], 2 * rows * k * n * done / (time.perf_counter() - t0) / 1e9)
    return best


def choose(k: int, n: int, rows: int, kind: str = "linear") -> str:
    """The fastest path for y = x W^T + b with x (rows, k), W (n, k) (kind "linear", one of PATHS; "train" and
    "train-t" count a training step's repacking, see `measure`), or for its weight gradient dW = dY^T X (kind
    "wgrad", one of WGRAD_PATHS); measured once per machine, shape and thread
    count (row counts grouped by powers of two), or once per process where the CPU was busy meanwhile."""
    force = forced()
    if kind in LINEAR_KINDS and force in PATHS and available(force):
        return force
    if kind == "wgrad" and force in PATHS and available(force):
        return "mkl" if force == "mkl" else "onednn" if wgrad_available("onednn") else "mkl"
    _load()
    key = (kind, k, n, _bucket(rows), torch.get_num_threads())
    if key not in _CHOICES:
        watch = thread_policy.LoadWatch()
        with watch.window():
            rates = measure(k, n, _bucket(rows), kind=kind)
        _RATES[key] = rates
        _CHOICES[key] = max(rates, key=rates.get) if rates else "mkl"
        if watch.busy:
            if not _UNSAVED:
                log.info(watch.note("the GEMM path per layer shape"))
            _UNSAVED.add(key)
        else:
            _save()
    return _CHOICES[key]


def choices() -> dict[str, dict]:
    """What was chosen in this process: {"[dW of |training |training dX, ]k x n @ rows": {"path", "gflops": {path:
    rate}}}."""
    label = {"wgrad": "dW of ", "train": "training ", "train-t": "training dX, "}
    return {f"{label.get(kind, '')}{k} x {n} @ {r} rows, {t} threads": {"path": p, "gflops": _RATES.get((kind, k, n, r, t), {})}
            for (kind, k, n, r, t), p in _CHOICES.items()}


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



def gemm_rates(dtype: str = "fp32", device: str | torch.device = "cpu", n: int | None = None,
               seconds: float = 1.5) -> dict[str, float]:
    """FLOP/s of every GEMM path this device has for an n x n x n product in `dtype`, best of several runs each.

    fp32 on a CPU: `torch.mm` (MKL) and the packed paths `choose` picks among (MKL packed,
    oneDNN packed); which is fastest depends on the CPU (on AMD Zen 5 oneDNN's runs ~2.3x MKL's). bf16/fp16 on a
    CPU: `torch.mm` (oneDNN there) and oneDNN with a packed weight. On a GPU: `torch.mm`."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    dt = _DTYPES[dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dt)
    b = torch.randn(n, n, generator=g).to(device, dt)
    calls = {"torch.mm": lambda: a @ b}
    if device.type == "cpu":
        wt = b.t().contiguous()  # y = a @ b as a linear layer with weight b^T
        for path in ("mkl-packed", "onednn-packed") if dtype == "fp32" else ("onednn-packed",):
            if not available(path):
                continue
            try:
                packed = pack(path, wt, n)
                fn = (lambda p=packed, path=path: run(path, a, p, wt, None, n))  # noqa: E731 - binds this path
                fn()
            except (RuntimeError, AttributeError):
                continue
            calls[path] = fn
    rates = {}
    with torch.no_grad():
        for name, fn in calls.items():
            fn()
            sync(device)
            best, t_end = 0.0, time.perf_counter() + seconds / len(calls)
            while time.perf_counter() < t_end:
                t = time.perf_counter()
                fn()
                sync(device)
                best = max(best, 2 * n**3 / (time.perf_counter() - t))
            rates[name] = best
    return rates


def matmul_peak(dtype: str = "fp32", device: str | torch.device = "cpu", n: int | None = None, seconds: float = 1.5) -> float:
    """This device's matmul FLOP/s in `dtype`: the fastest GEMM path it has (`gemm_rates`), not `torch.mm`'s alone."""
    return max(gemm_rates(dtype, device, n, seconds).values())
