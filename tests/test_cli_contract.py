"""What a new user met in the first hour, as command lines: every command does what it says, and a bad input ends
in one `vitkit: error:` line, exit 2, with nothing written and nothing moved."""
import json
import math
import socket
from pathlib import Path

import pytest
import torch
import yaml

import vitkit
from vitkit.cli import COMMANDS, main
from vitkit.training import PRESETS


REPO = Path(__file__).resolve().parents[1]
TINY_DIGITS = ["data.dataset=digits", "model.overrides.img_size=16", "model.overrides.patch_size=4",
               "model.overrides.embed_dim=32", "model.overrides.depth=1", "model.overrides.num_heads=2",
               "model.overrides.mlp_dim=64", "run.progress=false", "run.precision=fp32", "schedule.epochs=1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                            num_classes=3, class_names=["a", "b", "c"])
    vitkit.save(m, path)
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_train_without_a_preset_on_another_dataset_gets_plain_defaults_and_says_so(tmp_path, capsys):
    assert main(["train", "data.dataset=digits", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["preset"] == "none" and cfg["model"] == {**cfg["model"], "name": "vit_ti16", "overrides": {}}
    assert cfg["run"]["precision"] == "auto" and cfg["aug"]["random_erasing"] == 0.0  # TrainConfig's own defaults
    assert main(["train", "--print-config"]) == 0  # no dataset named: the fashion-mnist preset, as before
    assert yaml.safe_load(capsys.readouterr().out)["preset"] == "fashion-mnist"
    out = tmp_path / "run"
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--max-steps", "1"]) == 0
    err = capsys.readouterr().err
    assert f"training from no preset (plain defaults) on digits, into {out}" in err
    assert "model vit_ti16: plain ViT, D 32, depth 1" in err


def test_print_config_shows_every_override_and_trains_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "fashion-mnist-mpp", "--smoke", "optim.lr=0.01", f"run.out_dir={out}", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["preset"] == "fashion-mnist-mpp" and cfg["optim"]["lr"] == 0.01 and cfg["model"]["objective"] == "mpp"
    assert cfg["data"]["subset"] == 512 and not out.exists()


def test_help_lists_every_preset_and_the_readme_names_them(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    readme = (REPO / "README.md").read_text()
    for name in PRESETS:
        assert name in help_text and f"`{name}`" in readme, name


def test_max_steps_0_trains_nothing(tmp_path):
    out = tmp_path / "zero"
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--max-steps", "0"]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["step"] == 0 and not (out / "checkpoints").exists() and (out / "final.safetensors").exists()
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--max-steps", "-1"]) == 2


def test_zero_means_zero_for_the_periodic_settings(tmp_path):
    out = tmp_path / "quiet"
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "run.log_every=0", "run.eval_every=0", "run.ckpt_every=0",
                 "--max-steps", "3"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 3]  # one log line and one evaluation, at the end
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    assert main(["train", *TINY_DIGITS, f"run.out_dir={tmp_path / 'neg'}", "run.log_every=-1"]) == 2


def test_no_resume_with_a_bad_config_moves_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--max-steps", "1"]) == 0
    before = _files(out)
    capsys.readouterr()
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--no-resume", "model.name=vit_nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vitkit: error:") and "vit_nonexistent" in err[-1]
    assert _files(out) == before and not list(out.glob("previous-*"))  # best.safetensors still where it was
    # a failed fresh run leaves no empty folder behind
    assert main(["train", *TINY_DIGITS, f"run.out_dir={tmp_path / 'new'}", "data.dataset=/nowhere"]) == 2
    assert not (tmp_path / "new").exists()


def test_hf_export_keeps_the_preprocessing_as_transformers_reads_it(tmp_path):
    from transformers import AutoImageProcessor

    m = vitkit.create_model("vit_ti16", depth=1, num_classes=3, mean=(0.485, 0.456, 0.406),
                            std=(0.229, 0.224, 0.225), crop_pct=0.875, interpolation="bicubic")
    vitkit.save(m, tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    p = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert list(p.image_mean) == [0.485, 0.456, 0.406] and list(p.image_std) == [0.229, 0.224, 0.225]
    assert int(p.resample) == 3 and p.size["height"] == 256 and p.crop_size["height"] == 224 and p.do_center_crop
    back = vitkit.load(tmp_path / "hf").config
    assert (back.mean, back.std, back.interpolation, back.crop_pct) == (m.config.mean, m.config.std, "bicubic", 0.875)
    from vitkit.checkpoints.hf import _crop_pct

    for crop, pct in ((32, 0.875), (224, 0.9), (384, 0.95), (16, 0.5)):  # the same resize, whatever the value written
        size = math.floor(crop / pct)
        assert math.floor(crop / _crop_pct(crop, size)) == size
    # and one that resizes without a crop is transformers' ViTImageProcessor
    m.config.crop_pct = 1.0
    vitkit.save(m, tmp_path / "m1.safetensors")
    assert main(["convert", str(tmp_path / "m1.safetensors"), str(tmp_path / "hf1"), "--to", "hf"]) == 0
    p = AutoImageProcessor.from_pretrained(tmp_path / "hf1")
    assert "ViTImageProcessor" in type(p).__name__ and p.size["height"] == 224
    assert vitkit.load(tmp_path / "hf1").config.crop_pct == 1.0


def test_loading_a_run_folder_points_at_its_weights(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY_DIGITS, f"run.out_dir={out}", "--max-steps", "1"]) == 0
    with pytest.raises(vitkit.CheckpointError, match=f"load {out / 'best.safetensors'} or {out / 'final.safetensors'}"):
        vitkit.load(out)


def test_serve_refuses_a_taken_port_and_a_bad_checkpoint_before_announcing(ckpt, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", str(ckpt), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"vitkit: error: cannot listen on 127.0.0.1:{port}") and not any("serving" in e for e in err)
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    assert main(["serve", str(tmp_path / "bad.safetensors"), "--port", "0"]) == 2
    assert not any("serving" in e for e in capsys.readouterr().err.splitlines())


def test_explain_treats_a_bad_image_as_predict_does(ckpt, tmp_path, capsys):
    from PIL import Image

    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (20, 20), (200, 10, 10)).save(good)
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    for cmd in (["predict", str(bad), str(good), "--checkpoint", str(ckpt)],
                ["explain", str(bad), str(good), "--checkpoint", str(ckpt), "--out", str(tmp_path / "ex")]):
        assert main(cmd) == 1
        io = capsys.readouterr()
        assert f"{bad}: ERROR cannot decode image {bad}" in io.out and "1 of 2 image(s) could not be read" in io.err
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == ["good.npz", "good_heads.png", "good_rollout.png"]
    assert main(["explain", str(bad), "--checkpoint", str(ckpt), "--out", str(tmp_path / "none")]) == 2
    assert not (tmp_path / "none").exists()


# every command that reads a file: its arguments with the file in the place of `F`, and where it would write
SWEEP = {
    "info": ["F"], "convert": ["F", "{out}/c.safetensors"], "export": ["F", "{out}/m.onnx"],
    "eval": ["F", "--data", "digits", "--out", "{out}"], "predict": ["F"], "fewshot": ["F", "--data", "digits"],
    "explain": ["{img}", "--checkpoint", "F", "--out", "{out}"], "inspect": ["--checkpoint", "F", "--out", "{out}"],
    "serve": ["F", "--port", "0"], "bench": ["F"], "train": ["model.checkpoint=F", "run.out_dir={out}"],
    "data": ["pack", "F", "{out}/shards"], "knn": ["F", "--data", "digits"],
    "features": ["{img}", "--checkpoint", "F", "--out", "{out}/f.safetensors"],
}


def test_the_sweep_covers_every_command_that_reads_a_file():
    assert set(SWEEP) | {"models", "catalog", "reproduce", "demo"} == set(COMMANDS)  # those four read no input file


@pytest.mark.parametrize("what", ["missing", "corrupt", "wrong option"])
@pytest.mark.parametrize("command", sorted(SWEEP))
def test_every_command_refuses_bad_input_in_one_line_and_touches_nothing(command, what, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("an earlier result")
    bad = {"missing": work / "missing.safetensors", "corrupt": work / "corrupt.safetensors"}.get(what, work / "x")
    if what == "corrupt":
        bad.write_bytes(b"\x00\x01 truncated or foreign bytes")
    img = work / "img.png"
    from PIL import Image

    Image.new("RGB", (16, 16)).save(img)
    before = _files(tmp_path)
    args = [str(bad) if a == "F" else a.replace("=F", f"={bad}").replace("{out}", str(work / "out")).replace("{img}", str(img))
            for a in SWEEP[command]]
    if command == "predict":
        args = [str(img), "--checkpoint", str(bad)]
    if what == "wrong option":
        args = [*args, "--no-such-option"]
    with pytest.raises(SystemExit) if what == "wrong option" else _nothing() as e:
        code = main([command, *args])
    if what == "wrong option":
        code = e.value.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    # one error line, the last (a command may have said what it was about to do), and no traceback
    assert [e for e in err if "error" in e] == err[-1:] and err[-1].startswith("vitkit") and ": error: " in err[-1], err
    assert all(e.startswith("vitkit") for e in err), err
    assert _files(tmp_path) == before and not (work / "out").exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the contract of every command line: --help, --version, the default export (issue 42, items 5 and 6) ----------

@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    """`vitkit COMMAND --help` exits 0 with the command's usage and its options' help (a bare % in a help text once
    crashed argparse's formatting of eval, predict and serve --help)."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    io = capsys.readouterr()
    assert e.value.code == 0 and io.out.startswith(f"usage: vitkit {command} ") and "-h, --help" in io.out, io
    assert "Traceback" not in io.err


def test_version(capsys):
    import torch

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vitkit {vitkit.__version__} (torch {torch.__version__})"


@pytest.fixture(scope="module")
def export_ckpt(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny ViT whose every weight reaches the logits (no zero-initialised head)."""
    import torch

    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                            num_classes=3)
    with torch.no_grad():
        for p in m.parameters():
            if not p.any():
                p.normal_(std=0.1)
    path = tmp_path_factory.mktemp("export") / "m.safetensors"
    vitkit.save(m, path)
    return path, vitkit.load(path).eval()


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_the_default_export_runs_at_any_batch_in_its_engine(export_ckpt, fmt, tmp_path, capsys):
    """`vitkit export CKPT OUT` with no flags (and `--format openvino`): a file whose batch is dynamic, run by
    onnxruntime (OpenVINO's runtime) at batch 1 and 4 within 1e-4 of eager PyTorch."""
    import numpy as np
    import torch

    ckpt, eager = export_ckpt
    out = tmp_path / ("m.onnx" if fmt == "onnx" else "m.xml")
    assert main(["export", str(ckpt), str(out), *(["--format", "openvino"] if fmt == "openvino" else [])]) == 0
    assert "(3, 3, 16, 16)" in capsys.readouterr().out  # checked at a second batch size
    if fmt == "onnx":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        run = lambda x: sess.run(None, {"pixel_values": x})[0]  # noqa: E731
    else:
        from vitkit.machine.engine_probe import openvino_core

        compiled = openvino_core().compile_model(str(out), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        run = lambda x: compiled(x)[0]  # noqa: E731
    for batch in (1, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 16, 16)).astype(np.float32)
        with torch.no_grad():
            ref = eager(torch.from_numpy(x)).numpy()
        got = run(x)
        assert got.shape == (batch, 3) and np.abs(got - ref).max() <= 1e-4, (batch, np.abs(got - ref).max())
