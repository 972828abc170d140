"""`vitkit bench`: throughput, latency, peak memory, achieved FLOP/s and the fraction of this device's measured
matmul peak, for inference or a training step. Performance is measured here, never asserted in tests."""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoints import create_model, load
from .errors import UsageError
from .inference.backends import PackageModel, choose, is_package, open_engine
from .machine import gemm
from .machine.cpu import cpu_model, inductor_cache_for_caps
from .machine.device import resolve_device, sync
from .machine.engine import calibration_batch, check_backend
from .machine.fast_linear import FastGemm, pack_linears
from .machine.gemm import gemm_rates
from .machine.precision import resolve
from .models.stats import count_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



class PeakMemory:
    """Peak memory of a block: CUDA's allocator peak, or on Linux CPUs the process's peak RSS (VmHWM, reset first)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, None

    @staticmethod
    def _rss_kb(field: str) -> int | None:
        try:
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
            except OSError:
                pass
            self.base = (self._rss_kb("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            hwm = self._rss_kb("VmHWM")
            self.peak = None if hwm is None else max(0, hwm * 1024 - self.base)


@dataclass
class BenchResult:
    model: str
    mode: str  # "inference" or "train"
    img_size: int
    batch_size: int
    dtype: str
    compiled: bool
    device: str
    threads: int
    img_per_s: float
    latency_ms_b1: float | None
    peak_mem_mb: float | None
    gflops_per_img: float
    achieved_tflops: float
    matmul_peak_tflops: float
    fraction_of_peak: float
    packed_linears: int = 0  # matmul layers on the fastest GEMM measured here, from packed weights (fp32 CPU)
    peak_path: str = ""  # the GEMM path whose rate is the peak
    gemm_rates_gflops: dict | None = None  # every path's rate on the peak's problem
    gemm_choices: dict | None = None  # the path chosen for each of the model's Linear shapes, and the rates measured

    def to_dict(self) -> dict:
        return asdict(self)


def time_fn(fn, device: torch.device, warmup: int, iters: int, min_seconds: float = 0.0) -> list[float]:
    """Wall times of `iters` calls after `warmup` calls (at least `min_seconds` in all)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    t_all = time.perf_counter()
    while len(times) < iters or time.perf_counter() - t_all < min_seconds:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def make_step(model: nn.Module, x: torch.Tensor, dtype: str, train: bool, compile_: bool, compile_mode: str = "default",
              fullgraph: bool = True, pack: bool = True, freezing: bool = False):
    """A closure running one inference forward, or one training step (forward, backward, fused/foreach AdamW).
    `model` maps images to logits and has `config.num_classes`; `benchmarks/peers.py` times its peers with it too.
    pack: for fp32 on CPU, run vitkit's Linear layers on the fastest GEMM measured here, from packed weights
    (`pack_linears`; the training forward and input gradient too); a peer's model has none of them.
    freezing: with compile_, inference only: Inductor's freezing (weights folded in as constants, prepacked for
    oneDNN on a CPU, as `torch._inductor.config.freezing`)."""
    device = x.device
    amp = dtype != "fp32"
    if compile_ and freezing and not train:
        import torch._inductor.config as inductor_config  # start-up time: Inductor and dynamo cost ~0.5 s

        inductor_config.freezing = True
    if compile_:
        inductor_cache_for_caps()
    fwd = torch.compile(model, fullgraph=fullgraph, mode=compile_mode) if compile_ else model
    if not train:
        model.eval()
        pack_linears(model, enable=pack and dtype in ("fp32", "bf16") and device.type == "cpu" and not compile_)

        def infer() -> None:  # compiled: no_grad, which Inductor's freezing needs
            with torch.no_grad() if compile_ else torch.inference_mode(), torch.autocast(device.type, dtype=DTYPES[dtype], enabled=amp):
                fwd(x)

        return infer
    model.train()
    pack_linears(model, enable=pack and dtype == "fp32" and device.type == "cpu" and not compile_, training=True)
    y = torch.randint(0, max(model.config.num_classes, 1), (x.shape[0],), device=device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "fp16")

    def step() -> None:
        with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=amp):
            loss = F.cross_entropy(fwd(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def bench_model(model: nn.Module, name: str = "model", *, batch_size: int = 8, dtype: str = "fp32", train: bool = False,
                compile_: bool = False, compile_mode: str = "default", device: str | torch.device = "cpu", warmup: int = 2, iters: int = 5,
                min_seconds: float = 3.0, latency: bool = True, peak: float | None = None, pack: bool = True,
                freezing: bool = False) -> BenchResult:

    device = torch.device(device)
    model = model.to(device)
    c = model.config
    x = torch.randn(batch_size, c.in_chans, *c.img_size, device=device)
    step = make_step(model, x, dtype, train, compile_, compile_mode, pack=pack, freezing=freezing)
    # before any other forward: on CPU, memory an earlier forward freed stays in the process and would hide the peak
    with PeakMemory(device) as mem:
        times = time_fn(step, device, warmup, iters, min_seconds)
    flops = count_flops(model, c.img_size, c.in_chans)
    ips = batch_size / statistics.median(times)
    lat = None
    if latency and not train:
        one = make_step(model, x[:1], dtype, False, compile_, compile_mode, pack=pack, freezing=freezing)
        lat = statistics.median(time_fn(one, device, 2, 10, 1.0)) * 1e3
    work = flops * (3 if train else 1)  # backward ~ 2x forward

    rates = {"given": peak} if peak else gemm_rates(dtype, device)
    peak_path = max(rates, key=rates.get)
    peak = rates[peak_path]
    fast = sum(isinstance(m, FastGemm) and (m.train_fast if train else m.packable) for m in model.modules())
    return BenchResult(name, "train" if train else "inference", c.img_size[0], batch_size, dtype, compile_, str(device),
                       torch.get_num_threads(), ips, lat, None if mem.peak is None else mem.peak / 2**20, flops / 1e9,
                       work * ips / 1e12, peak / 1e12, work * ips / peak, fast, peak_path,
                       {k: float(f"{v / 1e9:.5g}") for k, v in rates.items()}, gemm.choices() if fast else None)


def bench(
    model: str,
    img_size: int | None = None,
    batch_size: int = 8,
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
    compile: bool = False,
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default",
    freezing: bool = False,
    train: bool = False,
    lowp_stream: bool = False,
    device: str = "auto",
    num_classes: int = 1000,
    min_seconds: float = 3.0,
    no_pack: bool = False,
    backend: Literal["torch", "auto", "aoti", "onnx", "openvino"] = "torch",
    backends: bool = False,
    trust_package: bool = False,
    json_out: bool = False,
) -> dict:
    """Measure a model: images/s, latency at batch 1, peak memory, achieved FLOP/s and the fraction of this
    device's matmul peak: the fastest GEMM path it has, measured by this command in the same dtype (on a CPU not
    only `torch.mm`, which is MKL's and far from the peak on some CPUs). Prints the GEMM path chosen per shape.

    Args:
        model: a registered model name (see `vitkit models`), a checkpoint path, or a package from `vitkit export
            --format aoti` (its rate and batch-1 latency as compiled).
        img_size: input resolution (default: the model's).
        batch_size: images per call.
        dtype: auto (bf16 where a short probe measures it faster than fp32 here for this model, batch and mode,
            else fp32; `vitkit.machine.precision`) | fp32 | bf16 | fp16 (bf16/fp16 via autocast; fp16 on GPU).
        compile: torch.compile the model (full graph).
        compile_mode: torch.compile's mode; reduce-overhead replays CUDA graphs (for launch-bound small batches on a GPU).
        freezing: with --compile, inference: Inductor's freezing (weights as constants, prepacked for oneDNN).
        train: time a training step (forward, backward, AdamW) instead of inference.
        lowp_stream: with bf16/fp16, keep a ViT's tokens between blocks in that dtype (`run.lowp_stream`).
        device: auto | cpu | cuda.
        num_classes: head size for registry models.
        min_seconds: measure for at least this long.
        no_pack: in fp32 on a CPU, call the Linear layers on PyTorch's own GEMM (MKL) instead of the fastest one
            measured here (`vitkit.machine.gemm`).
        backend: inference on a CPU: torch (eager, the measurements above) | auto (the engine `--backend auto`
            picks for this model and batch: `vitkit.inference.backends`) | aoti (vitkit's compiled engine, compiled
            once and cached) | onnx | openvino (vitkit's ONNX export, made once and cached); --dtype picks fp32 or
            bf16 (aoti, OpenVINO) where it applies.
        backends: inference on a CPU: measure every engine installed (eager fp32/bf16, the compiled engine
            fp32/bf16, onnxruntime, OpenVINO fp32/bf16) for this model and batch, each one's difference from fp32
            eager, and print the table with the one `--backend auto` picks (the measurement also refreshes its
            cache).
        trust_package: run a compiled package that this machine's vitkit did not compile (from another machine or
            user): its native code runs in this process with your permissions (docs/safety.md). Without it such a
            package is refused.
        json_out: print JSON.
    """
    if is_package(model):
        if train or compile or backends or img_size or backend not in ("torch", "auto", "aoti") or \
                (device != "auto" and resolve_device(device).type != "cpu"):
            raise UsageError(f"{model} is a compiled package: it runs CPU inference at its own size on its own engine "
                             "(no --train, --compile, --backends, --backend onnx|openvino, --img-size or GPU)")
        return _bench_package(model, batch_size, dtype, min_seconds, json_out, trust_package)
    dev = resolve_device(device)
    kw = {"img_size": img_size} if img_size else {}
    net = load(model, **kw) if Path(model).exists() else create_model(model, num_classes=num_classes, **kw)
    if backends or backend != "torch":
        if not Path(model).exists():  # random weights: the zero-initialised head would make every engine's logits 0
            _random_head(net)
        return _bench_engines(net.to(dev), model, dev, batch_size, dtype, backend, backends, train, compile, min_seconds,
                              json_out)
    if dtype == "auto":

        choice = resolve("auto", net.to(dev), dev, batch=batch_size, training=train, lowp_stream=lowp_stream,
                         fast_gemm=not no_pack and not compile)
        dtype = choice.precision
        lowp_stream = lowp_stream and dtype != "fp32"  # no token stream to keep low in fp32
        print(f"vitkit: precision {choice.reason}", file=sys.stderr, flush=True)
    if lowp_stream:
        if dtype == "fp32" or not hasattr(net, "lowp_stream"):
            raise UsageError("--lowp-stream needs --dtype bf16 or fp16 and a ViT (a CNN has no token stream)")
        net.lowp_stream = True
    res = bench_model(net, model, batch_size=batch_size, dtype=dtype, train=train, compile_=compile,
                      compile_mode=compile_mode, device=dev, min_seconds=min_seconds, pack=not no_pack, freezing=freezing)
    d = res.to_dict() | {"compile_mode": compile_mode if compile else None, "freezing": freezing and compile and not train}
    if json_out:
        print(json.dumps(d, indent=1))
    else:
        mem = "n/a" if res.peak_mem_mb is None else f"{res.peak_mem_mb:.0f} MB"
        comp = f" compiled ({compile_mode}{', freezing' if d['freezing'] else ''})" if compile else ""
        lat = "" if res.latency_ms_b1 is None else f", latency (batch 1) {res.latency_ms_b1:.1f} ms"
        print(f"{model} {res.mode} {res.img_size}px batch {batch_size} {dtype}{comp} on {res.device} "
              f"({res.threads} threads, {cpu_model() if res.device == 'cpu' else res.device}): {res.img_per_s:.2f} img/s{lat}, "
              f"peak memory {mem}, {res.gflops_per_img:.2f} GFLOP/img, {res.achieved_tflops * 1e3:.1f} GFLOP/s = "
              f"{res.fraction_of_peak:.0%} of the fastest {dtype} GEMM measured here ({res.peak_path}, "
              f"{res.matmul_peak_tflops * 1e3:.0f} GFLOP/s; " + ", ".join(f"{k} {v:.0f}" for k, v in res.gemm_rates_gflops.items()) + ")")
        for shape, ch in (res.gemm_choices or {}).items():
            print(f"  GEMM {shape}: {ch['path']} (" + ", ".join(f"{k} {v:.0f}" for k, v in ch["gflops"].items()) + " GFLOP/s)")
    return d


def _bench_package(path: str, batch: int, dtype: str, min_seconds: float, json_out: bool, trust: bool = False) -> dict:
    """`vitkit bench PACKAGE.pt2`: the rate and batch-1 latency of a compiled package, and its load time."""
    t0 = time.perf_counter()
    m = PackageModel(path, trust=trust)
    load_s = time.perf_counter() - t0
    if dtype not in ("auto", m.precision):
        raise UsageError(f"{path} computes in {m.precision}, not {dtype}")
    x = torch.from_numpy(calibration_batch(m, batch))
    times = time_fn(lambda: m(x), torch.device("cpu"), 2, 5, min_seconds)
    lat = statistics.median(time_fn(lambda: m(x[:1]), torch.device("cpu"), 2, 10, 1.0)) * 1e3
    d = {"model": path, "backend": f"aoti-{m.precision}", "reason": m.reason, "batch_size": batch, "cpu": cpu_model(),
         "threads": torch.get_num_threads(), "img_per_s": batch / statistics.median(times), "latency_ms_b1": lat,
         "load_s": load_s}
    if json_out:
        print(json.dumps(d, indent=1))
    else:
        print(f"{path} inference {m.config.img_size[0]}px batch {batch} on aoti-{m.precision} ({torch.get_num_threads()} "
              f"threads, {cpu_model()}): {d['img_per_s']:.2f} img/s, latency (batch 1) {lat:.1f} ms, loaded in "
              f"{load_s * 1e3:.0f} ms")
    return d


def _random_head(net: nn.Module) -> None:
    """Give a registry model's zero-initialised Linears (its head) seeded random weights, so that logits depend on
    every layer and engines' differences from fp32 eager show."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Linear) and not m.weight.any():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * m.in_features ** -0.5)


def _bench_engines(net: nn.Module, name: str, dev: torch.device, batch: int, dtype: str, backend: str, table: bool,
                   train: bool, compile_: bool, min_seconds: float, json_out: bool) -> dict:
    """`vitkit bench --backends` (every engine's rate and difference from fp32 eager, the pick) and
    `vitkit bench --backend auto|onnx|openvino` (the rate and batch-1 latency of one engine)."""
    check_backend(backend)
    if dev.type != "cpu" or train or compile_:
        raise UsageError("--backend and --backends measure CPU inference engines: no --train, --compile or GPU")
    where = f"{torch.get_num_threads()} threads, {cpu_model()}"
    if table:
        if dtype not in ("auto", "fp32", "bf16"):
            raise UsageError(f"--backends measures fp32 and bf16 engines, not {dtype}")
        choice = choose(net, batch, refresh=True)
        d = choice.to_dict() | {"model": name, "cpu": cpu_model(), "threads": torch.get_num_threads()}
        if json_out:
            print(json.dumps(d, indent=1))
        else:
            print(f"{name} inference {net.config.img_size[0]}px batch {choice.batch} on cpu ({where}):")
            print(choice.format_table())
            print(f"--backend {choice.reason}")
        return d
    m = open_engine(net, backend, dtype, batch)
    choice = m.choice
    x = calibration_batch(net, batch)
    times = time_fn(lambda: m.run(x), dev, 2, 5, min_seconds)
    lat = statistics.median(time_fn(lambda: m.run(x[:1]), dev, 2, 10, 1.0)) * 1e3
    d = {"model": name, "backend": choice.name, "reason": choice.reason, "batch_size": batch, "cpu": cpu_model(),
         "threads": torch.get_num_threads(), "img_per_s": batch / statistics.median(times), "latency_ms_b1": lat}
    if json_out:
        print(json.dumps(d, indent=1))
    else:
        print(f"{name} inference {net.config.img_size[0]}px batch {batch} on {choice.name} ({where}): "
              f"{d['img_per_s']:.2f} img/s, latency (batch 1) {lat:.1f} ms")
    return d
