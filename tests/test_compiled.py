"""vitkit's compiled engine (AOTInductor, `vitkit.machine.aoti`): `vitkit export --format aoti` compiles a checkpoint
for this CPU into a .pt2 package that torch's own loader runs and that predict, eval, bench and serve load; its
logits are the peer's (the official JAX code's fixture) within 1e-4; every family compiles; a package this machine
cannot run is refused before its code is loaded."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from conftest import FIXTURES, Server, tiny_kwargs
from vitkit import cli
from vitkit.errors import CheckpointError, UsageError
from vitkit.inference import backends
from vitkit.inference.export import ExportError, export_model, packed_examples
from vitkit.machine import aoti
from vitkit.models.layers.packing import PackedBatch

pytestmark = pytest.mark.xdist_group("compiled")  # one worker: the module's package is compiled once

JAX = FIXTURES / "jax_vit_token"  # the official code's ViT (p8, 32x32, D48, 2 layers, pre-logits, 10 classes)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The official fixture compiled by `vitkit export --format aoti` (fp32, dynamic batch)."""
    d = tmp_path_factory.mktemp("aoti")
    out = d / "vit.pt2"
    assert cli.main(["export", str(JAX / "model.npz"), str(out), "--format", "aoti"]) == 0
    return out


def test_the_package_gives_the_official_codes_logits_through_torchs_own_loader(package, capsys):
    x = np.load(JAX / "input.npy")
    want = np.load(JAX / "expected_output.npy")
    runner = torch._inductor.aoti_load_package(str(package))  # the peer's loader: torch's, no vitkit code
    with torch.inference_mode():
        got = runner(torch.from_numpy(x)).numpy()
    assert np.abs(got - want).max() <= 1e-4
    model = backends.PackageModel(package)  # vitkit's: the same numbers, config from the package
    assert model.config.num_classes == 10 and model.precision == "fp32" and tuple(model.config.img_size) == (32, 32)
    with torch.inference_mode():
        assert np.abs(model(torch.from_numpy(x)).numpy() - want).max() <= 1e-4
        eager = vitkit.load(JAX / "model.npz").eval()
        for b in (1, 5):  # the batch is dynamic
            xb = torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(b))
            assert (model(xb) - eager(xb)).abs().max() <= 1e-4
    meta = aoti.package_metadata(package)
    assert meta["vitkit_torch"] == torch.__version__ and meta["vitkit_isa"] == aoti.vec_isa()
    assert json.loads(meta["vitkit_config"])["representation_size"] == 32


def _images(folder, n, size=(40, 48)):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        p = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    return paths


def test_predict_eval_and_bench_run_the_package_as_the_checkpoint_runs_eagerly(package, tmp_path, capsys):
    imgs = _images(tmp_path, 3)
    outs = {}
    for name, ckpt in (("eager", JAX / "model.npz"), ("aoti", package)):
        assert cli.main(["predict", *imgs, "--checkpoint", str(ckpt), "--format", "json", "--precision", "fp32",
                         "--top-k", "3"]) == 0
        outs[name] = json.loads(capsys.readouterr().out)
    for a, b in zip(outs["eager"], outs["aoti"]):
        assert [t["index"] for t in a["top"]] == [t["index"] for t in b["top"]]
        assert np.allclose([t["probability"] for t in a["top"]], [t["probability"] for t in b["top"]], atol=1e-5)
    folder = tmp_path / "data"
    rng = np.random.default_rng(1)
    for i in range(10):
        (folder / f"c{i}").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"c{i}" / "a.png")
    reports = {}
    for name, ckpt in (("eager", JAX / "model.npz"), ("aoti", package)):
        assert cli.main(["eval", str(ckpt), "--data", str(folder), "--precision", "fp32", "--out",
                         str(tmp_path / name), "--num-workers", "0"]) == 0
        reports[name] = json.loads((tmp_path / name / "eval_report.json").read_text())
    assert reports["aoti"]["acc1"] == reports["eager"]["acc1"] and reports["aoti"]["n"] == 10
    assert abs(reports["aoti"]["loss"] - reports["eager"]["loss"]) <= 1e-5
    assert "aoti-fp32: the package vit.pt2" in reports["aoti"]["precision"]
    capsys.readouterr()
    assert cli.main(["eval", str(package), "--data", str(folder), "--precision", "bf16", "--num-workers", "0"]) == 2
    assert "computes in fp32, not bf16" in capsys.readouterr().err
    assert cli.main(["predict", *imgs, "--checkpoint", str(package), "--backend", "onnx"]) == 2
    assert "run it with --backend aoti" in capsys.readouterr().err
    assert cli.main(["bench", str(package), "--batch-size", "4", "--min-seconds", "0.2", "--json-out"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backend"] == "aoti-fp32" and d["img_per_s"] > 0 and d["latency_ms_b1"] > 0 and d["cpu"]


def test_serve_answers_from_the_package_as_from_the_eager_checkpoint(package):
    from vitkit.serve import create_app
    from vitkit.serve.engine import PackagePredictor, TorchPredictor, load_predictor

    served = load_predictor(str(package), "aoti")
    assert isinstance(served, PackagePredictor) and served.backend == "aoti-fp32" and not served.explains
    eager = TorchPredictor(vitkit.load(JAX / "model.npz"), "fp32")
    buf = __import__("io").BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (50, 60, 3), dtype=np.uint8)).save(buf, "PNG")
    x = eager.preprocess(buf.getvalue(), 10**7)[0][None]
    assert np.abs(served(x) - eager(x)).max() <= 1e-4
    srv = Server(create_app(served, name="aoti"))
    try:
        r = httpx.post(f"{srv.url}/predict", files={"file": ("x.png", buf.getvalue(), "image/png")})
        y = eager(x)[0]
        p = np.exp(y - y.max()) / np.exp(y - y.max()).sum()
        assert r.status_code == 200 and r.json()["top"][0]["index"] == int(p.argmax())
        assert r.json()["top"][0]["probability"] == pytest.approx(float(p.max()), abs=1e-5)
        assert httpx.get(f"{srv.url}/model").json()["backend"] == "aoti-fp32"
    finally:
        srv.stop()


