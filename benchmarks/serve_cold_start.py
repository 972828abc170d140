"""`vitkit serve --backend aoti` from a cold cache and a warm one: seconds from the command's start to its first
answer (GET /healthz ready, then one POST /predict), and that first request's own latency, beside `--backend torch`.

    python benchmarks/serve_cold_start.py [--model vit_s16] [--port 8765]

A checkpoint of the model (seeded weights) is written to a temporary folder; VITKIT_HOME is a fresh temporary
folder, so the first aoti start compiles the package (cold) and the second loads it from the cache (warm).
Inductor's own cache (/tmp/torchinductor_$USER) is left as it is: say whether it was warm when you report.
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

import vitkit
from vitkit.machine.cpu import cpu_model


def first_answer(ckpt: Path, backend: str, port: int, env: dict, png: bytes) -> tuple[float, float]:
    """(seconds from start to the first /predict answer, that request's seconds)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "vitkit", "serve", str(ckpt), "--backend", backend, "--port", str(port),
                          "--precision", "fp32"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if p.poll() is not None:
                raise RuntimeError(f"serve --backend {backend} exited with {p.returncode}")
            time.sleep(0.05)
        t1 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/predict", files={"file": ("x.png", png, "image/png")}, timeout=60)
        r.raise_for_status()
        return time.perf_counter() - t0, time.perf_counter() - t1
    finally:
        p.terminate()
        p.wait(30)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--model", default="vit_s16")
    a.add_argument("--port", type=int, default=8765)
    args = a.parse_args()
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(buf, "PNG")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        ckpt = Path(d) / "m.safetensors"
        vitkit.save(vitkit.create_model(args.model), ckpt)
        env = {**os.environ, "VITKIT_HOME": str(Path(d) / "home")}
        print(f"{args.model}, {cpu_model()}, {torch.get_num_threads()} threads:")
        for label, backend in (("torch", "torch"), ("aoti, cold cache", "aoti"), ("aoti, warm cache", "aoti")):
            total, first = first_answer(ckpt, backend, args.port, env, buf.getvalue())
            print(f"  {label:<17} first answer {total:6.1f} s after start; the first request itself {first * 1e3:6.0f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
