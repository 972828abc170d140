"""Where OpenVINO's time goes on the same model, beside vitkit's eager profile (`benchmarks/cpu_profile.py`): the
per-node performance counters of OpenVINO's CPU plugin summed by node type, and the kernels it ran.

    python benchmarks/openvino_profile.py --model vit_s16 --batch 1 --precision bf16

The model is vitkit's registry model (random weights, seeded) exported to ONNX as `--backend auto` does; OpenVINO
compiles it with PERF_COUNT on and INFERENCE_PRECISION_HINT set and read back. Prints per call the wall time, each
node type's share of the summed node time, and the kernel types (execType: brgemm_avx512_amx, jit_avx512, ...).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.machine.cpu import cpu_model
from vitkit.inference.export import export_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_s16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    from vitkit.machine.engine_probe import import_openvino, openvino_core

    ov = import_openvino()  # its usage telemetry off, as vitkit's own imports (docs/deploy.md)

    torch.manual_seed(0)
    m = vitkit.create_model(args.model).eval()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.onnx"
        export_model(m, path, "onnx", dynamic_batch=True)
        want = {"fp32": "f32", "bf16": "bf16"}[args.precision]
        compiled = openvino_core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": want, "PERF_COUNT": True,
                                                             "INFERENCE_NUM_THREADS": torch.get_num_threads()})
        req = compiled.create_infer_request()
        x = np.random.default_rng(0).standard_normal((args.batch, 3, *m.config.img_size)).astype(np.float32)
        for _ in range(3):
            req.infer({0: x})
        by_type: dict[str, float] = defaultdict(float)
        kernels: dict[str, set] = defaultdict(set)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            req.infer({0: x})
            for info in req.profiling_info:
                if info.status.name != "EXECUTED":
                    continue
                by_type[info.node_type] += info.real_time.total_seconds()
                kernels[info.node_type].add(info.exec_type)
        wall = (time.perf_counter() - t0) / args.calls
    total = sum(by_type.values()) / args.calls
    print(f"OpenVINO {ov.get_version()} {args.model} batch {args.batch} {args.precision} on {cpu_model()}, "
          f"{torch.get_num_threads()} threads: {wall * 1e3:.2f} ms per call ({args.batch / wall:.1f} img/s); "
          f"node time {total * 1e3:.2f} ms")
    for t, s in sorted(by_type.items(), key=lambda kv: -kv[1]):
        print(f"  {t:<22} {s / args.calls * 1e3:7.2f} ms  {s / args.calls / total:6.1%}  {', '.join(sorted(kernels[t]))}")


if __name__ == "__main__":
    main()
