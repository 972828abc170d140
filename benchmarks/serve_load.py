"""A bounded load test of `vitkit serve` on 127.0.0.1: concurrent clients, mixed valid and invalid requests.

    python benchmarks/serve_load.py [--checkpoint runs/demo/best.safetensors] [--seconds 60] [--clients 16] \
        [--invalid 0.2] [--backend torch|auto|onnx|openvino] [--mixed] [--max-patches N]

Starts the service in a child process on a free port of 127.0.0.1, waits for /healthz, then runs `--clients`
threads for `--seconds`, each with its own kept-alive connection, sending a valid image (a Fashion-MNIST test image
as PNG, multipart) or, with probability `--invalid`, one of five bad requests (not an image, a truncated PNG, a
decompression bomb's header, a wrong content type, malformed JSON). Prints requests/s, the p50/p99 latency of the
valid requests, the status codes, and fails (exit 1) if any valid request did not get 200 or any invalid one got
a 5xx. Every loop is bounded by the deadline; nothing leaves 127.0.0.1. With `--backend auto` the service first
measures the engines (`vitkit.inference.backends`; up to a few minutes the first time, then cached): the result
names the engine it picked and why, from its /model answer and its log. `--mixed` sends photo crops of mixed sizes
and aspect ratios instead; with `--max-patches N` the service packs them at native aspect ratio (NaFlex), without it
resizes each to the checkpoint's square.
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def multipart(data: bytes, name: str = "x.png", ctype: str = "image/png") -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: {ctype}\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def bomb() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def images(n: int) -> list[bytes]:
    from PIL import Image

    from vitkit.data.datasets import load_fashion_mnist

    test = load_fashion_mnist("test")
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(test.images[i, 0].numpy()).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def mixed_images(n: int, seed: int = 0) -> list[bytes]:
    """n crops of scikit-image's photos (astronaut, coffee, chelsea) at random aspect ratios (1/3 to 3, log-uniform)
    and sizes (shorter side 64-320 px), as PNG: requests of mixed sizes."""
    import math

    import numpy as np
    import skimage.data as sk
    from PIL import Image

    rng = random.Random(seed)
    photos = [sk.astronaut(), sk.coffee(), sk.chelsea()]
    out = []
    for _ in range(n):
        im = rng.choice(photos)
        a = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))
        h, w = im.shape[:2]
        ch, cw = (h, min(w, round(h * a))) if a * h <= w else (min(h, round(w / a)), w)
        top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
        crop = Image.fromarray(np.ascontiguousarray(im[top:top + ch, left:left + cw]))
        s = rng.uniform(64, 320) / min(ch, cw)
        crop = crop.resize((max(1, round(cw * s)), max(1, round(ch * s))), Image.BILINEAR)
        buf = io.BytesIO()
        crop.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs/demo/best.safetensors"))
    p.add_argument("--backend", default="torch")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--invalid", type=float, default=0.2)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--mixed", action="store_true", help="valid requests: photo crops of mixed sizes and aspect ratios")
    p.add_argument("--max-patches", type=int, default=None, help="serve packed batches at native aspect (NaFlex)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "vitkit", "serve", args.checkpoint, "--host", "127.0.0.1", "--port", str(port),
                               "--backend", args.backend, "--max-batch", str(args.max_batch), "--max-queue", "256",
                               *(["--max-patches", str(args.max_patches)] if args.max_patches else [])],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + (900 if args.backend == "auto" else 120)  # auto measures (and exports) first
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("the service exited: " + server.stderr.read().decode()[-2000:]) from None
                time.sleep(0.2)
        else:
            raise RuntimeError("the service did not start: " + server.stderr.read().decode()[-2000:])
        valid = [multipart(b) for b in (mixed_images(64) if args.mixed else images(64))]
        png = valid[0][0]
        bad = [multipart(b"hello, not an image"), multipart(images(1)[0][:60]), multipart(bomb(), "bomb.png"),
               (b"abc", "text/plain"), (b"{bad json", "application/json")]
        latencies, codes, failures = [], Counter(), []
        lock = threading.Lock()
        stop_at = time.time() + args.seconds

        def client(seed: int) -> None:
            rng = random.Random(seed)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while time.time() < stop_at:
                is_bad = rng.random() < args.invalid
                body, ctype = rng.choice(bad) if is_bad else rng.choice(valid)
                t0 = time.perf_counter()
                try:
                    conn.request("POST", "/predict", body=body, headers={"Content-Type": ctype})
                    r = conn.getresponse()
                    r.read()
                    status = r.status
                except (OSError, http.client.HTTPException) as e:
                    status = f"error {type(e).__name__}"
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                dt = time.perf_counter() - t0
                with lock:
                    codes[("invalid" if is_bad else "valid", status)] += 1
                    if not is_bad:
                        latencies.append(dt)
                        if status != 200:
                            failures.append(status)
                    elif not isinstance(status, int) or status >= 500:
                        failures.append(status)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.time() - t0
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        metrics = c.getresponse().read().decode()
        c.request("GET", "/model")
        served = json.loads(c.getresponse().read())
    finally:
        server.terminate()
        server.wait(10)
    log = server.stderr.read().decode()
    reason = next((line.split("backend ", 1)[1] for line in log.splitlines() if line.startswith("vitkit: backend ")), None)
    total = sum(codes.values())
    lat = sorted(latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q / 100 * (len(lat) - 1)))] * 1000  # noqa: E731
    batches = next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vitkit_batches ")), float("nan"))
    batched = next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vitkit_batched_images ")), float("nan"))
    tokens = next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vitkit_packed_tokens ")), 0.0)
    padding = next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vitkit_packed_padding_tokens ")), 0.0)
    from vitkit.machine.cpu import cpu_model

    res = {"backend": served["backend"], "backend_reason": reason, "cpu": cpu_model(), "seconds": elapsed, "clients": args.clients, "requests": total, "requests_per_s": total / elapsed,
           "valid": len(lat), "valid_per_s": len(lat) / elapsed, "p50_ms": pct(50), "p99_ms": pct(99),
           "mean_batch": batched / max(batches, 1), "codes": {f"{k[0]} {k[1]}": v for k, v in sorted(codes.items(), key=str)},
           "failed": len(failures), "png_bytes": len(png), "mixed": args.mixed, "max_patches": args.max_patches,
           "preprocessing": served["preprocessing"]["resize"],
           "packed_padding_share": padding / tokens if tokens else None}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
