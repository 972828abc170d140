"""Pretrained-checkpoint downloads against a local HTTP server on 127.0.0.1: cache, resume, checksums, offline errors."""
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import CATALOG, CheckpointError, register_checkpoint, resolve

from conftest import FIXTURES


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files from the test's folder, honouring `Range: bytes=N-`; counts requests."""

    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        type(self).requests.append((self.path, self.headers.get("Range")))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            data = data[start:]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    RangeHandler.requests = []
    handler = lambda *a, **k: RangeHandler(*a, directory=str(root), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    for name in [n for n in CATALOG if n.startswith("test-")]:
        del CATALOG[name]


def test_catalog_names_the_official_timm_and_hf_checkpoints():
    assert CATALOG["ViT-B_16-i21k"].files["ViT-B_16.npz"].endswith("vit_models/imagenet21k/ViT-B_16.npz")
    assert "R50+ViT-B_16-i1k" in CATALOG and "augreg-B_16-i1k" in CATALOG
    assert set(CATALOG["google/vit-base-patch16-224"].files) == {"config.json", "model.safetensors"}
    assert CATALOG["timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"].format == "timm"


def test_download_load_and_cache(server, home):
    root, url = server
    npz = (FIXTURES / "jax_vit_token/model.npz").read_bytes()
    (root / "model.npz").write_bytes(npz)
    register_checkpoint("test-jax", f"{url}/model.npz", "official-npz", sha256={"model.npz": hashlib.sha256(npz).hexdigest()})
    m = vitkit.load("test-jax")
    x = torch.from_numpy(np.load(FIXTURES / "jax_vit_token/input.npy"))
    with torch.no_grad():
        assert np.abs(m(x).numpy() - np.load(FIXTURES / "jax_vit_token/expected_output.npy")).max() <= 1e-4
    assert (home / "test-jax" / "model.npz").read_bytes() == npz
    n = len(RangeHandler.requests)
    vitkit.load("test-jax")  # cached: no new request
    assert len(RangeHandler.requests) == n


def test_hf_folder_from_two_files(server):
    root, url = server
    for f in ("config.json", "model.safetensors"):
        (root / f).write_bytes((FIXTURES / "hf_vit" / f).read_bytes())
    register_checkpoint("test-hf", {"config.json": f"{url}/config.json", "model.safetensors": f"{url}/model.safetensors"}, "hf")
    assert resolve("test-hf").is_dir()
    assert vitkit.load("test-hf").config.num_classes == 6


def test_resume_from_a_partial_download(server, home):
    root, url = server
    data = (FIXTURES / "timm_vit_tiny/model.safetensors").read_bytes()
    (root / "w.safetensors").write_bytes(data)
    dest = home / "test-resume" / "w.safetensors"
    dest.parent.mkdir(parents=True)
    dest.with_name("w.safetensors.part").write_bytes(data[:1000])
    register_checkpoint("test-resume", f"{url}/w.safetensors", "timm")
    assert resolve("test-resume").read_bytes() == data
    assert RangeHandler.requests[-1] == ("/w.safetensors", "bytes=1000-")


def test_checksum_mismatch_removes_the_download(server, home):
    root, url = server
    (root / "w.npz").write_bytes(b"PK-not-what-was-promised")
    register_checkpoint("test-bad", f"{url}/w.npz", "official-npz", sha256={"w.npz": "0" * 64})
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        resolve("test-bad")
    assert not any((home / "test-bad").iterdir())


def test_offline_error_names_the_url_and_the_path(home):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    register_checkpoint("test-offline", f"http://127.0.0.1:{port}/ViT-B_16.npz", "official-npz")
    with pytest.raises(CheckpointError) as e:
        vitkit.load("test-offline")
    msg = str(e.value)
    assert f"http://127.0.0.1:{port}/ViT-B_16.npz" in msg and str(home / "test-offline" / "ViT-B_16.npz") in msg


def test_file_urls_and_unknown_names(tmp_path):
    m = vitkit.load((FIXTURES / "jax_vit_gap/model.npz").resolve().as_uri())
    assert m.config.classifier == "gap"
    with pytest.raises(FileNotFoundError, match="not in the catalog"):
        vitkit.load("no-such-model-anywhere")
