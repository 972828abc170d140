"""The precision a model computes in: `auto` measures bf16 against fp32 on this device for this model and batch.

bf16 autocast is 4-5x faster than fp32 on a CPU with bf16 instructions (AVX-512 BF16, AMX) and 10x slower on one
without them (AVX2-only laptops and servers, where oneDNN emulates it), so no constant is right everywhere.
`resolve("auto", model, device, batch=..., training=...)`:

- on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in its flags, or oneDNN capped below them; an Arm CPU
  without bf16 in its features) keeps fp32 without measuring: emulated bf16 is never the faster, and a short
  timing on a busy machine can say otherwise (issue 42: 1.40x at batch 1, where it is 0.05-0.38x). `bf16` asked
  for by name still runs in bf16;
- elsewhere runs the model itself (training steps or forwards), fp32 on the fast packed GEMM where the run would
  use it, in rounds that interleave fp32 and bf16 after warm-up calls (`engine_probe.interleaved_rounds`), and
  `decide`s from the rounds: bf16 only where the median of the per-round speed-ups is at least BF16_MARGIN and
  bf16 was the faster in at least BF16_AGREE of the rounds. One noisy round decides nothing; a marginal gain is
  not worth bf16's rounding.

The probe runs inside its own random state (a run's randomness is the same whether it probed or read the cache),
leaves the model's weights, gradients and modes as they were, and is remembered per machine in
$VITKIT_HOME/precision/<cpu>-<isa caps>-<torch>-t<threads>.json with its rounds, so each model and batch size is
measured once per machine. "fp32", "bf16" and "fp16" are obeyed as given.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable, Sequence

import torch
from torch import nn

from ..cache import cache_dir, read_json_cache, write_json_cache
from ..errors import UsageError
from . import cpu, engine_probe, fast_linear
from .device import sync
from .fast_linear import pack_linears

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MARGIN = 1.2  # bf16 is chosen where the median of its per-round speed-ups over fp32 is at least this ...
BF16_AGREE = 0.8  # ... and it was the faster in at least this share of the rounds (4 of 5, 3 of 3)
MIN_ROUND_S = 0.05  # a timed round repeats a short call until it lasts this long
PROBE_ROUNDS = 5  # interleaved rounds (3 when one call takes over half a second)
PROBE_BATCH = 32  # images per probe call at most: representative GEMM shapes, a few seconds on a slow CPU
PROBE_VERSION = 3  # in every cache key: a measurement made by an earlier probe is made again
_CHOICES: dict[Path, dict[str, dict]] = {}  # cache file -> {model/batch/mode key -> rates}
# what the architecture's speed depends on; preprocessing, class names and regularisation rates do not change it
_IGNORED_FIELDS = {"class_names", "mean", "std", "interpolation", "crop_pct", "drop_rate", "attn_drop_rate",
                   "drop_path_rate"}


@dataclass(frozen=True)
class Choice:
    """What a run computes in, and why: `precision` is fp32 | bf16 | fp16; `reason` one line for logs and configs."""

    precision: str
    reason: str
    rates: dict = dataclasses.field(default_factory=dict)  # img/s per precision, where measured


def check(precision: str, name: str = "precision") -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"{name}={precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def autocast(precision: str, device: torch.device | str):
    """The autocast context of a resolved precision (a no-op for fp32)."""
    dev = torch.device(device)
    dtype = AMP_DTYPES.get(precision)
    return torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def resolve(precision: str, model: nn.Module, device: torch.device | str, *, batch: int, training: bool,
            lowp_stream: bool = False, fast_gemm: bool = True) -> Choice:
    """`precision` as given, or for "auto" the faster of fp32 and bf16 for `model` on `device` (measured once per
    machine, model architecture, batch size and mode, then cached).

    Args:
        precision: auto | fp32 | bf16 | fp16.
        model: the model as the caller will run it (frozen layers and activation checkpointing included).
        device: where it runs.
        batch: the caller's batch size (the probe uses at most PROBE_BATCH images of it).
        training: measure a training step (forward + backward) rather than an inference forward.
        lowp_stream: the bf16 candidate keeps a ViT's token stream in bf16 (`run.lowp_stream`).
        fast_gemm: the fp32 candidate runs its Linears on the packed fast GEMM (`run.fast_gemm`), as the run would.
    """
    check(precision)
    dev = torch.device(device)
    if precision != "auto":
        if precision == "fp16" and dev.type != "cuda":
            raise UsageError("fp16 needs a GPU (it relies on a grad scaler); use bf16 or auto on a CPU")
        return Choice(precision, f"{precision}: asked for")
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return Choice("fp32", "auto -> fp32: this GPU has no bf16")
    if dev.type == "cpu":
        native, why = bf16_support()
        if native is False:
            return Choice("fp32", f"auto -> fp32: {why}: bf16 would be emulated, several times slower; not measured "
                                  f"(precision bf16 by name still runs it)")
    pb = max(1, min(batch, PROBE_BATCH))
    mode = "training step" if training else "forward"
    key = _key(model, dev, pb, training, lowp_stream, fast_gemm)
    path = _cache_file()
    known = _load(path)
    cached = key in known and isinstance(known[key].get("rounds"), dict)
    if not cached:
        known[key] = measure(model, dev, batch=pb, training=training, lowp_stream=lowp_stream, fast_gemm=fast_gemm)
        _save(path, known)
    rates = known[key]
    where = "this GPU" if dev.type == "cuda" else "this CPU"
    rounds = rates.get("rounds", {})
    if not rates.get("bf16") or not rounds.get("bf16"):
        return Choice("fp32", f"auto -> fp32: bf16 does not run on {where} ({rates.get('error', 'no rate')})", rates)
    choice, v = decide(rounds["fp32"], rounds["bf16"])
    if v["rounds"] == 1:
        detail = "its first calls; not timed further"
    else:
        detail = (f"median of {v['rounds']} interleaved rounds, {v['low']:.2f}-{v['high']:.2f}x, bf16 the faster in "
                  f"{v['wins']} of {v['rounds']}")
    if choice == "fp32" and v["rounds"] > 1:
        detail += f"; bf16 is taken at {BF16_MARGIN:.2f}x and the faster in {v['need']} of {v['rounds']}"
    reason = (f"auto -> {choice}: bf16 {v['ratio']:.2f}x fp32 on {where} ({detail}; {rates['bf16']:.0f} vs "
              f"{rates['fp32']:.0f} img/s in their median rounds, {mode}, batch {pb}"
              f"{', measured earlier' if cached else ''})")
    return Choice(choice, reason, rates)


MIN_ROUNDS = 3  # fewer interleaved rounds than this never choose bf16


def decide(fp32_times: Sequence[float], bf16_times: Sequence[float], margin: float = BF16_MARGIN,
           agree: float = BF16_AGREE) -> tuple[str, dict]:
    """fp32 or bf16 from interleaved timings (seconds per call, round i of each measured back to back): bf16 only
    where the median of the per-round speed-ups fp32_i / bf16_i is at least `margin` and bf16 was the faster in at
    least `agree` of at least MIN_ROUNDS rounds. Else fp32: the simpler and exact one is kept unless bf16 wins clearly. Returns the
    choice and {"ratio": the median speed-up, "low", "high", "wins", "need", "rounds"}."""
    ratios = [a / b for a, b in zip(fp32_times, bf16_times) if a > 0 and b > 0 and math.isfinite(a / b)]
    if not ratios:
        return "fp32", {"ratio": 0.0, "low": 0.0, "high": 0.0, "wins": 0, "need": 1, "rounds": 0}
    n = len(ratios)
    v = {"ratio": median(ratios), "low": min(ratios), "high": max(ratios), "wins": sum(r > 1.0 for r in ratios),
         "need": math.ceil(agree * n - 1e-9), "rounds": n}
    clear = n >= MIN_ROUNDS and v["ratio"] >= margin and v["wins"] >= v["need"]  # one or two rounds decide nothing
    return ("bf16" if clear else "fp32"), v


def bf16_support() -> tuple[bool | None, str]:
    """Whether this CPU computes bf16 natively: (True | False | None when /proc/cpuinfo does not say, why). x86:
    avx512_bf16 or amx_bf16 in its flags and oneDNN not capped below them (`cpu.bf16_native`); Arm: bf16 in its
    features."""
    info = cpu.cpu_info()
    if "flags" in info:
        if cpu.bf16_native():
            return True, "this CPU has bf16 instructions"
        flags = set(info["flags"].split())
        if {"avx512_bf16", "amx_bf16"} & flags:
            return False, f"oneDNN is capped below this CPU's bf16 instructions ({cpu.isa_caps()})"
        return False, "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16 in its flags)"
    features = info.get("Features", info.get("features"))
    if features is not None:
        if "bf16" in features.split():
            return True, "this CPU has bf16 instructions"
        return False, "this CPU has no native bf16 (no bf16 in its features)"
    return None, "unknown"


def for_inference(model: nn.Module, device: torch.device | str, precision: str = "auto", batch: int = 32) -> Choice:
    """Set a loaded model up for inference commands (eval, predict, fewshot, serve, bench): `precision` resolved for
    a forward at `batch` (printed to stderr), and in fp32 on a CPU its Linears on the packed fast GEMM."""
    model.eval()
    choice = resolve(precision, model, device, batch=batch, training=False)
    pack_linears(model, enable=choice.precision in ("fp32", "bf16"))  # fp32: the fastest GEMM; bf16: weights cast
    # and packed once. No effect off the CPU
    log.info(f"precision {choice.reason}")
    return choice


def measure(model: nn.Module, device: torch.device, *, batch: int, training: bool, lowp_stream: bool = False,
            fast_gemm: bool = True, rounds: int = PROBE_ROUNDS) -> dict:
    """Images per second of `model` in fp32 and in bf16 autocast, and the timings they come from: a warm-up call
    each, then `rounds` interleaved rounds (`engine_probe.interleaved_rounds`: 3 when a call takes over half a
    second; a round repeats a short call until it lasts MIN_ROUND_S). Where bf16's warm-up is already 3x slower
    than fp32's, fp32 alone is timed again (its warm-up carries the GEMM choices) and bf16's warm-up stands as its
    one round. Returns {"fp32": img/s, "bf16": img/s (from the median round), "rounds": {precision: [seconds per
    call, round by round]}, "batch", "mode"} (and "error" where bf16 does not run).
    fp32 runs on the packed GEMM where `fast_gemm` (autocast calls bypass it); in training, its weights are repacked
    every call, as after every optimizer step of a run.
    The model's weights, gradients, modes and the global random state are left as they were."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c.in_chans, *c.img_size, generator=g).to(device)
    grads = {p: p.grad for p in model.parameters()}
    was_training, was_lowp = model.training, getattr(model, "lowp_stream", None)
    packed = bool(fast_gemm and device.type == "cpu")

    def call(precision: str) -> Callable[[], None]:
        def run() -> None:
            if training and precision == "fp32":
                fast_linear._optimizer_stepped()  # a run repacks after every optimizer step
            if was_lowp is not None:
                model.lowp_stream = lowp_stream and precision != "fp32"
            with autocast(precision, device), torch.set_grad_enabled(training):
                out = model(x)
                out = out[0] if isinstance(out, (tuple, list)) else out
                if training:
                    out.float().mean().backward()
            for p in model.parameters():
                p.grad = None
        return run

    def timed(fn: Callable[[], None]) -> float:  # one call
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    rates: dict = {}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train(training)
            pack_linears(model, enable=packed, training=training)
            fns = {"fp32": call("fp32"), "bf16": call("bf16")}
            first = {"fp32": timed(fns["fp32"])}  # the first calls carry one-time costs (GEMM choices, packing, kernels)
            try:
                first["bf16"] = timed(fns["bf16"])
            except (RuntimeError, NotImplementedError) as e:  # a build or device without bf16 kernels
                rates["error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            if "bf16" not in first or first["bf16"] >= 3 * first["fp32"]:
                times = {"fp32": [timed(fns["fp32"])]}  # steady: the warm-up measured the GEMM paths
                if "bf16" in first:
                    times["bf16"] = [first["bf16"]]
            else:
                times = engine_probe.interleaved_rounds(fns, rounds, MIN_ROUND_S, sync=lambda: sync(device), warm=False)
    finally:
        pack_linears(model, enable=False)
        model.train(was_training)
        if was_lowp is not None:
            model.lowp_stream = was_lowp
        for p, gr in grads.items():
            p.grad = gr
    rates.update({p: batch / median(ts) for p, ts in times.items()})
    rates.update(rounds=times, batch=batch, mode="train" if training else "eval")
    return rates



def _key(model: nn.Module, device: torch.device, batch: int, training: bool, lowp_stream: bool, fast_gemm: bool) -> str:
    cfg = getattr(model, "config", None)
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _IGNORED_FIELDS} if dataclasses.is_dataclass(cfg) else {}
    frozen = sum(not p.requires_grad for p in model.parameters())
    ckpt = any(getattr(m, "grad_checkpointing", False) for m in model.modules())
    digest = hashlib.sha1(json.dumps([type(model).__name__, arch, frozen, ckpt], sort_keys=True, default=str).encode())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"v{PROBE_VERSION}|{type(model).__name__}-{digest.hexdigest()[:12]}|{name}|{'train' if training else 'eval'}"
            f"|b{batch}|lowp{int(lowp_stream)}|gemm{int(fast_gemm)}")


def _cache_file() -> Path:
    return cache_dir() / "precision" / f"{cpu.machine_key()}.json"


def _load(path: Path) -> dict[str, dict]:
    if path not in _CHOICES:
        _CHOICES[path] = {}
        data = read_json_cache(path, {})
        if isinstance(data, dict):
            _CHOICES[path].update({k: v for k, v in data.items() if isinstance(v, dict)})
    return _CHOICES[path]


def _save(path: Path, known: dict[str, dict]) -> None:
    write_json_cache(path, known, indent=1, sort_keys=True)  # a read-only home: measured again next time
