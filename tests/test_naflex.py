"""Packed batches of mixed sizes and aspect ratios (NaFlex / NaViT): the model against itself one image at a time, and
against timm's NaFlexVit and transformers' SigLIP 2 tower on their own packed batches (tests/fixtures/naflex, made by
make_naflex_fixtures.py in the peers' venv)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import vitkit
from vitkit.errors import UsageError
from vitkit.models.layers.packing import (PackedBatch, from_spatial_shapes, grid_coords, pack, resample_for_coords,
                                          resize_to_patches)
from vitkit.models.registry import build_config

FIX = Path(__file__).parent / "fixtures" / "naflex"
TOL = 1e-4
SIZES = [(2, 3), (4, 1), (1, 1), (3, 2)]  # patch grids: four aspect ratios


def _images(patch: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(3, h * patch, w * patch, generator=g) for h, w in SIZES]


@pytest.mark.parametrize("name", [n for n in vitkit.list_models() if not n.startswith(("r50", "r26", "r_vit", "bit", "swin"))])
def test_every_plain_vit_gives_an_image_the_same_output_alone_and_packed(name):
    c = build_config(name)
    p = c.patch_size[0]
    m = vitkit.create_model(name, embed_dim=32, depth=2, num_heads=2, mlp_dim=64 if c.mlp_layer == "mlp" else 48,
                            img_size=3 * p, num_classes=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
        imgs = _images(p, g)
        packed = m(imgs)
        alone = torch.cat([m([im]) for im in imgs])
        m.set_dynamic_img_size(True)  # the classic forward at each image's own size, its grid resampled (bilinear)
        classic = torch.cat([m(im[None]) for im in imgs])
    assert packed.shape == (len(imgs), 3) and classic.abs().max() > 0.05
    assert (packed - alone).abs().max() < 1e-5
    assert (alone - classic).abs().max() < 1e-5


@pytest.mark.parametrize("method,kw", [
    ("bilinear", dict(mode="bilinear", align_corners=True)),
    ("bilinear_aa", dict(mode="bilinear", align_corners=False, antialias=True)),
    ("bicubic", dict(mode="bicubic", align_corners=False, antialias=True)),
    ("bicubic_noaa", dict(mode="bicubic", align_corners=False))])
def test_per_token_resampling_is_f_interpolate(method, kw):
    table = torch.randn(7, 9, 5, generator=torch.Generator().manual_seed(1))
    for h, w in [(7, 9), (1, 1), (3, 14), (20, 5), (14, 18)]:  # the same grid, down, up and mixed
        ref = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), **kw)[0].permute(1, 2, 0).reshape(h * w, -1)
        out = resample_for_coords(table, grid_coords(h, w)[None], torch.tensor([[h, w]]), method)[0]
        assert (out - ref).abs().max() < 1e-5, (h, w)


def _timm_batch(name: str) -> tuple[PackedBatch, list[torch.Tensor]]:
    ld = lambda k: torch.from_numpy(np.load(FIX / name / f"{k}.npy"))  # noqa: E731
    batch = PackedBatch(ld("patches"), ld("coords"), ld("valid"))
    imgs = [batch.patches[i, : gh * gw].reshape(gh, gw, 16, 16, 3).permute(4, 0, 2, 1, 3).reshape(3, gh * 16, gw * 16)
            for i, (gh, gw) in enumerate(batch.grids())]  # (gh, gw, ph, pw, C) -> (C, H, W)
    return batch, imgs


@pytest.mark.parametrize("name,source", [("timm_gap", "folder"), ("timm_gap", "state_dict"), ("timm_map", "folder"),
                                         ("timm_map", "state_dict"), ("timm_par_gap", "folder"), ("timm_siglip", "folder")])
def test_timm_naflexvit_parity_packed_and_alone(name, source):
    path = FIX / name if source == "folder" else FIX / name / "state_dict.safetensors"
    m = vitkit.load(path, **({"num_heads": 4} if source == "state_dict" else {})).eval()
    batch, imgs = _timm_batch(name)
    assert len({h / w for h, w in batch.grids()}) >= 3 and batch.padding() > 0
    with torch.no_grad():
        packed, alone = m(batch), torch.cat([m([im]) for im in imgs])
        loose = m({"patches": batch.patches, "patch_coord": batch.coords, "patch_valid": batch.valid})  # timm's dict
        classic = torch.cat([m(im[None]) for im in imgs])  # (1, C, H, W) at its own size: the grid resampled alike
    want = torch.from_numpy(np.load(FIX / name / "packed.npy"))
    assert (packed - want).abs().max() < TOL and (loose - want).abs().max() < TOL
    want_alone = torch.from_numpy(np.load(FIX / name / "alone.npy"))  # timm's classic forward of each image
    assert (alone - want_alone).abs().max() < TOL and (classic - want_alone).abs().max() < TOL


def test_siglip2_naflex_tower_parity_packed_and_alone():
    ld = lambda k: torch.from_numpy(np.load(FIX / "hf_siglip2" / f"{k}.npy"))  # noqa: E731
    m = vitkit.load(FIX / "hf_siglip2").eval()
    assert (m.config.classifier, m.config.pos_resample, m.config.naflex) == ("map", "bilinear_aa", True)
    batch = from_spatial_shapes(ld("pixel_values"), ld("spatial_shapes"), ld("pixel_attention_mask"))
    with torch.no_grad():
        pooled = m(batch)
        feats, valid = m.forward_features_packed(batch)
        alone = torch.cat([m(pack([batch.patches[i, : gh * gw].reshape(gh, gw, 16, 16, 3).permute(4, 0, 2, 1, 3)
                                    .reshape(3, gh * 16, gw * 16)], (16, 16))) for i, (gh, gw) in enumerate(batch.grids())])
    assert (pooled - ld("packed")).abs().max() < TOL
    assert (alone - ld("alone")).abs().max() < TOL
    assert (feats * valid[..., None] - ld("hidden")).abs().max() < TOL
    two = vitkit.load(FIX / "hf_siglip2" / "two_tower").eval()  # Siglip2Model: its vision half, the text tower unused
    with torch.no_grad():
        assert (two(batch) - ld("packed")).abs().max() < TOL


def test_naflex_exports_back_to_timm_as_timm_wrote_it(tmp_path):
    for name in ("timm_map", "timm_par_gap"):
        out = vitkit.export(vitkit.load(FIX / name), tmp_path / name, to="timm")
        theirs, ours = load_file(FIX / name / "model.safetensors"), load_file(out / "model.safetensors")
        assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
        cfg, want = json.loads((out / "config.json").read_text()), json.loads((FIX / name / "config.json").read_text())
        assert cfg["architecture"] == want["architecture"]
    # SigLIP 2's tower as a timm NaFlexVit (checked in timm itself: benchmarks/NOTES.md section 31)
    cfg = json.loads((vitkit.export(vitkit.load(FIX / "hf_siglip2"), tmp_path / "s2", to="timm") / "config.json").read_text())
    assert cfg["architecture"] == "naflexvit_base_patch16_siglip" and cfg["model_args"]["pos_embed_interp_mode"] == "bilinear"


REG = Path(__file__).parent / "fixtures" / "registry" / "timm"


@pytest.mark.parametrize("name, method", [("naflexvit_base_patch16_radio_v3", "bilinear"),
                                          ("naflexvit_large_patch16_radio_v3", "bilinear_noaa")])
def test_radio_naflexvit_reads_and_exports_its_resampling_and_no_final_norm(name, method, tmp_path):
    """RADIO's NaFlexVits (timm's registry sweep folders: a 3x3 learned grid, plain bilinear with or without aligned
    corners, aspect preserving, no final norm): timm's logits at the native and the wide size; the timm export spells
    the resampling and final_norm=False out, the same tensors, and reads back to timm's logits (timm reads these
    exports to 9e-8 / 3e-7: benchmarks/NOTES.md section 42)."""
    d = tmp_path / name
    d.mkdir()
    (d / "model.safetensors").symlink_to(REG / name / "model.safetensors")
    (d / "config.json").write_text((REG / name / "configs" / f"{name}.json").read_text())
    model = vitkit.load(d)
    assert (model.config.pos_resample, model.config.pos_resample_square, model.config.final_norm) == (method, True, False)
    out = vitkit.export(model, tmp_path / "export", to="timm")
    args = json.loads((out / "config.json").read_text())["model_args"]
    assert args["final_norm"] is False and args["pos_embed_align_corners"] == (method == "bilinear")
    theirs, ours = load_file(REG / name / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    back = vitkit.load(out)
    for x, y in (("input", "logits"), ("input_wide", "logits_wide")):
        with torch.no_grad():
            got = back(torch.from_numpy(np.load(REG / f"{x}.npy"))).numpy()
        assert np.abs(got - np.load(REG / name / f"{y}.npy")).max() <= TOL


def test_packed_input_errors_are_clear():
    m = vitkit.create_model("vit_ti16", depth=1, img_size=32, num_classes=2)
    with pytest.raises(UsageError, match="multiples of the patch size"):
        m([torch.zeros(3, 20, 32)])
    with pytest.raises(UsageError, match="patches .B, L, P"):
        m(PackedBatch(torch.zeros(2, 4, 768), torch.zeros(2, 5, 2), torch.ones(2, 4)))
    with pytest.raises(UsageError, match="patch_coord"):
        m({"patches": torch.zeros(1, 4, 768)})
    with pytest.raises(UsageError, match="without any valid patch"):
        m(PackedBatch(torch.zeros(2, 4, 768), torch.zeros(2, 4, 2), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])))
    with pytest.raises(UsageError, match="negative"):
        m(PackedBatch(torch.zeros(1, 4, 768), -torch.ones(1, 4, 2), torch.ones(1, 4)))
    hybrid = vitkit.create_model("r_vit_ti16", depth=1, num_classes=2)
    with pytest.raises(UsageError, match="hybrid"):
        hybrid([torch.zeros(3, 32, 32)])


def test_resize_to_patches_keeps_the_aspect_ratio_within_the_budget():
    for h, w in [(480, 640), (1000, 100), (17, 9000), (32, 32), (3, 3)]:
        for budget in (1, 16, 64, 256):
            H, W = resize_to_patches(h, w, (16, 16), budget)
            n = (H // 16) * (W // 16)
            assert H % 16 == 0 and W % 16 == 0 and 1 <= n <= budget
            # one more patch row or column at the same aspect would not fit, or the image is one patch thick
            if min(H, W) > 16 and budget >= 4:
                assert abs((H / W) / (h / w) - 1) < 0.5
    assert resize_to_patches(480, 640, (16, 16), 256) == (224, 288)  # 14 x 18 = 252 patches; 14 x 19 = 266 > 256


def test_packed_onnx_export_matches_eager_and_timm(tmp_path):
    import onnxruntime as ort

    from vitkit.inference.export import export_model

    m = vitkit.load(FIX / "timm_map").eval()
    report = export_model(m, tmp_path / "m.onnx", packed=True)  # checked against eager on 3 other batches and lengths
    assert report.worst < TOL and len({tuple(c["shape"][:2]) for c in report.checks}) == 3
    batch, _ = _timm_batch("timm_map")
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"patches": batch.patches.numpy(), "coords": batch.coords.numpy(), "valid": batch.valid.numpy()})[0]
    assert np.abs(got - np.load(FIX / "timm_map" / "packed.npy")).max() < TOL  # timm's own packed forward


def test_the_service_packs_requests_of_mixed_sizes_into_one_forward():
    import io
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from PIL import Image

    from tests.test_serve import Server
    from vitkit.data.naflex import PackTransform
    from vitkit.serve import Limits, TorchPredictor, create_app
    from vitkit.serve.engine import take_packed

    assert take_packed([10, 12, 30, 5], max_batch=8, max_tokens=40) == 2  # 2 x 12 fits; 3 x 30 padded tokens do not (FIFO)
    assert take_packed([50, 3], max_batch=8, max_tokens=40) == 1  # one image always goes, whatever its size
    assert take_packed([5, 5, 5, 5], max_batch=8, max_tokens=40, length=16) == 2  # rows padded to 16: 2 x 16 <= 40
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, mlp_dim=96,
                            num_classes=4).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    rng = np.random.default_rng(0)
    pngs = []
    for h, w in [(30, 90), (120, 40), (64, 64), (20, 200)]:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    srv = Server(create_app(TorchPredictor(m, "fp32"), Limits(max_batch=4, max_wait_ms=200, max_patches=16)))
    try:
        with ThreadPoolExecutor(4) as pool:  # four requests at once: one packed forward
            answers = list(pool.map(lambda d: httpx.post(f"{srv.url}/predict", content=d, timeout=30,
                                                         headers={"content-type": "image/png"}), pngs))
        info = httpx.get(f"{srv.url}/model").json()
        metrics = httpx.get(f"{srv.url}/metrics").text
        explained = httpx.post(f"{srv.url}/explain", content=pngs[3], headers={"content-type": "image/png"}, timeout=30)
    finally:
        srv.stop()
    assert "aspect ratio kept" in info["preprocessing"]["resize"]
    batches = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("vitkit_batches ")))
    assert batches < 4  # some requests shared a forward
    packer = PackTransform.for_model(m.config, 16)
    for data, r in zip(pngs, answers):
        assert r.status_code == 200, r.text
        img = torch.from_numpy(np.array(Image.open(io.BytesIO(data)))).permute(2, 0, 1)
        x = packer.image(img)
        with torch.no_grad():
            want = m([x]).softmax(-1)[0]  # the image alone at its own aspect ratio
        assert r.json()["top"][0]["probability"] == pytest.approx(float(want.max()), abs=1e-3)
    e = explained.json()
    assert explained.status_code == 200 and e["grid"][1] > 2 * e["grid"][0]  # a 20x200 image: a wide grid


def test_native_aspect_training_resumes_exactly_and_evaluates_packed(tmp_path):
    from vitkit.training.presets import get_preset
    from vitkit.training.trainer import train

    def cfg(out):
        c = get_preset("fashion-mnist-naflex", smoke=True)
        c.data.subset, c.data.test_subset, c.data.batch_size = 128, 64, 32
        c.schedule.epochs = 2
        c.run.out_dir, c.run.progress, c.run.ckpt_every, c.run.precision = str(out), "off", 3, "fp32"
        return c

    full = train(cfg(tmp_path / "a"), resume=False)
    part = train(cfg(tmp_path / "b"), resume=False, max_steps=5)
    assert part["step"] == 5
    resumed = train(cfg(tmp_path / "b"))
    a = load_file(tmp_path / "a" / "final.safetensors")
    b = load_file(tmp_path / "b" / "final.safetensors")
    assert full["step"] == resumed["step"] == 8 and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["acc1"] == full["acc1"]


def test_attention_maps_of_a_packed_batch_are_each_image_alone():
    m = vitkit.create_model("vit_ti16", depth=2, img_size=32, num_classes=3).eval()
    g = torch.Generator().manual_seed(3)
    imgs = [torch.randn(3, 16, 48, generator=g), torch.randn(3, 32, 32, generator=g)]
    with torch.no_grad():
        out = m.forward_intermediates(imgs, layers=[-1])
        for i, im in enumerate(imgs):
            one = m.forward_intermediates([im], layers=[-1])
            n = 1 + int(out["valid"][i].sum())  # the class token and the image's patches
            a = out["attention"][1][i, :, :n, :n]
            assert (a - one["attention"][1][0]).abs().max() < 1e-5
            assert out["attention"][1][i, :, :n, n:].abs().sum() == 0  # no weight on the padding
            assert (out["logits"][i] - one["logits"][0]).abs().max() < 1e-5


def test_an_image_folder_trains_and_evaluates_at_native_aspect(tmp_path):
    from PIL import Image

    from vitkit.cli import main

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i, (h, w) in enumerate([(28, 10), (12, 40), (30, 30), (50, 20)]):
                Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / split / c / f"{i}.png")
    run = tmp_path / "run"
    args = [f"data.dataset={tmp_path}", "data.max_patches=9", "data.batch_size=4", "data.num_workers=0",
            "model.name=vit_ti16", 'model.overrides={"img_size": 24, "patch_size": 8, "depth": 1, "embed_dim": 32, '
            '"num_heads": 2, "mlp_dim": 64}', "aug.crop=rrc", "aug.random_erasing=0", "schedule.epochs=1",
            f"run.out_dir={run}", "run.progress=false", "run.precision=fp32"]
    assert main(["train", *args]) == 0
    assert main(["eval", str(run / "final.safetensors"), "--data", str(tmp_path), "--max-patches", "9",
                 "--out", str(run)]) == 0
    report = json.loads((run / "eval_report.json").read_text())
    assert report["n"] == 8 and report["max_patches"] == 9 and report["skipped"] == 0
    assert main(["train", *args[:-3], "aug.mixup=0.8", f"run.out_dir={tmp_path / 'mix'}"]) == 2  # one size per batch
    # shifted test-time views need one size per batch too: refused before any training, loading or output
    assert main(["train", *args[:-3], "run.tta=flip-shift2", f"run.out_dir={tmp_path / 'shift'}"]) == 2
    assert not (tmp_path / "shift" / "checkpoints").exists()
    assert main(["eval", str(run / "final.safetensors"), "--data", str(tmp_path), "--max-patches", "9", "--tta",
                 "flip-shift", "--out", str(tmp_path / "shift_eval")]) == 2
    assert not (tmp_path / "shift_eval").exists()
    assert main(["predict", str(tmp_path / "val" / "a" / "0.png"), "--checkpoint", str(run / "final.safetensors"),
                 "--max-patches", "9", "--tta", "flip-shift2", "--out", str(tmp_path / "shift.jsonl")]) == 2
    assert not (tmp_path / "shift.jsonl").exists()


@pytest.mark.parametrize("name", ["timm_gap", "timm_map", "timm_par_gap", "timm_siglip"])
def test_one_image_at_a_non_native_size_is_timms_plain_and_packed(name):
    """timm's classic forward of one (1, C, H, W) image whose grid is not the position table's (make_naflex_fixtures.py
    single): vitkit's plain forward and its packed batch of one give timm's logits."""
    m = vitkit.load(FIX / name).eval()
    ref = np.load(FIX / name / "single.npz")
    sizes = [k[len("pixels_"):] for k in ref.files if k.startswith("pixels_")]
    assert len(sizes) == 2 and m.config.grid_size == (8, 8)
    with torch.no_grad():
        for k in sizes:
            x = torch.from_numpy(ref[f"pixels_{k}"]).float()[None] / 127.5 - 1
            assert x.shape[-2:] != (128, 128)
            want = torch.from_numpy(ref[f"logits_{k}"])
            assert (m(x) - want).abs().max() <= 1e-5, k
            assert (m([x[0]]) - want).abs().max() <= 1e-5, k
