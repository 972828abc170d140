"""Where a GPU step's time goes: wall time, GPU-busy time and kernel launches per call, vitkit against timm.

    python benchmarks/gpu_profile.py --model vit_b16 --batches 1 64 256

For each implementation and mode (bf16 autocast inference, bf16 autocast training step with fused AdamW),
it runs a few calls under `torch.profiler` and prints per call: the wall time, the summed time of the CUDA
kernels (if it is far below the wall time, the host cannot launch kernels fast enough: the call is
launch-bound, and only fewer kernels, CUDA graphs or `torch.compile` help), and the number of kernels.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.peers import SIZES, runner
import vitkit


def profile(fn, calls: int = 5) -> tuple[float, float, float]:
    """(wall ms, GPU kernel ms, kernels) per call."""
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / calls * 1e3
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / calls
    return wall, gpu_ms, len(kernels) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_b16", choices=list(SIZES))
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64, 256])
    args = ap.parse_args()
    import tempfile

    import timm
    from safetensors.torch import save_file

    dev = torch.device("cuda")
    ref = timm.create_model(SIZES[args.model]["timm"], pretrained=False, num_classes=1000)
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, f"{tmp}/w.safetensors")
        ours = vitkit.load(f"{tmp}/w.safetensors")
    impls = {"vitkit": ours.to(dev), "timm": ref.to(dev)}
    print(f"{args.model} on {torch.cuda.get_device_name()}, bf16 autocast; per call:")
    print("| impl | mode | batch | wall ms | GPU kernel ms | GPU busy | kernels |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for train in (False, True):
        for batch in args.batches:
            x = torch.randn(batch, 3, 224, 224, device=dev)
            for name, m in impls.items():
                fn = runner(m, "vitkit" if name == "vitkit" else "timm", x, "bf16", train)
                wall, gpu, n = profile(fn)
                print(f"| {name} | {'train' if train else 'inference'} | {batch} | {wall:.2f} | {gpu:.2f} | "
                      f"{gpu / wall:.0%} | {n:.0f} |", flush=True)


if __name__ == "__main__":
    main()
