"""Deployment side by side: vitkit eager against its ONNX export in onnxruntime (fp32 and int8), one run.

    python benchmarks/deploy.py speed [--models vit_s16 vit_b16] [--batches 1 8] [--seconds 3] [--rounds 3]
    python benchmarks/deploy.py accuracy --checkpoint runs/demo/best.safetensors   # int8's accuracy change, Fashion-MNIST

`speed` exports each model (random weights, 224 px, dynamic batch) to ONNX fp32 and int8 (onnxruntime's dynamic
quantization), then alternates timed rounds of the three on the same inputs: img/s per variant (median of the
rounds) and the ratio to eager. Eager runs as `vitkit bench` does (fp32, MKL-packed Linear weights).
`accuracy` evaluates a checkpoint on the 10,000 Fashion-MNIST test images three ways: eager, ONNX fp32, ONNX int8.
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

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _timed(fn, x, seconds: float) -> float:
    fn(x)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(x)
        n += len(x)
    return n / (time.perf_counter() - t0)


def speed(args) -> dict:
    from vitkit.machine.engine_probe import import_onnxruntime

    ort = import_onnxruntime()  # its telemetry off, as vitkit's own imports (docs/deploy.md)

    import vitkit
    from vitkit.inference.export import export_model
    from vitkit.machine.fast_linear import pack_linears

    results = {}
    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        torch.manual_seed(0)
        model = vitkit.create_model(name, num_classes=1000).eval()
        with torch.no_grad():
            torch.nn.init.normal_(model.head.weight, std=0.02)
        reports = {q: export_model(model, tmp / f"{name}-{q}.onnx", "onnx", dynamic_batch=True, quantize=None if q == "fp32" else "int8")
                   for q in ("fp32", "int8")}
        pack_linears(model)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        sessions = {q: ort.InferenceSession(str(r.path), opts, providers=["CPUExecutionProvider"]) for q, r in reports.items()}

        def eager(x):
            with torch.no_grad():
                return model(torch.from_numpy(x))

        runners = {"eager": eager, **{f"onnx-{q}": (lambda x, s=s: s.run(None, {"pixel_values": x})) for q, s in sessions.items()}}
        for batch in args.batches:
            x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
            rates = {k: [] for k in runners}
            for rnd in range(args.rounds):
                for k in (list(runners) if rnd % 2 == 0 else list(runners)[::-1]):
                    rates[k].append(_timed(runners[k], x, args.seconds))
            med = {k: statistics.median(v) for k, v in rates.items()}
            case = f"{name} batch {batch}"
            results[case] = {"img_per_s": med, "rounds": rates,
                             "max_abs_diff": {q: r.worst for q, r in reports.items()}}
            print(f"{case:<18} " + "  ".join(f"{k} {v:7.2f} img/s (x{v / med['eager']:.2f})" for k, v in med.items()), flush=True)
    return results


def accuracy(args) -> dict:
    from vitkit.machine.engine_probe import import_onnxruntime

    ort = import_onnxruntime()

    import vitkit
    from vitkit.data.datasets import load_dataset
    from vitkit.data.image import EvalTransform
    from vitkit.inference.export import export_model

    model = vitkit.load(args.checkpoint).eval()
    test = load_dataset("fashion-mnist").test
    tf = EvalTransform.for_model(model.config)
    tmp = Path(tempfile.mkdtemp())
    runners = {"eager": lambda x: model(torch.from_numpy(x)).numpy()}
    for q in ("fp32", "int8"):
        rep = export_model(model, tmp / f"{q}.onnx", "onnx", dynamic_batch=True, quantize=None if q == "fp32" else "int8")
        sess = ort.InferenceSession(str(rep.path), providers=["CPUExecutionProvider"])
        runners[f"onnx-{q}"] = lambda x, s=sess: s.run(None, {"pixel_values": x})[0]
    results = {}
    for name, run in runners.items():
        correct = 0
        with torch.no_grad():
            for i in range(0, len(test), 500):
                x = tf(test.images[i:i + 500]).numpy()
                correct += int((run(x).argmax(1) == test.labels[i:i + 500].numpy()).sum())
        results[name] = correct / len(test)
        print(f"{name:<10} top-1 {results[name]:.4f} on the {len(test)} Fashion-MNIST test images", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["speed", "accuracy"])
    p.add_argument("--models", nargs="+", default=["vit_s16", "vit_b16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--checkpoint", default="runs/demo/best.safetensors")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = speed(args) if args.what == "speed" else accuracy(args)
    if args.json:
        cpu = os.popen("lscpu | grep -E 'Model name|CPU family'").read().split("\n")
        Path(args.json).write_text(json.dumps({"cpu": [c.split(":", 1)[-1].strip() for c in cpu if c],
                                               "torch_threads": torch.get_num_threads(), "results": res}, indent=1))


if __name__ == "__main__":
    main()
