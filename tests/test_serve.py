"""The HTTP service on 127.0.0.1: predictions, explanations, metrics, bad input answered with a 4xx while the
next request is served, a bounded queue, and the web page in headless Chromium."""
import base64
import json
import contextlib
import io
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from conftest import Server
from vitkit.serve import Limits, TorchPredictor, create_app

CLASSES = [f"digit {i}" for i in range(10)]


def _model():
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, mlp_dim=96,
                            num_classes=10, class_names=CLASSES)
    torch.nn.init.normal_(m.head.weight, std=0.3)
    return m.eval()


@pytest.fixture(scope="module")
def server():
    srv = Server(create_app(TorchPredictor(_model()), Limits(max_upload_mb=0.5, max_pixels=4_000_000), name="tiny"))
    yield srv
    srv.stop()


def _png(size=(40, 52), seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_predict_three_ways_with_the_models_own_preprocessing(server):
    from vitkit.data.image import load_image, preprocess

    data = _png()
    m = _model()
    c = m.config
    with torch.no_grad():
        x = preprocess(load_image(io.BytesIO(data)), c.img_size, c.mean, c.std, crop_pct=c.crop_pct, interpolation=c.interpolation)
        want = m(x[None]).softmax(-1)[0]
    answers = [httpx.post(f"{server.url}/predict", files={"file": ("x.png", data, "image/png")}, data={"top_k": "3"}),
               httpx.post(f"{server.url}/predict", json={"image": base64.b64encode(data).decode(), "top_k": 3}),
               httpx.post(f"{server.url}/predict?top_k=3", content=data, headers={"content-type": "image/png"})]
    for r in answers:
        assert r.status_code == 200, r.text
        top = r.json()["top"]
        assert len(top) == 3 and top[0]["label"] == CLASSES[int(want.argmax())]
        assert top[0]["probability"] == pytest.approx(float(want.max()), abs=1e-5)


def test_explain_healthz_model_and_metrics(server):
    r = httpx.post(f"{server.url}/explain", files={"file": ("x.png", _png(), "image/png")})
    assert r.status_code == 200, r.text
    e = r.json()
    assert e["layers"] == 2 and e["heads"] == 3 and e["grid"] == [4, 4]
    assert np.asarray(e["rollout"]).shape == (2, 4, 4) and np.asarray(e["head_maps"]).shape == (2, 3, 4, 4)
    assert np.asarray(e["grad_rollout"]).max() == pytest.approx(1.0, abs=1e-3)
    assert Image.open(io.BytesIO(base64.b64decode(e["overlay_png"]))).size == (32, 32)
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    info = httpx.get(f"{server.url}/model").json()
    assert info["classes"] == CLASSES and info["preprocessing"]["img_size"] == [32, 32]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'vitkit_requests_total{endpoint="explain",status="200"}' in metrics and "vitkit_queue_depth" in metrics


@pytest.mark.parametrize("name,request_kw,status,message", [
    ("not an image", dict(files={"file": ("x.png", b"hello, not an image", "image/png")}), 400, "cannot decode the upload:"),
    ("truncated", dict(files={"file": ("x.png", _png((200, 200))[:400], "image/png")}), 400, "cannot decode"),
    ("decompression bomb", dict(files={"file": ("b.png", _bomb(), "image/png")}), 413, "decompression bomb"),
    ("wrong content type", dict(content=b"abc", headers={"content-type": "text/plain"}), 415, "unsupported content type"),
    ("oversized body", dict(content=b"x" * 600_000, headers={"content-type": "image/png"}), 413, "upload limit"),
    ("malformed JSON", dict(content=b"{bad", headers={"content-type": "application/json"}), 400, "malformed JSON"),
    ("bad base64", dict(json={"image": "!!not base64!!"}), 400, "not valid base64"),
    ("JSON without image", dict(json={"picture": "abc"}), 400, '{"image"'),
    ("empty file", dict(files={"file": ("x.png", b"", "image/png")}), 400, "empty"),
    ("bad top_k", dict(files={"file": ("x.png", _png(), "image/png")}, data={"top_k": "many"}), 400, "top_k"),
])
def test_bad_input_is_a_4xx_and_the_next_request_is_served(server, name, request_kw, status, message):
    r = httpx.post(f"{server.url}/predict", **request_kw)
    assert r.status_code == status, (name, r.text)
    assert message in r.json()["error"], r.json()
    ok = httpx.post(f"{server.url}/predict", files={"file": ("x.png", _png(), "image/png")})
    assert ok.status_code == 200


class Slow(TorchPredictor):
    """The real model, slowed down: requests pile up behind it."""

    def __call__(self, x):
        time.sleep(0.25)
        return super().__call__(x)


def test_a_full_queue_answers_503_and_a_late_request_504():
    srv = Server(create_app(Slow(_model()), Limits(max_batch=1, max_queue=2, max_wait_ms=0, timeout_s=5)))
    try:
        def post(_):
            return httpx.post(f"{srv.url}/predict", files={"file": ("x.png", _png(), "image/png")}, timeout=30).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(post, range(8)))
        assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    finally:
        srv.stop()
    srv = Server(create_app(Slow(_model()), Limits(timeout_s=0.1)))
    try:
        r = httpx.post(f"{srv.url}/predict", files={"file": ("x.png", _png(), "image/png")})
        assert r.status_code == 504 and "longer than 0.1 s" in r.json()["error"]
        time.sleep(0.3)
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
    finally:
        srv.stop()


