"""The backbones of 2025-26 (DINOv3, the Perception Encoder, AIMv2, ROPE-ViT, TIPSv2): parity with the outputs timm and
transformers computed themselves (tests/fixtures/backbones, made by make_backbone_fixtures.py) at the native size and
a non-square one, Meta's DINOv3 release layout, the real sizes against timm's, and the peers reading vitkit's exports."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError
from vitkit.models.registry import build_config, build_model
from vitkit.models.stats import count_flops, count_params

F = Path(__file__).resolve().parent / "fixtures" / "backbones"
TOL = 1e-4
TIMM = sorted(p.name for p in F.iterdir() if p.is_dir() and p.name.startswith("timm_"))
HF = sorted(p.name for p in F.iterdir() if p.is_dir() and p.name.startswith("hf_"))


def _np(folder: Path, name: str) -> np.ndarray:
    return np.load(folder / f"{name}.npy")


def _close(ours: torch.Tensor, expected: np.ndarray) -> None:
    assert tuple(ours.shape) == expected.shape
    err = np.abs(ours.detach().float().numpy() - expected).max()
    assert err <= TOL, err


def _meta(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


@pytest.mark.parametrize("name", TIMM)
def test_timm_folder_parity_native_and_non_square(name):
    """timm's hub folder (`save_for_hf`) -> timm's features, pooled features and logits; at a non-square size the
    rotary coordinates of each family at the new grid and, where there is one, the learned grid resampled as timm's
    `set_input_size` does (DINOv3 takes any size as it is)."""
    d = F / name
    m = vitkit.load(d)
    x = torch.from_numpy(_np(d, "input"))
    with torch.no_grad():
        feats = m.forward_features(x)
        _close(feats, _np(d, "features"))
        _close(m.forward_head(feats, pre_logits=True), _np(d, "pre_logits"))
        _close(m(x), _np(d, "logits"))
    xw = torch.from_numpy(_np(d, "input_wide"))
    mw = m if m.config.dynamic_img_size else vitkit.load(d, img_size=tuple(xw.shape[-2:]))
    with torch.no_grad():
        _close(mw.forward_features(xw), _np(d, "features_wide"))
        _close(mw(xw), _np(d, "logits_wide"))


@pytest.mark.parametrize("name", TIMM)
def test_timm_state_dict_by_architecture_name(name):
    """The bare model.safetensors named by its architecture, as timm users load one (`pretrained_cfg_overlay`),
    with what they changed: the head count and the size."""
    d = F / name
    meta = _meta(d)
    kw = meta["kwargs"]
    x = torch.from_numpy(_np(d, "input"))
    extra = {"global_pool": kw["global_pool"]} if "global_pool" in kw else {}
    m = vitkit.load(d / "model.safetensors", architecture=meta["architecture"], num_heads=kw["num_heads"],
                    img_size=tuple(x.shape[-2:]), **({"classifier": "token"} if extra.get("global_pool") == "token" else {}))
    with torch.no_grad():
        _close(m(x), _np(d, "logits"))


@pytest.mark.parametrize("name", sorted(n for n in TIMM if (F / n / "release.pth").exists()))
def test_dinov3_release_layout(name):
    """Meta's own DINOv3 files (facebookresearch/dinov3: `storage_tokens`, `rope_embed.periods`, `qkv.bias_mask`,
    `ls1.gamma`, SwiGLU's `w1`/`w2`/`w3`), as timm's converter read them when the fixture was made: the features and
    the pooled features of timm's model (the release has no head)."""
    d = F / name
    m = vitkit.load(d / "release.pth", num_heads=_meta(d)["kwargs"]["num_heads"])
    assert m.load_report["format"] == "dinov3-release"
    assert m.config.rope == "dinov3" and m.config.num_classes == 0 and m.config.dynamic_img_size
    assert "mask_token" in m.load_report["unused"]
    m.reset_classifier(0, "avg" if _meta(d).get("global_pool", "avg") == "avg" else "token")
    for suffix in ("", "_wide"):
        x = torch.from_numpy(_np(d, "input" + suffix))
        with torch.no_grad():
            feats = m.forward_features(x)
            _close(feats, _np(d, "features" + suffix))
            _close(m.forward_head(feats), _np(d, "pre_logits" + suffix))


