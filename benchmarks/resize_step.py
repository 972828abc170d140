"""What a training step costs at each size of progressive resizing (`schedule.resize_from`, benchmarks/NOTES.md
section 59): a preset's model taking any grid of patches, its optimizer, a batch of random images at each size,
compiled (or eager), the sizes timed in interleaved rounds; the median of each against the model's own size.

    python benchmarks/resize_step.py [--preset fashion-mnist-fast] [--precision fp32|bf16] [--sizes 16 20 24 28]
                                     [--threads 2] [--rounds 5] [--steps 10] [--eager]

Each size's first two steps (its compile) are timed apart. Run it alone: nothing else should share the cores.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vitkit.checkpoints import create_model
from vitkit.machine.cpu import cpu_model, isa_caps
from vitkit.training.optim import build_optimizer
from vitkit.training.presets import get_preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="fashion-mnist-fast")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 20, 24, 28], help="heights; the last is the reference")
    p.add_argument("--img-size", type=int, default=28, help="the model's size")
    p.add_argument("--in-chans", type=int, default=1)
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per size per round")
    p.add_argument("--eager", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset)
    batch = args.batch or cfg.data.batch_size
    ov = {**cfg.model.overrides, "img_size": args.img_size, "in_chans": args.in_chans, "crop_pct": 1.0,
          "dynamic_img_size": True}
    model = create_model(cfg.model.name, num_classes=10, **ov).train()
    opt = build_optimizer(model, cfg.optim)
    net = model if args.eager else torch.compile(model)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (batch,), generator=g)
    xs = {s: torch.randn(batch, args.in_chans, s, s, generator=g) for s in args.sizes}

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = net(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()

    caps = isa_caps()
    print(f"{cpu_model()}{f' (capped: {caps})' if caps else ''}; torch {torch.__version__}; {args.threads} threads; "
          f"{args.preset}'s model, batch {batch}, {args.precision}, {'eager' if args.eager else 'compiled'}", flush=True)
    first = {}
    for s, x in xs.items():  # each size's compile (and the optimizer's first step): timed apart
        t = time.perf_counter()
        step(x), step(x)
        first[s] = time.perf_counter() - t
    times: dict[int, list[float]] = {s: [] for s in xs}
    for rnd in range(args.rounds):
        for s in (list(xs) if rnd % 2 == 0 else list(xs)[::-1]):
            t = time.perf_counter()
            for _ in range(args.steps):
                step(xs[s])
            times[s].append((time.perf_counter() - t) / args.steps)
    ref = statistics.median(times[args.sizes[-1]])
    print("| size | pixels' share | ms/step | img/s | relative | first two steps (the compile) |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in xs:
        med = statistics.median(times[s])
        print(f"| {s} x {s} | {s * s / args.sizes[-1] ** 2:.2f} | {med * 1e3:.1f} | {batch / med:.0f} | "
              f"{med / ref:.2f} | {first[s]:.1f} s |")


if __name__ == "__main__":
    main()
