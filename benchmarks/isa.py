"""Each CPU speed choice on this machine as it is and capped to AVX2 (benchmarks/NOTES.md, section 23).

An AVX-512 CPU runs as an AVX2-only one (most laptops, many servers) under oneDNN's, MKL's and ATen's caps:
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2. This script runs the same
measurements in a child process under each, one after the other, and prints them side by side:

    python benchmarks/isa.py models   # training step and forward of the fashion-mnist preset's model and of S/16:
                                      # fp32 on the packed GEMM, fp32 on MKL, bf16 with and without the bf16 token stream
    python benchmarks/isa.py ops      # benchmarks/ops.py patch-embed and attention (bf16 fused vs explicit included)

Numbers are img/s from `vitkit.machine.precision.measure` (best of interleaved calls) or ms from ops.py (median of rounds).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

MODELS_CHILD = r"""
import json, torch, vitkit
from vitkit.machine.precision import measure
from vitkit.training import get_preset
cfg = get_preset("fashion-mnist")
models = {"fashion-mnist preset (28 px)": (vitkit.create_model(cfg.model.name, num_classes=10, img_size=28, in_chans=1,
                                                               **cfg.model.overrides), 256),
          "vit_s16 (224 px)": (vitkit.create_model("vit_s16", num_classes=1000), 8)}
rows = {}
cpu = torch.device("cpu")
for name, (m, batch) in models.items():
    for training in (True, False):
        b = min(batch, 32 if training else batch)
        packed = measure(m, cpu, batch=b, training=training, lowp_stream=True)
        plain = measure(m, cpu, batch=b, training=training, lowp_stream=False, fast_gemm=False)
        rows[f"{name}, {'training step' if training else 'forward'}, batch {b}"] = {
            "fp32 packed GEMM": packed["fp32"], "fp32 MKL": plain["fp32"],
            "bf16 + bf16 stream": packed.get("bf16", 0.0), "bf16": plain.get("bf16", 0.0)}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}))
"""


def child(code_or_args: list[str], capped: bool) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(CAPS if capped else {k: "" for k in CAPS})}
    out = subprocess.run([sys.executable, *code_or_args], env=env, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return out.stdout


def models() -> None:
    res = {tag: json.loads(child(["-c", MODELS_CHILD], capped).strip().splitlines()[-1])
           for tag, capped in (("native", False), ("AVX2 caps", True))}
    print(f"native: ATen {res['native']['capability']}; capped: ATen {res['AVX2 caps']['capability']} (img/s)")
    for row in res["native"]["rows"]:
        print(f"\n{row}")
        for tag, r in res.items():
            v = r["rows"][row]
            print(f"  {tag:<10} " + ", ".join(f"{k} {x:.0f}" for k, x in v.items())
                  + f"; bf16 stream / fp32 packed {v['bf16 + bf16 stream'] / v['fp32 packed GEMM']:.2f}x")


def ops() -> None:
    for what in ("patch-embed", "attention"):
        for tag, capped in (("native", False), ("AVX2 caps", True)):
            print(f"== ops.py {what}, {tag}")
            print(child([str(REPO / "benchmarks" / "ops.py"), what], capped), end="", flush=True)


if __name__ == "__main__":
    from vitkit.machine.cpu import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["models", "ops"])
    args = ap.parse_args()
    print(f"{cpu_model()}")
    {"models": models, "ops": ops}[args.what]()
