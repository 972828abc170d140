"""One training step under each strategy: the plain loop, DDP and FSDP2, each with and without activation
checkpointing; speed, the memory a step takes, and the model FLOP utilisation, side by side in one run.

    python benchmarks/train_step.py [--device cpu|cuda] [--models vit_s16 ...] [--batch 16] [--precision fp32|bf16]
        [--variants plain ddp fsdp] [--checkpointing off on] [--steps 6] [--rounds 3] [--json OUT]
    torchrun --nproc-per-node 8 benchmarks/train_step.py --device cuda --variants ddp fsdp ...   # several GPUs

Alone (no torchrun) the script makes a process group of one (gloo on a CPU, NCCL on CUDA), so DDP and FSDP2 run at
world size 1 beside the plain loop: their overhead when there is nothing to communicate. Under torchrun every
rank runs the same cases at --batch images each; rank 0 prints. The step is the trainer's: `wrap_model` and
`build_optimizer` of vitkit's trainer (AdamW), autocast for the plain loop and DDP, FSDP2's mixed-precision policy
for FSDP2, vitkit's packed-GEMM Linears in fp32 on a CPU.

Per case: img/s over all ranks (median over rounds; the rounds alternate the order of the cases), the step's
peak memory above the weights and optimizer state (CUDA's allocator peak, in the timed process; on a CPU, at
world size 1, the growth of resident memory over one step in a child process whose glibc maps every large block
and unmaps it when freed, so that resident memory follows the live tensors: slower, hence not the timed one), and
the MFU:
3 x the forward's FLOPs (vitkit.models.stats.count_flops) per image x img/s over --peak-tflops x ranks (default: the
fastest GEMM measured on this device in this dtype by vitkit.bench.gemm_rates, the peak `vitkit bench` uses).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vitkit.bench import DTYPES, PeakMemory  # noqa: E402
from vitkit.machine.cpu import cpu_model  # noqa: E402
from vitkit.machine.gemm import gemm_rates  # noqa: E402
from vitkit.training.distributed import Dist, wrap_model  # noqa: E402
from vitkit import create_model  # noqa: E402
from vitkit.machine.fast_linear import pack_linears  # noqa: E402
from vitkit.models.stats import count_flops  # noqa: E402
from vitkit.training.config import OptimConfig  # noqa: E402
from vitkit.training.optim import build_optimizer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allocated(device: torch.device) -> int:
    """Bytes allocated now: CUDA's allocator, or the process's resident memory."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else (PeakMemory._rss_kb("VmRSS") or 0) * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_step_memory(name: str, variant: str, ckpt: bool) -> dict:
    """The step's peak resident-memory growth and what its forward holds (MB), measured by this script in a child
    process (see the top)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    argv = [a for a in sys.argv[1:]]
    res = subprocess.run([sys.executable, __file__, *argv, "--memory-of", f"{name},{variant},{int(ckpt)}"], env=env,
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_case(name: str, variant: str, ckpt: bool, args, dist: Dist, steps: int | None = None) -> dict:
    """Build the model for one case, take warm-up steps, then the step's memory (CUDA) and its time."""
    device, precision = dist.device, args.precision
    torch.manual_seed(0)
    model = create_model(name, num_classes=1000, **({"img_size": args.img_size} if args.img_size else {})).to(device)
    model.set_grad_checkpointing(ckpt)
    if precision == "fp32" and device.type == "cpu":
        pack_linears(model, training=True)  # the trainer's fp32 CPU path
    flops = count_flops(model, model.config.img_size, model.config.in_chans)
    net = wrap_model(model, dist, {"plain": "none"}.get(variant, variant), precision)
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4))
    amp = None if variant == "fsdp" else DTYPES.get(precision) if precision != "fp32" else None
    g = torch.Generator().manual_seed(dist.rank)
    x = torch.randn(args.batch, model.config.in_chans, *model.config.img_size, generator=g).to(device)
    y = torch.randint(0, 1000, (args.batch,), generator=g).to(device)

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            return F.cross_entropy(net(x).float(), y)

    def backward_and_update(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        backward_and_update(forward())

    for _ in range(args.warmup):  # the optimizer's state exists after the first
        step()
    _sync(device)
    gc.collect()
    with PeakMemory(device) as mem:  # the step's peak; and what the forward leaves for the backward
        loss = forward()
        _sync(device)
        held = _allocated(device) - mem.base
        backward_and_update(loss)
        del loss
        _sync(device)
    times = []
    for _ in range(args.steps if steps is None else steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    dist.barrier()
    step_s = statistics.median(times) if times else float("nan")
    out = {"model": name, "variant": variant, "checkpointing": ckpt, "step_ms": step_s * 1e3,
           "img_per_s": args.batch * dist.world / step_s, "step_peak_mb": None if mem.peak is None else mem.peak / 2**20,
           "activations_mb": held / 2**20,
           "gflops_per_img": flops / 1e9}
    return out


def release(device: torch.device) -> None:
    """Free what the last case left: CUDA's cached blocks, or glibc's heap (a child measuring memory runs next)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", default=["vit_s16"])
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=16, help="images per rank")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--variants", nargs="+", default=["plain", "ddp", "fsdp"], choices=("plain", "ddp", "fsdp"))
    p.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=("off", "on"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="per device (default: the fastest GEMM measured here)")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # the child measuring a CPU step's memory
    args = p.parse_args()

    device = torch.device(args.device)
    if "RANK" not in os.environ:  # alone: a process group of one, so that DDP and FSDP2 can run
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist = Dist.from_env(device)
    if args.memory_of:
        name, variant, ckpt = args.memory_of.split(",")
        try:
            r = run_case(name, variant, ckpt == "1", args, dist, steps=0)
            print(json.dumps({k: r[k] for k in ("step_peak_mb", "activations_mb")}))
        finally:
            dist.close()
        return
    if "plain" in args.variants and dist.world > 1:
        raise SystemExit("--variants plain runs alone: drop it under torchrun with several processes")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else max(gemm_rates(args.precision, dist.device).values())
    say = print if dist.main else (lambda *a, **k: None)
    dev_name = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else cpu_model()
    say(f"{dev_name}; torch {torch.__version__}; {dist.world} process(es) x {torch.get_num_threads()} threads; "
        f"{args.precision}, batch {args.batch} per rank; peak {peak / 1e12:.2f} TFLOP/s per device", flush=True)
    cases = [(m, v, c == "on") for m in args.models for c in args.checkpointing for v in args.variants]
    results: dict[tuple, list[dict]] = {c: [] for c in cases}
    try:
        for rnd in range(args.rounds):
            for case in (cases if rnd % 2 == 0 else cases[::-1]):
                # on a CPU once per case, in a child process (see the top), while this one holds no model
                mem = cpu_step_memory(*case) if device.type == "cpu" and rnd == 0 and dist.world == 1 else None
                r = run_case(*case, args, dist)
                release(device)
                if device.type == "cpu":
                    r.update(mem or {"step_peak_mb": None, "activations_mb": None})
                results[case].append(r)
                say(f"round {rnd + 1}: {r['model']:<9} {r['variant']:<6} ckpt {'on ' if r['checkpointing'] else 'off'} "
                    f"{r['img_per_s']:8.2f} img/s", flush=True)
    finally:
        dist.close()
    rows = []
    for rs in results.values():
        ips = statistics.median(r["img_per_s"] for r in rs)
        mems = [r["step_peak_mb"] for r in rs if r["step_peak_mb"] is not None]
        acts = [r["activations_mb"] for r in rs if r["activations_mb"] is not None]
        rows.append({**rs[0], "img_per_s": ips, "step_ms": statistics.median(r["step_ms"] for r in rs),
                     "step_peak_mb": statistics.median(mems) if mems else None,
                     "activations_mb": statistics.median(acts) if acts else None,
                     "mfu": 3 * rs[0]["gflops_per_img"] * 1e9 * ips / (peak * dist.world), "rounds": [r["img_per_s"] for r in rs]})
    base = {(r["model"], r["checkpointing"]): r["img_per_s"] for r in rows if r["variant"] == rows[0]["variant"]}
    no_ckpt = {(r["model"], r["variant"]): r for r in rows if not r["checkpointing"]}
    say(f"\n| model | strategy | act. ckpt | img/s | vs {rows[0]['variant']} | vs no ckpt | activations MB | step peak MB | MFU |")
    say("|---|---|---|---:|---:|---:|---:|---:|---:|")
    mb = lambda v: "n/a" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        ref = no_ckpt.get((r["model"], r["variant"]))  # none when only checkpointing on was asked for
        vs_off = f"{r['img_per_s'] / ref['img_per_s']:.3f}" if ref else "n/a"
        say(f"| {r['model']} | {r['variant']} | {'on' if r['checkpointing'] else 'off'} | {r['img_per_s']:.2f} | "
            f"{r['img_per_s'] / base[(r['model'], r['checkpointing'])]:.3f} | {vs_off} | "
            f"{mb(r['activations_mb'])} | {mb(r['step_peak_mb'])} | {100 * r['mfu']:.1f}% |")
    if args.json and dist.main:
        Path(args.json).write_text(json.dumps({"device": dev_name, "torch": torch.__version__, "world_size": dist.world,
                                               "threads": torch.get_num_threads(), "precision": args.precision,
                                               "batch_per_rank": args.batch, "peak_tflops": peak / 1e12, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
