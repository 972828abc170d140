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
peak memory above the weights and optimizer state (CUDA's allocator peak; on a CPU the growth of the process's
resident memory, with glibc's mmap threshold fixed so that freed activations leave the process), and the MFU:
3 x the forward's FLOPs (vitkit.stats.count_flops) per image x img/s over --peak-tflops x ranks (default: the
fastest GEMM measured on this device in this dtype by vitkit.bench.gemm_rates, the peak `vitkit bench` uses).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# glibc keeps freed blocks below its (growing) mmap threshold in the heap: resident memory would then show the
# largest step so far, not this one's. A fixed threshold maps every large block and unmaps it on free.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vitkit.bench import DTYPES, PeakMemory, cpu_model, gemm_rates  # noqa: E402
from vitkit.distributed import Dist, wrap_model  # noqa: E402
from vitkit.models import create_model  # noqa: E402
from vitkit.models.layers.linear import pack_linears  # noqa: E402
from vitkit.stats import count_flops  # noqa: E402
from vitkit.training.config import OptimConfig  # noqa: E402
from vitkit.training.optim import build_optimizer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(name: str, variant: str, ckpt: bool, args, dist: Dist) -> dict:
    """Build the model for one case, take warm-up steps, then the step's memory and its time."""
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

    def step() -> None:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = F.cross_entropy(net(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # the optimizer's state exists after the first
        step()
    _sync(device)
    gc.collect()
    with PeakMemory(device) as mem:
        step()
        _sync(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    dist.barrier()
    step_s = statistics.median(times)
    out = {"model": name, "variant": variant, "checkpointing": ckpt, "step_ms": step_s * 1e3,
           "img_per_s": args.batch * dist.world / step_s, "step_peak_mb": None if mem.peak is None else mem.peak / 2**20,
           "gflops_per_img": flops / 1e9}
    del net, model, opt, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


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
    args = p.parse_args()

    device = torch.device(args.device)
    if "RANK" not in os.environ:  # alone: a process group of one, so that DDP and FSDP2 can run
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist = Dist.from_env(device)
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
                r = run_case(*case, args, dist)
                results[case].append(r)
                say(f"round {rnd + 1}: {r['model']:<9} {r['variant']:<6} ckpt {'on ' if r['checkpointing'] else 'off'} "
                    f"{r['img_per_s']:8.2f} img/s", flush=True)
    finally:
        dist.close()
    rows = []
    for (m, v, c), rs in results.items():
        ips = statistics.median(r["img_per_s"] for r in rs)
        mems = [r["step_peak_mb"] for r in rs if r["step_peak_mb"] is not None]
        rows.append({**rs[0], "img_per_s": ips, "step_ms": statistics.median(r["step_ms"] for r in rs),
                     "step_peak_mb": statistics.median(mems) if mems else None,
                     "mfu": 3 * rs[0]["gflops_per_img"] * 1e9 * ips / (peak * dist.world), "rounds": [r["img_per_s"] for r in rs]})
    base = {(r["model"], r["checkpointing"]): r["img_per_s"] for r in rows if r["variant"] == rows[0]["variant"]}
    no_ckpt = {(r["model"], r["variant"]): r for r in rows if not r["checkpointing"]}
    say(f"\n| model | strategy | act. ckpt | img/s | vs {rows[0]['variant']} | step peak MB | vs no ckpt | MFU |")
    say("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = no_ckpt.get((r["model"], r["variant"]))
        mem_ratio = (f"{r['step_peak_mb'] / ref['step_peak_mb']:.2f}x" if ref and r["step_peak_mb"] and ref["step_peak_mb"]
                     else "")
        mb = f"{r['step_peak_mb']:.0f}" if r["step_peak_mb"] is not None else "n/a"
        say(f"| {r['model']} | {r['variant']} | {'on' if r['checkpointing'] else 'off'} | {r['img_per_s']:.2f} | "
            f"{r['img_per_s'] / base[(r['model'], r['checkpointing'])]:.3f} | {mb} | {mem_ratio} | {100 * r['mfu']:.1f}% |")
    if args.json and dist.main:
        Path(args.json).write_text(json.dumps({"device": dev_name, "torch": torch.__version__, "world_size": dist.world,
                                               "threads": torch.get_num_threads(), "precision": args.precision,
                                               "batch_per_rank": args.batch, "peak_tflops": peak / 1e12, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
