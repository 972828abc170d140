"""The README's picture of the web page: `vitkit serve` on 127.0.0.1, one image dropped in, headless Chromium.

    python benchmarks/serve_screenshot.py [--checkpoint runs/demo/best.safetensors] [--image IMG] [--out docs/figures/serve_page.png]
"""
from __future__ import annotations

import argparse
import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs/demo/best.safetensors"))
    p.add_argument("--image", default=str(REPO / "runs/demo/samples/test0_Ankle_boot.png"))
    p.add_argument("--out", default=str(REPO / "docs/figures/serve_page.png"))
    p.add_argument("--mode", default="rollout", choices=["rollout", "grad_rollout", "head"])
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "vitkit", "serve", args.checkpoint, "--port", str(port)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
            page = browser.new_page(viewport={"width": 1180, "height": 560})
            page.goto(f"http://127.0.0.1:{port}/")
            page.set_input_files("#file", args.image)
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            page.check(f"input[value='{args.mode}']")
            page.screenshot(path=args.out)
            browser.close()
        print("wrote", args.out)
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
