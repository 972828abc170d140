"""How a ViT's cost grows with the number of tokens: throughput and peak memory against resolution and batch.

Every cell runs `vitkit bench ... --json-out` in a fresh process, so that one cell's memory high-water mark
never hides the next one's. Prints a Markdown table (the README's scaling table) and, with --json, the raw rows.

    python benchmarks/scaling.py                                  # S/16 and B/16, 224/384/512, CPU fp32
    python benchmarks/scaling.py --models vit_b16 vit_l16 --dtype bf16 --device cuda --batches 1 32 128

Columns: tokens = (res/16)^2 + 1; "cost/img vs 224" is the time per image relative to the same model,
batch and mode at 224 px, next to the token ratio: the difference is the attention's quadratic term
(and, for small batches, fixed per-call overheads).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run_cell(model: str, res: int, batch: int, mode: str, dtype: str, device: str, seconds: float) -> dict:
    cmd = [sys.executable, "-m", "vitkit", "bench", model, "--img-size", str(res), "--batch-size", str(batch),
           "--dtype", dtype, "--device", device, "--min-seconds", str(seconds), "--json-out"]
    if mode == "train":
        cmd.append("--train")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if out.returncode:
        return {"model": model, "img_size": res, "batch_size": batch, "mode": mode, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout[out.stdout.index("{"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["vit_s16", "vit_b16"])
    ap.add_argument("--resolutions", nargs="*", type=int, default=[224, 384, 512])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--modes", nargs="*", default=["inference", "train"], choices=["inference", "train"])
    ap.add_argument("--train-batch", type=int, default=8, help="batch for the training rows")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum measuring time per cell")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rows, base = [], {}
    print("| model | mode | res | tokens | batch | img/s | ms/img | peak MB above weights | GFLOP/img | % of matmul peak | tokens vs 224 | cost/img vs 224 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for mode in args.modes:
            for batch in (args.batches if mode == "inference" else [args.train_batch]):
                for res in args.resolutions:
                    r = run_cell(model, res, batch, mode, args.dtype, args.device, args.seconds)
                    rows.append(r)
                    tokens = (res // 16) ** 2 + 1
                    if "error" in r:
                        print(f"| {model} | {mode} | {res} | {tokens} | {batch} | error: {r['error']} |||||||", flush=True)
                        continue
                    ms = 1e3 / r["img_per_s"]
                    key = (model, mode, batch)
                    base.setdefault(key, (tokens, ms))
                    t0, ms0 = base[key]
                    mem = "n/a" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
                    print(f"| {model} | {mode} | {res} | {tokens} | {batch} | {r['img_per_s']:.2f} | {ms:.1f} | {mem} | "
                          f"{r['gflops_per_img']:.1f} | {r['fraction_of_peak']:.0%} | {tokens / t0:.2f}x | {ms / ms0:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
