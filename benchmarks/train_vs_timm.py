"""vitkit's training step (and inference call) against timm's, on the same weights, in one process, interleaved.

    /tmp/peers/bin/python benchmarks/train_vs_timm.py                       # the default cases, 5 rounds
    /tmp/peers/bin/python benchmarks/train_vs_timm.py --cases vit_s16:train:fp32:8 --rounds 7 --json out.json
    /tmp/peers/bin/python benchmarks/train_vs_timm.py --optimizer fused     # both sides on one AdamW kernel
    /tmp/peers/bin/python benchmarks/train_vs_timm.py --vitkit /tmp/base_f  # another checkout's vitkit (a before)
    /tmp/peers/bin/python benchmarks/train_vs_timm.py --profile vit_s16:train:fp32:8   # where each step's time goes

A case is model:train|infer:fp32|bf16:batch (224 px). Each builds timm's model (`timm.create_model`, a random
non-zero head), writes its weights and loads them into vitkit (`vitkit.load`), so both start from the same
numbers; the first training step's losses are printed side by side (same images, same labels).

The training step, each as its library trains (the same settings: AdamW, lr 1e-4, betas (0.9, 0.999), weight
decay 0.05 off norms and biases, no clipping, cross-entropy on fp32 logits, bf16 under `torch.autocast`):
- vitkit: the trainer's pieces: `vitkit.training.optim.build_optimizer` (its AdamW kernel) and, in fp32 on a CPU,
  `pack_linears(training=True)` (`run.fast_gemm`, the packed-GEMM Linears); `run.lowp_stream` off (the default);
- timm: `timm.optim.create_optimizer_v2(model, "adamw", ...)`, what timm's train.py builds: torch.optim.AdamW at
  its defaults, which on a CPU is the single-tensor (for-loop) kernel.
`--optimizer fused|foreach|single` puts both sides on that torch.optim.AdamW kernel instead, which leaves the models
alone to differ. Inference: vitkit as `vitkit bench` / `predict` call it (`vitkit.bench.make_step`: packed weights,
bf16 weights cast once), timm's model under `torch.inference_mode()`.

Timing: a warm-up, then --rounds rounds; in each, every implementation runs steps for --seconds (at least --steps)
and is timed by its median step; the order alternates per round. Per case: img/s median and spread (min-max) over
rounds, the vitkit/timm ratio of each round and their median, and in how many rounds vitkit was ahead; beside it
the ratio of the process's CPU time per call (timm's over vitkit's), which at one thread (OMP_NUM_THREADS=1) other
processes' load distorts less than the wall time. The CPU's 1-minute load average is printed before and after each
case (a shared machine's timings mean little).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _vitkit_path() -> str:
    """--vitkit PATH (before anything imports vitkit): that checkout's package, else this repository's."""
    for i, a in enumerate(sys.argv):
        if a == "--vitkit" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--vitkit="):
            return a.split("=", 1)[1]
    return str(REPO)


sys.path.insert(0, _vitkit_path())

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vitkit  # noqa: E402
from vitkit.bench import make_step  # noqa: E402
from vitkit.machine import gemm  # noqa: E402
from vitkit.machine.cpu import cpu_model  # noqa: E402
from vitkit.machine.fast_linear import pack_linears  # noqa: E402
from vitkit.training.config import OptimConfig  # noqa: E402
from vitkit.training.optim import build_optimizer  # noqa: E402

TIMM_NAMES = {"vit_s16": "vit_small_patch16_224", "vit_b16": "vit_base_patch16_224", "vit_t16": "vit_tiny_patch16_224"}
DEFAULT_CASES = [f"{m}:train:{d}:{b}" for m in ("vit_s16", "vit_b16") for d in ("fp32", "bf16") for b in (8, 32)] \
    + [f"{m}:infer:{d}:8" for m in ("vit_s16", "vit_b16") for d in ("fp32", "bf16")]
LR, WD, BETAS = 1e-4, 0.05, (0.9, 0.999)


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def build(name: str, tmp: Path, img: int = 224):
    """timm's model with a random non-zero head, and vitkit's model loaded from its weights."""
    import timm
    from safetensors.torch import save_file

    ref = timm.create_model(TIMM_NAMES[name], pretrained=False, num_classes=1000, img_size=img)
    torch.nn.init.normal_(ref.get_classifier().weight, std=0.02)
    path = tmp / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    return ref, vitkit.load(path)


def make_optimizer(side: str, model: torch.nn.Module, which: str) -> torch.optim.Optimizer:
    """'own': each library's own optimizer; otherwise torch.optim.AdamW with that kernel on both sides, over each
    library's own parameter groups (weight decay off norms and biases on both)."""
    if side == "vitkit":
        opt = build_optimizer(model, OptimConfig(name="adamw", lr=LR, weight_decay=WD, betas=BETAS, clip_grad=None))
    else:
        from timm.optim import create_optimizer_v2

        opt = create_optimizer_v2(model, "adamw", lr=LR, weight_decay=WD, betas=BETAS)
    if which == "own":
        return opt
    kernel = {"fused": {"fused": True, "foreach": False}, "foreach": {"fused": False, "foreach": True},
              "single": {"fused": False, "foreach": False}}[which]
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach", "differentiable", "capturable")}
              for g in opt.param_groups]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, **kernel)


