"""Loading and writing every checkpoint format; parity with the official JAX code, timm and HF."""
import json
import re

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import CheckpointError, inspect_checkpoint, read_checkpoint
from vitkit.models.layers import resample_pos_embed_grid

from conftest import FIXTURES, FIXTURES_HERE

TOL = 1e-4
FIXTURE_FILES = {
    "jax_vit_token": "model.npz", "jax_vit_gap": "model.npz", "timm_vit_tiny": "model.safetensors",
    "timm_resnetv2_bit": "model.safetensors", "hf_vit": "",
}


def _run(model, x):
    with torch.no_grad():
        return model(torch.as_tensor(x))


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_fixture_parity(name):
    d = FIXTURES / name
    model = vitkit.load(d / FIXTURE_FILES[name])
    x = np.load(d / "input.npy")
    y = _run(model, x).numpy()
    expected = np.load(d / "expected_output.npy")
    assert y.shape == expected.shape
    assert np.abs(y - expected).max() <= TOL
    xt = torch.from_numpy(x)
    with torch.no_grad():
        if (d / "expected_encoder_output.npy").exists():
            assert np.abs(model.forward_features(xt).numpy() - np.load(d / "expected_encoder_output.npy")).max() <= TOL
        if (d / "expected_features.npy").exists():
            assert np.abs(model.forward_features(xt).numpy() - np.load(d / "expected_features.npy")).max() <= TOL
        if (d / "expected_pre_logits.npy").exists():
            feats = model.forward_features(xt)
            if model.config.arch == "vit" and model.config.representation_size:
                # the official fixture stores the pre_logits Dense output before its tanh: compared as it is
                ours = model.pre_logits.fc(model.pool(feats))
            else:
                ours = model.forward_head(feats, pre_logits=True)
            assert np.abs(ours.numpy() - np.load(d / "expected_pre_logits.npy")).max() <= TOL


def test_fixture_configs_are_inferred_from_tensors():
    c = read_checkpoint(FIXTURES / "jax_vit_token/model.npz").config
    assert (c.embed_dim, c.depth, c.num_heads, c.mlp_dim, c.patch_size, c.img_size) == (48, 2, 3, 96, (8, 8), (32, 32))
    assert (c.classifier, c.representation_size, c.num_classes, c.act) == ("token", 32, 10, "gelu_tanh")
    c = read_checkpoint(FIXTURES / "jax_vit_gap/model.npz").config
    assert (c.classifier, c.class_token, c.representation_size, c.img_size, c.patch_size) == ("gap", False, None, (16, 16), (4, 4))
    c = read_checkpoint(FIXTURES / "timm_vit_tiny/model.safetensors").config
    assert (c.embed_dim, c.num_heads, c.img_size, c.num_classes, c.act) == (192, 3, (64, 64), 7, "gelu")
    c = read_checkpoint(FIXTURES / "hf_vit").config
    assert (c.num_heads, c.norm_eps, c.num_classes) == (3, 1e-12, 6)
    c = read_checkpoint(FIXTURES / "timm_resnetv2_bit/model.safetensors").config
    assert (c.layers, c.channels, c.stem_width, c.num_classes) == ((1, 1, 1, 1), (128, 128, 256, 256), 64, 3)


@pytest.mark.parametrize("name,layers", [("timm_hybrid_stages", (1, 1)), ("timm_hybrid_stem", ())])
def test_timm_hybrids_with_stages_and_stem_only(name, layers):
    """timm's hybrids as timm saves them: a staged ResNet, and the stem alone (keys patch_embed.backbone.conv/norm)."""
    d = FIXTURES_HERE / name
    m = vitkit.load(d / "model.safetensors", num_heads=3)
    assert m.config.hybrid_layers == layers and m.load_report["format"] == "timm-vit"
    x = np.load(d / "input.npy")
    assert np.abs(_run(m, x).numpy() - np.load(d / "expected_output.npy")).max() <= TOL
    with torch.no_grad():
        feats = m.forward_features(torch.from_numpy(x)).numpy()
    assert np.abs(feats - np.load(d / "expected_features.npy")).max() <= TOL


