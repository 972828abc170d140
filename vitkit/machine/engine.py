"""Which engine runs inference here: eager PyTorch (fp32 or bf16), vitkit's compiled engine (AOTInductor, fp32 or
bf16), ONNX Runtime, or OpenVINO (fp32 or bf16).

No engine is fastest everywhere: on a CPU with bf16 instructions a bf16 engine wins, on an AVX2-only CPU bf16 is
emulated and an fp32 engine wins, and which one depends on the CPU and the model.
`choose(model, batch)` (`--backend auto`) measures every candidate installed on this machine for this model and batch:

    torch-fp32     eager, Linears on the packed fast GEMM (`vitkit.machine.gemm`)
    torch-bf16     eager, bf16 autocast, each weight cast and packed once
    aoti-fp32      vitkit's compiled engine: the model compiled once for this CPU by AOTInductor (`vitkit.machine.aoti`)
    aoti-bf16      the same under bf16 autocast, bf16 weights folded in (only where the CPU has bf16 instructions)
    onnx-fp32      onnxruntime on vitkit's ONNX export (`vitkit[deploy]`)
    openvino-fp32  OpenVINO's CPU plugin on the same file, INFERENCE_PRECISION_HINT f32 read back (`vitkit[openvino]`)
    openvino-bf16  the same with the hint bf16 (only where the plugin keeps it: a CPU with bf16 instructions)

On one calibration batch (the model's own normalisation of seeded random pixels) each candidate's logits are compared
with fp32 eager's: a candidate whose max |difference| exceeds TOLERANCE x max |fp32 logit| (+ 1e-3) is dropped, so a
backend that is fast but wrong is never picked. The fastest of the rest wins, except that a candidate earlier in the
list above (simpler: no export, explanations, fp32) is kept when the winner beats it by less than MARGIN. ONNX Runtime
and OpenVINO are measured in a child process (a crash there, as OpenVINO's under some ISA caps, drops the candidate
instead of the caller); the compiled engine, torch's own, in this one, interleaved with eager. Every engine is timed the same way (`engine_probe.interleaved_rounds`): warm-up calls, then five
rounds (three for a call over half a second), each repeating the call until it lasts MIN_ROUND_S, the median round
its rate; torch-fp32 and torch-bf16 in the same rounds, interleaved, and torch-bf16 kept only where it is clearly
the faster (`vitkit.machine.precision.decide`: a median per-round speed-up of BF16_MARGIN, the faster in most rounds). On a
CPU without native bf16 the bf16 engines are not timed unless bf16 is asked for by name. Eager runs at the thread count
the load allows (`vitkit.machine.threads`); a measurement during which other processes used the CPU decides for this
run only, uncached, and an exported engine that wins it must beat eager again side by side in this process
(`side_by_side`). The measurements are cached per machine (CPU, ISA caps, torch, threads), installed engine
versions, model weights and batch in $VITKIT_HOME/backends/<machine>.json, and the ONNX export and the compiled
packages (made by the `export` function the caller hands in: `vitkit.inference.backends.export_for`) in
$VITKIT_HOME/backends/exports/, so each model is measured, exported and compiled once per machine.
"""
from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..cache import cache_dir, read_json_cache, write_json_cache
from ..errors import CheckpointError, UsageError
from ..safety import untrusted
from . import aoti, cpu, engine_probe
from . import threads as thread_policy
from . import precision as probe  # called through the module: tests patch probe.bf16_support
from .fast_linear import pack_linears

log = logging.getLogger(__name__)

# how an engine gets the model as a file: (model, weights digest or None, what, batch) -> the file, where `what` is
# "onnx" (the ONNX export ONNX Runtime and OpenVINO run) or "aoti-fp32" / "aoti-bf16" (a compiled package, laid out
# for calls of about `batch` images; vitkit.inference.backends)
Exporter = Callable[[nn.Module, "str | None", str, int], Path]

BACKENDS = ("auto", "torch", "aoti", "onnx", "openvino")
CANDIDATES = ("torch-fp32", "torch-bf16", "aoti-fp32", "aoti-bf16", "onnx-fp32", "openvino-fp32",
              "openvino-bf16")  # simplest first
