"""vitkit's compiled engine (AOTInductor, `vitkit.machine.aoti`) against eager vitkit, ONNX Runtime and OpenVINO, in
one process, interleaved rounds: img/s per model, batch and precision, the ratios issue 44 asks for, each engine's
difference from eager fp32, and the compiled package's compile time, load time and first call.

    python benchmarks/compiled_engine.py [--models vit_s16 vit_b16] [--batches 1 8] [--precisions fp32 bf16]
        [--rounds 5] [--json-out FILE]

Every engine runs the same seeded weights (the head drawn too, so the logits are not all zero) on the same input:
eager fp32 (vitkit's packed fast GEMM), eager bf16 (autocast, packed bf16 weights), aoti-fp32 / aoti-bf16 (the
packages `vitkit export --format aoti [--precision bf16]` writes), ONNX Runtime fp32 on vitkit's ONNX export, OpenVINO
f32 / bf16 on the same file. bf16 rows run only where the CPU has bf16 instructions (`--precisions bf16` forces them).
Rounds: `vitkit.machine.engine_probe.interleaved_rounds` (every engine in turn, order reversed every other round,
each round at least --min-round-s), the median round's rate reported, the ratio the median of per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.inference.export import export_model
from vitkit.machine import aoti, engine, engine_probe
from vitkit.machine.cpu import bf16_native, cpu_model, isa_caps


def seeded_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitkit.create_model(name).eval()
    head = getattr(m, "head", None)
    if isinstance(head, torch.nn.Linear):
        torch.nn.init.normal_(head.weight, std=0.02)  # a fine-tuning head starts at zero: every logit would be 0
    return m


def ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of rate(a) / rate(b), from seconds per call."""
    return engine_probe.median([tb / ta for ta, tb in zip(a, b)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["vit_s16", "vit_b16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--precisions", nargs="+", default=None, help="default: fp32, and bf16 where the CPU has it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-round-s", type=float, default=0.5)
    p.add_argument("--no-peers", action="store_true", help="eager and compiled only")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    precisions = args.precisions or (["fp32", "bf16"] if bf16_native() else ["fp32"])
    threads = torch.get_num_threads()
    cpu = f"{cpu_model()}{', caps ' + isa_caps() if isa_caps() else ''}"
    print(f"{cpu}; {threads} threads; torch {torch.__version__}; Inductor ISA {aoti.vec_isa()}", flush=True)
    peers = not args.no_peers and engine.installed("onnx") and engine.installed("openvino")
    rows, compiles = [], []
    with tempfile.TemporaryDirectory(prefix="vitkit-compiled-") as d:
        for name in args.models:
            m = seeded_model(name)
            engines: dict[str, callable] = {}
            for prec in precisions:
                engines[f"eager-{prec}"] = engine.torch_runner(m, prec)
                path = Path(d) / f"{name}-{prec}.pt2"
                t0 = time.perf_counter()
                export_model(m, path, "aoti", precision=prec)
                compile_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                run = engine.aoti_runner(path)
                load_s = time.perf_counter() - t0
                x1 = engine.calibration_batch(m, 1)
                t0 = time.perf_counter()
                run(x1)
                first_s = time.perf_counter() - t0
                compiles.append({"model": name, "precision": prec, "compile_s": compile_s, "load_s": load_s,
                                 "first_call_s": first_s, "package_mb": path.stat().st_size / 2**20})
                print(f"{name} aoti-{prec}: compiled and checked in {compile_s:.1f} s, loaded in {load_s * 1e3:.0f} ms, "
                      f"first call (batch 1) {first_s * 1e3:.0f} ms, package {path.stat().st_size / 2**20:.0f} MiB",
                      flush=True)
                engines[f"aoti-{prec}"] = run
            if peers:
                onnx = Path(d) / f"{name}.onnx"
                export_model(m, onnx, "onnx")
                engines["onnx-fp32"] = engine.engine("onnx", "fp32", onnx, threads)
                for prec in precisions:
                    engines[f"openvino-{prec}"] = engine.engine("openvino", prec, onnx, threads)
            for batch in args.batches:
                x = engine.calibration_batch(m, batch)
                ref = engines["eager-fp32"](x).astype(np.float64) if "eager-fp32" in engines else None
                fns = {k: (lambda f=f: f(x)) for k, f in engines.items()}
                diffs = {k: float(np.abs(f(x) - ref).max()) if ref is not None else None for k, f in engines.items()}
                t = engine_probe.interleaved_rounds(fns, rounds=args.rounds, min_round_s=args.min_round_s)
                rate = {k: batch / engine_probe.median(v) for k, v in t.items()}
                for prec in precisions:
                    a = f"aoti-{prec}"
                    row = {"model": name, "batch": batch, "precision": prec, "cpu": cpu, "threads": threads,
                           "img_per_s": {k: rate[k] for k in rate if k.endswith(prec)},
                           "max_abs_vs_eager_fp32": {k: diffs[k] for k in diffs if k.endswith(prec)},
                           "aoti_vs": {k: ratio(t[a], t[k]) for k in t if k.endswith(prec) and k != a}}
                    rows.append(row)
                    vs = "  ".join(f"{k} {v:.2f}x" for k, v in row["aoti_vs"].items())
                    got = "  ".join(f"{k} {v:.1f}" for k, v in row["img_per_s"].items())
                    print(f"{name} batch {batch} {prec}: {got} img/s | {a} vs {vs} | max abs vs eager fp32 "
                          f"{diffs[a]:.2g}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu, "torch": torch.__version__, "rows": rows,
                                                   "compiles": compiles}, indent=1))


if __name__ == "__main__":
    main()
