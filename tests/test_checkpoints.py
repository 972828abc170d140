"""Loading and writing every checkpoint format; parity with the official JAX code, timm and HF."""
import json
import re
import zipfile

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import CheckpointError, inspect_checkpoint, read_checkpoint
from vitkit.models.layers import resample_pos_embed_grid

from conftest import FIXTURES

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
            expected_pre = np.load(d / "expected_pre_logits.npy")
            if model.config.arch == "vit" and model.config.representation_size:
                # the official fixture stores the pre_logits Dense output before its tanh (values beyond +-1)
                assert np.abs(expected_pre).max() > 1
                expected_pre = np.tanh(expected_pre)
            assert np.abs(model.forward_head(feats, pre_logits=True).numpy() - expected_pre).max() <= TOL


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
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.ndim < 2 else p.shape[-1] ** -0.5) + (1.0 if p.ndim == 1 and False else 0.0))


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


# ---- round trips -----------------------------------------------------------------------------------

def _random_vit(**kw):
    m = vitkit.create_model("vit_ti16", **{"img_size": 32, "patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3,
                                           "mlp_dim": 96, "num_classes": 5, **kw}).eval()
    _randomise(m, 3)
    return m


ROUND_TRIPS = [
    ("vitkit", "m.safetensors", dict(pos_embed="learned_2d", classifier="gap", representation_size=16, class_names=list("abcde"))),
    ("vitkit", "m.safetensors", dict(pos_embed="relative")),
    ("timm", "m.safetensors", dict()),
    ("timm", "m.pth", dict(classifier="gap", fc_norm=True)),
    ("hf", "hf_dir", dict()),
    ("npz", "m.npz", dict(act="gelu_tanh", representation_size=24)),
    ("npz", "m.npz", dict(act="gelu_tanh", classifier="gap")),
    ("npz", "hyb.npz", dict(act="gelu_tanh", hybrid_layers=(1, 2), hybrid_width=0.5, img_size=64, patch_size=16)),
    ("timm", "hyb.safetensors", dict(hybrid_layers=(1, 1, 1), hybrid_width=0.5, img_size=64, patch_size=16,
                                     hybrid_ws_eps=1e-8, hybrid_ws_eps_mode="var", hybrid_gn_eps=1e-5)),
]


@pytest.mark.parametrize("fmt,fname,kw", ROUND_TRIPS, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_round_trip(fmt, fname, kw, tmp_path):
    m = _random_vit(**kw)
    x = torch.randn(2, 3, *m.config.img_size)
    dst = vitkit.export(m, tmp_path / fname, to=fmt)
    # a .pth state dict carries no metadata: the head count of a non-standard width must be given
    back = vitkit.load(dst, **({"num_heads": 3} if fname.endswith(".pth") else {}))
    assert torch.equal(_run(back, x), _run(m, x)), fmt
    if fmt == "vitkit":
        assert back.config.to_dict() == m.config.to_dict()


def test_bit_round_trips_through_timm_and_vitkit(tmp_path):
    m = vitkit.load(FIXTURES / "timm_resnetv2_bit/model.safetensors")
    x = torch.from_numpy(np.load(FIXTURES / "timm_resnetv2_bit/input.npy"))
    for fmt, name in (("timm", "b.safetensors"), ("vitkit", "v.safetensors")):
        assert torch.equal(_run(vitkit.load(vitkit.export(m, tmp_path / name, to=fmt)), x), _run(m, x))
    with pytest.raises(CheckpointError, match="exports to 'vitkit' or 'timm' only"):
        vitkit.export(m, tmp_path / "b.npz", to="npz")


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
    assert info["format"] == "hf" and info["params"] == sum(p.numel() for p in vitkit.load(FIXTURES / "hf_vit").parameters())


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
    with pytest.raises(CheckpointError, match="not an official ViT"):
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
