"""The Swin Transformer: parity with timm's and transformers' outputs (tests/fixtures/swin, made by
make_swin_fixtures.py with the peers themselves), the official .pth layout, windows at other sizes, timm reading
vitkit's exports, the paper's sizes, and the rest of vitkit (training, ONNX, explain) on it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError
from vitkit.models import get_entry
from vitkit.models.stats import model_stats

F = Path(__file__).resolve().parent / "fixtures" / "swin"
TIMM = F / "timm_swin"
TOL = 1e-4


def _close(ours: torch.Tensor, expected: np.ndarray) -> None:
    assert ours.shape == expected.shape
    assert np.abs(ours.detach().numpy() - expected).max() <= TOL


@pytest.mark.parametrize("src", ["timm folder", "timm state dict", "official .pth"])
def test_timm_and_official_parity(src):
    path = {"timm folder": TIMM, "timm state dict": TIMM / "model.safetensors", "official .pth": TIMM / "official.pth"}[src]
    m = vitkit.load(path)
    assert m.load_report["format"] == {"timm folder": "timm-swin", "timm state dict": "timm-swin",
                                       "official .pth": "swin-official"}[src]
    assert m.config.img_size == (64, 64) and m.config.window_size == 4  # the state dicts: inferred from the tables
    x = torch.from_numpy(np.load(TIMM / "input.npy"))
    with torch.no_grad():
        feats = m.forward_features(x)
        _close(feats, np.load(TIMM / "features.npy"))
        _close(m.forward_head(feats, pre_logits=True), np.load(TIMM / "pooled.npy"))
        _close(m(x), np.load(TIMM / "logits.npy"))


@pytest.mark.parametrize("suffix,size,window", [("_big", 128, None), ("_win6", 96, 6)])
def test_other_sizes_and_windows(suffix, size, window):
    """128 px: shifted windows in three stages; window 6 at 96 px: the tables resampled bicubically, as the paper's
    code does for 384 (the fixture resampled them with that code's own call)."""
    m = vitkit.load(TIMM, img_size=size, **({"window_size": window} if window else {}))
    x = torch.from_numpy(np.load(TIMM / f"input{suffix}.npy"))
    with torch.no_grad():
        _close(m(x), np.load(TIMM / f"logits{suffix}.npy"))
        _close(m.forward_features(x), np.load(TIMM / f"features{suffix}.npy"))


def test_hf_swin_parity():
    d = F / "hf_swin"
    m = vitkit.load(d)
    assert m.load_report["format"] == "hf-swin" and m.config.img_size == (128, 128)
    x = torch.from_numpy(np.load(d / "input.npy"))
    with torch.no_grad():
        feats = m.forward_features(x)
        _close(feats.flatten(1, 2), np.load(d / "features.npy"))  # (B, h, w, C) -> transformers' (B, h*w, C)
        _close(m.forward_head(feats, pre_logits=True), np.load(d / "pooled.npy"))
        _close(m(x), np.load(d / "logits.npy"))


def _manifest(file: Path) -> dict:
    from safetensors.torch import load_file

    return {k: [list(v.shape), hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()]
            for k, v in sorted(load_file(file).items())}


def test_timm_reads_vitkit_swin_exports(tmp_path):
    """timm read these exports with its own loaders when the fixture was made: exporting again writes the same."""
    r = F / "readback"
    m = vitkit.load(TIMM)
    out = vitkit.export(m, tmp_path / "timm", to="timm")
    assert json.loads((out / "config.json").read_text()) == json.loads((r / "timm" / "config.json").read_text())
    assert _manifest(out / "model.safetensors") == json.loads((r / "timm" / "model.tensors.json").read_text())
    sd = vitkit.export(m, tmp_path / "sd.safetensors", to="timm")
    assert _manifest(sd) == json.loads((r / "timm_state_dict.tensors.json").read_text())
    with torch.no_grad():
        _close(m(torch.from_numpy(np.load(TIMM / "input.npy"))), np.load(r / "timm_output.npy"))


@pytest.mark.parametrize("name,params_m,gmacs", [("swin_t", 28, 4.5), ("swin_s", 50, 8.7), ("swin_b", 88, 15.4),
                                                 ("swin_b_384", 88, 47.0)])
def test_sizes_match_the_swin_paper(name, params_m, gmacs):
    """Table 1 of the Swin paper: parameters, and FLOPs as it counts them (multiply-adds; vitkit's GFLOPs are 2 per
    multiply-add)."""
    s = model_stats(get_entry(name), num_classes=1000)
    assert abs(s["params_m"] - params_m) / params_m < 0.015, s
    assert abs(s["gflops"] / 2 - gmacs) / gmacs < 0.02, s


def test_sizes_that_do_not_divide_into_windows_are_refused():
    with pytest.raises(UsageError, match="does not divide into 7x7 windows"):
        vitkit.create_model("swin_t", img_size=256)
    m = vitkit.create_model("swin_t", img_size=448, depths=(2, 1, 1, 1), embed_dim=32, num_heads=(1, 2, 4, 8),
                            num_classes=3)  # 2x the windows per side
    assert m.blocks[0].attn_mask is None and m.blocks[1].attn_mask.shape == (16 * 16, 49, 49)
    with pytest.raises(UsageError, match="expected input of shape"):
        m(torch.randn(1, 3, 224, 224))


def test_window_attention_masks_tokens_brought_together_by_the_shift():
    """Shifted windows: a token never attends to one the cyclic shift brought from the opposite edge of the map."""
    m = vitkit.create_model("swin_t", img_size=32, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                            window_size=4, patch_size=2, num_classes=3).eval()
    blk = m.blocks[1]  # stage 0, shifted: 16x16 map, 4x4 windows, shift 2
    assert blk.shift == (2, 2)
    out = m.forward_intermediates(torch.randn(1, 3, 32, 32))
    a = out["attention"][1][0]  # (nW, H, N, N)
    last = a[-1, 0]  # the bottom-right window: four regions of the shifted map meet in it
    regions = torch.tensor([(r >= 2) * 2 + (c >= 2) for r in range(4) for c in range(4)])
    across = regions[:, None] != regions[None, :]
    assert last[across].max() < 1e-30 and last[~across].min() > 0


def test_training_onnx_and_explain_on_a_swin(tmp_path):
    from PIL import Image

    from vitkit.analysis.commands import explain_images
    from vitkit.cli import main
    from vitkit.inference.export import export_model

    code = main(["train", "fashion-mnist", "--smoke", "model.name=swin_t", f"run.out_dir={tmp_path / 'run'}",
                 "run.precision=fp32", "schedule.epochs=1"])  # 8 steps of the smoke's 16: a trained Swin to export
    assert code == 0
    m = vitkit.load(tmp_path / "run" / "best.safetensors")
    assert m.config.arch == "swin" and m.config.img_size == (32, 32)
    report = export_model(m, tmp_path / "m.onnx", "onnx", dynamic_batch=True)  # the shift masks in the graph
    assert max(c["max_abs_diff"] for c in report.checks) <= 1e-4
    with pytest.raises(UsageError, match="dynamic-size"):
        export_model(m, tmp_path / "d.onnx", "onnx", dynamic_size=True)
    Image.fromarray((np.random.default_rng(0).random((28, 28)) * 255).astype(np.uint8)).save(tmp_path / "x.png")
    rec = explain_images(m, [tmp_path / "x.png"], tmp_path / "explain")[0]
    arrays = np.load(rec["npz"])
    assert arrays["grad_cam"].shape == (2, 2) and arrays["window_attention_0"].shape == (16, 16)
    assert Path(rec["heads_png"]).stat().st_size > 0


def test_explicit_and_fused_window_attention_agree():
    """The two paths of the window attention (the explicit one is taken in bf16 training on CPUs with native bf16):
    the same outputs and gradients, shifted windows included."""
    torch.manual_seed(0)
    m = vitkit.create_model("swin_t", img_size=32, patch_size=2, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                            window_size=4, num_classes=3, drop_path_rate=0.0)  # deterministic, gradients on
    x = torch.randn(2, 3, 32, 32)
    outs = []
    for impl in ("sdpa", "explicit"):
        m.set_attention_impl(impl)
        m.zero_grad()
        y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), m.layers[0].blocks[1].attn.relative_position_bias_table.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-4)