SIZES = json.loads((F / "timm_sizes.json").read_text())["models"]
# timm's own ROPE baseline (Searching for Better Baselines): loaded from its files, not in vitkit's registry
UNREGISTERED = {"vit_base_patch16_rope_reg1_gap_256"}


def test_every_fixture_family_is_registered():
    from vitkit.models.registry import lookup

    missing = set()
    for arch in SIZES:
        try:
            lookup(arch)
        except UsageError:
            missing.add(arch)
    assert missing == UNREGISTERED


@pytest.mark.parametrize("arch", sorted(set(SIZES) - UNREGISTERED))
def test_real_sizes_match_timm(arch):
    """timm's name builds vitkit's entry at timm's parameter count and FLOPs (the same counter), registered size and
    head."""
    r = SIZES[arch]
    config = build_config(arch, num_classes=r["num_classes"])
    assert list(config.img_size) == r["img_size"]
    with torch.device("meta"):
        model = build_model(config)
    assert count_params(model) == r["params"]
    assert count_flops(model, config.img_size) == r["flops"]
    with torch.device("meta"):
        assert count_params(build_model(build_config(arch, num_classes=0))) == r["params_0"]


def test_models_lists_the_new_families_with_timm_s_sizes(capsys):
    from vitkit.cli import main

    main(["models", "--pattern", "dinov3_*"])
    out = capsys.readouterr().out
    for name in ("dinov3_s16", "dinov3_l16", "dinov3_h16plus"):
        assert name in out
    main(["models", "--pattern", "aimv2_l14"])
    assert "aimv2_l14" in capsys.readouterr().out


@pytest.mark.parametrize("name", [n for n in HF if n != "hf_aimv2_native"])
def test_transformers_folder_parity(name):
    """`DINOv3ViTModel` and `Aimv2VisionModel` folders (`save_pretrained`), and their bare model.safetensors:
    transformers' last_hidden_state and pooler_output; DINOv3 also at a non-square size, as it takes any."""
    d = F / name
    for src in (d, d / "model.safetensors"):
        m = vitkit.load(src, **({} if src.is_dir() else {"num_heads": 4}))
        for suffix in ("", "_wide"):
            if not (d / f"input{suffix}.npy").exists():
                continue
            x = torch.from_numpy(_np(d, "input" + suffix))
            with torch.no_grad():
                if (d / f"last_hidden_state{suffix}.npy").exists():
                    _close(m.forward_features(x), _np(d, "last_hidden_state" + suffix))
                if (d / f"pooler_output{suffix}.npy").exists():
                    _close(m(x), _np(d, "pooler_output" + suffix))


def test_dinov3_backbone_feature_maps_are_forward_intermediates():
    """`DINOv3ViTBackbone(out_indices=[1, 2])`: the chosen layers' patch tokens after the final norm, as maps; vitkit's
    `forward_intermediates(..., patch_grid=True, norm=True)` (stage i is block i - 1's output)."""
    d = F / "hf_dinov3_backbone"
    m = vitkit.load(d)
    for suffix in ("", "_wide"):
        x = torch.from_numpy(_np(d, "input" + suffix))
        with torch.no_grad():
            out = m.forward_intermediates(x, layers=[0, 1], attention=False, patch_grid=True, norm=True)
        for j, i in enumerate((0, 1)):
            _close(out["patch_grid"][i], _np(d, f"feature_maps_{j}" + suffix))


def test_aimv2_native_resolution_tower_is_refused():
    with pytest.raises(vitkit.CheckpointError, match="is_native"):
        vitkit.load(F / "hf_aimv2_native")


def _manifest(file: Path) -> dict:
    import hashlib

    from safetensors.torch import load_file

    return {k: [list(v.shape), hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()]
            for k, v in sorted(load_file(file).items())}


READBACK = F / "readback"


