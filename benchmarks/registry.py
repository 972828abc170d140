"""`vitkit bench` over every registered model: one Markdown row per model, one process, one measured matmul peak.

    python benchmarks/registry.py                                   # CPU, fp32, inference, batch 1
    python benchmarks/registry.py --device cuda --dtype bf16 --batch 64 --train --json registry.json

Each row is `vitkit.bench.bench_model` (the code behind `vitkit bench`): images/s, latency at batch 1,
peak memory, GFLOP per image and the fraction of the matmul peak measured once at the start. On a GPU
the peak memory is the allocator's peak above the weights; on a CPU it is the process's peak RSS, which
one process shares between rows, so use `benchmarks/scaling.py` (a process per cell) for CPU memory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vitkit import create_model, list_models
from vitkit.bench import bench_model
from vitkit.machine.gemm import matmul_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="default: every registered model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--train", action="store_true", help="also time a training step per model")
    ap.add_argument("--train-batch", type=int, default=None, help="default: --batch")
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum measuring time per row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    peak = matmul_peak(args.dtype, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} on {where}; measured {args.dtype} matmul peak {peak / 1e12:.2f} TFLOP/s\n")
    print("| model | mode | batch | img/s | latency b1 ms | peak MB | GFLOP/img | TFLOP/s | % of matmul peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in args.models or list_models():
        for train in ([False, True] if args.train else [False]):
            batch = (args.train_batch or args.batch) if train else args.batch
            torch.manual_seed(0)
            try:
                r = bench_model(create_model(name), name, batch_size=batch, dtype=args.dtype, train=train, device=device,
                                warmup=2, iters=3, min_seconds=args.seconds, peak=peak).to_dict()
            except torch.OutOfMemoryError:
                print(f"| {name} | {'train' if train else 'inference'} | {batch} | out of memory ||||||", flush=True)
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(r)
            lat = "-" if r["latency_ms_b1"] is None else f"{r['latency_ms_b1']:.1f}"
            mem = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
            print(f"| {name} | {r['mode']} | {batch} | {r['img_per_s']:.1f} | {lat} | {mem} | {r['gflops_per_img']:.1f} | "
                  f"{r['achieved_tflops']:.2f} | {r['fraction_of_peak']:.0%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "peak": peak, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
