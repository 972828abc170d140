"""The precision a model computes in: `auto` measures bf16 against fp32 on this device for this model and batch.

bf16 autocast is 4-5x faster than fp32 on a CPU with bf16 instructions (AVX-512 BF16, AMX) and 10x slower on one
without them (AVX2-only laptops and servers, where oneDNN emulates it), so no constant is right everywhere.
`resolve("auto", model, device, batch=..., training=...)` runs a few training steps (or forwards) of the model
itself in each precision, fp32 on the fast packed GEMM where the run would use it, and keeps bf16 only where it is
measured faster (by 5%: the smaller margin is not worth bf16's rounding). The probe runs inside its own random
state (a run's randomness is the same whether it probed or read the cache), leaves the model's weights, gradients
and modes as they were, and is remembered per machine in $VITKIT_HOME/precision/<cpu>-<isa caps>-<torch>-t<threads>.json,
so each model and batch size is measured once per machine. "fp32", "bf16" and "fp16" are obeyed as given.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .errors import UsageError
from .models.layers import gemm

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MARGIN = 1.05  # bf16 must be measured this much faster than fp32 to be chosen
MIN_ROUND_S = 0.05  # a timed round repeats a short call until it lasts this long
PROBE_BATCH = 32  # images per probe call at most: representative GEMM shapes, a few seconds on a slow CPU
PROBE_VERSION = 2  # in every cache key: a measurement made by an earlier probe is made again
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
    pb = max(1, min(batch, PROBE_BATCH))
    mode = "training step" if training else "forward"
    key = _key(model, dev, pb, training, lowp_stream, fast_gemm)
    path = _cache_file()
    known = _load(path)
    cached = key in known
    if not cached:
        known[key] = measure(model, dev, batch=pb, training=training, lowp_stream=lowp_stream, fast_gemm=fast_gemm)
        _save(path, known)
    rates = known[key]
    r32, r16 = rates.get("fp32", 0.0), rates.get("bf16", 0.0)
    where = "this GPU" if dev.type == "cuda" else "this CPU"
    if not r16:
        return Choice("fp32", f"auto -> fp32: bf16 does not run on {where} ({rates.get('error', 'no rate')})", rates)
    choice = "bf16" if r16 > BF16_MARGIN * r32 else "fp32"
    reason = (f"auto -> {choice}: bf16 {r16 / r32:.2f}x fp32 on {where} ({r16:.0f} vs {r32:.0f} img/s, {mode}, "
              f"batch {pb}{', measured earlier' if cached else ''})")
    return Choice(choice, reason, rates)


def for_inference(model: nn.Module, device: torch.device | str, precision: str = "auto", batch: int = 32) -> Choice:
    """Set a loaded model up for inference commands (eval, predict, fewshot, serve, bench): `precision` resolved for
    a forward at `batch` (printed to stderr), and in fp32 on a CPU its Linears on the packed fast GEMM."""
    import sys

    from .models.layers.linear import pack_linears

    model.eval()
    choice = resolve(precision, model, device, batch=batch, training=False)
    pack_linears(model, enable=choice.precision in ("fp32", "bf16"))  # fp32: the fastest GEMM; bf16: weights cast
    # and packed once. No effect off the CPU
    print(f"vitkit: precision {choice.reason}", file=sys.stderr, flush=True)
    return choice


def measure(model: nn.Module, device: torch.device, *, batch: int, training: bool, lowp_stream: bool = False,
            fast_gemm: bool = True) -> dict:
    """Images per second of `model` in fp32 and in bf16 autocast: a warm-up call each, then the best of two timed
    rounds each, interleaved (one when a call takes over a second), a round repeating a short call until it lasts
    MIN_ROUND_S (a 1-ms forward timed once is noise). Where bf16's warm-up is already 3x slower than fp32's, fp32
    alone is timed again (its warm-up carries the GEMM choices) and bf16's warm-up stands as its rate.
    fp32 runs on the packed GEMM where `fast_gemm` (autocast calls bypass it); in training, its weights are repacked
    every call, as after every optimizer step of a run.
    The model's weights, gradients, modes and the global random state are left as they were."""
    from .models.layers import linear
    from .models.layers.linear import pack_linears

    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c.in_chans, *c.img_size, generator=g).to(device)
    grads = {p: p.grad for p in model.parameters()}
    was_training, was_lowp = model.training, getattr(model, "lowp_stream", None)
    packed = bool(fast_gemm and device.type == "cpu")

    def call(precision: str) -> Callable[[], None]:
        def run() -> None:
            if training and precision == "fp32":
                linear._optimizer_stepped()  # a run repacks after every optimizer step
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

    def timed(fn: Callable[[], None], calls: int = 1) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / calls

    rates: dict = {}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train(training)
            pack_linears(model, enable=packed, training=training)
            fp32, bf16 = call("fp32"), call("bf16")
            best = {"fp32": timed(fp32)}  # the first calls carry one-time costs (GEMM choices, packing, kernels)
            try:
                best["bf16"] = timed(bf16)
            except (RuntimeError, NotImplementedError) as e:  # a build or device without bf16 kernels
                rates["error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            if "bf16" not in best or best["bf16"] >= 3 * best["fp32"]:
                best["fp32"] = timed(fp32)  # steady: the warm-up measured the GEMM paths
            else:
                once = {"fp32": timed(fp32), "bf16": timed(bf16)}
                calls = {p: max(1, math.ceil(MIN_ROUND_S / max(t, 1e-6))) for p, t in once.items()}
                best = {p: float("inf") for p in best}
                for _ in range(1 if max(once.values()) > 1.0 else 2):
                    best["fp32"] = min(best["fp32"], timed(fp32, calls["fp32"]))
                    best["bf16"] = min(best["bf16"], timed(bf16, calls["bf16"]))
    finally:
        pack_linears(model, enable=False)
        model.train(was_training)
        if was_lowp is not None:
            model.lowp_stream = was_lowp
        for p, gr in grads.items():
            p.grad = gr
    rates.update({p: batch / t for p, t in best.items()})
    rates.update(batch=batch, mode="train" if training else "eval")
    return rates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    from .checkpoints.catalog import cache_dir

    return cache_dir() / "precision" / f"{gemm.machine_key()}.json"


def _load(path: Path) -> dict[str, dict]:
    if path not in _CHOICES:
        _CHOICES[path] = {}
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                _CHOICES[path].update({k: v for k, v in data.items() if isinstance(v, dict)})
        except (OSError, ValueError):
            pass
    return _CHOICES[path]


def _save(path: Path, known: dict[str, dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
