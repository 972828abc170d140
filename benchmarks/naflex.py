"""Native aspect ratios (NaFlex packing) against one square size: accuracy and throughput.

    python benchmarks/naflex.py accuracy [--seeds 0 1 2] [--epochs 4]
        The `fashion-mnist-naflex` preset (a plain ViT, patch 4, at most 49 patches per image, packed batches of mixed
        sizes) trained on Fashion-MNIST cut to random aspect ratios (1/3 to 3), and the same recipe on the same images
        squashed to 28x28 (what a fixed-size pipeline does), each evaluated on the test crops both ways: at native
        aspect ratio (packed, <= 49 patches) and squashed to 28x28 (49 patches). Final-epoch accuracy, per seed and
        mean +- sd; no choice is made on the test set.

    python benchmarks/naflex.py throughput [--model vit_b16] [--batch 16] [--budget 256] [--rounds 5]
        One batch of images of mixed sizes and aspect ratios (each resized, aspect kept, to <= budget patches),
        classified three ways in one interleaved run: packed (one forward of patch sequences, padded to the longest),
        padded (every image zero-padded to the batch's largest height and width: one rectangular batch, the
        position embedding at that grid) and square (every image resized to one square of the same budget,
        sqrt(budget) patches a side: its aspect ratio lost). img/s and the share of tokens spent on padding.

    python benchmarks/naflex.py padding [--model vit_s16] [--batch 8] [--budget 196] [--batches 12] [--rounds 3]
        A stream of packed batches whose longest image varies, as a service sees it, on the packed fast GEMM: every
        row padded to the batch's longest image, or to the budget (one shape per batch size), interleaved rounds.

Results are printed and written to benchmarks/results/naflex_<what>_<cpu>.json.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vitkit
from vitkit.data.image import EvalTransform
from vitkit.data.naflex import PackTransform
from vitkit.evaluation import evaluate
from vitkit.models.layers.packing import pack, resize_to_patches
from vitkit.training.presets import get_preset
from vitkit.training.trainer import train

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{info.get('Model name', '?').strip()} (CPU family {info.get('CPU family', '?').strip()})"
    except OSError:
        return platform.processor() or "unknown CPU"


def accuracy(args) -> dict:
    from vitkit.data.datasets import load_dataset

    spec = load_dataset("fashion-mnist-crops")
    test = spec.test
    rows = {}
    for mode in ("native", "square"):
        for seed in args.seeds:
            cfg = get_preset("fashion-mnist-naflex")
            cfg.schedule.epochs = args.epochs
            cfg.run.seed, cfg.run.out_dir = seed, f"{args.out}/{mode}-{seed}"
            cfg.run.progress = "off"
            if mode == "square":
                cfg.data.max_patches = None  # the in-memory crops resized to 28x28 (VarSizeDataset.squared)
            t0 = time.perf_counter()
            train(cfg, resume=False, force=True)
            secs = time.perf_counter() - t0
            model = vitkit.load(f"{cfg.run.out_dir}/final.safetensors").eval()
            c = model.config
            native = evaluate(model, test, PackTransform.for_model(c, 49), batch_size=500).acc1
            square = evaluate(model, test.squared(c.img_size), EvalTransform.for_model(c, geometry=False), batch_size=500).acc1
            rows.setdefault(mode, []).append({"seed": seed, "eval_native": native, "eval_square": square, "train_s": secs})
            print(f"trained {mode:6s} seed {seed}: test at native aspect {native:.4f}, squashed to 28x28 {square:.4f} "
                  f"({secs:.0f} s)", flush=True)
    print(f"\nFashion-MNIST crops (aspect 1/3-3), ViT D96 depth 4 patch 4, {args.epochs} epochs, {len(args.seeds)} seeds, "
          f"final-epoch test top-1, mean +- sd; {cpu_name()}\n")
    print("| trained on | evaluated at native aspect (packed, <= 49 patches) | evaluated squashed to 28x28 |")
    print("|---|---:|---:|")
    for mode, rs in rows.items():
        cells = []
        for key in ("eval_native", "eval_square"):
            v = [r[key] * 100 for r in rs]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cells.append(f"{statistics.mean(v):.2f} +- {sd:.2f} ({', '.join(f'{x:.2f}' for x in v)})")
        label = "native aspect, packed" if mode == "native" else "squashed to 28x28"
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    return {"cpu": cpu_name(), "epochs": args.epochs, "rows": rows}


def _images(n: int, seed: int, budget: int, patch: int) -> list[torch.Tensor]:
    """n images of random aspect ratios (1/3 to 3) and sizes, each resized to <= budget patches, normalised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = float(torch.empty(1).uniform_(-1.0986, 1.0986, generator=g).exp())  # log-uniform in [1/3, 3]
        h = int(torch.randint(200, 600, (1,), generator=g))
        w = max(16, int(h * a))
        H, W = resize_to_patches(h, w, (patch, patch), budget)
        out.append(torch.randn(3, H, W, generator=g))
    return out


