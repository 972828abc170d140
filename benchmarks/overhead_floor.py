"""The fixed cost of one forward in each engine: ViT-S/16's graph (12 blocks, 197 tokens, the same ops and the same
number of them) at a width where the arithmetic is nearly free (D 24, 6 heads of 4, MLP 96), so the time per call
is what an engine spends around the ops: dispatch, allocation, Python. Eager vitkit and vitkit's compiled engine
(an AOTInductor package, `vitkit export --format aoti`) against OpenVINO on vitkit's own ONNX export, batch 1,
interleaved rounds, the best of each.

    python benchmarks/overhead_floor.py [--model vit_s16] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.machine.cpu import cpu_model
from vitkit.bench import make_step
from vitkit.machine.engine import aoti_runner, engine
from vitkit.inference.export import export_model


def best_ms(fn, seconds: float = 1.0) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_s16")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    results = {}
    for label, kw in (("narrow (D 24)", dict(embed_dim=24, num_heads=6, mlp_dim=96)), ("full", {})):
        m = vitkit.create_model(args.model, **kw).eval()
        x = torch.randn(1, 3, *m.config.img_size)
        eager = make_step(m, x, args.dtype, False, False)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.onnx"
            export_model(m, path, "onnx", dynamic_batch=True)
            ov = engine("openvino", args.dtype, path, torch.get_num_threads())
            export_model(m, Path(d) / "m.pt2", "aoti", dynamic_batch=True, precision=args.dtype)
            compiled = aoti_runner(Path(d) / "m.pt2")
            xn = x.numpy().astype(np.float32)
            e, o, c = [], [], []
            for _ in range(args.rounds):
                e.append(best_ms(eager))
                c.append(best_ms(lambda: compiled(xn)))
                o.append(best_ms(lambda: ov(xn)))
        results[label] = (min(e), min(c), min(o))
    print(f"{args.model} graph, batch 1, {args.dtype}, {cpu_model()}, {torch.get_num_threads()} threads "
          f"(best ms per call):")
    for label, (e, c, o) in results.items():
        print(f"  {label:<14} vitkit eager {e:7.2f}   vitkit compiled {c:7.2f}   OpenVINO {o:7.2f}   "
              f"eager - OpenVINO {e - o:+6.2f}   compiled - OpenVINO {c - o:+6.2f}")


if __name__ == "__main__":
    main()
