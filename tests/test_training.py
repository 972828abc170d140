"""Training: exact resume after SIGKILL/SIGTERM, real image folders, fine-tuning a checkpoint, bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitkit
from vitkit.checkpoints.run import load_model_weights
from vitkit.data.datasets import DatasetError, load_digits
from vitkit.training import TrainingError, apply_overrides, checkpoint, get_preset, train

from conftest import FIXTURES

REPO = Path(__file__).resolve().parents[1]

TINY = {
    "data.dataset": "digits", "data.batch_size": 64, "data.eval_batch_size": 500, "model.name": "vit_ti16",
    "model.overrides": {"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_dim": 128},
    "aug.hflip": False, "aug.pad": 0, "run.tta": "none",
    "optim.lr": 3e-3, "schedule.epochs": 4, "schedule.warmup_epochs": 0.5,
    "run.progress": False, "run.log_every": 1, "run.threads": 1, "run.deterministic": True,
    "run.precision": "fp32",  # runs compared bitwise compute alike on any machine (auto: tests/test_precision.py)
}


def tiny_cfg(out, **extra):
    """The fashion-mnist preset shrunk to seconds on digits; `extra` model.overrides merge into the tiny ones."""
    cfg = get_preset("fashion-mnist")
    cfg.model.overrides = {}  # a plain ViT; the CLI resume test below keeps the preset's hybrid stages
    merged = {**TINY, "run.out_dir": str(out), **extra}
    base = {} if "model.checkpoint" in extra else TINY["model.overrides"]  # a checkpoint brings its own architecture
    merged["model.overrides"] = {**base, **extra.get("model.overrides", {})}
    apply_overrides(cfg, merged)
    return cfg


def test_digits_training_learns(tmp_path):
    res = train(tiny_cfg(tmp_path / "run", **{"schedule.epochs": 8}))
    assert res["acc1"] > 0.9, res  # 10 classes: chance is 0.1
    out = tmp_path / "run"
    assert {"config.yaml", "checkpoints", "best.safetensors", "final.safetensors", "metrics.jsonl", "result.json"} <= {p.name for p in out.iterdir()}
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{res['step']:08d}"]  # the newest only
    assert any((out / "tb").iterdir())
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "test" for r in lines) and all("img_per_s" in r for r in lines if "split" not in r)
    m = vitkit.load(out / "best.safetensors")
    assert m.config.class_names == [str(i) for i in range(10)] and m.config.in_chans == 1


# 4 epochs of 23 steps: a kill at step 40 (mid-epoch 2) resumes across two epoch ends, each with its evaluation
RESUME_EPOCHS, RESUME_STEPS = 4, 4 * (1500 // 64)
RESUME_ARGS = [f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in TINY.items()] + [
    f"schedule.epochs={RESUME_EPOCHS}", "run.ckpt_every=4", "run.ema=0.9", "aug.randaugment=2,9", "aug.mixup=0.8", "aug.cutmix=1.0",
    "aug.random_erasing=0.25", "aug.pad=1", "aug.hflip=true", "model.overrides.img_size=32",
    "model.overrides.drop_path_rate=0.1", "model.overrides.drop_rate=0.1",
]


def _cli(out, *extra):
    # one GEMM path for the three processes compared bit for bit: a path measured again under another load (an
    # xdist worker beside them) may differ in fp32 rounding
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VITKIT_GEMM": "onednn-packed"}
    return subprocess.Popen([sys.executable, "-m", "vitkit.cli", "train", *RESUME_ARGS, f"run.out_dir={out}", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)


def _wait_for_step(out: Path, step: int, proc) -> None:
    """Until the run has logged `step` (no time limit: a slow machine is no failure; a run that ends first is)."""
    while True:
        f = out / "metrics.jsonl"
        if f.exists():
            steps = [json.loads(x).get("step", 0) for x in f.read_text().splitlines() if x.strip().endswith("}")]
            if steps and max(steps) >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted run both kill tests compare with (made once)."""
    out = tmp_path_factory.mktemp("reference") / "ref"
    ref = _cli(out)
    _, err = ref.communicate()
    assert ref.returncode == 0, err.decode()[-2000:]
    assert b"model vit_ti16: plain ViT, D 64, depth 2" in err  # the model named, not the preset's hybrid
    return out