def _rewrite_metadata(src, dst, **changes):
    """A copy of a package whose metadata file says other things (every other member byte for byte)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("wrapper_metadata.json"):
                data = json.dumps({**json.loads(data), **changes}).encode()
            zout.writestr(info, data)


def test_a_package_this_machine_cannot_run_is_refused_before_its_code_is_loaded(package, tmp_path, capsys, monkeypatch):
    from vitkit.serve.engine import load_predictor

    wider = tmp_path / "wider.pt2"  # compiled on a CPU with an instruction this one lacks
    _rewrite_metadata(package, wider, vitkit_cpu_flags=aoti.package_metadata(package)["vitkit_cpu_flags"] + " avx_future512")
    with pytest.raises(CheckpointError, match=r"instructions this one lacks \(avx_future512\).*compile it again here"):
        backends.PackageModel(wider, trust=True)  # made elsewhere, and trusted: still refused, and why
    with monkeypatch.context() as mp:  # this process capped below the package's vector ISA
        mp.setenv("ATEN_CPU_CAPABILITY", "default")
        with pytest.raises(CheckpointError, match="capped at ATEN_CPU_CAPABILITY=default"):
            backends.PackageModel(package)
    model = backends.PackageModel(package)  # on the machine that made it: accepted
    with pytest.raises(UsageError, match=r"takes \(1-4096, 3, 32, 32\) images, got \(2, 3, 48, 32\)"):
        model(torch.zeros(2, 3, 48, 32))  # AOTInductor checks no shapes: vitkit does
    assert cli.main(["predict", *_images(tmp_path, 1), "--checkpoint", str(package), "--max-patches", "16"]) == 2
    assert "--max-patches runs packed batches on eager torch" in capsys.readouterr().err
    assert cli.main(["bench", str(package), "--dtype", "bf16"]) == 2
    assert "computes in fp32, not bf16" in capsys.readouterr().err
    other = tmp_path / "other_torch.pt2"
    _rewrite_metadata(package, other, vitkit_torch="2.99.0")
    with pytest.raises(CheckpointError, match="compiled by torch 2.99.0"):
        load_predictor(str(other), "aoti", trust_package=True)
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    assert not backends.is_package(cut)  # not a package: read as a checkpoint, which it is not either
    assert cli.main(["predict", *_images(tmp_path, 1), "--checkpoint", str(cut)]) == 2  # a clear error, no traceback
    assert "truncated or corrupt" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="not an AOTInductor package"):
        aoti.package_metadata(cut)
    program = tmp_path / "program.pt2"  # a torch.export program is a .pt2 too, but no compiled package
    export_model(vitkit.load(JAX / "model.npz"), program, "torch-export")
    assert not backends.is_package(program)
    shutil.copy(package, tmp_path / "ok.pt2")
    assert backends.is_package(tmp_path / "ok.pt2")


@pytest.mark.parametrize("name,precision", [("r50_vit_b16", "fp32"), ("swin_t", "fp32"), ("eva02_ti14", "bf16")])
def test_every_family_compiles_and_matches_eager(name, precision, tmp_path):
    """A hybrid (its ResNet stages: BiT's StdConv and GroupNorm), Swin (two stages: shifted windows and the patch
    merging) and EVA-02's modern options (RoPE, SwiGLU, sub-LN) in bf16: each compiled with a dynamic batch and
    checked by `export_model` against eager (fp32 1e-4; bf16 5% of the largest logit). The package above is the
    plain ViT in fp32; tests/test_backends.py compiles one in bf16 too where the CPU has bf16. (Each compile costs
    10-30 s of the suite: one case per family.)"""
    torch.manual_seed(0)
    kw = tiny_kwargs(name)
    if name == "swin_t":  # two stages of the suite's four: compiling each stage's windows costs ~10 s here
        kw.update(depths=(2, 2), num_heads=(1, 2))
    else:  # one transformer block: each family's blocks are alike, so a second adds compile time and nothing to check
        kw.update(depth=1)
    m = vitkit.create_model(name, **kw).eval()
    for p in m.parameters():  # no zero-initialised head: logits that depend on every layer
        if p.dim() == 2 and not p.any():
            torch.nn.init.normal_(p, std=0.3)
    r = export_model(m, tmp_path / "m.pt2", "aoti", precision=precision)
    assert r.precision == precision and [c["shape"][0] for c in r.checks] == [1, 3]
    assert r.worst <= (1e-4 if precision == "fp32" else 0.05 * max(c["max_abs_logit"] for c in r.checks) + 1e-3)


def test_packed_batches_of_mixed_sizes_compile(tmp_path):
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1}).eval()
    torch.nn.init.normal_(m.head.weight, std=0.3)
    # a file name as people (and the engine cache, under ISA caps) write them: spaces, an accent, 150+ characters;
    # the package's top folder is not named after it (its loader refuses odd or long folder names)
    packed = tmp_path / ("packed batches, modèle " + "x" * 130 + ".pt2")
    r = export_model(m, packed, "aoti", packed=True)
    assert r.format == "aoti-packed" and len(r.checks) == 3 and r.worst <= 1e-4
    assert json.loads(aoti.package_metadata(packed)["vitkit_config"])["packed_inputs"] is True
    run, _ = aoti.load_package(packed)  # from Python, by its three inputs
    p, c, v = packed_examples(m.config, 5, 2)
    with torch.no_grad():
        assert (run(p, c, v) - m.forward_packed(PackedBatch(p, c, v))).abs().max() <= 1e-4
    with pytest.raises(UsageError, match="takes packed batches"):  # not a square-image package for predict and serve
        backends.PackageModel(packed)
    with pytest.raises(UsageError, match="drop --no-dynamic-batch"):
        export_model(m, tmp_path / "static.pt2", "aoti", dynamic_batch=False)
    with pytest.raises(UsageError, match="PATH.pt2"):
        export_model(m, tmp_path / "m.onnx", "aoti")
    with pytest.raises(UsageError, match="bf16: --format aoti"):
        export_model(m, tmp_path / "m.onnx", "onnx", precision="bf16")


def test_training_compile_auto_skips_runs_too_short_to_repay_and_measures_long_ones(tmp_path, monkeypatch):
    from vitkit.training import compile as compile_mod

    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1})
    kw = dict(batch=8, precision="fp32", lowp_stream=False, fast_gemm=True)
    cpu = torch.device("cpu")
    short = compile_mod.decide("auto", m, cpu, steps=3, **kw)  # seconds of steps: no compile could pay
    assert not short.on and "would not pay" in short.reason and "measured earlier" not in short.reason
    assert "measured earlier" in compile_mod.decide("auto", m, cpu, steps=3, **kw).reason
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    long = compile_mod.decide("auto", m, cpu, steps=10**7, **kw)  # long enough: compiled on a copy and timed
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in weights.items())  # the model itself untouched
    (rec,) = [v for v in json.loads(next((tmp_path / "compile").glob("*.json")).read_text()).values() if "compiled_s" in v]
    assert rec["compile_s"] > 0 and rec["eager_s"] > 0 and rec["compiled_s"] > 0 and len(rec["rounds"]["eager"]) == 3
    speedup = rec["eager_s"] / rec["compiled_s"]
    want = speedup >= compile_mod.MARGIN and 10**7 * (rec["eager_s"] - rec["compiled_s"]) > rec["compile_s"]
    assert long.on == want and f"{speedup:.2f}x eager" in long.reason
    assert compile_mod.decide("true", m, cpu, steps=3, **kw).on and not compile_mod.decide("off", m, cpu, steps=3, **kw).on
    assert "several processes" in compile_mod.decide("auto", m, cpu, steps=10**7, world=2, **kw).reason
    with pytest.raises(UsageError, match="run.compile='maybe'"):
        compile_mod.normalize("maybe")


def test_training_compile_auto_refuses_a_compiled_step_that_computes_nan_where_eager_does_not(tmp_path, monkeypatch):
    """Under ATEN_CPU_CAPABILITY=avx2, fashion-mnist-fast's compiled step computed NaN at the first step (a graph
    Inductor's cache had kept from an uncapped compile: benchmarks/NOTES.md sections 52-53). `run.compile=auto`
    compares the first two compiled steps' losses with the eager ones and stays eager where only the compiled are not
    finite; here with a model whose compiled graph multiplies by NaN."""
    from vitkit.training import compile as compile_mod

    class NanWhenCompiled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1})
            self.config = self.inner.config

        def forward(self, x):
            y = self.inner(x)
            return y * float("nan") if torch.compiler.is_compiling() else y

    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    kw = dict(batch=8, precision="fp32", lowp_stream=False, fast_gemm=False)
    nan = NanWhenCompiled()
    c = compile_mod.decide("auto", nan, torch.device("cpu"), steps=10**7, **kw)
    assert not c.on and "the compiled step's loss was not finite where the eager step's was" in c.reason, c
    assert "measured earlier" in compile_mod.decide("auto", nan, torch.device("cpu"), steps=10**7, **kw).reason
    # a record of an older vitkit (a compiled step measured, not checked) is measured again, whatever it says
    (path,) = (tmp_path / "compile").glob("*.json")
    key = next(iter(json.loads(path.read_text())))
    path.write_text(json.dumps({key: {"eager_s": 1.0, "compiled_s": 0.1, "compile_s": 1.0}}))
    c = compile_mod.decide("auto", nan, torch.device("cpu"), steps=10**7, **kw)
    assert not c.on and "not finite" in c.reason and "measured earlier" not in c.reason, c


def test_inductors_cache_is_kept_apart_for_each_set_of_isa_caps(tmp_path, monkeypatch):
    """Inductor's FX graph cache does not key on ATEN_CPU_CAPABILITY or oneDNN's cap: a graph compiled uncapped was
    served under the AVX2 caps and computed NaN (benchmarks/NOTES.md section 53). Every vitkit compile first points
    the cache at a folder of the caps' own under the user's TORCHINDUCTOR_CACHE_DIR; a process without caps (a child
    of a capped one) goes back to the user's folder; hostile values make one bounded folder name."""
    from vitkit.machine import cpu

    def caps(**values):
        for k in cpu.ISA_CAPS:
            monkeypatch.delenv(k, raising=False)
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    user = str(tmp_path / "c")
    monkeypatch.delenv("VITKIT_INDUCTOR_CACHE_BASE", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", user)
    caps()
    assert cpu.inductor_cache_for_caps() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == user
    folders = set()
    for values in ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ONEDNN_MAX_CPU_ISA": "../../x/\n"},
                   {"ONEDNN_MAX_CPU_ISA": "x,DNNL_MAX_CPU_ISA=y"}, {"ONEDNN_MAX_CPU_ISA": "x", "DNNL_MAX_CPU_ISA": "y"},
                   {"ONEDNN_MAX_CPU_ISA": "\U0001d7d8" * 200}, {"ONEDNN_MAX_CPU_ISA": os.fsdecode(b"\xff\xfe")}):
        caps(**values)
        folder = cpu.inductor_cache_for_caps()
        assert Path(folder).parent == tmp_path / "c" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder
        name = Path(folder).name
        assert name.startswith("caps-") and ".." not in name and name.isascii() and len(name) < 128
        assert cpu.inductor_cache_for_caps() == folder  # a second compile, or a child with the same caps: no nesting
        folders.add(folder)
    assert len(folders) == 7
    caps()  # a child of a capped process, without caps: the user's folder again, not its parent's
    assert cpu.inductor_cache_for_caps() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == user

    # each of vitkit's compiles asks for the folder before it compiles (Inductor stubbed: what it is handed is checked)
    caps(ATEN_CPU_CAPABILITY="avx2")
    want = cpu.inductor_cache_for_caps()
    caps()
    cpu.inductor_cache_for_caps()
    caps(ATEN_CPU_CAPABILITY="avx2")
    seen = []

    def fake_compile(model, *a, **k):
        seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return model

    class Stop(Exception):
        pass

    def fake_aoti(*a, **k):
        seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        raise Stop

    import torch._inductor

    from vitkit.bench import make_step

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_aoti)
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    m = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1})
    x = torch.randn(2, 3, *m.config.img_size)
    make_step(m, x, "fp32", train=False, compile_=True)
    if aoti.compiler() is not None:
        with pytest.raises(Stop):
            aoti.compile_package(m.eval(), (x,), None, tmp_path / "m.pt2", {})
    assert cli.main(["train", "fashion-mnist", "data.dataset=digits", "model.name=vit_ti16", "data.batch_size=64",
                     'model.overrides={"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, '
                     '"mlp_dim": 64}', "aug.hflip=false", "aug.pad=0", "run.tta=none", "schedule.epochs=1",
                     "run.progress=false", "run.threads=1", "run.precision=fp32", "run.compile=on",
                     f"run.out_dir={tmp_path / 'run'}"]) == 0
    assert seen == [want] * (3 if aoti.compiler() is not None else 2), (seen, want)

    # a real compile (the training probe's) in a process under the AVX2 caps writes only into their folder
    code = """
import torch, vitkit
from conftest import tiny_kwargs
from vitkit.training import compile as compile_mod
m = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1})
r = compile_mod.measure(m, torch.device("cpu"), batch=4, precision="fp32", lowp_stream=False, fast_gemm=False,
                        steps=10**7, compile_s=0.0)
assert "compiled_s" in r, r
"""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "run-cache"), "ATEN_CPU_CAPABILITY": "avx2",
           "VITKIT_HOME": str(tmp_path / "home"), "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")])}
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "VITKIT_INDUCTOR_CACHE_BASE",
              "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (only,) = (tmp_path / "run-cache").iterdir()  # nothing beside the caps' folder
    assert only.name.startswith("caps-ATEN_CPU_CAPABILITY=avx2-") and any((only / "fxgraph").rglob("*")), only