@pytest.mark.parametrize("name", ["timm_hybrid_stages", "timm_hybrid_stem"])
def test_official_hybrid_npz_with_legacy_groupnorm_shapes(name):
    """The published R50+ViT / R+Ti .npz layout: GroupNorm scales and biases of shape (1, 1, 1, C). timm's own
    .npz importer read this file to the stored output, with its numerics (exact GELU, weight-standardisation eps
    1e-8 on the variance, GroupNorm eps 1e-5); vitkit reads it the same way when told those numerics, and with
    the official code's own (tanh-GELU, eps 1e-5 on the std, GroupNorm eps 1e-6) by default."""
    d = FIXTURES_HERE / name
    w = np.load(d / "official.npz", allow_pickle=False)
    assert w["gn_root/scale"].shape[:3] == (1, 1, 1)
    timm_numerics = dict(act="gelu", hybrid_ws_eps=1e-8, hybrid_ws_eps_mode="var", hybrid_gn_eps=1e-5)
    x, y = np.load(d / "input.npy"), np.load(d / "expected_output.npy")
    assert np.abs(_run(vitkit.load(d / "official.npz", **timm_numerics), x).numpy() - y).max() <= TOL
    official = vitkit.load(d / "official.npz")
    c = official.config
    assert (c.act, c.hybrid_ws_eps, c.hybrid_ws_eps_mode, c.hybrid_gn_eps) == ("gelu_tanh", 1e-5, "std", 1e-6)
    assert official.load_report["unused"] == []


def test_bit_npz_as_big_transfer_publishes_it():
    d = FIXTURES_HERE / "bit_npz"
    m = vitkit.load(d / "model.npz")
    assert m.load_report["format"] == "bit-npz" and m.config.layers == (1, 1, 1, 1) and m.load_report["unused"] == []
    assert np.abs(_run(m, np.load(d / "input.npy")).numpy() - np.load(d / "expected_output.npy")).max() <= TOL


def test_exact_gelu_would_miss_the_official_fixture():
    """The check can fail: the same weights with exact GELU land on the stored alternative, not the reference."""
    d = FIXTURES / "jax_vit_token"
    model = vitkit.load(d / "model.npz", act="gelu")
    y = _run(model, np.load(d / "input.npy")).numpy()
    assert np.abs(y - np.load(d / "expected_output.npy")).max() > TOL
    assert np.abs(y - np.load(d / "alt_output_exact_gelu.npy")).max() <= TOL


def test_linen_key_names_load_too(tmp_path):
    w = dict(np.load(FIXTURES / "jax_vit_token/model.npz", allow_pickle=False))
    ren = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}
    linen = {re.sub("|".join(ren), lambda m: ren[m.group(0)], k): v for k, v in w.items()}
    np.savez(tmp_path / "linen.npz", **linen)
    y = _run(vitkit.load(tmp_path / "linen.npz"), np.load(FIXTURES / "jax_vit_token/input.npy")).numpy()
    assert np.abs(y - np.load(FIXTURES / "jax_vit_token/expected_output.npy")).max() <= TOL


# ---- Hugging Face transformers as a live peer ------------------------------------------------------

HF_CONFIGS = [
    dict(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, num_labels=6),
    dict(image_size=48, patch_size=16, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, num_labels=3, hidden_act="gelu_pytorch_tanh"),
    dict(image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=80, num_labels=10, num_channels=1, layer_norm_eps=1e-6),
]


def _randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.ndim < 2 else p.shape[-1] ** -0.5))


@pytest.mark.parametrize("cfg", HF_CONFIGS, ids=lambda c: f"{c['hidden_size']}x{c['num_hidden_layers']}")
def test_hf_parity_fresh_models(cfg, tmp_path):
    import transformers
    hf_model = transformers.ViTForImageClassification(transformers.ViTConfig(**cfg)).eval()
    _randomise(hf_model, 7)
    hf_model.save_pretrained(tmp_path / "hf")
    x = torch.randn(2, cfg.get("num_channels", 3), cfg["image_size"], cfg["image_size"])
    with torch.no_grad():
        expected = hf_model(pixel_values=x).logits
    ours = vitkit.load(tmp_path / "hf")
    assert (_run(ours, x) - expected).abs().max() <= TOL
    # and back: vitkit -> HF folder -> transformers
    vitkit.export(ours, tmp_path / "back", to="hf")
    again = transformers.ViTForImageClassification.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (again(pixel_values=x).logits - expected).abs().max() <= TOL