@pytest.mark.parametrize("name", sorted(p.name for p in READBACK.iterdir() if p.is_dir()))
def test_peers_read_vitkit_exports(name, tmp_path):
    """timm (`create_model("local-dir:...")`) and transformers (`AutoModel.from_pretrained`) read these exports when
    make_backbone_readback.py ran: exporting the same model again writes the same config.json and tensors, and
    vitkit's outputs are what the peers computed from them."""
    d, rb = F / name, READBACK / name
    m = vitkit.load(d).eval()
    x = torch.from_numpy(_np(d, "input"))
    if (rb / "timm").exists():
        out = vitkit.export(m, tmp_path / "timm", to="timm")
        assert json.loads((out / "config.json").read_text()) == json.loads((rb / "timm" / "config.json").read_text())
        assert _manifest(out / "model.safetensors") == json.loads((rb / "timm" / "tensors.json").read_text())
        with torch.no_grad():
            _close(m(x), _np(rb, "timm_output"))
    if (rb / "hf").exists():
        if m.config.rope == "dinov3":
            m.reset_classifier(0, "token")
        else:
            m.reset_classifier(0)
        out = vitkit.export(m, tmp_path / "hf", to="hf")
        assert json.loads((out / "config.json").read_text()) == json.loads((rb / "hf" / "config.json").read_text())
        assert _manifest(out / "model.safetensors") == json.loads((rb / "hf" / "tensors.json").read_text())
        with torch.no_grad():
            _close(m.forward_features(x), _np(rb, "hf_last_hidden_state"))
            if (rb / "hf_pooler_output.npy").exists():
                _close(m(x), _np(rb, "hf_pooler_output"))


def test_every_family_is_read_back_by_a_peer():
    report = json.loads((READBACK / "report.json").read_text())["models"]
    for name in TIMM:
        assert isinstance(report[name]["timm"], dict), name  # every timm folder goes back to timm
    for name in ("hf_dinov3", "timm_dinov3_s16", "timm_dinov3_hplus16", "hf_aimv2_head", "timm_aimv2_l14"):
        assert isinstance(report[name]["hf"], dict), name


@pytest.mark.parametrize("name", ["timm_dinov3_s16", "timm_rope_mixed_s16", "timm_pe_core_b16"])
def test_a_packed_batch_of_two_sizes_is_each_image_alone(name):
    """Images of different sizes in one packed forward (each family's rotary angles per image, at its own grid;
    PE's position grid resampled per image): each row is what the image alone gives at its size."""
    d = F / name
    x, xw = torch.from_numpy(_np(d, "input"))[:1], torch.from_numpy(_np(d, "input_wide"))[:1]
    m = vitkit.load(d)
    with torch.no_grad():
        packed = m([x[0], xw[0]])
        alone = m(x)
        wide = (m if m.config.dynamic_img_size else vitkit.load(d, img_size=tuple(xw.shape[-2:])))(xw)
    assert (packed[0] - alone[0]).abs().max() <= TOL
    assert (packed[1] - wide[0]).abs().max() <= TOL


@pytest.mark.parametrize("name", ["timm_dinov3_s16"])
def test_onnx_export_of_the_rotary_families(name, tmp_path):
    """ONNX (ONNX Runtime) gives the model's outputs: DINOv3 at any size (its grid a graph input's shape). (ROPE-ViT's
    learned frequencies export as weights of the graph too: 1.3e-6 measured; not repeated here for the suite's time.)"""
    import onnxruntime as ort
    from vitkit.inference.export import export_model

    d = F / name
    m = vitkit.load(d)
    report = export_model(m, tmp_path / "m.onnx", format="onnx", dynamic_size=m.config.dynamic_img_size)
    s = ort.InferenceSession(str(report.path))
    for suffix in ("", "_wide") if m.config.dynamic_img_size else ("",):
        x = _np(d, "input" + suffix)
        y = s.run(None, {s.get_inputs()[0].name: x})[0]
        assert np.abs(y - _np(d, "logits" + suffix)).max() <= TOL


