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

`choose(k, n, rows[, kind])` times the available ones on the problem and returns the fastest; the choice never
makes a machine slower, since plain MKL is a candidate. A path whose op is missing (a build without MKL or
oneDNN), fails or computes something else is simply not a candidate. The choices are cached in memory and in
$VITKIT_HOME/gemm/<cpu>[-caps-<ISA caps>]-<torch>-t<threads>.json, so each shape is measured once per machine (0.15 s a path).
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ...cache import cache_dir, read_json_cache, write_json_cache

PATHS = ("mkl", "mkl-packed", "onednn-packed")
WGRAD_PATHS = ("mkl", "onednn")  # the weight gradient dW = dY^T X: both operands activations, nothing to prepack
_CHOICES: dict[tuple, str] = {}
_RATES: dict[tuple, dict[str, float]] = {}
_LOADED = False
FORCE = os.environ.get("VITKIT_GEMM")  # "mkl" | "mkl-packed" | "onednn-packed": skip the measurement (tests, A/Bs)


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


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = line.split(":", 1)
                    info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """Vendor, family, model and name: what the choice of path depends on."""
    info = cpu_info()
    if not info:
        return platform.processor() or platform.machine()
    return "-".join(info.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name"))


# Environment variables that cap the instruction sets oneDNN, MKL and ATen use (`ONEDNN_MAX_CPU_ISA=AVX2` makes an
# AVX-512 machine run as an AVX2-only one): a capped process measures its own choices.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def isa_caps() -> str:
    """The instruction-set caps in force, e.g. "ONEDNN_MAX_CPU_ISA=AVX2,ATEN_CPU_CAPABILITY=avx2" ("" for none)."""
    return ",".join(f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k))


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) below which it has no bf16 dot product, and those that allow AMX
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_AMX_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16"}


def _onednn_cap() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def bf16_native() -> bool:
    """Whether oneDNN computes bf16 matmuls with the CPU's own bf16 instructions (AVX-512 BF16 or AMX) rather than
    emulating them (AVX2-only CPUs, or a cap below AVX512_CORE_BF16), where a bf16 matmul is ~10x slower."""
    flags = cpu_info().get("flags", "").split()
    has = "avx512_bf16" in flags or "amx_bf16" in flags
    return has and _onednn_cap() not in _NO_BF16_ISAS


def amx_usable() -> bool:
    """Whether oneDNN may use this CPU's AMX tiles (present, and not capped away)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()) and _onednn_cap() in _AMX_ISAS


def machine_key() -> str:
    """A file-name-safe key for measurements that hold on this machine: CPU, ISA caps, torch version, threads."""
    caps = isa_caps()
    raw = f"{cpu_name()}{'-caps-' + caps if caps else ''}-{torch.__version__}-t{torch.get_num_threads()}"
    return "".join(c if c.isalnum() or c in "-." else "_" for c in raw)


def _cache_file() -> Path:
    return cache_dir() / "gemm" / f"{machine_key()}.json"


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
    merged.update({k: {"shape": list(k), "path": p, "gflops": _RATES.get(k, {})} for k, p in _CHOICES.items()})
    write_json_cache(path, list(merged.values()), indent=1)  # a read-only home: measured again next time


def _bucket(rows: int) -> int:
    """Row counts grouped by powers of two: a choice holds for batches of the same order."""
    return 1 << max(0, (rows - 1).bit_length())


MAX_CALLS = 500  # a round of a tiny problem (calls under 0.1 ms) ends after this many calls, not at its time


def measure(k: int, n: int, rows: int, seconds: float = 0.15, rounds: int = 3, kind: str = "linear") -> dict[str, float]:
    """GFLOP/s of every available path on a problem, its packing excluded: the best of `rounds` interleaved rounds
    per path, so that a neighbour's burst of load does not decide the choice. A round lasts seconds / rounds, or
    MAX_CALLS calls where those take less (a 10-us problem is timed over 500 calls, not 5,000).
    kind "linear": y = x W^T + b with x (rows, k), W (n, k); "wgrad": dW = dY^T X with dY (rows, n), X (rows, k)."""
    from torch.utils._python_dispatch import _disable_current_modes

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
            cands = {}
            for path in PATHS:
                if available(path):
                    try:
                        cands[path] = (lambda path=path, p=pack(path, w, rows): run(path, x, p, w, b, rows))
                    except (RuntimeError, AttributeError):  # an op this build lacks, or one that refuses the shape
                        continue
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
    """The fastest path for y = x W^T + b with x (rows, k), W (n, k) (kind "linear", one of PATHS), or for its
    weight gradient dW = dY^T X (kind "wgrad", one of WGRAD_PATHS); measured once per machine, shape and thread
    count (row counts grouped by powers of two)."""
    if kind == "linear" and FORCE in PATHS and available(FORCE):
        return FORCE
    if kind == "wgrad" and FORCE in PATHS and available(FORCE):
        return "mkl" if FORCE == "mkl" else "onednn" if wgrad_available("onednn") else "mkl"
    _load()
    key = (kind, k, n, _bucket(rows), torch.get_num_threads())
    if key not in _CHOICES:
        rates = measure(k, n, _bucket(rows), kind=kind)
        _RATES[key] = rates
        _CHOICES[key] = max(rates, key=rates.get) if rates else "mkl"
        _save()
    return _CHOICES[key]


def choices() -> dict[str, dict]:
    """What was chosen in this process: {"[dW of ]k x n @ rows": {"path", "gflops": {path: rate}}}."""
    return {f"{'dW of ' if kind == 'wgrad' else ''}{k} x {n} @ {r} rows, {t} threads": {"path": p, "gflops": _RATES.get((kind, k, n, r, t), {})}
            for (kind, k, n, r, t), p in _CHOICES.items()}
