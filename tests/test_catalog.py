"""Pretrained-checkpoint downloads against a local HTTP server on 127.0.0.1: cache, resume, checksums, offline errors."""
import base64
import hashlib
import http.server
import json
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
    """Serves files from the test's folder, honouring `Range: bytes=N-`; counts requests. Like the servers vitkit
    trusts for checksums: `/resolve/NAME` redirects to `/NAME` stating the file's SHA-256 (as the Hugging Face hub
    does, `x-linked-etag`), and every file comes with its MD5 in `x-goog-hash` (as Google Cloud Storage does);
    `published` replaces what they state (a wrong checksum)."""

    requests: list = []
    published: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).requests.append((self.path, self.headers.get("Range")))
        if self.path.startswith("/resolve/"):
            target = Path(self.translate_path(self.path[len("/resolve"):]))
            self.send_response(302)
            self.send_header("Location", self.path[len("/resolve"):])
            if target.is_file():
                digest = self.published.get("sha256") or hashlib.sha256(target.read_bytes()).hexdigest()
                self.send_header("X-Linked-Etag", f'"{digest}"')
            self.end_headers()
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        md5 = self.published.get("md5") or hashlib.md5(data).hexdigest()
        self.headers_out = {"x-goog-hash": "crc32c=AAAAAA==,md5=" + base64.b64encode(bytes.fromhex(md5)).decode()}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            data = data[start:]
        else:
            self.send_response(200)
        for k, v in self.headers_out.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    RangeHandler.requests, RangeHandler.published = [], {}
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
    assert set(CATALOG["google/vit-base-patch16-224"].files) == {"config.json", "model.safetensors", "preprocessor_config.json"}
    assert CATALOG["timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"].format == "timm"
    # the later ViTs, by their hub ids (fetched with huggingface_hub), and DINOv2's own release
    for repo in ("timm/vit_small_patch14_reg4_dinov2.lvd142m", "timm/eva02_tiny_patch14_224.mim_in22k",
                 "timm/vit_base_patch16_siglip_224.webli", "timm/deit3_small_patch16_224.fb_in1k",
                 "timm/vit_base_patch16_clip_quickgelu_224.openai", "facebook/dinov2-small", "google/siglip-base-patch16-224"):
        assert CATALOG[repo].repo == repo
    assert CATALOG["dinov2_vitb14_reg4"].files == {
        "dinov2_vitb14_reg4_pretrain.pth": "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/dinov2_vitb14_reg4_pretrain.pth"}


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


@pytest.mark.parametrize("kind", ["gcs", "hf"])
def test_downloads_are_checked_against_the_hash_the_server_publishes(server, home, monkeypatch, kind):
    """No checksum in the catalog: the server's own is used (GCS's MD5, the hub's SHA-256 on its redirect)."""
    from vitkit import download as catalog

    root, url = server
    monkeypatch.setitem(catalog.HASH_PUBLISHERS, "127.0.0.1", kind)
    data = (FIXTURES / "jax_vit_gap/model.npz").read_bytes()
    (root / "w.npz").write_bytes(data)
    src = f"{url}/resolve/w.npz" if kind == "hf" else f"{url}/w.npz"
    register_checkpoint("test-published", src, "official-npz")
    assert "published by" in CATALOG["test-published"].verification
    assert resolve("test-published").read_bytes() == data
    RangeHandler.published = {"sha256": "0" * 64} if kind == "hf" else {"md5": "0" * 32}
    register_checkpoint("test-published-bad", src, "official-npz")
    algo = "sha256" if kind == "hf" else "md5"
    with pytest.raises(CheckpointError, match=f"checksum mismatch .* expected {algo} 0+ \\(published by the server\\)"):
        resolve("test-published-bad")
    assert not (home / "test-published-bad" / "w.npz").exists()