def _folder_copy(tmp_path: Path, name: str, **model_args) -> Path:
    import shutil

    d = tmp_path / name
    shutil.copytree(F / name, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"].update(model_args)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_what_vitkit_does_not_implement_is_refused_not_ignored(tmp_path):
    """timm arguments that change the model are refused where vitkit does not read them: a rope_type it lacks, an
    average that includes the prefix tokens, Eva's rotary arguments on another class (NaFlexVit)."""
    for i, (args, match) in enumerate([(dict(rope_type="base"), "rope_type='base'"),
                                       (dict(rope_type="mrope"), "rope_type='mrope'")]):
        with pytest.raises(vitkit.CheckpointError, match=match):
            vitkit.load(_folder_copy(tmp_path / str(i), "timm_rope_axial_s16", **args))
    d = _folder_copy(tmp_path / "pip", "timm_tipsv2_b14", pool_include_prefix=True, global_pool="avg")
    with pytest.raises(vitkit.CheckpointError, match="pool_include_prefix"):
        vitkit.load(d)
    naflex = Path(__file__).resolve().parent / "fixtures" / "naflex" / "timm_gap"
    import shutil

    shutil.copytree(naflex, tmp_path / "nf")
    cfg = json.loads((tmp_path / "nf" / "config.json").read_text())
    cfg["model_args"]["rope_type"] = "axial"
    (tmp_path / "nf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(vitkit.CheckpointError, match="rope_type='axial'"):
        vitkit.load(tmp_path / "nf")


def test_unfused_rope_attention_keeps_its_key_bias(tmp_path):
    """timm's AttentionRope with qkv_fused=False has a key bias (ROPE-ViT, PE): the same model as the fused one, so the
    fixture's outputs; a dropped key bias would change them (the rotation makes q.b_k differ per key)."""
    from safetensors.torch import load_file, save_file

    d = _folder_copy(tmp_path, "timm_rope_axial_s16", qkv_fused=False)
    sd = load_file(d / "model.safetensors")
    for k in [k for k in sd if k.endswith("attn.qkv.weight") or k.endswith("attn.qkv.bias")]:
        leaf = k.rsplit(".", 1)[1]
        for n, t in zip("qkv", sd.pop(k).chunk(3)):
            sd[k.replace(f"qkv.{leaf}", f"{n}_proj.{leaf}")] = t
    assert sd["blocks.0.attn.k_proj.bias"].abs().max() > 0
    save_file(sd, d / "model.safetensors")
    m = vitkit.load(d)
    assert m.config.k_bias
    with torch.no_grad():
        _close(m(torch.from_numpy(_np(d, "input"))), _np(d, "logits"))


def test_a_bare_rotary_state_dict_needs_its_architecture():
    """No position table in the file and no architecture named: refused (its rotary embedding is not in the file),
    not loaded as a model without positions; ROPE-ViT-Mixed's frequencies say what it is (column first)."""
    d = F / "timm_dinov3_s16"
    with pytest.raises(vitkit.CheckpointError, match="architecture="):
        vitkit.load(d / "model.safetensors", num_heads=4, img_size=64)
    d = F / "timm_rope_mixed_s16"
    m = vitkit.load(d / "model.safetensors", img_size=64)
    assert m.config.rope == "mixed" and m.config.rope_indexing == "xy" and m.config.num_heads == 4
    with torch.no_grad():
        _close(m(torch.from_numpy(_np(d, "input"))), _np(d, "logits"))


def test_training_after_an_inference_mode_call():
    """The rotary cache keeps nothing made under inference_mode: a fine-tuning step after it has its gradients."""
    m = vitkit.create_model("dinov3_s16", img_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        m.eval()(x)
    m.train()(x).sum().backward()
    assert m.patch_embed.proj.weight.grad is not None


@pytest.mark.parametrize("opts,match", [
    (dict(rope="mixed", rope_offset=1.0), "rope='mixed'"), (dict(rope="mixed", rope_ref_grid=(4, 4)), "rope='mixed'"),
    (dict(rope="dinov3", rope_ref_grid=(4, 4)), "rope='dinov3'"), (dict(final_norm=False, classifier="gap", fc_norm=True),
                                                                    "fc_norm"),
    (dict(pool_mlp_dim=0), "classifier='map'"), (dict(norm="batchnorm"), "norm must be")])
def test_settings_no_model_has_are_refused(opts, match):
    with pytest.raises(UsageError, match=match):
        vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, **opts)