# ---- writing: every export is checked against the peer's own file or loader ------------------------------------

def _random_vit(**kw):
    m = vitkit.create_model("vit_ti16", **{"img_size": 32, "patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3,
                                           "mlp_dim": 96, "num_classes": 5, **kw}).eval()
    _randomise(m, 3)
    return m


@pytest.mark.parametrize("kw", [dict(pos_embed="learned_2d", classifier="gap", representation_size=16, class_names=list("abcde")),
                                dict(pos_embed="relative"), dict(hybrid_layers=(), img_size=64, patch_size=32, hybrid_width=0.5)],
                         ids=["learned_2d-gap-prelogits", "relative", "stem-only-hybrid"])
def test_vitkit_format_keeps_every_option(kw, tmp_path):
    """vitkit's own format has no peer: it must give back the same config and the same outputs, bit for bit."""
    m = _random_vit(**kw)
    x = torch.randn(2, 3, *m.config.img_size)
    back = vitkit.load(vitkit.export(m, tmp_path / "m.safetensors", to="vitkit"))
    assert back.config.to_dict() == m.config.to_dict()
    assert torch.equal(_run(back, x), _run(m, x))


@pytest.mark.parametrize("fixture,weights,fmt,out_name", [
    ("jax_vit_token", "model.npz", "npz", "m.npz"), ("jax_vit_gap", "model.npz", "npz", "m.npz"),
    ("timm_vit_tiny", "model.safetensors", "timm", "m.safetensors"), ("timm_resnetv2_bit", "model.safetensors", "timm", "m.safetensors"),
    ("hf_vit", "", "hf", "hf"),
])
def test_exports_reproduce_the_peers_own_files(fixture, weights, fmt, out_name, tmp_path):
    """A peer's checkpoint, loaded and exported back to the peer's format, is the peer's file again: the same
    names, shapes and values (the official code's .npz, timm's state dict, transformers' save_pretrained)."""
    from safetensors.torch import load_file

    src = FIXTURES / fixture / weights
    out = vitkit.export(vitkit.load(src), tmp_path / out_name, to=fmt)
    if fmt == "npz":
        a, b = dict(np.load(src, allow_pickle=False)), dict(np.load(out, allow_pickle=False))
        assert a.keys() == b.keys()
        assert all(a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)
        return
    if fmt == "hf":
        a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
        theirs, ours = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
                  "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias", "id2label"):
            assert ours[k] == theirs[k], k
    else:
        a, b = load_file(src), load_file(out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


READBACK = FIXTURES_HERE / "export_readback"


@pytest.mark.parametrize("case", sorted(p.name for p in READBACK.iterdir() if p.is_dir()))
def test_timm_reads_vitkit_exports(case, tmp_path):
    """timm itself read these exports (tests/fixtures/make_timm_fixtures.py): exporting the same model again must
    write what timm read, and vitkit's outputs must be timm's."""
    from safetensors.torch import load_file

    d = READBACK / case
    m = vitkit.load(d / "source.safetensors")
    stored = next(p for p in d.iterdir() if p.name.startswith("export"))
    out = vitkit.export(m, tmp_path / stored.name, to="timm")
    if stored.is_dir():
        assert json.loads((out / "config.json").read_text()) == json.loads((stored / "config.json").read_text())
        a, b = load_file(stored / "model.safetensors"), load_file(out / "model.safetensors")
    elif stored.suffix == ".pth":
        a, b = torch.load(stored, weights_only=True), torch.load(out, weights_only=True)
    else:
        a, b = load_file(stored), load_file(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = np.load(d / "input.npy")
    assert np.abs(_run(m, x).numpy() - np.load(d / "timm_output.npy")).max() <= TOL


def test_exports_refuse_what_the_format_cannot_hold(tmp_path):
    """Each exporter writes the model exactly or refuses, naming what the format cannot hold."""
    cases = [
        # average pooling beside a class token: the official format and a bare timm state dict read it as 'token'
        (dict(classifier="gap", class_token=True, act="gelu_tanh"), "npz", "m.npz", "classifier: 'gap' in the model, 'token'"),
        (dict(classifier="gap", class_token=True), "timm", "m.pth", "classifier: 'gap' in the model, 'token'"),
        # the official code computes tanh-GELU; a timm state dict is built with exact GELU
        (dict(), "npz", "m.npz", "act: 'gelu' in the model, 'gelu_tanh'"),
        (dict(act="gelu_tanh"), "timm", "m.safetensors", "act: 'gelu_tanh' in the model, 'gelu'"),
        # a standard width with a non-standard head count: a state dict reader would take the standard count
        (dict(embed_dim=192, mlp_dim=384, num_heads=6), "timm", "m.safetensors", "num_heads: 6 in the model, 3"),
        (dict(norm_eps=1e-12), "timm", "dir", "timm's ViTs use LayerNorm eps 1e-6 (1e-5 for the CLIP ones), not 1e-12"),
        (dict(classifier="gap"), "hf", "hf", "class-token ViT"),
        (dict(hybrid_layers=(1, 1), hybrid_width=0.5, img_size=64, patch_size=16), "timm", "dir", "timm registers hybrids"),
        # a norm after the pooling (BEiT-3, any fc_norm ViT): the official format's encoder_norm is before it (was a
        # KeyError: 'norm.weight'; red team N7)
        (dict(classifier="gap", fc_norm=True, act="gelu_tanh"), "npz", "m.npz", "a norm after the pooling (fc_norm)"),
    ]
    for kw, fmt, name, msg in cases:
        m = _random_vit(**kw)
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            vitkit.export(m, tmp_path / name, to=fmt)
        assert not (tmp_path / name).exists(), (kw, fmt)
    # what a timm state dict cannot hold, its folder form can: timm reads that (test_timm_reads_vitkit_exports)
    m = _random_vit(classifier="gap", class_token=True, act="gelu_tanh")
    back = vitkit.load(vitkit.export(m, tmp_path / "folder", to="timm"))
    x = torch.randn(2, 3, 32, 32)
    assert back.config.classifier == "gap" and torch.equal(_run(back, x), _run(m, x))


@pytest.mark.parametrize("kw", [dict(qkv_bias=False), dict(img_size=(32, 48)), dict(act="gelu_tanh", norm_eps=1e-6)],
                         ids=["no-qkv-bias", "rectangular", "gelu_tanh"])
def test_hf_reads_vitkit_exports(kw, tmp_path):
    """transformers' own from_pretrained reads vitkit's HF exports to the same logits."""
    import transformers

    m = _random_vit(**kw)
    x = torch.randn(2, 3, *m.config.img_size)
    out = vitkit.export(m, tmp_path / "hf", to="hf")
    theirs = transformers.ViTForImageClassification.from_pretrained(out).eval()
    with torch.no_grad():
        assert (theirs(pixel_values=x).logits - _run(m, x)).abs().max() <= TOL


def test_cli_convert_and_info(tmp_path, capsys):
    from vitkit.cli import main

    src = FIXTURES / "jax_vit_token/model.npz"
    assert main(["convert", str(src), str(tmp_path / "a.safetensors"), "--to", "vitkit"]) == 0
    assert main(["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.npz"), "--to", "npz"]) == 0
    x = np.load(FIXTURES / "jax_vit_token/input.npy")
    assert np.abs(_run(vitkit.load(tmp_path / "b.npz"), x).numpy() - np.load(FIXTURES / "jax_vit_token/expected_output.npy")).max() <= TOL
    capsys.readouterr()
    assert main(["info", str(FIXTURES / "hf_vit"), "--json-out"]) == 0
    info = json.loads(capsys.readouterr().out)
    # D 48, 2 blocks, MLP 96, 8x8 patches on 32x32, 6 classes: 9,264 + 48 + 816 + 2 x 18,960 + 96 + 294
    assert info["format"] == "hf" and info["params"] == 48_438


def test_torchvision_state_dict(tmp_path):
    m = _random_vit()
    sd = m.state_dict()
    tv = {"class_token": sd["cls_token"], "encoder.pos_embedding": sd["pos_embed.weight"],
          "conv_proj.weight": sd["patch_embed.proj.weight"], "conv_proj.bias": sd["patch_embed.proj.bias"],
          "encoder.ln.weight": sd["norm.weight"], "encoder.ln.bias": sd["norm.bias"],
          "heads.head.weight": sd["head.weight"], "heads.head.bias": sd["head.bias"]}
    for i in range(2):
        p, q = f"encoder.layers.encoder_layer_{i}.", f"blocks.{i}."
        for a, b in (("ln_1", "norm1"), ("ln_2", "norm2"), ("self_attention.out_proj", "attn.proj"), ("mlp.0", "mlp.fc1"), ("mlp.3", "mlp.fc2")):
            tv[f"{p}{a}.weight"], tv[f"{p}{a}.bias"] = sd[f"{q}{b}.weight"], sd[f"{q}{b}.bias"]
        tv[p + "self_attention.in_proj_weight"], tv[p + "self_attention.in_proj_bias"] = sd[q + "attn.qkv.weight"], sd[q + "attn.qkv.bias"]
    torch.save(tv, tmp_path / "tv.pth")
    back = vitkit.load(tmp_path / "tv.pth", num_heads=3)
    assert back.load_report["format"] == "torchvision" and back.config.mean == (0.485, 0.456, 0.406)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(_run(back, x), _run(m, x))


# ---- resolution changes ------------------------------------------------------------------------------

def test_bilinear_resampling_matches_the_official_scipy_zoom():
    import scipy.ndimage as scipy_ndimage
    grid = torch.randn(7, 7, 16)
    for new in ((12, 12), (5, 9)):
        ours = resample_pos_embed_grid(grid, new, "bilinear").numpy()
        ref = scipy_ndimage.zoom(grid.numpy(), (new[0] / 7, new[1] / 7, 1), order=1)
        assert np.abs(ours - ref).max() < 1e-5
    bicubic = resample_pos_embed_grid(grid, (12, 12), "bicubic").numpy()
    assert np.abs(bicubic - scipy_ndimage.zoom(grid.numpy(), (12 / 7, 12 / 7, 1), order=1)).max() > 1e-3


def test_load_at_a_new_resolution_resamples_the_position_embedding():
    import scipy.ndimage as scipy_ndimage
    d = FIXTURES / "jax_vit_token"
    w = np.load(d / "model.npz")["Transformer/posembed_input/pos_embedding"][0]  # (17, 48)
    m = vitkit.load(d / "model.npz", img_size=(48, 64))
    assert m.config.img_size == (48, 64) and m.config.grid_size == (6, 8)
    pe = m.pos_embed.weight[0].detach().numpy()
    np.testing.assert_array_equal(pe[0], w[0])  # the class token's embedding is kept
    ref = scipy_ndimage.zoom(w[1:].reshape(4, 4, 48), (6 / 4, 8 / 4, 1), order=1).reshape(48, 48)
    assert np.abs(pe[1:] - ref).max() < 1e-5
    assert _run(m, torch.randn(1, 3, 48, 64)).shape == (1, 10)
    b = vitkit.load(d / "model.npz", img_size=48, resample="bicubic")
    assert b.pos_embed.weight.shape == (1, 37, 48)


@pytest.mark.parametrize("img_size,grid", [((8, 32), (2, 8)), ((32, 8), (8, 2)), ((16, 64), (4, 16))])
def test_any_new_grid_shape_resamples(img_size, grid):
    """A new resolution with the same number of patches (4x4 -> 2x8) is still a new grid: it must be resampled,
    never reinterpreted. The official fixture: 16x16 images, patch 4, a 4x4 grid, no class token."""
    import scipy.ndimage as scipy_ndimage

    d = FIXTURES / "jax_vit_gap"
    w = np.load(d / "model.npz")["Transformer/posembed_input/pos_embedding"][0].reshape(4, 4, -1)
    m = vitkit.load(d / "model.npz", img_size=img_size)
    assert m.config.grid_size == grid
    ref = scipy_ndimage.zoom(w, (grid[0] / 4, grid[1] / 4, 1), order=1).reshape(grid[0] * grid[1], -1)
    assert np.abs(m.pos_embed.weight[0].detach().numpy() - ref).max() < 1e-5
    # a format that records its resolution (HF's image_size): the same
    hf = vitkit.load(FIXTURES / "hf_vit", img_size=(16, 64))  # 32x32 at patch 8: 4x4 -> 2x8
    assert hf.config.grid_size == (2, 8)
    assert not torch.equal(hf.pos_embed.weight[0, 1:], vitkit.load(FIXTURES / "hf_vit").pos_embed.weight[0, 1:])


def test_new_head_for_fine_tuning():
    m = vitkit.load(FIXTURES / "timm_vit_tiny/model.safetensors", num_classes=3, class_names=["a", "b", "c"])
    assert m.head.out_features == 3 and not m.head.weight.any() and m.config.class_names == ["a", "b", "c"]


# ---- bad files -------------------------------------------------------------------------------------------

def test_truncated_and_foreign_files(tmp_path):
    src = (FIXTURES / "timm_vit_tiny/model.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(src[: len(src) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        vitkit.load(tmp_path / "trunc.safetensors")
    npz = (FIXTURES / "jax_vit_token/model.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(npz[: len(npz) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        vitkit.load(tmp_path / "trunc.npz")
    (tmp_path / "notes.txt").write_text("hello, I am not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        vitkit.load(tmp_path / "notes.txt")
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty or truncated"):
        vitkit.load(tmp_path / "empty.pth")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(CheckpointError, match="neither an official ViT nor a BiT"):
        vitkit.load(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError):
        vitkit.load(tmp_path / "missing.npz")


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickled_objects_are_refused(tmp_path, capsys):
    torch.save({"patch_embed.proj.weight": torch.zeros(1), "evil": Evil()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="weights_only"):
        vitkit.load(tmp_path / "evil.pth")
    assert "pwned" not in capsys.readouterr().out
    np.savez(tmp_path / "obj.npz", **{"embedding/kernel": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(CheckpointError, match="pickled"):
        vitkit.load(tmp_path / "obj.npz")


def test_strict_reports_missing_unexpected_and_mismatched_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(FIXTURES / "timm_vit_tiny/model.safetensors")
    del sd["blocks.1.norm2.bias"]
    sd["blocks.0.extra.weight"] = torch.zeros(3)
    sd["norm.weight"] = torch.zeros(5)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as e:
        vitkit.load(tmp_path / "bad.safetensors")
    msg = str(e.value)
    assert "blocks.1.norm2.bias" in msg and "blocks.0.extra.weight" in msg and "norm.weight: checkpoint (5,) vs model (192,)" in msg
    m = vitkit.load(tmp_path / "bad.safetensors", strict=False)
    assert m.load_report["missing"] == ["blocks.1.norm2.bias"]
    assert m.load_report["mismatched"] == ["norm.weight: checkpoint (5,) vs model (192,)"]
    assert m.load_report["unexpected"] == ["blocks.0.extra.weight"]


def test_num_heads_needed_for_nonstandard_width(tmp_path):
    m = _random_vit(embed_dim=40, num_heads=5, mlp_dim=80)
    sd = {("pos_embed" if k == "pos_embed.weight" else k): v for k, v in m.state_dict().items()}
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "t.safetensors")
    with pytest.raises(CheckpointError, match="num_heads="):
        vitkit.load(tmp_path / "t.safetensors")
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(_run(vitkit.load(tmp_path / "t.safetensors", num_heads=5), x), _run(m, x))
    assert inspect_checkpoint(tmp_path / "t.safetensors", num_heads=5)["format"] == "timm-vit"


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m = _random_vit()
    path = vitkit.save(m, tmp_path / "m.safetensors")
    before = path.read_bytes()
    import safetensors.torch

    def boom(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        vitkit.save(m, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_timm_deit_distilled_checkpoint():
    """DeiT's distillation token as timm saves it: two prefix tokens, two heads; eval logits are their mean."""
    d = FIXTURES_HERE / "timm_deit_distilled"
    m = vitkit.load(d / "model.safetensors")
    assert m.config.distilled and m.config.num_prefix_tokens == 2 and m.load_report["format"] == "timm-vit"
    x = torch.from_numpy(np.load(d / "input.npy"))
    with torch.no_grad():
        feats = m.forward_features(x)
        assert np.abs(feats.numpy() - np.load(d / "expected_features.npy")).max() <= TOL
        assert np.abs(m.head(feats[:, 0]).numpy() - np.load(d / "expected_head.npy")).max() <= TOL
        assert np.abs(m.head_dist(feats[:, 1]).numpy() - np.load(d / "expected_head_dist.npy")).max() <= TOL
        assert np.abs(m(x).numpy() - np.load(d / "expected_output.npy")).max() <= TOL
    m.train()
    m.distilled_training = True
    with torch.no_grad():
        a, b = m(x)
    assert np.abs(((a + b) / 2).numpy() - np.load(d / "expected_output.npy")).max() <= TOL
