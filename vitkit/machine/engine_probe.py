"""Exported models compiled for this CPU, and their timing: onnxruntime (fp32) and OpenVINO (f32 or bf16, the
precision hint read back). Standalone on purpose: `--backend auto` runs this file as a child process
(`python engine_probe.py BACKEND PRECISION MODEL.onnx DIR THREADS`) to measure an engine without importing torch or
vitkit there (faster to start), and so that an engine that crashes takes down only the child."""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

MIN_ROUND_S = 0.1  # a timed round repeats the call until it lasts this long (ROUNDS of them: the median counts)


class EngineError(RuntimeError):
    """The engine cannot run the model as asked (another precision than the one compiled for)."""


_OV_CORE = None
_OV_CORE_LOCK = threading.Lock()


def import_onnxruntime():
    """The `onnxruntime` module, imported with its telemetry off: onnxruntime 1.32 on Linux writes a device id and a
    database under ~/.cache/Microsoft/DeveloperTools/ at import and has a telemetry client (Microsoft's 1DS
    collector) unless ORT_DISABLE_TELEMETRY is set. vitkit sets it (where the environment does not already) before
    the first import; the child processes vitkit starts inherit it. Raises ImportError where it is not installed."""
    if "onnxruntime" not in sys.modules:
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    import onnxruntime  # optional: the [deploy] extra

    return onnxruntime


def import_openvino():
    """The `openvino` module, imported with its usage telemetry off.

    `import openvino` starts its converter tools' telemetry (the `openvino_telemetry` package, installed with it):
    a Google Analytics event at every import, sent from a forked process, and a client id and counters written to
    ~/intel/, unless the user ran `opt_in_out --opt_out`. Where that package cannot be imported, OpenVINO falls
    back to a stub of its own that does nothing; so before OpenVINO's first import in a process vitkit marks the
    package as absent (`sys.modules["openvino_telemetry"] = None`) for that process. Where the program imported
    OpenVINO or its telemetry before vitkit did, that import has already happened and this changes nothing.
    Raises ImportError where OpenVINO is not installed."""
    if "openvino" not in sys.modules:
        sys.modules.setdefault("openvino_telemetry", None)
    import openvino  # optional: the [openvino] extra

    return openvino


def openvino_core():
    """The process's one OpenVINO Core: made on first use, kept until the process exits.

    Never a Core per call. OpenVINO's CPU plugin (2026.4, `ov::intel_cpu::SigAltStackSetup`) gives the thread that
    creates it an alternate signal stack of its own (big enough for AMX state), and unmaps that stack when the plugin
    is freed, putting the previous one back only if its own is still current on the freeing thread. Two Cores freed
    in the order they were made, or one freed on another thread, leave the creating thread (here the main thread)
    with an alternate stack in unmapped memory. The next signal handled there on that stack (every Python handler:
    the SIGCHLD handler torch's DataLoader installs, SIGINT, SIGTERM; faulthandler's SIGSEGV) then kills the process
    with SIGSEGV (si_code SI_KERNEL, address 0) and no traceback. One Core that lives as long as the process frees
    no plugin before exit (benchmarks/NOTES.md section 32; tests/test_deploy.py reproduces the sequence)."""
    global _OV_CORE
    with _OV_CORE_LOCK:
        if _OV_CORE is None:
            _OV_CORE = import_openvino().Core()
        return _OV_CORE


def openvino_compile(path: str | Path, precision: str = "fp32", threads: int | None = None):
    """A model file (IR .xml or .onnx) compiled by OpenVINO for the CPU with INFERENCE_PRECISION_HINT f32 or bf16,
    the hint read back (the CPU plugin computes in bf16 by default where the CPU has it): a CompiledModel, called as
    model(x)."""
    want = {"fp32": "f32", "bf16": "bf16"}[precision]
    cfg = {"INFERENCE_PRECISION_HINT": want, **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    compiled = openvino_core().compile_model(str(path), "CPU", cfg)
    got = compiled.get_property("INFERENCE_PRECISION_HINT")
    got = got.get_type_name() if hasattr(got, "get_type_name") else str(got)
    if got != want:
        raise EngineError(f"OpenVINO compiled {path} for {got}, not the {want} asked for")
    return compiled


def compile_engine(backend: str, precision: str, path: str | Path, threads: int | None = None
                   ) -> Callable[[np.ndarray], np.ndarray]:
    """onnxruntime (fp32) or OpenVINO (fp32 or bf16) running the model file: (B, C, H, W) float32 -> logits."""
    if backend == "onnx":
        ort = import_onnxruntime()  # optional: the [deploy] extra

        if precision != "fp32":
            raise EngineError(f"the onnx backend computes in fp32, not {precision}")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return lambda x: sess.run(None, {name: x})[0]
    if backend == "openvino":
        compiled = openvino_compile(path, precision, threads)
        return lambda x: compiled(x)[0]
    raise EngineError(f"no exported engine {backend!r}")


ROUNDS = 5  # timed rounds after the warm-up (3 when one call takes over SLOW_CALL_S)
SLOW_CALL_S = 0.5


def rounds_for(seconds_per_call: float, rounds: int = ROUNDS) -> int:
    """How many timed rounds a call of this length gets: `rounds`, or 3 for a slow call (a round is then one call)."""
    return rounds if seconds_per_call <= SLOW_CALL_S else min(rounds, 3)


def interleaved_rounds(fns: dict[str, Callable[[], object]], rounds: int = ROUNDS, min_round_s: float = MIN_ROUND_S,
                       sync: Callable[[], None] = lambda: None, warm: bool = True) -> dict[str, list[float]]:
    """Seconds per call of each function, round by round: a warm-up call each (unless `warm` is False: the caller
    made them), one more that sizes the rounds, then `rounds` rounds (fewer for a slow call: `rounds_for`) in which
    every function runs in turn, the order reversed every other round (AB BA AB ...: a machine growing busier or
    quieter weighs on all alike), each repeating its call until it lasts `min_round_s`. One timing is noise on a
    busy machine: compare the rounds one by one (the median of per-round ratios)."""
    def clock(fn: Callable[[], object], calls: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls

    if warm:
        for fn in fns.values():  # the first calls carry one-time costs (GEMM choices, packing, kernels)
            clock(fn, 1)
    once = {name: clock(fn, 1) for name, fn in fns.items()}
    calls = {name: max(1, math.ceil(min_round_s / max(t, 1e-6))) for name, t in once.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds_for(max(once.values()), rounds)):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(clock(fns[name], calls[name]))
    return times


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def timed_rate(fn: Callable[[], object], batch: int, min_round_s: float = MIN_ROUND_S) -> float:
    """Images per second of `fn` (one call = `batch` images): warm-up calls, then the median of ROUNDS rounds (3 when a
    call takes over SLOW_CALL_S), each repeating the call until it lasts `min_round_s` (`interleaved_rounds`)."""
    return batch / median(interleaved_rounds({"fn": fn}, min_round_s=min_round_s)["fn"])


def main(argv: list[str]) -> None:
    """BACKEND PRECISION MODEL.onnx DIR THREADS: reads DIR/x.npy, writes DIR/y.npy (the logits) and DIR/rate.json."""
    backend, precision, path, d, threads = argv
    x = np.load(Path(d) / "x.npy", allow_pickle=False)
    fn = compile_engine(backend, precision, path, int(threads))
    y = fn(x)
    rate = timed_rate(lambda: fn(x), len(x))
    np.save(Path(d) / "y.npy", y)
    (Path(d) / "rate.json").write_text(json.dumps({"rate": rate}))


if __name__ == "__main__":
    main(sys.argv[1:])
