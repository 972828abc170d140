"""`--backend auto`: every installed engine measured against fp32 eager on a calibration batch, an engine outside the
tolerance or failing dropped (never fatal), the fastest of the rest picked and cached; the commands run on it."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit import cli
from vitkit.inference import backends
from vitkit.machine import engine
from vitkit.machine.engine import CANDIDATES, Candidate, pick

CLASSES = [f"class {i}" for i in range(10)]


def _model():
    torch.manual_seed(0)
    # one block: each engine is compiled or exported twice here (fp32, bf16), and a second block checks nothing more
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, embed_dim=48, num_heads=3, mlp_dim=96,
                            num_classes=10, class_names=CLASSES)
    torch.nn.init.normal_(m.head.weight, std=0.3)  # logits that depend on every layer
    return m.eval()


def _eager(m, x):
    with torch.no_grad():
        return m(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("home")
        mp.setenv("VITKIT_HOME", str(d))
        yield d


def test_auto_measures_every_installed_engine_against_fp32_eager_and_caches_the_pick(home, tmp_path, capsys):
    from vitkit.serve.engine import EnginePredictor, load_predictor

    ckpt = tmp_path / "m.safetensors"
    vitkit.save(_model(), ckpt)
    # `vitkit bench --backends` measures every engine afresh and prints the table with auto's pick ...
    assert cli.main(["bench", str(ckpt), "--batch-size", "4", "--backends", "--json-out"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in d["table"]] == list(CANDIDATES) and d["batch"] == 4 and d["cpu"]
    assert d["reason"].startswith(f"auto -> {d['choice']}")
    # ... and the service's `--backend auto` reads that measurement back for the same weights and batch
    served = load_predictor(str(ckpt), "auto", max_batch=4)
    assert isinstance(served, EnginePredictor) and served.explains  # explanations from the eager model
    assert "measured earlier" in served.choice.reason and served.choice.name == d["choice"]
    table = {c.name: c for c in served.choice.table}
    assert list(table) == list(CANDIDATES)
    assert table["torch-fp32"].rate > 0 and table["torch-fp32"].error == 0
    for name in ("aoti-fp32", "onnx-fp32", "openvino-fp32"):  # installed with the test extra (aoti: torch and g++);
        assert table[name].rate > 0 and not table[name].skipped and table[name].error <= 1e-5, table[name]  # close
    for name in ("torch-bf16", "aoti-bf16", "openvino-bf16"):  # bf16 rounds: a difference, or a reason it did not run
        c = table[name]
        assert (c.rate > 0 and 0 < c.error <= engine.TOLERANCE) or c.skipped, c
    kept = [c for c in served.choice.table if c.rate and not c.skipped]
    chosen = table[served.choice.name]
    assert chosen in kept and chosen.rate * engine.MARGIN >= max(c.rate for c in kept)
    assert served.backend == served.choice.name and "auto -> " + chosen.name in served.choice.reason
    # the engine picked, on new images and more of them than it was measured with: within the tolerance of eager
    x = np.random.default_rng(1).standard_normal((37, 3, 32, 32)).astype(np.float32)
    ref = _eager(vitkit.load(ckpt).eval(), x)
    assert engine.within(served(x), ref, engine.TOLERANCE)
    assert [(c.name, c.rate, c.skipped) for c in served.choice.table] == \
        [(r["name"], r["img_per_s"], r["skipped"]) for r in d["table"]]
    assert len(list((home / "backends").glob("*.json"))) == 1 and len(list((home / "backends" / "exports").glob("*.onnx"))) == 1
    # the compiled packages: made once per weights and machine (fp32, and bf16 where it was measured), then reused
    packages = sorted((home / "backends" / "exports").glob("*.pt2"))
    assert any("-aoti-fp32-" in p.name for p in packages) and all("-aoti-" in p.name for p in packages)
    assert len(packages) == 1 + any("-aoti-bf16-" in p.name for p in packages)  # one per precision compiled
    stamps = [p.stat().st_mtime_ns for p in packages]
    served = load_predictor(str(ckpt), "aoti", max_batch=4)
    assert served.backend == "aoti-fp32" and engine.within(served(x), ref, 1e-5)
    assert [p.stat().st_mtime_ns for p in sorted((home / "backends" / "exports").glob("*.pt2"))] == stamps


def test_a_failing_engine_or_one_outside_the_tolerance_is_dropped_not_fatal(home):
    m = _model()
    good = backends.export_for(m)
    m2 = _model()
    torch.nn.init.normal_(m2.head.weight, std=0.31)  # other weights: another export, which we corrupt
    path = home / "backends" / "exports" / f"{engine.weights_digest(m2)}.onnx"
    path.write_bytes(b"\x08\x07not an onnx graph")
    table = engine.measure(m2, 2, candidates=("torch-fp32", "onnx-fp32", "openvino-fp32"), export=backends.export_for)
    assert [c.name for c in table] == ["torch-fp32", "onnx-fp32", "openvino-fp32"]
    assert all(c.skipped.startswith("failed: exit status") and not c.rate for c in table[1:]), table
    assert pick(table)[0] == "torch-fp32"
    assert good.is_file()  # the export of the other weights is untouched
    # tolerance 0 leaves only engines within the absolute 1e-3: bf16's rounding of logits of about 2 is outside it
    table = engine.measure(m, 2, tolerance=0.0, candidates=("torch-fp32", "torch-bf16"))
    assert table[1].error > 0 and table[1].skipped.startswith("outside the tolerance"), table
    assert pick(table)[0] == "torch-fp32"


def test_pick_takes_the_fastest_kept_engine_unless_a_simpler_one_is_within_the_margin():
    t = [Candidate("torch-fp32", 100.0, 0.0), Candidate("torch-bf16", 300.0, 0.01),
         Candidate("onnx-fp32", 120.0, 1e-7), Candidate("openvino-fp32", 0.0, skipped="not installed"),
         Candidate("openvino-bf16", 500.0, 0.2, skipped="outside the tolerance (0.2 > 0.05 ...)")]
    name, why = pick(t)
    assert name == "torch-bf16" and "2.50x the next (onnx-fp32" in why and "outside the tolerance: openvino-bf16" in why
    t[2].rate = 310.0  # onnx 3% faster than eager bf16: eager kept, the simpler
    name, why = pick(t)
    assert name == "torch-bf16" and "within 5% of onnx-fp32" in why
    assert pick([Candidate("torch-fp32", skipped="failed: x")])[0] == "torch-fp32"


def test_predict_and_eval_run_on_an_engine_and_agree_with_eager(home, tmp_path, capsys):
    m = _model()
    ckpt = tmp_path / "m.safetensors"
    vitkit.save(m, ckpt)
    rng = np.random.default_rng(0)
    imgs = []
    for i in range(3):
        p = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(p)
        imgs.append(str(p))
    outs = {}
    for backend in ("torch", "onnx", "openvino"):
        assert cli.main(["predict", *imgs, "--checkpoint", str(ckpt), "--format", "json", "--backend", backend,
                         "--precision", "fp32", "--top-k", "3"]) == 0
        outs[backend] = json.loads(capsys.readouterr().out)
    for backend in ("onnx", "openvino"):
        for a, b in zip(outs["torch"], outs[backend]):
            assert [t["index"] for t in a["top"]] == [t["index"] for t in b["top"]]
            assert np.allclose([t["probability"] for t in a["top"]], [t["probability"] for t in b["top"]], atol=1e-4)
    folder = tmp_path / "data"
    for c in CLASSES[:10]:
        (folder / c).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / c / "a.png")
    reports = {}
    for backend in ("torch", "openvino"):
        assert cli.main(["eval", str(ckpt), "--data", str(folder), "--backend", backend, "--precision", "fp32",
                         "--out", str(tmp_path / backend), "--num-workers", "0"]) == 0
        reports[backend] = json.loads((tmp_path / backend / "eval_report.json").read_text())
    capsys.readouterr()
    assert reports["openvino"]["acc1"] == reports["torch"]["acc1"] and reports["openvino"]["n"] == 10
    assert abs(reports["openvino"]["loss"] - reports["torch"]["loss"]) <= 1e-4
    assert "openvino-fp32" in reports["openvino"]["precision"]

