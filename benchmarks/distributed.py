"""One machine's cores as one process or several: the same training run, img/s side by side.

    python benchmarks/distributed.py [--steps 120] [--rounds 2] [--preset fashion-mnist] [overrides ...]

Each round runs, one after the other, `vitkit train PRESET` for --steps optimizer steps as:
  1 process x N threads (run.threads=N), and N processes x 1 thread under DDP and under FSDP2 (`--nproc N`),
with the same global batch, and reads the training throughput from metrics.jsonl (the img/s of every logged
interval after the first 20 steps, which hold start-up and the first compilation of kernels). The rounds
alternate which goes first; the median per variant is printed with the ratio to the single process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(variant: str, nproc: int, steps: int, preset: str, overrides: list[str], out: Path) -> float:
    args = [sys.executable, "-m", "vitkit", "train", preset, f"run.out_dir={out}", "run.progress=false", "run.log_every=5",
            "run.eval_every=1000", "run.ckpt_every=100000", "--max-steps", str(steps), *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if variant == "1 process":
        args.append(f"run.threads={nproc}")
    else:
        args += ["--nproc", str(nproc), f"run.strategy={variant.split()[0]}", "run.threads=1"]
        env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        raise RuntimeError(f"{variant} failed:\n{res.stderr[-4000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["img_per_s"] for r in recs if "split" not in r and r["step"] > 20]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="fashion-mnist")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    variants = ["1 process", "ddp x1 thread", "fsdp x1 thread"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for v in order:
                r = run(v, args.nproc, args.steps, args.preset, args.overrides, Path(tmp) / f"{rnd}-{v.split()[0]}")
                rates[v].append(r)
                print(f"round {rnd + 1}: {v:<16} {r:8.1f} img/s", flush=True)
    base = statistics.median(rates["1 process"])
    print(f"\n{args.preset}, {args.steps} steps, {args.nproc} cores ({' '.join(args.overrides) or 'the preset as it is'}):")
    for v in variants:
        m = statistics.median(rates[v])
        print(f"  {v if v == '1 process' else f'{args.nproc} processes, ' + v:<34} {m:8.1f} img/s  x{m / base:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
