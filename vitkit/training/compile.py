"""Whether a training run compiles its model with `torch.compile` (`run.compile`: auto | on | off).

A compiled training step fuses the elementwise work around the GEMMs (LayerNorm, GELU, the residual adds, the
optimizer's arithmetic stays eager), but it costs a compile (45-60 s for the fashion-mnist preset on a 2-core AMD
EPYC) and gives up vitkit's packed fast GEMM in fp32 (Inductor calls MKL, whose AVX2 code on AMD CPUs runs below
oneDNN's). Measured there (benchmarks/NOTES.md section 35): the preset's hybrid in fp32 1.1x faster compiled, in
bf16 0.67x; ViT-S/16 at batch 32 in fp32 at parity. So no setting wins everywhere, and auto measures:

1. The eager step of this model, batch and precision, on a copy (two warm-up steps, then three timed): with the
   run's number of steps, how long the run's steps take eagerly.
2. If even the best speed-up seen (BEST_SPEEDUP) could not repay a compile (the slowest compile measured on this
   machine, COMPILE_S before any), off without compiling: the demo and smoke runs never pay for a compile.
3. Otherwise the copy is compiled and its steps timed against eager ones in interleaved rounds, and the run
   compiles where the compiled step is at least MARGIN faster and the time it saves over the run's steps exceeds
   the compile's. A run under `schedule.time_budget` counts the steps what is left of its budget holds eagerly (at
   most the schedule's): where the budget ends the run, a compile that repays itself within them lets it hold more
   steps, to first order (start-up, data and evaluations take part of the budget too), and one that does not fewer.

Each measurement is cached per machine, model architecture, batch, precision and options, in
$VITKIT_HOME/compile/<machine>.json: a second run decides at once. The choice is printed and recorded in
run.compile_choice (config.yaml), as the precision's is. Runs of several processes compile only when asked (on).
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..cache import cache_dir, read_json_cache, write_json_cache
from ..errors import UsageError
from ..machine import aoti, cpu, engine_probe
from ..machine.device import sync
from ..machine.fast_linear import pack_linears
from ..machine.precision import autocast

CHOICES = ("auto", "on", "off")
COMPILE_S = 60.0  # a compile's cost before one was measured on this machine (the preset's hybrid: 46-61 s, 2 cores)
BEST_SPEEDUP = 1.25  # the most a compiled step is hoped to gain, to rule out runs too short to repay a compile
MARGIN = 1.05  # a compiled step must be this much faster than the eager one to be kept
# 2: measured with Inductor's cache kept apart per ISA caps (a version-1 record under caps may hold a failure that
# was a stale cache's, NOTES 53)
VERSION = 2


def normalize(value) -> str:
    """run.compile as auto | on | off (true/false, as older configs wrote it, are on/off)."""
    v = str(value).strip().lower()
    v = {"true": "on", "false": "off", "yes": "on", "no": "off", "1": "on", "0": "off"}.get(v, v)
    if v not in CHOICES:
        raise UsageError(f"run.compile={value!r}: must be one of {', '.join(CHOICES)}")
    return v


@dataclass
class CompileChoice:
    on: bool
    reason: str


def _key(model: nn.Module, device: torch.device, batch: int, precision: str, lowp_stream: bool, fast_gemm: bool) -> str:
    cfg = getattr(model, "config", None)
    arch = cfg.to_dict() if hasattr(cfg, "to_dict") else str(cfg)
    frozen = sum(not p.requires_grad for p in model.parameters())
    ckpt = any(getattr(m, "grad_checkpointing", False) for m in model.modules())
    digest = hashlib.sha1(json.dumps([type(model).__name__, arch, frozen, ckpt], sort_keys=True, default=str).encode())
    return (f"v{VERSION}|{type(model).__name__}-{digest.hexdigest()[:12]}|{device.type}|b{batch}|{precision}"
            f"|lowp{int(lowp_stream)}|gemm{int(fast_gemm)}|torch{torch.__version__}")


def _cache_file() -> Path:
    return cache_dir() / "compile" / f"{cpu.machine_key()}.json"


def _stepper(model: nn.Module, device: torch.device, batch: int, precision: str) -> Callable[[], torch.Tensor]:
    """One training step of `model` (a copy) on a seeded batch: forward under the run's autocast, a loss over every
    output, backward, AdamW; returns the loss (detached)."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c.in_chans, *c.img_size, generator=g).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with autocast(precision, device):
            out = model(x)
        outs = out if isinstance(out, (tuple, list)) else [out]
        loss = sum(o.float().mean() for o in outs if isinstance(o, torch.Tensor))
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def budget_steps(steps: int, eager_s: float, budget_s: float | None) -> int:
    """The run's steps, or under a time budget the fewer that fit it eagerly: a compiled run holds more, to first
    order, where the time a compile saves over these exceeds the compile's ((B - C) / c > B / e)."""
    return steps if budget_s is None else min(steps, int(budget_s / max(eager_s, 1e-9)))


