"""Hostile input at every door ends in a clean refusal: one line `vitkit: error: ...` (exit 2) from the CLI, a
vitkit error from the API, a 4xx from the service. The files come from fuzz/hostile.py; the inputs fuzzing once
found are replayed from tests/fuzz_regressions/ (fuzz/targets.py holds the property)."""
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import vitkit
from fuzz import hostile
from fuzz.targets import TARGETS, check, regressions, seeds
from vitkit.cli import main
from vitkit.errors import CheckpointError, UsageError
from vitkit.safety import check_tree, parse_json, parse_yaml

ROOT = Path(__file__).resolve().parent.parent


def _one_line_refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitkit: error: "), err
    assert "Traceback" not in err[0] and "report it" not in err[0]
    return err[0]


def _run_cli(*args, cwd=None) -> tuple[int, str, int]:
    """vitkit in a child process: (exit status, stderr, the child's peak resident memory in MiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    p = subprocess.run([sys.executable, "-m", "vitkit", *args], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return p.returncode, p.stderr, max(peak, before) // 1024


# ---- the three examples, end to end --------------------------------------------------------------------

def test_an_8gb_npz_bomb_is_refused_from_its_header_without_allocating(tmp_path):
    bomb = hostile.npz_bomb(tmp_path / "bomb.npz", gib=8)
    assert bomb.stat().st_size < 16 << 20
    code, err, peak_mib = _run_cli("info", str(bomb))
    assert code == 2 and err.strip().startswith("vitkit: error: ") and len(err.strip().splitlines()) == 1, err
    assert "decompression bomb" in err and "bomb.npz" in err
    assert peak_mib < 2048, f"peak RSS {peak_mib} MiB: the 8 GiB array was allocated"
    with pytest.raises(CheckpointError, match="decompression bomb"):
        vitkit.load(bomb)


def test_a_shard_row_claiming_a_terabyte_is_a_skipped_sample_in_dataloader_workers(tmp_path):
    from vitkit.data.image import BadSample, ImageDecodeError
    from vitkit.data.shards import ShardDataset

    root = hostile.shards_absurd_row(tmp_path / "shards", size=10**12)
    ds = ShardDataset.open(str(root / "test"), img_size=(8, 8))
    assert isinstance(ds[1], BadSample) and "per-sample limit" in ds[1].reason
    assert not isinstance(ds[0], BadSample) and not isinstance(ds[2], BadSample)
    with pytest.raises(ImageDecodeError, match="per-sample limit"):
        ShardDataset.open(str(root / "test"), img_size=(8, 8), strict=True)[1]
    # a row inside the cap but past the tar's end
    rows_file = root / "test" / "shard-000000.idx.npy"
    import numpy as np
    rows = np.load(rows_file)
    rows[1, 0] = 10**9
    rows[1, 1] = 1000
    np.save(rows_file, rows)
    assert "of a file of" in ShardDataset.open(str(root / "test"), img_size=(8, 8))[1].reason
    rows[1] = (10**9, 10**12, 1)
    np.save(rows_file, rows)
    # end to end: `vitkit eval` with two DataLoader workers skips and counts the sample
    m = vitkit.create_model("vit_ti16", img_size=8, patch_size=4, num_classes=3, depth=1, embed_dim=16, num_heads=2,
                            mlp_dim=32, class_names=["a", "b", "c"])
    ckpt = vitkit.save(m, tmp_path / "tiny.safetensors")
    code, err, _ = _run_cli("eval", str(ckpt), "--data", str(root), "--num-workers", "2", "--precision", "fp32",
                            cwd=tmp_path)
    assert code == 0, err
    assert "skipped an undecodable image" in err and "per-sample limit" in err


def test_a_yaml_python_tag_is_one_line_and_runs_nothing(tmp_path, capsys):
    evil = hostile.yaml_python_tag(tmp_path / "evil.yaml")
    line = _one_line_refusal(capsys, ["train", "--config", str(evil), "--print-config"])
    assert "evil.yaml" in line and "python" in line
    assert not Path("/tmp/vitkit-pwned").exists()


# ---- every other door ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, argv, message", [
    ("bomb.pth", ["info"], "decompression bomb"),
    ("lying.npz", ["info"], "claims shape"),
    ("absurd.safetensors", ["info"], "over the limit of"),
    ("absurd_hf", ["info"], "img_size"),
    ("deep_json", ["info"], "nested too deeply"),
    ("laughs.yaml", ["train", "--print-config", "--config"], "values"),
])
def test_hostile_files_are_one_line_refusals(tmp_path, capsys, name, argv, message):
    make = hostile.ALL[name]
    path = make(tmp_path / name, gib=1) if name == "bomb.pth" else make(tmp_path / name)
    line = _one_line_refusal(capsys, [*argv, str(path)])
    assert message in line and name in line


def test_a_png_bomb_is_refused_from_its_header(tmp_path, capsys):
    bomb = hostile.png_bomb(tmp_path / "bomb.png", side=50_000)
    m = vitkit.create_model("vit_ti16", img_size=8, patch_size=4, num_classes=3, depth=1, embed_dim=16, num_heads=2,
                            mlp_dim=32)
    ckpt = vitkit.save(m, tmp_path / "m.safetensors")
    assert main(["predict", "--checkpoint", str(ckpt), "--precision", "fp32", str(bomb)]) == 1  # reported, not raised
    assert "decompression bomb" in capsys.readouterr().out


def test_config_numbers_are_bounded_by_name_and_models_by_memory():
    with pytest.raises(UsageError, match=r"ViTConfig.img_size=.*\[1, 16384\]"):
        vitkit.create_model("vit_ti16", img_size=10**6)
    with pytest.raises(UsageError, match=r"depth=-1"):
        vitkit.create_model("vit_ti16", depth=-1)
    with pytest.raises(UsageError, match="SwinConfig.depths"):
        vitkit.create_model("swin_t", depths=(2, 2, 10**6, 2))
    with pytest.raises(UsageError, match="more than the .* of memory"):  # every field in range, the whole too large
        vitkit.create_model("vit_ti16", embed_dim=32768, depth=512, num_heads=64, mlp_dim=131072)
    from vitkit.training import TrainConfig, apply_overrides

    for kv, msg in [({"optim.lr": "nan"}, "finite"), ({"data.batch_size": "0"}, "batch_size"),
                    ({"schedule.epochs": "1e300"}, "epochs"), ({"model.overrides": "[1, 2]"}, "not a mapping")]:
        with pytest.raises(UsageError, match=msg):
            apply_overrides(TrainConfig(), kv)


def test_documents_are_bounded_in_depth_and_size(tmp_path):
    with pytest.raises(UsageError, match="nested"):
        parse_json("[" * 100_000 + "]" * 100_000, "x.json")
    with pytest.raises(UsageError, match="nested more than"):
        parse_json("[" * 100 + "]" * 100, "x.json")
    assert parse_json('{"a": [1, 2]}', "x.json") == {"a": [1, 2]}
    with pytest.raises(UsageError, match="values"):
        parse_yaml(hostile.yaml_laughs(tmp_path / "laughs.yaml").read_text(), "laughs.yaml")
    shared = [list(range(1000))] * 2000  # 2 million reachable values
    with pytest.raises(UsageError, match="values"):
        check_tree(shared, "x")


def test_truncated_and_foreign_files_name_the_file(tmp_path):
    good = vitkit.save(vitkit.create_model("vit_ti16", img_size=8, patch_size=4, depth=1, embed_dim=8, num_heads=2,
                                           mlp_dim=16, num_classes=3), tmp_path / "m.safetensors")
    data = good.read_bytes()
    for i, cut in enumerate((9, 100, len(data) // 2, len(data) - 1)):
        p = tmp_path / f"cut{i}.safetensors"
        p.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=re.escape(str(p))):
            vitkit.load(p)


# ---- fuzzing's findings, replayed ------------------------------------------------------------------------------

@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_seeds_and_regressions_keep_the_property(target):
    """Every seed and every input a campaign once found (tests/fuzz_regressions/TARGET/) ends in a result or a
    vitkit error, without a stray file (fuzz/targets.py `check`)."""
    for data in seeds(target).values():
        check(target, data)
    for _, f in regressions(target):
        check(target, f.read_bytes())


# ---- the service, attacked -------------------------------------------------------------------------------------

def _tiny_server_model(class_names):
    torch.manual_seed(0)
    return vitkit.create_model("vit_ti16", img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2, mlp_dim=32,
                               num_classes=len(class_names), class_names=class_names).eval()


XSS = ['<img src=x onerror="window.__pwned=1">', '"><script>window.__pwned=2</script>', "safe"]


@pytest.fixture(scope="module")
def keyed_server():
    from test_serve import Server
    from vitkit.serve import Limits, TorchPredictor, create_app

    srv = Server(create_app(TorchPredictor(_tiny_server_model(XSS), precision="fp32"),
                            Limits(max_upload_mb=0.25, timeout_s=120), name='<b onmouseover="x()">tiny</b>',
                            api_key="s3cret"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def impatient_server():
    from test_serve import Server
    from vitkit.serve import Limits, TorchPredictor, create_app

    srv = Server(create_app(TorchPredictor(_tiny_server_model(["a", "b"]), precision="fp32"), Limits(timeout_s=1)))
    yield srv
    srv.stop()


def _png(seed=0) -> bytes:
    from test_serve import _png as png

    return png((24, 30), seed)


def test_an_api_key_is_required_when_set(keyed_server):
    url = keyed_server.url
    assert httpx.get(f"{url}/healthz").status_code == 200
    for r in (httpx.post(f"{url}/predict", content=_png(), headers={"content-type": "image/png"}),
              httpx.get(f"{url}/model"), httpx.get(f"{url}/metrics"),
              httpx.post(f"{url}/predict", content=_png(),
                         headers={"content-type": "image/png", "x-api-key": "wrong"})):
        assert r.status_code == 401 and "API key" in r.json()["error"]
    ok = httpx.post(f"{url}/predict", content=_png(), headers={"content-type": "image/png", "x-api-key": "s3cret"})
    assert ok.status_code == 200 and len(ok.json()["top"]) == 3
    bearer = httpx.get(f"{url}/model", headers={"authorization": "Bearer s3cret"})
    assert bearer.status_code == 200 and bearer.json()["classes"] == XSS


def test_a_slow_upload_is_cut_by_the_time_limit(impatient_server):
    """A client that sends 4 bytes of a 100 kB body and waits: answered 504 at the 1 s limit, not held open."""
    with socket.create_connection(("127.0.0.1", impatient_server.port), timeout=60) as s:
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"\x89PNG")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 504"), reply[:200]


def test_class_names_and_model_names_are_escaped_in_the_page(keyed_server, tmp_path):
    """A checkpoint whose class names hold HTML and script: the page shows them as text and runs nothing."""
    from test_serve import page_with_upload

    img = tmp_path / '<img src=x onerror="window.__pwned=3">.png'
    img.write_bytes(_png(1))
    with page_with_upload(keyed_server.url + "/#key=s3cret", img) as page:
        labels = page.locator("#top5 li .label").all_text_contents()
        assert sorted(labels) == sorted(XSS)  # shown as the text they are
        assert page.evaluate("window.__pwned === undefined")
        assert page.locator("#top5 img, #top5 script, #modelname b").count() == 0
        assert '<b onmouseover="x()">' in page.locator("#modelname").text_content()


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(keyed_server, tmp_path):
    """schemathesis against the service's own OpenAPI schema: every endpoint, all of its checks (no 5xx, every
    status and body as documented, invalid input refused). `make fuzz` runs it with more examples."""
    config = str(ROOT / "fuzz" / "schemathesis.toml")
    p = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", config,
                        "run", f"{keyed_server.url}/openapi.json", "--checks", "all", "--max-examples", "25",
                        "-H", "X-API-Key: s3cret", "--seed", "1"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)  # its cache (.schemathesis/) goes there
    summary = p.stdout[-3000:]
    assert p.returncode == 0, summary
    assert re.search(r"\d+ generated, \d+ passed", summary), summary


def test_binding_beyond_loopback_without_a_key_warns(tmp_path):
    ckpt = vitkit.save(_tiny_server_model(["a", "b"]), tmp_path / "m.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "vitkit", "serve", str(ckpt), "--host", "0.0.0.0", "--port", "0",
                             "--precision", "fp32"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "VITKIT_API_KEY": ""})
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("serving" in ln for ln in lines):
            lines.append(proc.stderr.readline())
        text = "".join(lines)
        assert "warning" in text and "without an API key" in text, text
    finally:
        proc.kill()
        proc.wait()


# ---- no pickle ---------------------------------------------------------------------------------------------------

def test_the_package_never_unpickles_or_evaluates_file_contents():
    """The only deserialisers in vitkit are the safe ones: torch.load with weights_only=True, np.load with
    allow_pickle=False, yaml.safe_load (through vitkit.safety), and CIFAR's restricted unpickler (numpy arrays only)."""
    bad = []
    for f in sorted((ROOT / "vitkit").rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            where = f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
            if re.search(r"\bpickle\.loads?\(|\bcPickle\b|\bdill\b|\bjoblib\.load\b|\bmarshal\.loads?\(", code):
                bad.append(where)
            if re.search(r"\btorch\.load\(", code) and "weights_only=True" not in code:
                bad.append(where)
            if re.search(r"\bnp\.load\(", code) and "allow_pickle=False" not in code:
                bad.append(where)
            if re.search(r"allow_pickle\s*=\s*True|weights_only\s*=\s*False", code):
                bad.append(where)
            if re.search(r"\byaml\.(load|unsafe_load|full_load|load_all)\(", code):
                bad.append(where)
            if re.search(r"(?<![\w.])(eval|exec)\(", code):
                bad.append(where)
    assert not bad, "\n".join(bad)
    # the one unpickler is restricted: a pickle naming a callable is refused
    from vitkit.data.datasets import _CifarUnpickler
    import io
    import pickle

    with pytest.raises(pickle.UnpicklingError):
        _CifarUnpickler(io.BytesIO(pickle.dumps(os.system)), encoding="bytes").load()


def test_a_download_declaring_a_petabyte_is_refused_before_it_starts(tmp_path):
    import http.server
    import threading

    from vitkit.download import download

    class Liar(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(10**15))
            self.end_headers()
            self.wfile.write(b"\0" * 1024)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(CheckpointError, match="declares 1,000,000,000,000,000 bytes"):
            download(f"http://127.0.0.1:{srv.server_port}/w.safetensors", tmp_path / "w.safetensors")
        assert not (tmp_path / "w.safetensors").exists()
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_run_checkpoint_whose_index_pickles_a_command_runs_nothing(tmp_path):
    """torch.distributed.checkpoint writes its .metadata with pickle; vitkit unpickles it through an allow-list."""
    import json
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / ".metadata").write_bytes(pickle.dumps(Evil()))
    cfg = vitkit.create_model("vit_ti16", img_size=8, patch_size=4, depth=1, embed_dim=8, num_heads=2,
                              mlp_dim=16).config
    (step / "meta.json").write_text(json.dumps({"model_config": cfg.to_dict(), "config": {}}))
    with pytest.raises(CheckpointError, match=r"refusing posix\.system"):
        vitkit.load(step)
    assert not marker.exists()