def _rate(fn, n: int, rounds: int, seconds: float) -> list[float]:
    rates = []
    fn()  # warm-up
    for _ in range(rounds):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            k += 1
        rates.append(k * n / (time.perf_counter() - t0))
    return rates


@torch.no_grad()
def throughput(args) -> dict:
    torch.manual_seed(0)
    model = vitkit.create_model(args.model, num_classes=10).eval()
    p = model.config.patch_size[0]
    imgs = _images(args.batch, 0, args.budget, p)
    packed = pack(imgs, (p, p))
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    padded = torch.zeros(len(imgs), 3, H, W)
    for i, im in enumerate(imgs):
        padded[i, :, : im.shape[1], : im.shape[2]] = im
    n = int(math.isqrt(args.budget))
    side = (n * p, n * p)  # the same budget as one square: n x n patches per image
    square = torch.stack([torch.nn.functional.interpolate(im[None], size=side, mode="bilinear", antialias=True)[0] for im in imgs])
    model.set_dynamic_img_size(True)
    real = int(packed.valid.sum())
    tokens = {"packed": packed.valid.numel(), "padded": len(imgs) * (H // p) * (W // p),
              "square": len(imgs) * (side[0] // p) * (side[1] // p)}
    cases = {"packed": lambda: model(packed), "padded": lambda: model(padded), "square": lambda: model(square)}
    rates = {k: [] for k in cases}
    for _ in range(args.rounds):  # interleaved: the machine's drift hits every case alike
        for k, fn in cases.items():
            rates[k] += _rate(fn, len(imgs), 1, args.seconds)
    print(f"\n{args.model}, {len(imgs)} images of aspect 1/3-3 at <= {args.budget} patches ({real} real patches), "
          f"{torch.get_num_threads()} threads, fp32 eager; {cpu_name()}\n")
    print("| batch as | tokens computed | of which padding | img/s (median of rounds) | vs packed |")
    print("|---|---:|---:|---:|---:|")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k in cases:
        waste = 1 - real / tokens[k] if k != "square" else float("nan")
        waste_s = f"{waste:.1%}" if k != "square" else "0 (every image resized to one square: aspect lost)"
        print(f"| {k} | {tokens[k]} | {waste_s} | {med[k]:.1f} | {med[k] / med['packed']:.2f}x |")
    return {"cpu": cpu_name(), "model": args.model, "batch": len(imgs), "budget": args.budget, "real_patches": real,
            "tokens": tokens, "img_per_s": rates}


@torch.no_grad()
def padding(args) -> dict:
    """Rows padded to the longest image of each batch, or to the budget (one shape per batch size), on a stream of
    batches whose images (and so longest rows) vary, as a service sees them: the model set up as `vitkit serve` runs
    it (fp32 on the packed fast GEMM, `vitkit.machine.precision.for_inference`)."""
    from vitkit.machine.precision import for_inference

    torch.manual_seed(0)
    model = vitkit.create_model(args.model, num_classes=10).eval()
    for_inference(model, torch.device("cpu"), "fp32", args.batch)
    p = model.config.patch_size[0]
    stream = [_images(args.batch, 100 + i, args.budget, p) for i in range(args.batches)]
    cases = {"longest": lambda imgs: pack(imgs, (p, p)), "budget": lambda imgs: pack(imgs, (p, p), length=args.budget)}
    rates = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, make in cases.items():
            t0 = time.perf_counter()
            for imgs in stream:
                model(make(imgs))
            rates[k].append(len(stream) * args.batch / (time.perf_counter() - t0))
    print(f"\n{args.model}, {args.batches} batches of {args.batch} images (aspect 1/3-3, <= {args.budget} patches), fp32 on the "
          f"packed GEMM, {torch.get_num_threads()} threads; {cpu_name()}\n")
    print("| rows padded to | img/s per round | median |")
    print("|---|---|---:|")
    for k, v in rates.items():
        print(f"| {k} | {', '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} |")
    return {"cpu": cpu_name(), "model": args.model, "img_per_s": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a.add_argument("--epochs", type=int, default=4)
    a.add_argument("--out", default="runs/naflex-accuracy")
    t = sub.add_parser("throughput")
    t.add_argument("--model", default="vit_b16")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--budget", type=int, default=256)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--seconds", type=float, default=2.0)
    d = sub.add_parser("padding")
    d.add_argument("--model", default="vit_s16")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--budget", type=int, default=196)
    d.add_argument("--batches", type=int, default=12)
    d.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = {"accuracy": accuracy, "throughput": throughput, "padding": padding}[args.what](args)
    RESULTS.mkdir(exist_ok=True)
    tag = "".join(ch if ch.isalnum() else "_" for ch in cpu_name().split("(")[0].strip().lower())
    (RESULTS / f"naflex_{args.what}_{tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