TOLERANCE = 0.05  # max |logit - fp32 eager logit| <= TOLERANCE * max |fp32 logit| + ATOL on the calibration batch
ATOL = 1e-3
MARGIN = 1.05  # a later candidate must be this much faster than an earlier one to be preferred
PROBE_BATCH = 32  # the most images a measured call takes (larger batches run in chunks of the measured size)
CACHE_VERSION = 3  # 2: rounds interleaved and medians, bf16 kept only where clearly faster and native; 3: aoti


class _Named:
    """`name` is "<backend>-<precision>", as in CANDIDATES."""

    name: str

    @property
    def backend(self) -> str:
        return self.name.split("-")[0]

    @property
    def precision(self) -> str:
        return self.name.split("-")[1]


@dataclass
class Candidate(_Named):
    """One engine's measurement: `rate` img/s at `batch`, `error` its max |logit - fp32 eager| relative to the largest
    fp32 logit; `skipped` why it is not a candidate (not installed, failed, outside the tolerance)."""

    name: str
    rate: float = 0.0
    error: float | None = None
    skipped: str = ""


@dataclass
class BackendChoice(_Named):
    """The engine inference runs on and why: `name` (a CANDIDATES entry), one line of `reason`, every candidate's
    measurement in `table`, and for onnx/openvino the exported file."""

    name: str
    reason: str
    table: list[Candidate] = field(default_factory=list)
    batch: int = 1
    export: Path | None = None

    def format_table(self) -> str:
        fp32 = next((c.rate for c in self.table if c.name == "torch-fp32" and c.rate), 0.0)
        lines = [f"{'backend':<15} {'img/s':>8} {'vs torch-fp32':>13} {'max rel diff':>12}  note"]
        for c in self.table:
            rate = f"{c.rate:8.2f}" if c.rate else f"{'-':>8}"
            rel = f"{c.rate / fp32:12.2f}x" if c.rate and fp32 else f"{'-':>13}"
            err = f"{c.error:12.2e}" if c.error is not None else f"{'-':>12}"
            note = "chosen" if c.name == self.name else c.skipped
            lines.append(f"{c.name:<15} {rate} {rel} {err}  {note}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"choice": self.name, "reason": self.reason, "batch": self.batch,
                "table": [{"name": c.name, "img_per_s": c.rate, "max_rel_diff": c.error, "skipped": c.skipped}
                          for c in self.table]}


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    return backend


def installed(backend: str) -> str | None:
    """The version of an optional engine, or None when it is not installed (aoti: torch's, where a C++ compiler is
    at hand for Inductor)."""
    if backend == "aoti":
        return torch.__version__ if aoti.compiler() else None
    try:
        if backend == "onnx":
            import onnx
            import onnxscript

            from .engine_probe import import_onnxruntime  # optional: the [deploy] extra

            return import_onnxruntime().__version__
        if backend == "openvino":
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401
            from .engine_probe import import_openvino  # optional: the [openvino] extra

            return import_openvino().get_version()
    except ImportError:
        return None
    return torch.__version__