@pytest.mark.xdist_group("reference_run")  # one worker runs both, so the module's reference run is trained once
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_identical_weights(tmp_path, sig, reference_run):
    run = _cli(tmp_path / "cut")
    try:
        _wait_for_step(tmp_path / "cut", 40, run)
    finally:  # the run ends here whatever happened while waiting for it
        run.send_signal(sig)
        code = run.wait()
    assert code == (-9 if sig == signal.SIGKILL else 143), run.stderr.read().decode()[-1000:]
    assert 0 < checkpoint.read_meta(checkpoint.latest(tmp_path / "cut"))["step"] < RESUME_STEPS  # stopped in the middle
    resumed = _cli(tmp_path / "cut")
    _, err = resumed.communicate()
    assert resumed.returncode == 0, err.decode()[-2000:]
    lines = [x for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    whole = [x for x in lines if x.endswith("}")]
    assert len(lines) - len(whole) <= 1  # at most the line being written at the kill is partial
    assert json.loads(whole[-1])["step"] == RESUME_STEPS
    a, b = load_file(reference_run / "final.safetensors"), load_file(tmp_path / "cut" / "final.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    sa, sb = _checkpoint_weights(reference_run), _checkpoint_weights(tmp_path / "cut")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _checkpoint_weights(run_dir: Path, key: str = "model") -> dict:
    """The weights of a run's newest sharded checkpoint, read into a plain model."""
    from vitkit.models import build_model
    from vitkit.models.registry import ViTConfig

    ck = checkpoint.latest(run_dir)
    model = build_model(ViTConfig(**{k: v for k, v in checkpoint.read_meta(ck)["model_config"].items() if k != "arch"}))
    load_model_weights(ck, model, key)
    return model.state_dict()


def _write_png_folder(root: Path, n_per_class: int = 12, corrupt: bool = True) -> None:
    d = load_digits("train")
    for split, offset in (("train", 0), ("val", 500)):
        for c in range(3):
            folder = root / split / f"digit{c}"
            folder.mkdir(parents=True)
            idx = (d.labels == c).nonzero().flatten()[offset // 50 : offset // 50 + n_per_class]
            for i in idx.tolist():
                Image.fromarray(d.images[i, 0].numpy()).resize((16, 16)).convert("RGB").save(folder / f"{i}.png")
    if corrupt:
        (root / "train" / "digit0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")


def test_image_folder_end_to_end(tmp_path, capsys):
    root = tmp_path / "imgs"
    _write_png_folder(root)
    cfg = tiny_cfg(tmp_path / "run", **{"data.dataset": str(root), "data.batch_size": 8, "data.num_workers": 0,
                                        "model.overrides": {"img_size": 16, "in_chans": 3}, "schedule.epochs": 3})
    res = train(cfg)
    assert res["skipped_images"] >= 1  # the corrupt file was skipped and counted, not fatal
    named = [line for line in capsys.readouterr().err.splitlines() if "broken.png" in line]
    assert len(named) == 1 and "skipped an undecodable image" in named[0], named  # named, once over 3 epochs
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert max(r.get("skipped_images", 0) for r in recs) >= 1
    from vitkit.cli import main

    ckpt = tmp_path / "run" / "best.safetensors"
    assert main(["eval", str(ckpt), "--data", str(root), "--num-workers", "0", "--out", str(tmp_path / "ev"), "--tta", "flip",
                 "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert set(report["per_class"]) == {"digit0", "digit1", "digit2"} and report["n"] == 36 and report["tta"] == "flip"
    assert Image.open(tmp_path / "ev" / "confusion.png").size[0] > 200
    capsys.readouterr()
    img = next((root / "val" / "digit1").iterdir())
    assert main(["predict", str(img), str(root / "train" / "digit0" / "broken.png"), "--checkpoint", str(ckpt), "--format", "json",
                 "--tta", "flip-shift", "--device", "cpu"]) == 1  # one file could not be read
    recs = json.loads(capsys.readouterr().out)
    assert recs[0]["top"][0]["label"] in {"digit0", "digit1", "digit2"} and "error" in recs[1]
    cfg.data.strict_images = True
    cfg.run.out_dir = str(tmp_path / "strict")
    with pytest.raises(Exception, match="broken.png"):
        train(cfg)


def test_random_resized_crops_of_files_are_cut_at_full_resolution(tmp_path):
    """aug.crop=rrc on files: each crop is cut from the decoded full-resolution image in the DataLoader workers,
    drawn from (seed, epoch, index) alone, so a small crop keeps the file's detail (a crop of the model-size image
    would be upsampled blur), and the training batch is not cropped again."""
    import random

    from vitkit.data.datasets import image_folder
    from vitkit.data.image import random_resized_crop_box
    from vitkit.training.distributed import Dist
    from vitkit.training.setup import prepare_run

    rng = random.Random(0)
    boxes = [random_resized_crop_box(375, 500, (0.1, 0.3), (3 / 4, 4 / 3), rng) for _ in range(2000)]
    for top, left, h, w in boxes:  # inside the image, area and aspect ratio in range up to rounding
        assert 0 <= top <= 375 - h and 0 <= left <= 500 - w
        assert 0.099 <= h * w / (375 * 500) <= 0.302 and 0.74 <= w / h <= 1.345
    assert abs(np.mean([h * w for _, _, h, w in boxes]) / (375 * 500) - 0.2) < 0.01  # U(0.1, 0.3): every draw fits
    assert random_resized_crop_box(375, 500, (2.0, 2.0), (1.0, 1.0), rng) == (0, 62, 375, 375)  # none fits: centre

    root = tmp_path / "noise"
    for cls in ("a", "b"):
        (root / "train" / cls).mkdir(parents=True)
        (root / "val" / cls).mkdir(parents=True)
        for i in range(4):
            noise = np.random.default_rng(i).integers(0, 256, (480, 480, 3), dtype=np.uint8)
            Image.fromarray(noise).save(root / "train" / cls / f"{i}.png")
            Image.fromarray(noise).save(root / "val" / cls / f"{i}.png")
    ds = image_folder(root / "train", img_size=(32, 32)).with_train_crop((0.01, 0.01), (1.0, 1.0), seed=0)
    x = ds.for_epoch(0)[0][0]
    assert x.shape == (3, 32, 32) and torch.equal(x, ds.for_epoch(0)[0][0]) and not torch.equal(x, ds.for_epoch(1)[0][0])
    # a 48-px crop of the noise resized to 32: neighbours differ as noise does (~85 grey levels before resizing)
    assert (x[:, :, 1:].int() - x[:, :, :-1].int()).abs().float().mean() > 25

    cfg = tiny_cfg(tmp_path / "run", **{"data.dataset": str(root), "data.batch_size": 4, "data.num_workers": 0,
                                        "aug.crop": "rrc", "model.overrides": {"img_size": 16, "in_chans": 3}})
    run = prepare_run(cfg, Dist())
    assert run.data.train.train_crop[:3] == (tuple(cfg.aug.scale), tuple(cfg.aug.ratio), cfg.run.seed)
    assert run.data.augment.cfg.crop == "none" and run.data.test.train_crop is None  # evaluation keeps its geometry


def test_finetune_a_fixture_checkpoint_at_a_new_resolution(tmp_path):
    """timm ViT-Ti fixture (64x64, 7 classes) -> digits at 32x32 (grayscale replicated), a new 10-class head."""
    cfg = tiny_cfg(tmp_path / "ft", **{"model.checkpoint": str(FIXTURES / "timm_vit_tiny/model.safetensors"),
                                       "model.overrides": {"img_size": 32}, "optim.name": "sgd", "optim.lr": 0.03,
                                       "optim.weight_decay": 0.0, "schedule.epochs": 3, "aug.label_smoothing": 0.0})
    res = train(cfg)
    m = vitkit.load(tmp_path / "ft" / "best.safetensors")
    assert m.config.img_size == (32, 32) and m.pos_embed.weight.shape == (1, 5, 192) and m.config.num_classes == 10
    assert res["acc1"] > 0.3
    probe = tiny_cfg(tmp_path / "lp", **{"model.checkpoint": str(FIXTURES / "timm_vit_tiny/model.safetensors"),
                                         "model.overrides": {"img_size": 32}, "model.linear_probe": True, "schedule.epochs": 1})
    train(probe)
    before = vitkit.load(FIXTURES / "timm_vit_tiny/model.safetensors", img_size=32)
    after = vitkit.load(tmp_path / "lp" / "final.safetensors")
    assert torch.equal(before.blocks[0].attn.qkv.weight, after.blocks[0].attn.qkv.weight)  # frozen backbone
    assert after.head.weight.abs().sum() > 0


def test_a_run_from_a_checkpoint_prints_and_records_the_model_it_loaded(tmp_path, capsys):
    """model.checkpoint=PATH: the run names what it loaded (timm's name from a timm folder, the registered name of a
    vitkit file's architecture), not the preset's model.name, on stderr, in config.yaml and result.json."""
    import yaml

    from conftest import FIXTURES_HERE

    vitkit.save(vitkit.create_model("deit3_s16", img_size=32, num_classes=3), tmp_path / "deit.safetensors")
    for ckpt, want in [(FIXTURES_HERE / "naflex" / "timm_gap", "naflexvit_base_patch16_gap"),
                       (tmp_path / "deit.safetensors", "deit3_s16")]:
        cfg = tiny_cfg(tmp_path / want, **{"model.checkpoint": str(ckpt), "model.overrides": {"img_size": 32}})
        assert cfg.model.name != want
        res = train(cfg, max_steps=1)
        assert f"model {want} from {ckpt}" in capsys.readouterr().err
        assert res["model"] == json.loads((tmp_path / want / "result.json").read_text())["model"] == want
        assert yaml.safe_load((tmp_path / want / "config.yaml").read_text())["model"]["loaded"] == want
    res = train(tiny_cfg(tmp_path / "plain"), max_steps=1)
    assert res["model"] == "vit_ti16"


def test_low_precision_token_stream_trains(tmp_path):
    cfg = tiny_cfg(tmp_path / "lowp", **{"schedule.epochs": 8, "run.lowp_stream": True, "run.precision": "bf16"})
    assert train(cfg)["acc1"] > 0.9
    # in fp32 (asked for, or chosen by auto) the option has nothing to keep low: the preset's lowp_stream=true stays valid
    assert train(tiny_cfg(tmp_path / "lowp32", **{"run.lowp_stream": True, "run.precision": "fp32"}), max_steps=2)["step"] == 2


def test_nan_loss_stops_with_the_last_good_checkpoint_intact(tmp_path):
    cfg = tiny_cfg(tmp_path / "nan", **{"run.ckpt_every": 1, "optim.clip_grad": None, "optim.lr": 1e4, "schedule.warmup_epochs": 0.0})
    with pytest.raises(TrainingError, match="became") as e:
        train(cfg)
    assert "last good checkpoint is intact" in str(e.value)
    assert all(torch.isfinite(v).all() for v in _checkpoint_weights(tmp_path / "nan").values())


def test_bad_datasets_give_clear_errors(tmp_path):
    (tmp_path / "one" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "one" / "val" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "train" / "cat" / "a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "val" / "cat" / "a.png")
    with pytest.raises(DatasetError, match="single class"):
        train(tiny_cfg(tmp_path / "r1", **{"data.dataset": str(tmp_path / "one")}))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    (tmp_path / "empty" / "val").mkdir(parents=True)
    with pytest.raises(DatasetError, match="empty"):
        train(tiny_cfg(tmp_path / "r2", **{"data.dataset": str(tmp_path / "empty")}))
    with pytest.raises(DatasetError, match="unknown dataset"):
        train(tiny_cfg(tmp_path / "r3", **{"data.dataset": "imagenet-99k"}))


def test_checkpoint_classes_that_do_not_match_the_data(tmp_path):
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, in_chans=1, depth=1, num_classes=10,
                            class_names=list("abcdefghij"))
    vitkit.save(m, tmp_path / "m.safetensors")
    with pytest.raises(TrainingError, match="do not match"):
        train(tiny_cfg(tmp_path / "r", **{"model.checkpoint": str(tmp_path / "m.safetensors"), "model.overrides": {}}))


def test_config_overrides_files_and_errors(tmp_path):
    cfg = get_preset("fashion-mnist")
    apply_overrides(cfg, {"optim.lr": "2e-3", "aug.scale": "[0.5, 1.0]", "model.overrides.depth": "3", "run.ema": "null"})
    assert cfg.optim.lr == 2e-3 and cfg.aug.scale == (0.5, 1.0) and cfg.model.overrides["depth"] == 3 and cfg.run.ema is None
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(cfg, {"optim.learning_rate": 1})
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(cfg, {"lr": 1})
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 0.005\nschedule:\n  epochs: 1\n")
    from vitkit.training import load_config_file
    from vitkit.training.config import TrainConfig

    c2 = TrainConfig.from_dict(load_config_file(tmp_path / "c.yaml"))
    assert c2.optim.lr == 0.005 and c2.schedule.epochs == 1.0
    from vitkit.training.presets import PRESETS

    assert {"fashion-mnist", "fashion-mnist-long", "fashion-mnist-fast", "fashion-mnist-mpp", "cifar10-scratch",
            "cifar10-finetune"} <= set(PRESETS)
    for name in PRESETS:
        smoke = get_preset(name, smoke=True)
        assert smoke.data.subset and smoke.schedule.epochs <= 2


def test_cli_train_smoke_writes_the_resolved_config(tmp_path):
    from vitkit.cli import main

    out = tmp_path / "cli"
    assert main(["train", "fashion-mnist", "--smoke", "data.dataset=digits", f"run.out_dir={out}", "run.progress=false",
                 "model.overrides.img_size=16", "model.overrides.patch_size=4"]) == 0
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["dataset"] == "digits" and saved["model"]["overrides"]["embed_dim"] == 32


def test_mpp_preset_pretrains_and_fine_tunes_as_its_docstring_says(tmp_path):
    from vitkit.cli import main

    common = ["--smoke", "data.dataset=digits", "run.progress=false", "model.overrides.img_size=16"]
    assert main(["train", "fashion-mnist-mpp", *common, f"run.out_dir={tmp_path / 'pre'}"]) == 0
    assert vitkit.load(tmp_path / "pre" / "final.safetensors").config.mpp
    assert main(["train", "fashion-mnist-mpp", *common, "model.objective=classify", f"run.out_dir={tmp_path / 'ft'}",
                 f"model.checkpoint={tmp_path / 'pre' / 'final.safetensors'}"]) == 0
    m = vitkit.load(tmp_path / "ft" / "final.safetensors")
    assert not m.config.mpp and m.config.num_classes == 10


def test_demo_trains_evaluates_and_predicts_on_fashion_mnist(tmp_path, capsys, monkeypatch):
    """The README's first command on a sliver of an epoch: real Fashion-MNIST files, real PNGs. One GEMM path, as in
    tests/test_predict.py: the per-shape measurement (tests/test_gemm.py) is not what this checks, and under a busy
    neighbour it is measured again, uncached, in every process."""
    from vitkit.demo import DEMO_RECIPE, demo
    from vitkit.machine import gemm

    monkeypatch.setattr(gemm, "FORCE", "onednn-packed")

    res = demo(epochs=0.01, out=str(tmp_path / "demo"), images=2)  # 5 steps: the evaluation is the demo's bulk
    assert res["step"] == round(0.01 * (60000 // DEMO_RECIPE["data.batch_size"]))
    out = capsys.readouterr().out
    assert "on the 10000 test images" in out and "top-1" in out and "Ankle boot" in out
    report = json.loads((tmp_path / "demo" / "test_report.json").read_text())
    assert report["n"] == 10000 and len(report["per_class"]) == 10 and report["acc1"] == res["acc1"]
    assert Image.open(tmp_path / "demo" / "test_confusion.png").size[0] > 200
    assert len(list((tmp_path / "demo" / "samples").glob("*.png"))) == 2


def test_finetune_a_bit_checkpoint_gets_a_new_head(tmp_path):
    cfg = tiny_cfg(tmp_path / "bit", **{"model.checkpoint": str(FIXTURES / "timm_resnetv2_bit/model.safetensors"),
                                        "model.overrides": {"img_size": 32}, "schedule.epochs": 0.2,
                                        "data.batch_size": 32})
    train(cfg)
    m = vitkit.load(tmp_path / "bit" / "final.safetensors")
    assert m.config.num_classes == 10 and m.config.class_names == [str(i) for i in range(10)]


def test_eval_every_a_fraction_of_an_epoch(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", **{"schedule.epochs": 2, "run.eval_every": 0.5, "run.tta": "flip", "aug.hflip": True})
    steps_per_epoch = 1500 // 64  # digits: 1500 training images
    train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in lines if r.get("split") == "test"]
    half = round(0.5 * steps_per_epoch)
    assert steps == [half, 2 * half, 3 * half, 2 * steps_per_epoch], steps  # every half epoch, and the last step


def test_held_out_validation_split(tmp_path):
    from safetensors import safe_open

    from vitkit.data.datasets import load_dataset, split_holdout

    train_set = load_dataset("digits").train
    tr, va = split_holdout(train_set, 0.1)
    tr2, va2 = split_holdout(train_set, 0.1)
    assert torch.equal(va.labels, va2.labels) and len(tr) + len(va) == len(train_set)  # the same images every time
    counts = torch.bincount(va.labels, minlength=10)
    assert counts.min() >= 1 and abs(len(va) - 0.1 * len(train_set)) <= 10  # per class, about 10%
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_holdout(train_set, 1.0)

    cfg = tiny_cfg(tmp_path / "run", **{"schedule.epochs": 2, "run.eval_every": 1, "data.val_split": 0.1, "run.ema": 0.9})
    res = train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r["split"], r["step"]) for r in lines if "split" in r]
    last = 2 * (len(tr) // 64)
    assert evals == [("val", last // 2), ("val", last), ("test", last)], evals  # the test set once, at the end
    assert res["best_split"] == "val" and 0 < res["val_acc1"] <= 1 and res["acc1"] == lines[-1]["acc1"]
    with safe_open(str(tmp_path / "run" / "best.safetensors"), "pt") as f:
        assert f.metadata()["split"] == "val"


def test_resume_refuses_a_changed_config_and_logs_every_step_once(tmp_path):
    """A run resumed with another batch size or schedule would mix two runs: refused with the differences listed,
    unless forced. Settings that do not change a step (evaluation, logging) may change. Records logged after the
    checkpoint (by a run killed later) are dropped before the resumed run logs those steps again."""
    out = tmp_path / "run"
    train(tiny_cfg(out, **{"schedule.epochs": 2, "run.ckpt_every": 10}), max_steps=15)
    metrics = out / "metrics.jsonl"
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "split" not in x][-1] == 15
    with open(metrics, "a") as f:  # as if killed at step 17, after the checkpoint of step 15, mid-write
        f.write(json.dumps({"step": 16, "loss": 1.0}) + "\n" + json.dumps({"step": 17, "loss": 1.0}) + "\n" + '{"step": 18, "lo')
    with pytest.raises(TrainingError) as e:
        train(tiny_cfg(out, **{"schedule.epochs": 3, "data.batch_size": 32, "run.ckpt_every": 10}))
    msg = str(e.value)
    assert "data.batch_size: 64 -> 32" in msg and "schedule.epochs: 2.0 -> 3.0" in msg and "--force" in msg
    assert "run.ckpt_every" not in msg
    res = train(tiny_cfg(out, **{"schedule.epochs": 2, "run.ckpt_every": 10, "run.eval_every": 0.5}))  # only eval changed
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "split" not in json.loads(x)]
    assert steps == list(range(1, res["step"] + 1))  # every step once, in order
    forced = train(tiny_cfg(out, **{"schedule.epochs": 3, "run.ckpt_every": 10}), force=True)
    assert forced["step"] > res["step"]
    fresh = train(tiny_cfg(out, **{"schedule.epochs": 1}), resume=False)
    previous = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1 and (previous[0] / "checkpoints").exists() and (previous[0] / "metrics.jsonl").exists()
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "split" not in x][0] == 1
    assert fresh["step"] < res["step"]


def test_a_non_finite_gradient_stops_the_run_with_or_without_clipping(tmp_path):
    from vitkit.training.loop import check_gradients

    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, depth=1, num_classes=3)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    check_gradients(m, None, False, 0)  # finite: nothing happens
    m.blocks[0].mlp.fc1.weight.grad[0, 0] = float("inf")
    for clip in (None, 1.0):
        with pytest.raises(TrainingError, match=r"gradient norm became (inf|nan) .*blocks\.0\.mlp\.fc1\.weight"):
            check_gradients(m, clip, False, 7)
    check_gradients(m, None, True, 7)  # fp16's grad scaler skips such a step itself


def test_masked_patch_pretraining_then_fine_tuning_and_distillation(tmp_path):
    """model.objective=mpp pre-trains without labels and saves a checkpoint that fine-tunes as any other (its head
    left behind); a distilled student learns from a teacher checkpoint; every evaluation can add few-shot accuracy."""
    pre = train(tiny_cfg(tmp_path / "pre", **{"model.objective": "mpp", "schedule.epochs": 2}))
    assert 1 / 512 * 5 < pre["acc1"] <= 1  # the share of corrupted patches whose 3-bit colour is right: far above chance
    assert vitkit.load(tmp_path / "pre" / "final.safetensors").config.mpp
    ft = train(tiny_cfg(tmp_path / "ft", **{"model.checkpoint": str(tmp_path / "pre" / "final.safetensors"),
                                            "schedule.epochs": 2, "run.fewshot": "digits", "run.eval_every": 1}))
    m = vitkit.load(tmp_path / "ft" / "final.safetensors")
    assert not m.config.mpp and m.config.num_classes == 10 and ft["acc1"] > 0.3
    recs = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["fewshot_5"] <= 1 for r in recs if r.get("split"))
    for kind in ("hard", "soft"):
        st = train(tiny_cfg(tmp_path / kind, **{"distill.teacher": str(tmp_path / "ft" / "final.safetensors"),
                                                "distill.kind": kind, "schedule.epochs": 2}))
        student = vitkit.load(tmp_path / kind / "final.safetensors")
        assert student.config.distilled and st["acc1"] > 0.3
    with pytest.raises(ValueError, match="distillation token"):
        train(tiny_cfg(tmp_path / "bad", **{"distill.teacher": str(tmp_path / "ft" / "final.safetensors"),
                                            "model.checkpoint": str(tmp_path / "ft" / "final.safetensors")}))
