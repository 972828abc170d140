"""One preprocessing per checkpoint (timm's eval transform), bad and oversized images, verified dataset downloads."""
import gzip
import importlib.machinery
import importlib.util
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.data.datasets import image_folder, iterate_batches
from vitkit.data.image import EvalTransform, ImageDecodeError, load_image, preprocess, to_uint8_tensor
from vitkit.models.layers.patch_embed import to_2tuple

from conftest import FIXTURES, FIXTURES_HERE

EVAL = FIXTURES_HERE / "timm_eval_transform"


def _cases():
    return list(enumerate(json.loads((EVAL / "cases.json").read_text())))


@pytest.mark.parametrize("i,case", _cases(), ids=lambda v: str(v) if isinstance(v, int) else None)
def test_eval_preprocessing_is_timms(i, case):
    """Files go through timm's eval transform exactly (resize the shorter side to size / crop_pct, centre crop);
    a batch of same-sized images in memory through the same geometry, resampled by torch (within 2.5 grey levels: torch keeps floats where PIL rounds to bytes)."""
    expected = np.load(EVAL / "expected.npz")
    size = to_2tuple(case["img_size"])
    for name in ("tall", "wide", "small"):
        want = expected[f"{i}/{name}"]
        img = load_image(EVAL / f"{name}.png")
        got = preprocess(img, size, case["mean"], case["std"], crop_pct=case["crop_pct"], interpolation=case["interpolation"])
        assert np.array_equal(got.numpy(), want), name
        batch = EvalTransform(size, case["mean"], case["std"], crop_pct=case["crop_pct"], interpolation=case["interpolation"])
        got = batch(to_uint8_tensor(img)[None])[0].numpy()
        assert got.shape == want.shape and np.abs(got - want).max() <= 2.5 / 255 / min(case["std"]), name


def _tiny_checkpoint(tmp_path, **kw) -> Path:
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=3, class_names=["a", "b", "c"],
                            crop_pct=0.875, interpolation="bicubic", mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), **kw)
    torch.nn.init.normal_(m.head.weight, std=0.5)
    return vitkit.save(m, tmp_path / "m.safetensors")


def _write_folder(root: Path, splits: dict[str, int], size=(50, 70)) -> None:
    rng = np.random.default_rng(0)
    for split, n in splits.items():
        for c in "abc":
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for j in range(n):
                Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / split / c / f"{j}.png")