def weights_digest(model: nn.Module) -> str:
    """A digest of the model's architecture and every weight: measurements and exports are per model."""
    h = hashlib.blake2b(digest_size=16)
    cfg = getattr(model, "config", None)
    h.update(json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else str(cfg), sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def calibration_batch(model: nn.Module, batch: int) -> np.ndarray:
    """`batch` images of seeded uniform random pixels in [0, 1], normalised with the model's own mean and std."""
    c = model.config
    g = np.random.default_rng(0)
    x = g.random((batch, c.in_chans, *c.img_size), dtype=np.float32)
    mean = np.asarray(c.mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(c.std, np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((x - mean) / std, dtype=np.float32)


def rel_diff(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-12))


def within(y: np.ndarray, ref: np.ndarray, tolerance: float) -> bool:
    return bool(np.isfinite(y).all()) and float(np.abs(y.astype(np.float64) - ref).max()) <= \
        tolerance * float(np.abs(ref).max()) + ATOL


# ---------------------------------------------------------------------------------------------------- runners


def engine(backend: str, precision: str, path: str | Path, threads: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """An exported model compiled for this CPU: onnxruntime (fp32) or OpenVINO (fp32 or bf16, the hint read back),
    as a function (B, C, H, W) float32 -> logits."""
    try:
        return engine_probe.compile_engine(backend, precision, path, threads)
    except engine_probe.EngineError as e:
        raise UsageError(str(e)) from e


def torch_runner(model: nn.Module, precision: str) -> Callable[[np.ndarray], np.ndarray]:
    """Eager inference in `precision` on the CPU's fastest GEMM (weights packed once; bf16: cast once too)."""
    device = next(model.parameters()).device
    model.eval()
    pack_linears(model, enable=precision in ("fp32", "bf16"))

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode(), probe.autocast(precision, device):
            return model(torch.from_numpy(x).to(device)).float().cpu().numpy()

    return run


def aoti_runner(path: str | Path) -> Callable[[np.ndarray], np.ndarray]:
    """A compiled package (`vitkit.machine.aoti`) as a function (B, C, H, W) float32 -> logits: one this machine's
    vitkit compiled (the engine's own cache), through `aoti.load_package`'s checks; no opt-in here."""
    with untrusted(str(path), CheckpointError):
        run, _ = aoti.load_package(path)
    return lambda x: run(torch.from_numpy(x)).numpy()


def chunked(fn: Callable[[np.ndarray], np.ndarray], batch: int) -> Callable[[np.ndarray], np.ndarray]:
    """`fn` on at most `batch` images per call (the batch it was measured at; bounds an engine's memory)."""
    def run(x: np.ndarray) -> np.ndarray:
        if len(x) <= batch:
            return fn(np.ascontiguousarray(x, dtype=np.float32))
        return np.concatenate([fn(np.ascontiguousarray(x[i:i + batch], dtype=np.float32)) for i in range(0, len(x), batch)])
    return run


# ---------------------------------------------------------------------------------------------------- measuring


def _probe_child(backend: str, precision: str, path: Path, x: np.ndarray, threads: int, timeout: float) -> tuple[float, np.ndarray]:
    """Rate and calibration logits of an exported engine, measured in a child process."""
    with tempfile.TemporaryDirectory(prefix="vitkit-probe-") as d:
        np.save(Path(d) / "x.npy", x)
        cmd = [sys.executable, engine_probe.__file__, backend, precision, str(path), d, str(threads)]  # no torch there
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"no answer in {timeout:.0f} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1][:200]
            raise RuntimeError(f"exit status {r.returncode}{' (crashed: signal ' + str(-r.returncode) + ')' if r.returncode < 0 else ''}"
                               f"{': ' + last if last else ''}")
        rate = json.loads((Path(d) / "rate.json").read_text())["rate"]
        return float(rate), np.load(Path(d) / "y.npy", allow_pickle=False)


def measure(model: nn.Module, batch: int, *, threads: int | None = None, tolerance: float = TOLERANCE,
            candidates: tuple[str, ...] = CANDIDATES, digest: str | None = None, log=None,
            force_bf16: bool = False, export: Exporter | None = None,
            watch: thread_policy.LoadWatch | None = None) -> list[Candidate]:
    """Every candidate's img/s at `batch` and its difference from fp32 eager on the calibration batch.

    The in-process candidates (torch-fp32, torch-bf16, the compiled aoti-fp32 and aoti-bf16) are timed together, in
    interleaved rounds (`engine_probe.interleaved_rounds`), and torch-bf16 stays a candidate only where
    `precision.decide` finds it clearly faster than torch-fp32 (the median per-round speed-up at least
    precision.BF16_MARGIN, the faster in most rounds). On a CPU without native bf16 (`precision.bf16_support`) the
    bf16 candidates are not timed (nor compiled; torch-bf16's logits are still compared), unless `force_bf16` (bf16
    asked for by name). The in-process candidates run at torch's thread count; ONNX Runtime and OpenVINO, which keep
    their own pools, at `threads` or the count torch had before any governor lowered it (`threads.ceiling`), as they
    will run. `watch` (a `threads.LoadWatch`) is handed every timed stretch: what other processes used meanwhile."""
    pool = threads or thread_policy.ceiling()
    watch = watch or thread_policy.LoadWatch()
    x = calibration_batch(model, batch)
    table = [Candidate(n) for n in CANDIDATES if n in candidates]
    ref: np.ndarray | None = None
    onnx_file: Path | None = None
    say = log or (lambda s: None)
    was_training = model.training
    native, why = probe.bf16_support()
    emulated = native is False and not force_bf16
    inproc: dict[str, Callable[[], np.ndarray]] = {}  # torch and aoti candidates, timed together after the loop
    try:
        for c in table:
            try:
                if c.backend == "torch":
                    run = torch_runner(model, c.precision)
                    with torch.random.fork_rng():
                        y = run(x)
                    inproc[c.name] = lambda run=run: run(x)
                elif emulated and c.precision == "bf16":
                    c.skipped = f"not measured: {why} (bf16 would be emulated)"
                    continue
                elif installed(c.backend) is None:
                    c.skipped = (f"not installed: {aoti.NO_COMPILER}"
                                 if c.backend == "aoti" else
                                 f"not installed (pip install 'vitkit[{'deploy' if c.backend == 'onnx' else 'openvino'}]')")
                    continue
                elif export is None:
                    c.skipped = "not measured: no exporter given"
                    continue
                elif c.backend == "aoti":
                    say(f"compiling the model with AOTInductor for {c.name} (once per model and machine) ...")
                    run = aoti_runner(export(model, digest, c.name, batch))
                    y = run(x)
                    inproc[c.name] = lambda run=run: run(x)
                else:
                    if onnx_file is None:
                        say("exporting to ONNX for the onnx and openvino candidates (once per model) ...")
                        onnx_file = export(model, digest, "onnx", batch)
                    with watch.window():
                        c.rate, y = _probe_child(c.backend, c.precision, onnx_file, x, pool, timeout=600)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is not a candidate
                c.rate, c.skipped = 0.0, f"failed: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"
                inproc.pop(c.name, None)
                continue
            if c.name == "torch-fp32":
                ref = y.astype(np.float64)
            if ref is None:
                c.skipped = "no fp32 eager reference"
                inproc.pop(c.name, None)
                continue
            c.error = rel_diff(y, ref)
            if not within(y, ref, tolerance):
                c.skipped = f"outside the tolerance ({c.error:.2g} > {tolerance:g} of the largest fp32 logit)"
                inproc.pop(c.name, None)
            elif c.name == "torch-bf16" and emulated:
                c.skipped = f"not timed: {why} (bf16 would be emulated)"
                inproc.pop(c.name, None)
            if c.backend in ("onnx", "openvino") or (c.backend == "aoti" and c.name not in inproc):
                say(f"  {c.name}: {c.rate:.2f} img/s, max rel diff {c.error:.2g}{' (' + c.skipped + ')' if c.skipped else ''}")
        rounds: dict[str, list[float]] = {}
        with torch.random.fork_rng():
            try:
                with watch.window():
                    rounds = engine_probe.interleaved_rounds(inproc) if inproc else {}
            except Exception as e:  # noqa: BLE001 - a candidate that fails while timed is not a candidate
                for c in table:
                    if c.name in inproc:
                        c.skipped = f"failed: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"
        for c in table:
            if c.name in rounds:
                c.rate = batch / engine_probe.median(rounds[c.name])
        if "torch-fp32" in rounds and "torch-bf16" in rounds:
            verdict, v = probe.decide(rounds["torch-fp32"], rounds["torch-bf16"])
            if verdict == "fp32":
                bf16 = next(c for c in table if c.name == "torch-bf16")
                bf16.skipped = (f"not clearly faster than torch-fp32 ({v['ratio']:.2f}x, median of {v['rounds']} "
                                f"interleaved rounds, the faster in {v['wins']}; needs {probe.BF16_MARGIN:.2f}x in {v['need']})")
        for c in table:
            if c.name in inproc or (c.backend == "torch" and c.error is not None):
                say(f"  {c.name}: {c.rate:.2f} img/s, max rel diff {c.error:.2g}{' (' + c.skipped + ')' if c.skipped else ''}")
    finally:
        pack_linears(model, enable=False)
        model.train(was_training)
    return table


def pick(table: list[Candidate]) -> tuple[str, str]:
    """The winner among the kept candidates and the reason, in one line."""
    kept = [c for c in table if c.rate and not c.skipped]
    if not kept:
        return "torch-fp32", "no candidate ran within the tolerance: torch-fp32"
    best = max(kept, key=lambda c: c.rate)
    chosen = next(c for c in kept if c.rate * MARGIN >= best.rate)  # the simplest within the margin of the fastest
    runner_up = max((c for c in kept if c is not chosen), key=lambda c: c.rate, default=None)
    why = f"{chosen.rate:.1f} img/s"
    if chosen is not best:
        why += f", within {MARGIN - 1:.0%} of {best.name}'s {best.rate:.1f} and simpler"
    elif runner_up is not None:
        why += f", {chosen.rate / runner_up.rate:.2f}x the next ({runner_up.name}, {runner_up.rate:.1f})"
    dropped = [c.name for c in table if c.skipped.startswith("outside")]
    if dropped:
        why += f"; outside the tolerance: {', '.join(dropped)}"
    return chosen.name, why


def choose(model: nn.Module, batch: int, *, threads: int | None = None, tolerance: float = TOLERANCE,
           candidates: tuple[str, ...] = CANDIDATES, refresh: bool = False, log=None,
           force_bf16: bool = False, export: Exporter) -> BackendChoice:
    """The fastest engine within `tolerance` of fp32 eager for `model` at `batch` on this machine (measured once per
    machine, engine versions, weights and batch, then read from the cache). Without `threads`, at the thread count
    the load allows now (`threads.settle`: every thread on a quiet machine). A measurement during which other
    processes used the CPU (`threads.LoadWatch`) decides for this run only: it is not cached, and a line says so;
    an exported engine that wins it is then timed again beside eager (`side_by_side`), never picked if slower."""
    pb = max(1, min(batch, PROBE_BATCH))
    given, threads = threads, threads or thread_policy.settle()
    digest = weights_digest(model)
    versions = {b: installed(b) for b in ("torch", "aoti", "onnx", "openvino")}
    key = json.dumps([CACHE_VERSION, digest, pb, threads, tolerance, sorted(candidates), versions]
                     + (["bf16 forced"] if force_bf16 else []), sort_keys=True)
    cache = cache_dir() / "backends" / f"{cpu.machine_key()}.json"
    known = _load(cache)
    cached = key in known and not refresh
    if cached:
        table = [Candidate(**row) for row in known[key]]
    watch = thread_policy.LoadWatch()
    if not cached:
        table = measure(model, pb, threads=given, tolerance=tolerance, candidates=candidates, digest=digest, log=log,
                        force_bf16=force_bf16, export=export, watch=watch)
        if watch.busy:
            (log or thread_policy.log.warning)(watch.note("--backend auto's engines"))
        else:
            known[key] = [vars(c) for c in table]
            write_json_cache(cache, known, indent=1, sort_keys=True)
    name, why = pick(table)
    if watch.busy and name.split("-")[0] in ("onnx", "openvino") and export is not None:
        name, why = side_by_side(model, table, name, why, pb, given, lambda: export(model, digest, "onnx", pb))
    when = ", measured earlier" if cached else ", measured under load: this run only" if watch.busy else ""
    reason = f"auto -> {name}: {why} (batch {pb}, {threads} threads, {cpu.cpu_model()}{when})"
    path = None
    if export is not None and not name.startswith("torch"):
        path = export(model, digest, name if name.startswith("aoti") else "onnx", pb)
    return BackendChoice(name, reason, table, pb, path)


def side_by_side(model: nn.Module, table: list[Candidate], name: str, why: str, batch: int, threads: int | None,
                 exported: Callable[[], Path]) -> tuple[str, str]:
    """`pick`'s winner `name`, an engine measured in a child process, timed again in this one interleaved with the
    fastest eager candidate (`engine_probe.interleaved_rounds`), as it would run: measured under load, the child's
    rounds and eager's came at other moments, and the winner is kept only where it is faster side by side (the
    median of per-round ratios). Returns (the engine, the reason); the winner unchanged where either cannot run."""
    eager = max((c for c in table if c.backend == "torch" and c.rate and not c.skipped), key=lambda c: c.rate,
                default=None)
    if eager is None:
        return name, why
    x = calibration_batch(model, batch)
    was_training = model.training
    try:
        fn = engine(name.split("-")[0], name.split("-")[1], exported(), threads or thread_policy.ceiling())
        run = torch_runner(model, eager.precision)
        with torch.random.fork_rng():
            rounds = engine_probe.interleaved_rounds({name: lambda: fn(x), eager.name: lambda: run(x)})
    except Exception:  # noqa: BLE001 - the check is a second opinion: without it the first stands
        return name, why
    finally:
        pack_linears(model, enable=False)
        model.train(was_training)
    ratio = engine_probe.median([te / tw for tw, te in zip(rounds[name], rounds[eager.name])])
    if ratio >= 1:
        return name, f"{why}; {ratio:.2f}x {eager.name} side by side"
    return eager.name, (f"{eager.rate:.1f} img/s; {name} ({next(c.rate for c in table if c.name == name):.1f} in its "
                        f"own process) ran at {ratio:.2f}x {eager.name} side by side in this one")


def resolve(model: nn.Module, backend: str, precision: str, batch: int, *, threads: int | None = None,
            log=None, export: Exporter) -> BackendChoice:
    """`--backend` and `--precision` as a command gives them: auto measures (`choose`); torch resolves the precision
    (`vitkit.machine.precision`); aoti runs the cached compiled package, onnx and openvino the cached export, in
    fp32 (aoti and openvino: bf16 if asked)."""
    check_backend(backend)
    if backend == "auto":
        if precision not in ("auto", "fp32", "bf16"):
            raise UsageError(f"--backend auto picks among fp32 and bf16 engines, not {precision}")
        cands = CANDIDATES if precision == "auto" else tuple(c for c in CANDIDATES if c.endswith(precision) or c == "torch-fp32")
        return choose(model, batch, threads=threads, candidates=cands, log=log, force_bf16=precision == "bf16",
                      export=export)
    if backend == "torch":
        device = next(model.parameters()).device
        p = probe.resolve(precision, model, device, batch=batch, training=False)
        return BackendChoice(f"torch-{p.precision}", p.reason, batch=batch)
    if installed(backend) is None:
        raise UsageError(f"--backend aoti compiles C++: {aoti.NO_COMPILER}"
                         if backend == "aoti" else
                         f"--backend {backend} needs {backend}: pip install 'vitkit[{'deploy' if backend == 'onnx' else 'openvino'}]'")
    p = "fp32" if precision in ("auto", "fp32") else precision
    if (backend, p) not in (("onnx", "fp32"), ("openvino", "fp32"), ("openvino", "bf16"), ("aoti", "fp32"), ("aoti", "bf16")):
        raise UsageError(f"--backend {backend} computes in {'fp32' if backend == 'onnx' else 'fp32 or bf16'}, not {precision}")
    if export is None:
        raise UsageError(f"--backend {backend} runs an exported model: no exporter given")
    name = f"{backend}-{p}"
    if backend == "aoti" and log is not None:
        log(f"the {name} package: compiled once per model and machine, then cached ...")
    return BackendChoice(name, f"{name}: asked for", batch=batch,
                         export=export(model, None, name if backend == "aoti" else "onnx", batch))


def say(line: str) -> None:
    """A progress line: a message of this module's logger, which the commands show on stderr."""
    log.info(line)


def resolve_and_announce(model: nn.Module, backend: str, precision: str, batch: int, *,
                         threads: int | None = None, export: Exporter) -> BackendChoice:
    """`resolve`, with its progress, its reason and (for auto) the whole table printed on stderr."""
    choice = resolve(model, backend, precision, batch, threads=threads, log=say, export=export)
    say(f"backend {choice.reason}")
    if backend == "auto":
        log.info("every engine measured:\n" + choice.format_table())
    return choice


class BackendModel(nn.Module):
    """A model running on the engine a `BackendChoice` names, called like the eager model: (B, C, H, W) float32
    tensor -> logits (fp32, on the CPU). Holds `config` for preprocessing and class names. For torch it is the
    eager model in the chosen precision."""

    def __init__(self, model: nn.Module, choice: BackendChoice, threads: int | None = None) -> None:
        super().__init__()
        self.config = model.config
        self.choice = choice
        if choice.backend == "torch":
            self.eager = model
            fn = torch_runner(model, choice.precision)
        elif choice.backend == "aoti":
            self.eager = None
            fn = aoti_runner(choice.export)
        else:
            self.eager = None
            with untrusted(str(choice.export), CheckpointError):
                fn = engine(choice.backend, choice.precision, choice.export, threads or thread_policy.ceiling())
        self.run = chunked(fn, max(choice.batch, PROBE_BATCH))
        self.device = torch.device("cpu") if self.eager is None else next(model.parameters()).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.run(x.detach().float().cpu().numpy()))


def _load(path: Path) -> dict:
    data = read_json_cache(path, {})
    return {k: v for k, v in data.items() if isinstance(v, list)} if isinstance(data, dict) else {}
