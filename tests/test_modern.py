"""The ViTs that followed the paper (DINOv2, DINOv2 with registers, DeiT-III, SigLIP, CLIP, EVA-02): parity with the
outputs timm and transformers computed themselves (tests/fixtures/modern, made by make_modern_fixtures.py), exports
that the peers read back, the real sizes against timm's, and the new options one by one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError
from vitkit.models.registry import build_config, build_model
from vitkit.models.stats import count_flops, count_params

F = Path(__file__).resolve().parent / "fixtures" / "modern"
TOL = 1e-4
TIMM = sorted(p.name for p in F.iterdir() if p.is_dir() and p.name.startswith("timm_"))
HF = sorted(p.name for p in F.iterdir() if p.is_dir() and p.name.startswith("hf_"))
# what a bare timm state dict cannot say and the architecture's name would (timm's defaults otherwise)
STATE_DICT_HINTS = {"timm_clip": dict(norm_eps=1e-5), "timm_clip_quickgelu": dict(norm_eps=1e-5, act="quick_gelu")}


def _np(name: str, folder: Path) -> np.ndarray:
    return np.load(folder / f"{name}.npy")


def _close(ours: torch.Tensor, expected: np.ndarray) -> None:
    assert ours.shape == expected.shape
    err = np.abs(ours.detach().numpy() - expected).max()
    assert err <= TOL, err


@pytest.mark.parametrize("name", TIMM)
def test_timm_folder_parity_at_two_sizes(name):
    d = F / name
    m = vitkit.load(d)
    x = torch.from_numpy(_np("input", d))
    with torch.no_grad():
        feats = m.forward_features(x)
        _close(feats, _np("features", d))
        _close(m.forward_head(feats, pre_logits=True), _np("pooled", d))
        _close(m(x), _np("logits", d))
    # a larger input: timm's set_input_size (bicubic position embedding, rotary grid rebuilt) = vitkit's img_size=
    xb = torch.from_numpy(_np("input_big", d))
    mb = vitkit.load(d, img_size=xb.shape[-1], resample="bicubic")
    with torch.no_grad():
        _close(mb.forward_features(xb), _np("features_big", d))
        _close(mb(xb), _np("logits_big", d))


@pytest.mark.parametrize("name", TIMM)
def test_timm_state_dict_parity(name):
    """The bare model.safetensors: the architecture from the tensors (registers, LayerScale, the position embedding's
    coverage, MAP, qk-norm, SwiGLU packed or not, EVA-02's rotary embedding); the head count, as ever, by hand."""
    d = F / name
    m = vitkit.load(d / "model.safetensors", num_heads=2, **STATE_DICT_HINTS.get(name, {}))
    with torch.no_grad():
        _close(m(torch.from_numpy(_np("input", d))), _np("logits", d))


@pytest.mark.parametrize("name", [n for n in TIMM if (F / n / "release.pth").exists()])
def test_dinov2_release_state_dict(name):
    """DINOv2's own release names (`register_tokens`, `mask_token`, the class token's position in `pos_embed`), as
    timm's own converter read them when the fixture was made."""
    d = F / name
    m = vitkit.load(d / "release.pth", num_heads=2)
    assert m.load_report["format"] == "dinov2-release" and "mask_token" in m.load_report["unused"]
    assert m.config.num_classes == 0
    with torch.no_grad():
        _close(m(torch.from_numpy(_np("input", d))), _np("release_pooled", d))


@pytest.mark.parametrize("name", HF)
def test_hf_parity(name):
    d = F / name
    for src in (d, d / "model.safetensors"):
        m = vitkit.load(src, **({} if src.is_dir() else {"num_heads": 2}))
        x = torch.from_numpy(_np("input", d))
        with torch.no_grad():
            out = m.forward_intermediates(x, layers=[-1], attention=False)
            # transformers' CLIP returns the last block's tokens before post_layernorm, the others after their norm
            feats = out["tokens"][m.config.depth - 1] if "clip" in name else out["features"]
            _close(feats, _np("features", d))
            _close(m(x), _np("pooled", d))
    # a larger input: transformers' own interpolation, plain bicubic (antialiased only in Dinov2WithRegistersModel)
    xb = torch.from_numpy(_np("input_big", d))
    mb = vitkit.load(d, img_size=xb.shape[-1], resample="bicubic" if "reg" in name else "bicubic_noaa")
    with torch.no_grad():
        _close(mb(xb), _np("pooled_big", d))
        if "clip" not in name:
            _close(mb.forward_features(xb), _np("features_big", d))


def _manifest(file: Path) -> dict:
    from safetensors.torch import load_file

    return {k: [list(v.shape), hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()]
            for k, v in sorted(load_file(file).items())}


@pytest.mark.parametrize("name", sorted(p.name for p in (F / "readback").iterdir() if p.is_dir()))
def test_peers_read_vitkit_exports(name, tmp_path):
    """timm and transformers read these exports with their own loaders when the fixtures were made: exporting the
    same model again must write the same config.json and tensors, and vitkit's outputs must be the peers'."""
    d = F / "readback" / name
    m = vitkit.load(d / "source.safetensors") if (d / "source.safetensors").exists() else vitkit.load(F / name)
    x = torch.from_numpy(_np("input", d))
    out = vitkit.export(m, tmp_path / "timm", to="timm")
    assert json.loads((out / "config.json").read_text()) == json.loads((d / "timm" / "config.json").read_text())
    assert _manifest(out / "model.safetensors") == json.loads((d / "timm" / "tensors.json").read_text())
    with torch.no_grad():
        _close(m(x), _np("timm_output", d))
    m.reset_classifier(0)
    if (d / "hf").exists():
        out = vitkit.export(m, tmp_path / "hf", to="hf")
        assert json.loads((out / "config.json").read_text()) == json.loads((d / "hf" / "config.json").read_text())
        assert _manifest(out / "model.safetensors") == json.loads((d / "hf" / "tensors.json").read_text())
        with torch.no_grad():
            _close(m(x), _np("hf_pooled", d))
    else:
        with pytest.raises(vitkit.CheckpointError, match="cannot hold|exports to timm instead"):
            vitkit.export(m, tmp_path / "hf", to="hf")


SIZES = json.loads((F / "timm_sizes.json").read_text())["models"]


@pytest.mark.parametrize("arch", sorted(SIZES))
def test_real_sizes_match_timm(arch):
    """Parameters (with a 1000-class head and without) and, where recorded, FLOPs equal timm's for the real sizes."""
    r = SIZES[arch]
    assert vitkit.models.get_entry(arch).name == r["vitkit"]  # timm's name is an alias
    for classes in (1000, 0):
        config = build_config(r["vitkit"], num_classes=classes)
        assert list(config.img_size) == r["img_size"]
        with torch.device("meta"):
            model = build_model(config)
        assert count_params(model) == r[f"params_{classes}"]
        if f"flops_{classes}" in r:
            assert count_flops(model, config.img_size) == r[f"flops_{classes}"]


def test_new_options_are_off_by_default():
    """The paper's ViT is unchanged: no new parameter, buffer or module state."""
    c = vitkit.ViTConfig()
    assert (c.init_values, c.reg_tokens, c.no_embed_class, c.pre_norm, c.qk_norm, c.attn_norm, c.mlp_layer,
            c.mlp_norm, c.rope, c.patch_bias, c.k_bias, c.classifier) == (None, 0, False, False, False, False, "mlp",
                                                                             False, None, True, True, "token")
    assert (c.norm, c.patch_norm, c.proj_bias, c.final_norm, c.pool_heads, c.pool_mlp_dim, c.pool_prefix,
            c.rope_indexing, c.rope_offset, c.rope_half) == ("layernorm", False, True, True, None, None, False,
                                                              "ij", 0.0, False)
    keys = set(vitkit.create_model("vit_ti16", depth=1).state_dict())
    assert not [k for k in keys if any(s in k for s in ("ls1", "reg_token", "norm_pre", "q_norm", "attn_pool", "fc1_g",
                                                         "q_bias"))]


ONE_OPTION = [dict(init_values=0.1), dict(reg_tokens=2), dict(reg_tokens=2, no_embed_class=True), dict(pre_norm=True),
              dict(patch_bias=False), dict(qk_norm=True), dict(attn_norm=True), dict(mlp_layer="swiglu"),
              dict(mlp_layer="swiglu", mlp_norm=True), dict(rope="eva"), dict(rope="eva", rope_ref_grid=(8, 8)),
              dict(k_bias=False), dict(act="quick_gelu"), dict(classifier="map", class_token=False),
              dict(classifier="gap", fc_norm=True),
              # the backbones of 2025-26 (tests/test_backbones.py has their parity)
              dict(rope="dinov3", rope_half=True, pos_embed="none"), dict(rope="mixed", rope_indexing="xy"),
              dict(rope="eva", rope_indexing="xy", rope_offset=1.0, rope_ref_grid=(6, 6)),
              dict(norm="rmsnorm", patch_norm=True, proj_bias=False), dict(classifier="gap", final_norm=False),
              dict(classifier="map", pool_heads=4, pool_mlp_dim=0, pool_prefix=True)]


@pytest.mark.parametrize("opts", ONE_OPTION, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_each_new_option_trains_and_resizes(opts):
    """Each option alone: gradients reach every parameter, and the model runs at another resolution (the position
    embedding resampled, the rotary angles recomputed), dynamically too."""
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64,
                            num_classes=4, **opts)
    with torch.no_grad():
        m.head.weight.normal_(std=0.1)
    x = torch.randn(3, 3, 32, 32)
    m(x).square().sum().backward()
    none = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not none, none
    m.eval()
    with torch.no_grad():
        ref = m(x)
        m.set_dynamic_img_size(True)
        assert torch.allclose(m(x), ref, atol=1e-6)
        assert m(torch.randn(2, 3, 48, 40)).shape == (2, 4)
        m.set_dynamic_img_size(False)
        m.set_img_size(48)
        assert m(torch.randn(2, 3, 48, 48)).shape == (2, 4)


def test_registers_are_prefix_tokens_everywhere():
    """Registers sit after the class token; the head reads neither; dense features exclude them."""
    m = vitkit.create_model("dinov2_s14_reg4", img_size=56, embed_dim=32, depth=2, num_heads=2, mlp_dim=64).eval()
    x = torch.randn(2, 3, 56, 56)
    out = m.forward_intermediates(x, layers=[-1], patch_grid=True, norm=True)
    assert out["patch_grid"][1].shape == (2, 32, 4, 4) and out["prefix"][1].shape == (2, 5, 32)
    assert torch.allclose(out["patch_grid"][1].flatten(2).transpose(1, 2), out["features"][:, 5:])
    assert out["attention"][1].shape == (2, 2, 21, 21)
    with torch.no_grad():
        assert torch.allclose(m(x), out["features"][:, 0], atol=1e-6)  # the class token, normed


def test_hf_exports_refuse_what_the_tower_cannot_hold(tmp_path):
    m = vitkit.create_model("eva02_ti14", img_size=28, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    with pytest.raises(vitkit.CheckpointError, match="rotary embeddings"):
        vitkit.export(m, tmp_path / "x", to="hf")
    m = vitkit.create_model("siglip_b16", img_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    with pytest.raises(vitkit.CheckpointError, match="classifier head"):
        vitkit.export(m, tmp_path / "y", to="hf")


def test_timm_architectures_vitkit_does_not_implement_are_refused(tmp_path):
    """An Eva argument vitkit does not implement (MRoPE's temporal sections) is refused by name; one it reads that the
    file contradicts (LayerScale on the attention branch alone, Sapiens2's, in a file without LayerScale) too."""
    d = tmp_path / "eva"
    d.mkdir()
    src = F / "timm_eva02"
    (d / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_args"]["rope_type"] = "mrope"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(vitkit.CheckpointError, match="rope_type='mrope'"):
        vitkit.load(d)
    cfg["model_args"].update(rope_type="cat", attn_only_layer_scale=True)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="attn_only_layer_scale puts LayerScale on the attention branch alone: it "
                                         "needs init_values"):
        vitkit.load(d)


def test_explain_shows_registers_apart_and_the_map_probe(tmp_path):
    """A registers model's figures: the patch maps exclude the registers, which get their own figure and arrays
    (the class token's and the patches' attention to each, the rollout's share); SigLIP's MAP probe gets a map."""
    from PIL import Image

    from vitkit.analysis.attention import register_attention
    from vitkit.analysis.commands import explain_images

    img = tmp_path / "x.png"
    Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)).save(img)
    m = vitkit.load(F / "timm_dinov2_reg")
    rec = explain_images(m, [img], tmp_path / "out")[0]
    assert Path(rec["registers_png"]).stat().st_size > 0
    arrays = np.load(rec["npz"])
    assert arrays["registers_class_to_registers"].shape == (2, 2, 4)  # (layers, heads, registers)
    assert arrays["registers_patches_to_registers"].shape == (2, 4) and arrays["rollout"].shape == (4, 4)
    x = torch.randn(2, 3, 56, 56)
    reg = register_attention(m, x)
    total = reg["rollout_registers"].sum(-1) + reg["rollout_patches"]
    assert ((total > 0) & (total < 1)).all()  # the rest is the class token's share of its own rollout
    # the same attention the forward pass uses: a block's attention rows, explicit, match the fused forward's output
    out = m.forward_intermediates(x, layers=[0], attention=True)
    assert torch.allclose(reg["class_to_registers"][:, 0], out["attention"][0][:, :, 0, 1:5])
    m = vitkit.load(F / "timm_siglip")
    img32 = tmp_path / "y.png"
    Image.fromarray((np.random.default_rng(1).random((32, 32, 3)) * 255).astype(np.uint8)).save(img32)
    rec = explain_images(m, [img32], tmp_path / "out2")[0]
    assert np.load(rec["npz"])["map_probe"].shape == (4, 4)


def test_rope_models_give_attention_maps_from_the_rotated_queries():
    """The analysis runs the blocks with the rotary embedding: its explicit attention reproduces the model's tokens."""
    from vitkit.analysis.attention import iter_attention

    m = vitkit.load(F / "timm_eva02")
    x = torch.from_numpy(np.load(F / "timm_eva02" / "input.npy"))
    with torch.no_grad():
        attn = dict(iter_attention(m, x))
        out = m.forward_intermediates(x, attention=True)
    assert all(torch.allclose(attn[i], out["attention"][i], atol=1e-6) for i in attn)
    _close(out["features"], _np("features", F / "timm_eva02"))  # explicit attention, timm's output


def test_onnx_export_of_a_rotary_registers_model(tmp_path):
    """torch.export / ONNX with dynamic batch and size: the rotary angles and the position embedding are computed in
    the graph for every grid; onnxruntime matches eager (export_model checks 2 batches x 2 sizes, fails above 1e-4)."""
    from vitkit.inference.export import export_model

    m = vitkit.load(F / "readback" / "vitkit_eva_modern" / "source.safetensors").eval()  # rope, registers, SwiGLU
    report = export_model(m, tmp_path / "m.onnx", "onnx", dynamic_batch=True, dynamic_size=True)
    assert len(report.checks) == 4 and max(c["max_abs_diff"] for c in report.checks) <= 1e-4
    assert {tuple(c["shape"][2:]) for c in report.checks} >= {(32, 32)} and len({tuple(c["shape"][2:]) for c in report.checks}) == 2