def measure(model: nn.Module, device: torch.device, *, batch: int, precision: str, lowp_stream: bool,
            fast_gemm: bool, steps: int, compile_s: float, budget_s: float | None = None) -> dict:
    """Seconds per eager step of a copy of `model`; and where a compile could pay over `steps` steps (given a
    compile of `compile_s`), the compiled step and the compile's seconds, timed against eager in interleaved rounds.
    The model itself is not touched."""
    eager = copy.deepcopy(model).train()
    if hasattr(eager, "lowp_stream"):
        eager.lowp_stream = lowp_stream and precision != "fp32"
    pack_linears(eager, enable=fast_gemm and precision == "fp32" and device.type == "cpu", training=True)
    e_step = _stepper(eager, device, batch, precision)

    def timed(fn: Callable[[], None], n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / n

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        e_finite = bool(torch.isfinite(e_step()) & torch.isfinite(e_step()))  # the second: after the backward's update
        eager_s = timed(e_step, 3)
        out = {"eager_s": eager_s}
        if budget_steps(steps, eager_s, budget_s) * eager_s * (1 - 1 / BEST_SPEEDUP) < compile_s:
            return out
        other = copy.deepcopy(model).train()
        if hasattr(other, "lowp_stream"):
            other.lowp_stream = lowp_stream and precision != "fp32"
        cpu.inductor_cache_for_caps()
        compiled = torch.compile(other)
        c_step = _stepper(compiled, device, batch, precision)
        t0 = time.perf_counter()
        try:
            c_finite = bool(torch.isfinite(c_step()))
            # a second step: the optimizer's and any recompilation for the backward's layout; its loss shows whether
            # the compiled backward's gradients kept the weights finite
            c_finite &= bool(torch.isfinite(c_step()))
        except Exception as e:  # noqa: BLE001 - Inductor raises many types; any means "this model does not compile here"
            out["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            return out
        if e_finite and not c_finite:  # e.g. a graph Inductor's cache served under other ISA caps (NOTES 52-53)
            out["failed"] = "the compiled step's loss was not finite where the eager step's was"
            return out
        out["finite"] = c_finite or not e_finite  # checked: a record without it (older vitkit) is measured again
        out["compile_s"] = time.perf_counter() - t0
        rounds = engine_probe.interleaved_rounds({"eager": e_step, "compiled": c_step}, rounds=3, warm=False,
                                                 sync=lambda: sync(device))
        out["eager_s"] = engine_probe.median(rounds["eager"])
        out["compiled_s"] = engine_probe.median(rounds["compiled"])
        out["rounds"] = rounds
    return out


def decide(setting, model: nn.Module, device: torch.device, *, batch: int, precision: str, lowp_stream: bool,
           fast_gemm: bool, steps: int, world: int = 1, budget_s: float | None = None) -> CompileChoice:
    """run.compile resolved for this run (see the module's docstring): `steps` optimizer steps of `batch` images, or
    as many of them as `budget_s` seconds hold (`schedule.time_budget`)."""
    setting = normalize(setting)
    if setting != "auto":
        return CompileChoice(setting == "on", f"{setting}: asked for")
    if world > 1:
        return CompileChoice(False, "auto -> off: not measured for runs of several processes (run.compile=on "
                                    "compiles them)")
    if device.type == "cpu" and aoti.compiler() is None:
        return CompileChoice(False, f"auto -> off: {aoti.NO_COMPILER}")
    path = _cache_file()
    known = read_json_cache(path, {})
    known = known if isinstance(known, dict) else {}
    key = _key(model, device, batch, precision, lowp_stream, fast_gemm)
    compiles = [v["compile_s"] for v in known.values() if isinstance(v, dict) and "compile_s" in v]
    compile_s = max(compiles) if compiles else COMPILE_S
    m = known.get(key)
    cached = isinstance(m, dict) and "eager_s" in m and (
        "failed" in m or m.get("finite") is True  # a compiled step measured and checked (older records: measured again)
        or ("compiled_s" not in m
            and budget_steps(steps, m["eager_s"], budget_s) * m["eager_s"] * (1 - 1 / BEST_SPEEDUP) < compile_s))
    if not cached:
        m = measure(model, device, batch=batch, precision=precision, lowp_stream=lowp_stream, fast_gemm=fast_gemm,
                    steps=steps, compile_s=compile_s, budget_s=budget_s)
        known[key] = m
        write_json_cache(path, known, indent=1, sort_keys=True)  # a read-only home: measured again next time
    earlier = ", measured earlier" if cached else ""
    held = budget_steps(steps, m["eager_s"], budget_s)
    count = f"{held} steps" + (f" (those {budget_s:.0f} s of budget hold eagerly)" if held < steps else "")
    steps = held
    eager_total = steps * m["eager_s"]
    if "failed" in m:
        return CompileChoice(False, f"auto -> off: the compiled step failed here ({m['failed']}){earlier}")
    if "compiled_s" not in m:
        return CompileChoice(False, f"auto -> off: the run's {count} take ~{eager_total:.0f} s eagerly; at the "
                                    f"best speed-up hoped for ({BEST_SPEEDUP:.2f}x) a compile (~{compile_s:.0f} s here) "
                                    f"would not pay{earlier}")
    speedup = m["eager_s"] / m["compiled_s"]
    saved = steps * (m["eager_s"] - m["compiled_s"])
    why = (f"compiled step {speedup:.2f}x eager ({m['compiled_s'] * 1e3:.0f} vs {m['eager_s'] * 1e3:.0f} ms, median of "
           f"interleaved rounds), {count} save ~{saved:.0f} s against a {m['compile_s']:.0f} s compile{earlier}")
    on = speedup >= MARGIN and saved > m["compile_s"]
    return CompileChoice(on, f"auto -> {'on' if on else 'off'}: {why}")