@contextlib.contextmanager
def page_with_upload(url: str, img):
    """Headless Chromium (Debian's) on the service's page at `url`, once `img` is uploaded and its answer drawn."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("document.getElementById('modelname').textContent.includes('tiny')")
            page.set_input_files("#file", str(img))
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            yield page
        finally:
            browser.close()


def test_the_web_page_in_headless_chromium(server, tmp_path):
    """Upload an image in the page: the top-5 and the attention overlay render; the layer slider and the
    single-head view redraw it."""
    img = tmp_path / "digit.png"
    img.write_bytes(_png((64, 64), seed=3))
    with page_with_upload(server.url + "/", img) as page:
        labels = page.locator("#top5 li .label").all_text_contents()
        assert len(labels) == 5 and set(labels) <= set(CLASSES)

        def painted() -> list:
            return page.evaluate("""() => { const c = document.getElementById('overlay');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let s = 0; for (let i = 0; i < d.length; i += 4) s += d[i] + d[i + 1] + d[i + 2];
                return [c.width, c.height, s]; }""")

        w, h, last = painted()
        assert w == h == 320 and last > 0
        page.locator("#layer").fill("0")
        page.check("input[value='head']")
        page.locator("#head").fill("2")
        page.locator("#head").dispatch_event("input")
        assert page.locator("#layerval").text_content() == "1 of 2"
        assert painted()[2] != last  # another map drawn
        page.screenshot(path=str(tmp_path / "page.png"))
        assert Image.open(tmp_path / "page.png").size[0] > 600


def test_the_onnx_backend_answers_as_the_torch_one(tmp_path):
    from vitkit.inference.export import export_model
    from vitkit.serve import OnnxPredictor

    m = _model()
    export_model(m, tmp_path / "m.onnx", "onnx", dynamic_batch=True)
    srv = Server(create_app(OnnxPredictor(tmp_path / "m.onnx"), name="onnx"))
    try:
        data = _png(seed=5)
        r = httpx.post(f"{srv.url}/predict", files={"file": ("x.png", data, "image/png")})
        want = TorchPredictor(m)(TorchPredictor(m).preprocess(data, 10**7)[0][None])[0]
        p = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
        assert r.status_code == 200 and r.json()["top"][0]["label"] == CLASSES[int(p.argmax())]
        assert r.json()["top"][0]["probability"] == pytest.approx(float(p.max()), abs=1e-5)
        e = httpx.post(f"{srv.url}/explain", files={"file": ("x.png", data, "image/png")})
        assert e.status_code == 501 and "PyTorch" in e.json()["error"]
        assert httpx.get(f"{srv.url}/model").json()["backend"] == "onnx"
    finally:
        srv.stop()


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_an_export_runs_on_its_runtime_with_the_default_backend(fmt, tmp_path, capsys):
    """`vitkit serve m.onnx` / `m.xml` with the default --backend torch (or auto): the file names its runtime; and
    `vitkit predict` the same, its answers those of the checkpoint on torch."""
    from vitkit.machine.engine_probe import import_onnxruntime, import_openvino

    try:  # through vitkit, telemetry off: a bare `import openvino` forks its usage sender in the test worker
        (import_onnxruntime if fmt == "onnx" else import_openvino)()
    except ImportError as e:
        pytest.skip(f"{fmt} not installed ({e})")
    from vitkit.inference.export import export_model
    from vitkit.inference.predict import predict_images
    from vitkit.serve import load_predictor

    m = _model()
    ckpt = vitkit.save(m, tmp_path / "m.safetensors")
    path = tmp_path / ("m.onnx" if fmt == "onnx" else "m.xml")
    export_model(m, path, fmt, dynamic_batch=True)
    for backend in ("torch", "auto"):
        served = load_predictor(str(path), backend)
        assert served.backend == fmt
        x = TorchPredictor(m).preprocess(_png(seed=7), 10**7)[0][None]
        assert np.abs(served(x) - TorchPredictor(m)(x)).max() < 1e-4
    Image.open(io.BytesIO(_png(seed=7))).save(tmp_path / "a.png")
    Image.open(io.BytesIO(_png(seed=8))).save(tmp_path / "b.png")
    predict_images([str(tmp_path)], str(ckpt), out=str(tmp_path / "want.jsonl"), progress=False, num_workers=0,
                   precision="fp32")
    predict_images([str(tmp_path)], str(path), out=str(tmp_path / "got.jsonl"), progress=False, num_workers=0)
    read = lambda f: [json.loads(line) for line in (tmp_path / f).read_text().splitlines()]  # noqa: E731
    a, b = read("want.jsonl"), read("got.jsonl")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert [t["index"] for t in ra["top"]] == [t["index"] for t in rb["top"]]
        assert ra["top"][0]["probability"] == pytest.approx(rb["top"][0]["probability"], abs=1e-4)
    with pytest.raises(vitkit.errors.UsageError, match="export for"):
        predict_images([str(tmp_path / "a.png")], str(path), backend="aoti", progress=False)
