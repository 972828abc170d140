"""Where a CPU call's time goes: the GEMMs against everything else, and the GEMMs' own rate against the fastest
GEMM path measured in the same process (NOTES.md, section 20).

    python benchmarks/cpu_profile.py --model vit_b16 --dtype bf16 --batch 8          # inference
    python benchmarks/cpu_profile.py --model vit_b16 --dtype bf16 --batch 16 --train # a training step (AdamW)

Runs a few calls as `vitkit bench` times them (`vitkit.bench.make_step`: fp32 on the fastest GEMM path, bf16 under
autocast) under `torch.profiler`, sums each op's self CPU time into groups (the Linear GEMMs, attention, norms,
activations, elementwise, copies and casts, the optimizer, the rest) and prints per call: the wall time, each group's
share, and the rate the GEMMs reach (the model's Linear FLOPs over the GEMM time) beside the peak rate of that dtype
measured here. The gap between "the model's FLOP/s" and "the peak" splits into: GEMMs below the peak (small or
skinny shapes, packing) and time outside the GEMMs (attention, norms, GELU, casts, the optimizer).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.machine.cpu import cpu_model
from vitkit.machine.gemm import gemm_rates
from vitkit.bench import make_step

GROUPS = {  # op name (after "::") -> group; anything else is "other"
    "gemm": {"addmm", "mm", "linear", "_linear_pointwise", "_mkl_linear", "matmul"},
    "attention": {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                  "scaled_dot_product_attention", "bmm", "_softmax", "_softmax_backward_data", "softmax"},
    "norm": {"native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward"},
    "activation": {"gelu", "gelu_backward", "tanh", "tanh_backward", "relu", "threshold_backward"},
    "copies and casts": {"copy_", "to", "_to_copy", "contiguous", "clone", "cat", "transpose", "view", "reshape", "permute",
                         "expand", "split", "split_with_sizes", "select", "slice", "unbind", "t", "empty", "empty_strided",
                         "as_strided", "_reorder_linear_weight", "_mkl_reorder_linear_weight", "detach", "_unsafe_view",
                         "stack", "flatten", "narrow", "unsqueeze", "squeeze", "resize_"},
    "elementwise": {"add", "add_", "mul", "mul_", "div", "div_", "sub", "sum", "mean", "fill_", "zero_", "zeros_like",
                    "where", "dropout", "native_dropout", "neg", "exp", "log_softmax", "_log_softmax",
                    "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward", "cross_entropy_loss"},
}


def group(name: str) -> str:
    op = name.split("::")[-1]
    if op.startswith(("_foreach", "_fused_adam")):
        return "optimizer"
    return next((g for g, ops in GROUPS.items() if op in ops), "other")


def linear_flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of the forward's Linear (and patch-embedding) matmuls alone, counted as the calls happen."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitkit.models.stats import CPU_FLOPS

    with FlopCounterMode(display=False, custom_mapping=CPU_FLOPS) as fc, torch.no_grad():
        model(x)
    counts = fc.get_flop_counts().get("Global", {})
    return sum(v for k, v in counts.items() if str(k).split(".")[-1] in ("mm", "addmm", "_linear_pointwise", "_mkl_linear"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_b16")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = vitkit.create_model(args.model, num_classes=1000)
    c = model.config
    x = torch.randn(args.batch, c.in_chans, *c.img_size)
    step = make_step(model, x, args.dtype, args.train, False)
    for _ in range(2):
        step()
    rates = gemm_rates(args.dtype, "cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.calls):
            step()
    by = defaultdict(float)
    for e in prof.key_averages():
        by[group(e.key)] += e.self_cpu_time_total / 1e3 / args.calls  # ms per call
    total = sum(by.values())
    model.eval()
    gemm_fl = linear_flops(model, x) * (3 if args.train else 1)
    peak_name = max(rates, key=rates.get)
    print(f"{args.model} {'training step' if args.train else 'inference'} batch {args.batch} {args.dtype}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}")
    print(f"  per call: {total:.1f} ms of op self time; the {args.dtype} GEMM paths measured here (1024^3), GFLOP/s: "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items()))
    others = defaultdict(float)
    for e in prof.key_averages():
        if group(e.key) == "other":
            others[e.key] += e.self_cpu_time_total / 1e3 / args.calls
    for g, ms in sorted(by.items(), key=lambda kv: -kv[1]):
        extra = ", ".join(f"{k} {v:.1f}" for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:4]) if g == "other" else ""
        print(f"  {g:<17} {ms:8.1f} ms  {ms / total:6.1%}" + (f"  ({extra})" if extra else ""))
    if by["gemm"]:
        achieved = gemm_fl / (by["gemm"] / 1e3)
        print(f"  the Linear GEMMs: {gemm_fl / 1e9:.1f} GFLOP per call in {by['gemm']:.1f} ms = {achieved / 1e9:.0f} GFLOP/s, "
              f"{achieved / rates[peak_name]:.0%} of the peak ({peak_name}); the whole call: "
              f"{gemm_fl / (total / 1e3) / 1e9:.0f} GFLOP/s of Linear work")


if __name__ == "__main__":
    main()
