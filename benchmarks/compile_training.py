"""The training step compiled (`torch.compile`) against eager vitkit, as `run.compile=auto` measures it
(`vitkit.training.compile.measure`), and what auto decides for a run's length: the fashion-mnist preset's model at
its batch in the precision `run.precision=auto` picks here, and ViT-S/16 at batch 32 in fp32 (and bf16 where the
CPU has it).

    python benchmarks/compile_training.py [--cases preset s16-fp32 s16-bf16] [--json-out FILE]

Per case: eager and compiled seconds per step (median of interleaved rounds, on copies of the model with AdamW),
the compile's seconds (the first two compiled steps), and auto's decision for the preset's 10 epochs (2,340 steps)
and for 100 steps. Inductor's caches are left as they are: a second run of this script compiles from a warm cache.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.machine import precision as precision_mod
from vitkit.machine.cpu import bf16_native, cpu_model, isa_caps
from vitkit.training import compile as compile_mod
from vitkit.training.presets import run_config

PRESET_STEPS = 10 * (60000 // 256)  # the fashion-mnist preset: 10 epochs of 60,000 images at batch 256


def case(name: str) -> tuple[torch.nn.Module, int, str, bool]:
    torch.manual_seed(0)
    if name == "preset":
        cfg, _ = run_config("fashion-mnist")
        m = vitkit.create_model(cfg.model.name, num_classes=10, img_size=28, in_chans=1, **cfg.model.overrides)
        prec = precision_mod.resolve("auto", m, torch.device("cpu"), batch=256, training=True, lowp_stream=True).precision
        return m, 256, prec, True
    prec = name.split("-")[1]
    return vitkit.create_model("vit_s16"), 32, prec, False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["preset", "s16-fp32"] + (["s16-bf16"] if bf16_native() else []))
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    cpu = f"{cpu_model()}{', caps ' + isa_caps() if isa_caps() else ''}"
    print(f"{cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}", flush=True)
    rows = []
    for name in args.cases:
        m, batch, prec, lowp = case(name)
        r = compile_mod.measure(m, torch.device("cpu"), batch=batch, precision=prec, lowp_stream=lowp, fast_gemm=True,
                                steps=10**9, compile_s=0.0)
        speedup = r["eager_s"] / r["compiled_s"]
        verdicts = {}
        for steps in (100, PRESET_STEPS):
            saved = steps * (r["eager_s"] - r["compiled_s"])
            verdicts[steps] = "on" if speedup >= compile_mod.MARGIN and saved > r["compile_s"] else "off"
        row = {"case": name, "batch": batch, "precision": prec, "cpu": cpu, "eager_s": r["eager_s"],
               "compiled_s": r["compiled_s"], "compile_s": r["compile_s"], "speedup": speedup,
               "eager_img_per_s": batch / r["eager_s"], "compiled_img_per_s": batch / r["compiled_s"],
               "auto": verdicts, "rounds": r["rounds"]}
        rows.append(row)
        print(f"{name} batch {batch} {prec}: eager {row['eager_img_per_s']:.1f} img/s, compiled "
              f"{row['compiled_img_per_s']:.1f} img/s ({speedup:.2f}x), compile {r['compile_s']:.0f} s; auto: "
              f"100 steps -> {verdicts[100]}, {PRESET_STEPS} steps -> {verdicts[PRESET_STEPS]}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