def optimizer_kernel(opt: torch.optim.Optimizer) -> str:
    d = opt.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "single-tensor"


def train_step(side: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: str, which: str):
    model.train()
    if side == "vitkit" and dtype == "fp32":
        pack_linears(model, training=True)  # run.fast_gemm (the default) in an fp32 CPU run
    opt = make_optimizer(side, model, which)
    amp = dtype == "bf16"
    losses: list[float] = []

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not losses:
            losses.append(loss.item())

    return step, opt, losses


def infer_step(side: str, model: torch.nn.Module, x: torch.Tensor, dtype: str):
    if side == "vitkit":
        return make_step(model, x, dtype, False, False)
    model.eval()

    def infer() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            model(x)

    return infer


def measure(fn, seconds: float, steps: int) -> tuple[float, float]:
    """The median wall time of one call over at least `seconds` and `steps` calls, and the process's CPU time per
    call (all threads, user and system: at one thread, a measure of the work that other processes' load distorts
    less than the wall time, though their use of caches and memory still shows)."""
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    c0 = time.process_time()
    while time.perf_counter() < t_end or len(times) < steps:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), (time.process_time() - c0) / len(times)


def profile(fns: dict, steps: int) -> None:
    """Each side's self CPU time per op over `steps` calls, the top ops, per call (after the warm-up)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for side, fn in fns.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in rows)
        print(f"  {side}: {total / steps / 1e3:.1f} ms of op self time per call")
        for e in rows[:22]:
            print(f"    {e.key:<58} {e.self_cpu_time_total / steps / 1e3:8.2f} ms  {e.count // steps:>5} calls")


def run_case(case: str, args, tmp: Path) -> dict:
    name, mode, dtype, batch = case.split(":")
    batch, train = int(batch), mode == "train"
    torch.manual_seed(0)
    ref, ours = build(name, tmp)
    x = torch.randn(batch, 3, 224, 224)
    y = torch.randint(0, 1000, (batch,))
    with torch.no_grad():
        ours.eval(), ref.eval()
        diff = (ours(x[:2]) - ref(x[:2])).abs().max().item()
    models = {"vitkit": ours, "timm": ref}
    kernels, losses = {}, {}
    if train:
        fns = {}
        for side, m in models.items():
            fns[side], opt, losses[side] = train_step(side, m, x, y, dtype, args.optimizer)
            kernels[side] = optimizer_kernel(opt)
    else:
        fns = {side: infer_step(side, m, x, dtype) for side, m in models.items()}
    load_before = load1()
    for fn in fns.values():  # warm-up: the GEMM choice, packing, first-call allocations
        for _ in range(args.warmup):
            fn()
    if args.profile:
        print(f"{case}: torch.profiler, {args.profile_steps} calls each after {args.warmup} warm-up")
        profile(fns, args.profile_steps)
        return {}
    speeds: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(args.rounds):
        for k in order:
            t, c = measure(fns[k], args.seconds, args.steps)
            speeds[k].append(batch / t)
            cpu[k].append(c)
        order.reverse()
    ratios = [a / b for a, b in zip(speeds["vitkit"], speeds["timm"])]
    cpu_ratios = [b / a for a, b in zip(cpu["vitkit"], cpu["timm"])]  # timm's CPU time over vitkit's: > 1 is ahead
    row = {"case": case, "batch": batch, "optimizer": args.optimizer if train else None,
           "optimizer_kernels": kernels, "first_loss": losses and {k: v[0] for k, v in losses.items()},
           "max_abs_logit_diff_fp32_eval": diff,
           "vitkit_img_s": speeds["vitkit"], "timm_img_s": speeds["timm"], "round_ratios": ratios,
           "vitkit_median": statistics.median(speeds["vitkit"]), "timm_median": statistics.median(speeds["timm"]),
           "ratio_median": statistics.median(ratios), "ahead": sum(r > 1 for r in ratios),
           "vitkit_cpu_s": cpu["vitkit"], "timm_cpu_s": cpu["timm"], "cpu_ratios": cpu_ratios,
           "cpu_ratio_median": statistics.median(cpu_ratios),
           "load1_before": load_before, "load1_after": load1()}
    picked: dict[str, dict[str, int]] = {}  # the GEMM paths vitkit's layers run on, by kind, over the process so far
    for label, c in gemm.choices().items():
        kind = next((k for k in ("dW", "training dX", "training") if label.startswith(k)), "forward")
        picked.setdefault(kind, {}).setdefault(c["path"], 0)
        picked[kind][c["path"]] += 1
    row["gemm_paths"] = picked
    v, t = speeds["vitkit"], speeds["timm"]
    print(f"{case:<22} vitkit {row['vitkit_median']:7.2f} img/s ({min(v):.2f}-{max(v):.2f})  timm {row['timm_median']:7.2f} "
          f"({min(t):.2f}-{max(t):.2f})  ratio {row['ratio_median']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}), ahead "
          f"{row['ahead']}/{len(ratios)}; rounds {' '.join(f'{r:.3f}' for r in ratios)}"
          + (f"; AdamW {kernels['vitkit']} / {kernels['timm']}, first loss {losses['vitkit'][0]:.5f} / "
             f"{losses['timm'][0]:.5f}" if train else "")
          + f"; CPU s per call: ratio {row['cpu_ratio_median']:.3f} ({min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})"
          + f"; load {load_before:.2f} -> {row['load1_after']:.2f}; GEMM paths chosen so far {picked}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="model:train|infer:fp32|bf16:batch")
    ap.add_argument("--optimizer", default="own", choices=["own", "fused", "foreach", "single"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="per implementation per round")
    ap.add_argument("--steps", type=int, default=3, help="at least this many calls per implementation per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vitkit", default=str(REPO), help="the checkout whose vitkit runs (read before the imports)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler per side instead of the timing")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import timm

    cpu = f"{cpu_model()}, {torch.get_num_threads()} threads"
    print(f"{cpu}; torch {torch.__version__}, timm {timm.__version__}, vitkit from {Path(vitkit.__file__).parent}; "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}; load {Path('/proc/loadavg').read_text().strip()}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmpd:
        for case in args.cases:
            rows.append(run_case(case, args, Path(tmpd)))
    if args.json and not args.profile:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "torch": torch.__version__, "timm": timm.__version__,
                                               "vitkit": str(Path(vitkit.__file__).parent), "argv": sys.argv,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