def test_eval_predict_and_explain_see_the_same_input(tmp_path, capsys):
    """`vitkit eval`, `predict` and `explain` feed the model one and the same tensor per file: the checkpoint's own
    size, crop, interpolation and mean/std. `eval` of an ImageFolder uses the trainer's split (val/ before test/)."""
    from vitkit.analysis.commands import _input
    from vitkit.cli import main
    from vitkit.inference import predict

    ckpt = _tiny_checkpoint(tmp_path)
    root = tmp_path / "imgs"
    _write_folder(root, {"train": 1, "val": 2, "test": 3})
    model = vitkit.load(ckpt)
    c = model.config
    ds = image_folder(root / "val", classes=c.class_names).configured(c)
    x, _, _ = next(iterate_batches(ds, len(ds), shuffle=False, drop_last=False))
    assert x.shape[-2:] == (32, 32)
    batch = EvalTransform.for_model(c, geometry=False)(x)
    files = [p for p, _ in ds.samples]
    by_file = dict(zip(files, batch))
    for f in files:
        ref = preprocess(load_image(f), c.img_size, c.mean, c.std, crop_pct=c.crop_pct, interpolation=c.interpolation)
        assert torch.equal(by_file[f], ref)  # the dataset path is the PIL path
        assert torch.equal(_input(model, f)[0][0], ref)  # explain
    with torch.no_grad():
        probs = model(batch).softmax(-1)
    recs = predict(model, files, top_k=1)
    for rec, p in zip(recs, probs):
        assert rec["top"][0]["probability"] == pytest.approx(p.max().item(), abs=1e-6)
    assert main(["eval", str(ckpt), "--data", str(root), "--num-workers", "0", "--out", str(tmp_path / "ev"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert report["n"] == 6  # val/ (2 per class), as the trainer evaluates, not test/ (3 per class)


def test_finetuning_decodes_folders_at_the_checkpoint_size(tmp_path, monkeypatch):
    """A 48-px checkpoint fine-tuned on a folder of 64-px images: the files are decoded at 48, not at a default size
    and then resampled."""
    import vitkit.data.image as image
    from test_training import tiny_cfg
    from vitkit.training import train

    m = vitkit.create_model("vit_ti16", img_size=48, patch_size=16, depth=1, num_classes=3, embed_dim=48, num_heads=3, mlp_dim=96)
    ckpt = vitkit.save(m, tmp_path / "m48.safetensors")
    root = tmp_path / "imgs"
    _write_folder(root, {"train": 4, "val": 1}, size=(64, 64))
    sizes = set()
    real = image.resize_crop  # what every file sample is decoded by (image.sample_geometry), seen passing through
    monkeypatch.setattr(image, "resize_crop", lambda img, size, *a: (sizes.add(tuple(size)), real(img, size, *a))[1])
    cfg = tiny_cfg(tmp_path / "run", **{"data.dataset": str(root), "data.batch_size": 4, "data.num_workers": 0,
                                        "model.checkpoint": str(ckpt), "model.overrides": {}, "schedule.epochs": 1})
    train(cfg)
    assert sizes == {(48, 48)}


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A tiny PNG whose header declares width x height: a decompression bomb's shape without its bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def test_decompression_bombs_are_skipped_and_counted(tmp_path, capsys):
    from vitkit.cli import main
    from test_training import tiny_cfg
    from vitkit.training import train

    bomb = tmp_path / "bomb.png"
    _png_header_only(bomb, 20000, 20000)
    assert bomb.stat().st_size < 200
    with pytest.raises(ImageDecodeError, match="over the limit of .* pixels: refused as a possible decompression bomb"):
        load_image(bomb)
    _png_header_only(tmp_path / "big.png", 9000, 8000)  # 72 Mpx: under PIL's own limits, over vitkit's
    with pytest.raises(ImageDecodeError, match="9000 x 8000 = 72,000,000 pixels, over the limit"):
        load_image(tmp_path / "big.png")
    root = tmp_path / "imgs"
    _write_folder(root, {"train": 4, "val": 2}, size=(32, 32))
    for split in ("train", "val"):
        _png_header_only(root / split / "a" / "bomb.png", 20000, 20000)
    res = train(tiny_cfg(tmp_path / "run", **{"data.dataset": str(root), "data.batch_size": 4, "data.num_workers": 0,
                                               "model.overrides": {"img_size": 32, "in_chans": 3}, "schedule.epochs": 1}))
    assert res["skipped_images"] >= 1
    ckpt = tmp_path / "run" / "final.safetensors"
    assert main(["eval", str(ckpt), "--data", str(root), "--num-workers", "0", "--out", str(tmp_path / "ev"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert report["skipped"] == 1 and report["n"] == 6
    capsys.readouterr()
    good = root / "val" / "b" / "0.png"
    assert main(["predict", str(good), str(bomb), "--checkpoint", str(ckpt), "--format", "json", "--device", "cpu"]) == 1
    recs = json.loads(capsys.readouterr().out)
    assert "top" in recs[0] and "decompression bomb" in recs[1]["error"]


def test_predict_and_explain_work_on_a_bit_checkpoint(tmp_path, capsys):
    from vitkit.cli import main

    ckpt = FIXTURES / "timm_resnetv2_bit" / "model.safetensors"
    img = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (80, 72, 3), dtype=np.uint8)).save(img)
    assert main(["predict", str(img), "--checkpoint", str(ckpt), "--format", "json", "--device", "cpu"]) == 0
    rec = json.loads(capsys.readouterr().out)[0]
    assert len(rec["top"]) == 3 and abs(sum(t["probability"] for t in rec["top"]) - 1) < 1e-5
    assert main(["explain", str(img), "--checkpoint", str(ckpt), "--out", str(tmp_path / "ex")]) == 0
    arrays = np.load(tmp_path / "ex" / "x.npz")
    h, w = vitkit.load(ckpt).config.img_size  # a timm state dict records no size: BiT's default 224, stride 32
    assert arrays["grad_cam"].shape == (h // 32, w // 32) and arrays["grad_cam"].max() == pytest.approx(1.0)
    assert Image.open(tmp_path / "ex" / "x_rollout.png").size[0] > 100


def test_dataset_downloads_are_verified(tmp_path, monkeypatch):
    """Fashion-MNIST is fetched over https from Zalando's repository and checked against the published MD5s; a file
    that does not match is removed and the error says so."""
    import vitkit.data.datasets as datasets

    assert datasets.FASHION_MNIST_URL.startswith("https://") and all(u.startswith("https://") for u in datasets.CIFAR_URLS.values())
    src = tmp_path / "www"
    src.mkdir()
    good = (FIXTURES.parent / "fixtures" / "jax_vit_gap" / "model.npz").read_bytes()
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (src / f"{stem}.gz").write_bytes(good)  # not Fashion-MNIST: its MD5 is not the published one
    monkeypatch.setattr(datasets, "FASHION_MNIST_URL", src.as_uri())
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "data_roots", lambda data_dir, name: [tmp_path / "cache" / "data" / name])
    with pytest.raises(datasets.DatasetError, match="checksum mismatch.*md5 bef4ecab320f06d8554ea6380940ec79"):
        datasets.load_fashion_mnist("test")
    assert not list((tmp_path / "cache").rglob("*.gz"))


def test_digits_read_without_scikit_learn_are_scikit_learns_own(tmp_path, monkeypatch):
    """The digits come from scikit-learn's installed csv without importing it: the same images and labels as
    `sklearn.datasets.load_digits`; a csv not of its form (truncated, corrupt, empty, another shape) or a package
    without a folder of its own is left to scikit-learn's loader, and nothing outside the package is read."""
    import subprocess
    import sys

    import sklearn.datasets

    from vitkit.data import datasets

    code = "import sys; from vitkit.data.datasets import load_digits; load_digits(); print('sklearn' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0 and res.stdout.split() == ["False"], res.stderr[-2000:]  # the fast path ran

    datasets._digits_arrays.cache_clear()
    images, target = datasets._digits_arrays()
    d = sklearn.datasets.load_digits()
    assert np.array_equal(images, d.images) and np.array_equal(target, d.target)
    train, test = datasets.load_digits("train"), datasets.load_digits("test")
    assert len(train) == 1500 and len(test) == 297
    assert sorted(torch.cat([train.labels, test.labels]).tolist()) == sorted(d.target.tolist())

    calls = []
    real = sklearn.datasets.load_digits
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda *a, **k: calls.append(1) or real(*a, **k))
    fake = tmp_path / "pkg" / "sklearn"
    (fake / "datasets" / "data").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    good = gzip.compress(b"\n".join(b",".join([b"3"] * 64 + [b"7"]) for _ in range(1797)) + b"\n")
    planted = {"truncated": good[: len(good) // 2], "corrupt deflate": good[:20] + b"\xff" * 200 + good[220:],
               "empty": gzip.compress(b""), "another shape": gzip.compress(b"0,1,2\n")}
    monkeypatch.chdir(tmp_path)  # a csv where a package without an origin would have pointed
    (tmp_path / "datasets" / "data").mkdir(parents=True)
    (tmp_path / "datasets" / "data" / "digits.csv.gz").write_bytes(good)
    specs = {name: importlib.util.spec_from_file_location("sklearn", fake / "__init__.py") for name in planted}
    specs["a package without an origin"] = importlib.machinery.ModuleSpec("sklearn", None)
    try:
        for name, spec in specs.items():
            if name in planted:
                (fake / "datasets" / "data" / "digits.csv.gz").write_bytes(planted[name])
            monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, spec=spec: spec if n == "sklearn" else None)
            datasets._digits_arrays.cache_clear()
            calls.clear()
            images2, target2 = datasets._digits_arrays()
            assert calls == [1] and np.array_equal(images2, d.images) and np.array_equal(target2, d.target), name
        # the form it expects, planted: read as it is, scikit-learn's loader not called
        (fake / "datasets" / "data" / "digits.csv.gz").write_bytes(good)
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: specs["truncated"] if n == "sklearn" else None)
        datasets._digits_arrays.cache_clear()
        calls.clear()
        images3, target3 = datasets._digits_arrays()
        assert calls == [] and (images3 == 3).all() and (target3 == 7).all()
    finally:
        datasets._digits_arrays.cache_clear()
