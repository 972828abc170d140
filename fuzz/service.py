"""schemathesis against the running service: a tiny model served on 127.0.0.1 (with an API key, as a deployment
would be), every endpoint of its own OpenAPI schema, all of schemathesis' checks.

    python -m fuzz.service [--max-examples 500] [--seed N]

Prints schemathesis' summary; the exit status is schemathesis' (0: no failure). tests/test_hostile.py runs the same
with 25 examples per operation.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def start_server(api_key: str = "fuzz-key"):
    import torch
    import uvicorn

    import vitkit
    from vitkit.serve import Limits, TorchPredictor, create_app

    torch.manual_seed(0)
    model = vitkit.create_model("vit_ti16", img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2, mlp_dim=32,
                                num_classes=3, class_names=["a", "b", "<c>"]).eval()
    app = create_app(TorchPredictor(model, precision="fp32"), Limits(max_upload_mb=0.5, timeout_s=5), name="fuzz",
                     api_key=api_key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-examples", type=int, default=500)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    server, url = start_server()
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(HERE / "schemathesis.toml"), "run",
           f"{url}/openapi.json", "--checks", "all", "--max-examples", str(args.max_examples),
           "-H", "X-API-Key: fuzz-key"]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    code = subprocess.run(cmd).returncode
    server.should_exit = True
    return code


if __name__ == "__main__":
    sys.exit(main())