def test_training_compile_auto_weighs_the_compile_against_the_steps_it_saves(tmp_path, monkeypatch):
    """The decision rule on given measurements (the measurement itself is the test above)."""
    from vitkit.training import compile as compile_mod

    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    m = vitkit.create_model("vit_ti16", **tiny_kwargs("vit_ti16"))
    kw = dict(batch=8, precision="fp32", lowp_stream=False, fast_gemm=True)
    for i, (record, steps, on, says) in enumerate([
            ({"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0}, 100, True, "2.00x eager"),
            ({"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0}, 19, False, "save ~10 s against a 10 s compile"),
            ({"eager_s": 1.0, "compiled_s": 0.98, "compile_s": 1.0}, 10**6, False, "1.02x eager"),
            ({"eager_s": 1.0, "failed": "InductorError: x"}, 10**6, False, "compiled step failed here"),
            ({"eager_s": 0.01}, 100, False, "would not pay")]):
        monkeypatch.setattr(compile_mod, "measure", lambda *a, r=record, **k: dict(r))
        monkeypatch.setenv("VITKIT_HOME", str(tmp_path / str(i)))
        c = compile_mod.decide("auto", m, torch.device("cpu"), steps=steps, **kw)
        assert c.on is on and says in c.reason, (record, c)
    # under a time budget the steps it holds eagerly count, not the schedule's: 100 steps of 1 s in a 30 s budget
    # are 30, where a 10 s compile at 2x saves 15 s (on: the budget holds 40 compiled steps); in a 15 s budget 15
    # steps save 7.5 s (off: 10 compiled steps against 15 eager); a budget past the schedule's steps changes nothing
    for i, (budget, on, says) in enumerate([(30.0, True, "30 steps (those 30 s of budget hold eagerly) save ~15 s"),
                                            (15.0, False, "15 steps (those 15 s of budget hold eagerly) save ~8 s"),
                                            (1e6, True, "100 steps save ~50 s")]):
        monkeypatch.setattr(compile_mod, "measure", lambda *a, **k: {"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0})
        monkeypatch.setenv("VITKIT_HOME", str(tmp_path / f"b{i}"))
        c = compile_mod.decide("auto", m, torch.device("cpu"), steps=100, budget_s=budget, **kw)
        assert c.on is on and says in c.reason, (budget, c)



def test_a_resumed_budgeted_run_weighs_the_compile_against_what_is_left_of_its_budget(tmp_path, monkeypatch):
    """A run resumed under schedule.time_budget counts the steps the rest of its budget holds, not the whole budget's:
    100 steps of 1 s with a 10 s compile at 2x pay in a 30 s budget (30 steps save 15 s), not with 20 s of it spent
    (10 steps save 5 s)."""
    from vitkit.training import compile as compile_mod
    from vitkit.training.distributed import Dist
    from vitkit.training.presets import get_preset
    from vitkit.training.setup import _choose_compile

    m = vitkit.create_model("vit_ti16", **tiny_kwargs("vit_ti16"))
    cfg = get_preset("fashion-mnist-fast")
    cfg.schedule.time_budget = 30
    monkeypatch.setattr(compile_mod, "measure", lambda *a, **k: {"eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0})
    for i, (spent, on, says) in enumerate([(0.0, True, "30 steps (those 30 s"), (20.0, False, "10 steps (those 10 s")]):
        monkeypatch.setenv("VITKIT_HOME", str(tmp_path / str(i)))
        assert _choose_compile(cfg, m, Dist(), "fp32", 100, spent) is on
        assert says in cfg.run.compile_choice, cfg.run.compile_choice

# ---- the trust boundary: a package is native code, so one door checks it before any of it is extracted or run ----

def _rezip(src, dst, drop=(), add=(), change=None):
    """A copy of a package with members dropped, added ((name, bytes) or ZipInfo pairs) or changed (name -> bytes)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if not any(info.filename.endswith(d) for d in drop):
                data = zin.read(info)
                for suffix, new in (change or {}).items():
                    if info.filename.endswith(suffix):
                        data = new(data) if callable(new) else new
                zout.writestr(info, data)
        for name, data in add:
            zout.writestr(name, data)
    return dst


def _root(package):
    return zipfile.ZipFile(package).namelist()[0].split("/")[0]


def _marker_library(tmp_path, marker):
    """A shared library whose constructor writes `marker` when it is loaded (what an attacker's package would run)."""
    src = tmp_path / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ FILE *f = '
                   f'fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    lib = tmp_path / "evil.so"
    subprocess.run([aoti.compiler(), "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib.read_bytes()


def test_a_package_this_machines_vitkit_did_not_compile_runs_no_code_without_an_opt_in(package, tmp_path, capsys,
                                                                                          monkeypatch):
    """Its own metadata vouches for nothing: the library swapped, or the vitkit_* keys deleted, and the package is
    refused before its library is loaded; a package copied from another machine (another VITKIT_HOME) needs
    --trust-package, which says what it runs."""
    monkeypatch.setattr(aoti, "_MADE_HERE", set())  # another process than the one that compiled the fixture
    marker = tmp_path / "ran"
    swapped = _rezip(package, tmp_path / "swapped.pt2", change={".wrapper.so": _marker_library(tmp_path, marker)})
    stripped = _rezip(package, tmp_path / "stripped.pt2", change={"wrapper_metadata.json": lambda d: json.dumps(
        {k: v for k, v in json.loads(d).items() if k != "vitkit_torch" and k != "vitkit_cpu_flags"}).encode()})
    for bad in (swapped, stripped):
        with pytest.raises(CheckpointError, match="did not make.*--trust-package"):
            backends.PackageModel(bad)
        assert cli.main(["bench", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "--trust-package" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()  # nothing of the swapped library ran
    home = tmp_path / "elsewhere"  # the genuine package, on a machine whose vitkit did not compile it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VITKIT_HOME", str(home))
        with pytest.raises(CheckpointError, match="did not make"):
            backends.PackageModel(package)
        assert cli.main(["bench", str(package), "--trust-package", "--min-seconds", "0.05", "--batch-size", "1"]) == 0
        assert "sha256" in capsys.readouterr().err  # what it is about to run, said before it runs
        assert backends.PackageModel(package, trust=True).config.num_classes == 10


@pytest.mark.parametrize("case", ["pickle", "traversal", "symlink", "duplicate", "unexpected", "absolute"])
def test_a_packages_zip_is_checked_before_anything_is_extracted_or_unpickled(package, tmp_path, case):
    """Every zip trick is refused, trusted or not, before torch's loader sees the file: nothing unpickled, nothing
    written outside, no link followed."""
    import pickle

    root, marker = _root(package), tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / f"{case}.pt2"
    link = zipfile.ZipInfo(f"{root}/data/aotinductor/model/link.so")
    link.external_attr = (0o120777 << 16)  # a symbolic link member
    add = {"pickle": [(f"{root}/data/sample_inputs/model.pt", pickle.dumps(Payload()))],
           "traversal": [(f"{root}/../../../escaped.so", b"\x7fELF")],
           "symlink": [(link, "/etc/passwd")],
           "duplicate": [(f"{root}/byteorder", b"big")],
           "unexpected": [(f"{root}/data/aotinductor/model/notes.txt", b"hello")],
           "absolute": [("/tmp/vitkit-absolute.so", b"\x7fELF")]}[case]
    with pytest.warns(UserWarning) if case == "duplicate" else contextlib.nullcontext():
        _rezip(package, evil, add=add)
    with pytest.raises(CheckpointError, match="refused|not all in one top folder"):
        aoti.load_package(evil)
    assert not marker.exists() and not list(tmp_path.parent.parent.glob("escaped.so"))
    with pytest.raises(CheckpointError, match="refused|not all in one top folder"):
        aoti.load_package(evil, trust=True)  # trusting the maker never extends to pickles or zip tricks
    assert not marker.exists() and not list(tmp_path.parent.parent.glob("escaped.so"))


def test_the_engine_cache_never_reuses_a_package_this_machine_did_not_record(package, tmp_path, monkeypatch):
    """A package planted in (or changed inside) a shared VITKIT_HOME's cache is removed, to be compiled again; a
    trust folder that others can write, or another user owns, vouches for nothing."""
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(aoti, "_MADE_HERE", set())  # another process than the one that compiled the fixture
    planted = tmp_path / "home" / "backends" / "exports" / "x-aoti-fp32.pt2"
    planted.parent.mkdir(parents=True)
    shutil.copy(package, planted)
    backends._forget_unvouched(planted)
    assert not planted.exists()
    shutil.copy(package, planted)
    digest = aoti.record_trusted(planted)  # made here: kept
    backends._forget_unvouched(planted)
    assert planted.exists() and aoti.is_trusted(digest)
    aoti._MADE_HERE.clear()  # from here on only the record on disk vouches
    folder = tmp_path / "home" / "trusted" / "packages"
    folder.chmod(0o777)  # a folder anyone may write to vouches for nothing
    assert not aoti.is_trusted(digest)
    folder.chmod(0o700)
    assert aoti.is_trusted(digest)
    os.chown(folder, 12345, -1)  # another user's folder neither
    assert not aoti.is_trusted(digest)
    os.chown(folder, os.geteuid(), -1)
    os.chown(folder / f"{digest}.json", 12345, -1)
    assert not aoti.is_trusted(digest)


def test_onnx_external_data_outside_the_files_folder_is_refused(tmp_path):
    """An ONNX file whose weights point outside its folder (`../`, an absolute path, a link to a device) is refused
    before an engine reads them."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from vitkit.inference.export import onnx_config

    folder = tmp_path / "m"
    folder.mkdir()
    np.zeros(4, np.float32).tofile(tmp_path / "secret.bin")
    (folder / "dev").symlink_to("/dev/zero")
    (folder / "ok.bin").write_bytes(np.zeros(4, np.float32).tobytes())
    for loc, ok in (("../secret.bin", False), (str(tmp_path / "secret.bin"), False), ("dev", False), ("ok.bin", True)):
        t = numpy_helper.from_array(np.zeros(4, np.float32), "w")
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        e = t.external_data.add()
        e.key, e.value = "location", loc
        g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [t])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        m.metadata_props.add(key="vitkit_config", value="{}")
        onnx.save(m, folder / "m.onnx")
        if ok:
            assert onnx_config(folder / "m.onnx") == {}
        else:
            with pytest.raises(CheckpointError, match="outside the file's folder"):
                onnx_config(folder / "m.onnx")


def test_a_package_whose_config_disagrees_with_its_graph_is_one_clear_error(package, tmp_path, capsys):
    """The config in a package's metadata is text anyone can change: a package that says one class and returns ten
    is refused by predict with one line, not a traceback."""
    one = _rewrite_metadata(package, tmp_path / "one.pt2", vitkit_config=json.dumps(
        {**json.loads(aoti.package_metadata(package)["vitkit_config"]), "num_classes": 1})) or tmp_path / "one.pt2"
    assert cli.main(["predict", *_images(tmp_path, 2), "--checkpoint", str(one), "--trust-package"]) == 2
    err = capsys.readouterr().err
    assert "disagree" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_bytes_around_a_packages_zip_are_refused_and_torch_reads_only_what_was_checked(package, tmp_path, where):
    """Python's zipfile forgives bytes before an archive (shifting every offset) where torch's reader takes them
    literally, so a second archive hidden there would be what torch loads: such a file is refused, trusted or not;
    and what torch is handed is the archive rebuilt from the checked members, never the file itself."""
    data = package.read_bytes()
    evil = tmp_path / f"{where}.pt2"
    evil.write_bytes(b"\0" * 4096 + data if where == "before" else data + b"PK\x03\x04" + b"\0" * 64)
    for trust in (False, True):
        with pytest.raises(CheckpointError, match="bytes before or after the archive"):
            aoti.open_package(evil, trust=trust)
    opened = aoti.open_package(package)
    with zipfile.ZipFile(opened.file) as rebuilt, zipfile.ZipFile(package) as original:
        assert rebuilt.namelist() == original.namelist() and opened.file.parent.stat().st_mode & 0o077 == 0
        assert all(rebuilt.read(n) == original.read(n) for n in original.namelist())


def test_a_package_compiled_where_the_record_cannot_be_written_still_loads_in_that_process(tmp_path, monkeypatch):
    """A read-only VITKIT_HOME: the digest cannot be recorded (a warning says so), but the process that compiled the
    package vouches for it, so `vitkit export --format aoti` still checks its own output; another process would
    need --trust-package."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "trusted").write_text("not a folder")  # the record's folder cannot be made
    monkeypatch.setenv("VITKIT_HOME", str(home))
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_dim=32,
                            num_classes=3)
    r = export_model(m, tmp_path / "m.pt2", "aoti")
    assert r.worst <= 1e-4
    monkeypatch.setattr(aoti, "_MADE_HERE", set())
    with pytest.raises(CheckpointError, match="did not make"):
        aoti.load_package(tmp_path / "m.pt2")


def test_a_failed_compile_keeps_the_file_there_and_a_link_planted_meanwhile_is_refused(tmp_path, monkeypatch):
    """A package compiles beside its file and is renamed over it when whole: a compile that fails, or has no
    compiler, leaves the user's previous package as it was; a symbolic link put at the path while it compiled
    (minutes) is refused at the rename, not replaced, and its target is untouched; nothing is left beside it."""
    import torch._inductor

    m = vitkit.create_model("vit_ti16", **{**tiny_kwargs("vit_ti16"), "depth": 1}).eval()
    old = tmp_path / "m.pt2"
    old.write_bytes(b"the package of yesterday")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    for packed in (False, True):
        with pytest.raises(UsageError, match="C\\+\\+ compiler"):
            export_model(m, old, "aoti", packed=packed)
        assert old.read_bytes() == b"the package of yesterday"
    monkeypatch.delenv("CXX")

    def broken(ep, package_path, inductor_configs):  # the compiler failing half-way (a full disk, a crash)
        Path(package_path).write_bytes(b"half a package")
        raise RuntimeError("C++ compile error")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    for packed in (False, True):
        with pytest.raises(ExportError, match="C\\+\\+ compile error"):
            export_model(m, old, "aoti", packed=packed)
        assert old.read_bytes() == b"the package of yesterday"
    target = tmp_path / "elsewhere.txt"
    target.write_text("not yours")
    link = tmp_path / "linked.pt2"

    def planting(ep, package_path, inductor_configs):  # someone puts a link at the output while it compiles
        Path(package_path).write_bytes(b"a whole package")
        link.symlink_to(target)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", planting)
    with pytest.raises(UsageError, match="symbolic link"):
        aoti.compile_package(aoti.Autocast(m, "fp32"), (torch.randn(2, 3, 32, 32),), None, link, {})
    assert link.is_symlink() and target.read_text() == "not yours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "linked.pt2", "m.pt2"]