def test_catalog_listing_says_how_each_entry_is_verified(capsys):
    from vitkit.cli import main

    assert main(["catalog", "--json-out"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["ViT-B_16-i21k"]["verification"] == "md5 published by Google Cloud Storage"
    assert "Hugging Face hub" in rows["google/vit-base-patch16-224"]["verification"]
    assert {"augreg-R_Ti_16-384-i1k", "timm/vit_tiny_r_s16_p8_384.augreg_in21k_ft_in1k"} <= set(rows)
    register_checkpoint("test-plain", "http://example.invalid/w.npz", "official-npz")
    assert main(["catalog", "--pattern", "test-*"]) == 0
    assert "1 unverified: test-plain" in capsys.readouterr().out


# ---- the Hugging Face hub, through huggingface_hub, against a local stand-in for the hub ---------------------------

class HubHandler(http.server.BaseHTTPRequestHandler):
    """Answers huggingface_hub's HEAD and GET of /{org}/{name}/resolve/{revision}/{file} as the hub does: the
    revision's commit in X-Repo-Commit, an LFS file's SHA-256 (X-Linked-Etag) or a small file's git blob id (ETag)."""

    files: dict = {}  # (repo, file) -> bytes
    commits = {"main": "a" * 40, "v1": "b" * 40}
    requests: list = []

    def log_message(self, *args):
        pass

    def _lookup(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve" or parts[3] not in self.commits:
            return None, None
        return self.files.get(("/".join(parts[:2]), "/".join(parts[4:]))), self.commits[parts[3]]

    def _head(self, with_body: bool):
        type(self).requests.append((self.command, self.path))
        data, commit = self._lookup()
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        if self.path.endswith(".safetensors"):
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
        blob_id = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # git's id of a small file
        self.send_header("ETag", f'"{blob_id}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def do_HEAD(self):
        self._head(False)

    def do_GET(self):
        self._head(True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    src = Path(__file__).resolve().parent / "fixtures" / "modern" / "timm_dinov2"
    HubHandler.files = {("test-org/dinov2-tiny", f): (src / f).read_bytes() for f in ("config.json", "model.safetensors")}
    HubHandler.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import: a test that set it before the worker's first import
    # (the offline test below) would leave every later hub test in that worker offline
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield src, tmp_path / "hf-cache"
    httpd.shutdown()
    httpd.server_close()


def test_hub_entries_load_through_huggingface_hub(hub, home, monkeypatch):
    """A hub repository by its id, at a revision, into the cache timm and transformers share; offline from it."""
    from vitkit.checkpoints.catalog import register_hub

    src, cache = hub
    register_hub("test-org/dinov2-tiny", "timm", "a stand-in", revision="v1")
    m = vitkit.load("test-org/dinov2-tiny")
    x = torch.from_numpy(np.load(src / "input.npy"))
    with torch.no_grad():
        assert np.abs(m(x).numpy() - np.load(src / "logits.npy")).max() <= 1e-4
    snap = cache / "models--test-org--dinov2-tiny" / "snapshots" / ("b" * 40)  # the revision's commit
    assert (snap / "model.safetensors").exists() and (snap / "config.json").exists()
    assert {p for _, p in HubHandler.requests} >= {"/test-org/dinov2-tiny/resolve/v1/model.safetensors"}
    n = len(HubHandler.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert vitkit.load("test-org/dinov2-tiny").config.reg_tokens == 0  # from the cache, no request
    assert len(HubHandler.requests) == n


def test_hub_offline_error_names_the_repo_and_what_to_do(hub, home, monkeypatch):
    from vitkit.checkpoints.catalog import register_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    register_hub("test-org/dinov2-tiny", "timm")
    with pytest.raises(CheckpointError) as e:
        vitkit.load("test-org/dinov2-tiny")
    msg = str(e.value)
    assert "'test-org/dinov2-tiny'" in msg and "revision 'main'" in msg and "hf download test-org/dinov2-tiny" in msg
    assert "models--test-org--dinov2-tiny" in msg and "load that folder" in msg
    monkeypatch.delenv("HF_HUB_OFFLINE")
    register_hub("test-org/no-such-repo", "timm")
    with pytest.raises(CheckpointError, match="'test-org/no-such-repo'"):
        vitkit.load("test-org/no-such-repo")


def test_an_unreachable_hub_reads_the_cache_or_fails_at_once_with_what_to_do(hub, home, monkeypatch):
    """No network (HF_ENDPOINT at a closed local port, HF_HUB_OFFLINE unset): a cached repository loads from the cache,
    an uncached one fails with the offline message, without huggingface_hub's retries."""
    import socket

    from vitkit.checkpoints.catalog import register_hub

    register_hub("test-org/dinov2-tiny", "timm")
    vitkit.load("test-org/dinov2-tiny")  # into the cache, from the stand-in hub
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    assert vitkit.load("test-org/dinov2-tiny").config.reg_tokens == 0  # the cache, as HF_HUB_OFFLINE=1 would
    register_hub("test-org/not-cached", "timm")
    with pytest.raises(CheckpointError) as e:
        vitkit.load("test-org/not-cached")
    msg = str(e.value)
    assert f"http://127.0.0.1:{port} cannot be reached" in msg and "not in the cache" in msg
    assert "hf download test-org/not-cached" in msg and "\n" not in msg


def test_hub_cache_copy_is_checked_against_its_sha256(hub, home):
    from vitkit.checkpoints.catalog import register_hub

    _, cache = hub
    register_hub("test-org/dinov2-tiny", "timm")
    resolve("test-org/dinov2-tiny")
    blob = next(p for p in (cache / "models--test-org--dinov2-tiny" / "blobs").iterdir() if len(p.name) == 64)
    blob.write_bytes(blob.read_bytes()[:-1] + b"x")  # corrupted in place
    for marker in (home / "verified").iterdir():
        marker.unlink()  # as on another machine sharing the cache
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        resolve("test-org/dinov2-tiny")


def test_downloads_of_one_file_at_once_take_turns(tmp_path):
    """Four downloaders of one file into one folder at once (xdist workers fetching Fashion-MNIST, say): one
    download, one verified file, no partial or lock file left, every caller gets the path."""
    from concurrent.futures import ThreadPoolExecutor

    from vitkit.download import download

    data = np.random.default_rng(0).bytes(3_000_000)
    (tmp_path / "f.bin").write_bytes(data)
    seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path), **k)

        def do_GET(self):
            seen.append(self.headers.get("Range"))
            super().do_GET()

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    dest = tmp_path / "out" / "f.bin"
    try:
        with ThreadPoolExecutor(4) as pool:  # each call opens the folder itself: flock holds between them too
            got = list(pool.map(lambda _: download(f"http://127.0.0.1:{httpd.server_port}/f.bin", dest,
                                                   sha256=hashlib.sha256(data).hexdigest()), range(4)))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert got == [dest] * 4 and dest.read_bytes() == data and seen == [None]
    assert [p.name for p in dest.parent.iterdir()] == ["f.bin"]


def test_a_dinov3_hub_repository_loads_through_huggingface_hub(hub, home):
    """transformers' DINOv3ViTModel as the hub serves it (gated on the real hub: the same requests with a token):
    fetched with huggingface_hub and loaded to transformers' pooled output; the catalog names the real ones."""
    from vitkit.checkpoints.catalog import CATALOG, register_hub

    src = Path(__file__).resolve().parent / "fixtures" / "backbones" / "hf_dinov3"
    for f in ("config.json", "model.safetensors"):
        HubHandler.files[("test-org/dinov3-tiny", f)] = (src / f).read_bytes()
    register_hub("test-org/dinov3-tiny", "hf", "a stand-in", files=("config.json", "model.safetensors"))
    m = vitkit.load("test-org/dinov3-tiny")
    assert m.load_report["format"] == "hf-dinov3" and m.config.rope == "dinov3"
    with torch.no_grad():
        out = m(torch.from_numpy(np.load(src / "input.npy")))
    assert np.abs(out.numpy() - np.load(src / "pooler_output.npy")).max() <= 1e-4
    for repo in ("facebook/dinov3-vitb16-pretrain-lvd1689m", "timm/vit_base_patch16_dinov3.lvd1689m",
                 "timm/vit_pe_core_base_patch16_224.fb", "timm/aimv2_large_patch14_224.apple_pt",
                 "timm/vit_base_patch16_rope_mixed_224.naver_in1k", "timm/vit_base_patch14_reg1_tipsv2.webli"):
        assert CATALOG[repo].repo == repo
