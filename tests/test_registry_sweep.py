"""The peers' registries, swept (issue 42): every architecture timm registers in the families vitkit claims and
every transformers vision class vitkit reads, built small by the peer with a user's keyword arguments and written
with the peer's own writer (tests/fixtures/make_registry_sweep.py). vitkit either loads a file and gives the peer's
outputs (<= 1e-4) at the native size and a non-square one, or refuses it with a CheckpointError: never a silent
difference."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints.api import describe_folder
from vitkit.checkpoints.io import CheckpointError
from vitkit.models import build_model

REG = Path(__file__).parent / "fixtures" / "registry"
TIMM = json.loads((REG / "timm" / "index.json").read_text())
HF = json.loads((REG / "hf" / "index.json").read_text())
TOL = 1e-4

# What vitkit does not implement, by timm's architecture name: refused with a CheckpointError naming the argument,
# never loaded. Every other registered architecture must load and give timm's outputs.
REFUSED = re.compile(
    r"^(naflexvit_.*_parfac|resnetv2_\d+(d|t|d_\w+)?$)|"
    r"_xp_|_(dpwee|pwee)_|_18x2_|"
    r"_resnet\d+d_")


def _folder(tmp_path: Path, group: str, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "model.safetensors").symlink_to(REG / "timm" / group / "model.safetensors")
    shutil.copy(REG / "timm" / group / "configs" / f"{name}.json", d / "config.json")
    return d


def _logits(model, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


BUILT = sorted(n for n, r in TIMM["archs"].items() if r["status"] == "built")
SHAPES = sorted(n for n, r in TIMM["archs"].items() if r["status"] == "shapes")


@pytest.mark.parametrize("name", BUILT)
def test_every_timm_architecture_loads_as_timm_or_is_refused(name, tmp_path):
    row = TIMM["archs"][name]
    d = _folder(tmp_path, row["group"], name)
    exp = REG / "timm" / row["group"]
    x, xw = np.load(REG / "timm" / "input.npy"), np.load(REG / "timm" / "input_wide.npy")
    if REFUSED.search(name):
        with pytest.raises(CheckpointError):
            vitkit.load(d)
        return
    model = vitkit.load(d)
    assert np.abs(_logits(model, x) - np.load(exp / "logits.npy")).max() <= TOL
    wide = vitkit.load(d, img_size=tuple(TIMM["versions"]["wide"]))
    assert np.abs(_logits(wide, xw) - np.load(exp / "logits_wide.npy")).max() <= TOL


@pytest.mark.parametrize("name", BUILT)
def test_a_bare_timm_state_dict_loads_by_its_architecture_name(name):
    """timm users load a bare state dict with `create_model(name, pretrained_cfg_overlay=dict(file=...))`; vitkit
    takes the same name (`architecture=`) and what the user changed (here the head count and the size)."""
    row = TIMM["archs"][name]
    if REFUSED.search(name):
        return  # the folder test checks the refusal
    x = np.load(REG / "timm" / "input.npy")
    # the size the peer built it at, as a timm user passes img_size= to create_model (a model with no position table
    # has no other record of it)
    model = vitkit.load(REG / "timm" / row["group"] / "model.safetensors", architecture=name, num_heads=2,
                        img_size=x.shape[-2:])
    assert np.abs(_logits(model, x) - np.load(REG / "timm" / row["group"] / "logits.npy")).max() <= TOL


@pytest.mark.parametrize("name", SHAPES)
def test_full_size_timm_architectures_build_as_timm_or_are_refused(name):
    """The registered sizes of BiT and the hybrids (their backbones cannot be built small by a user's arguments):
    timm's config.json and the names and shapes of timm's state dict (on the meta device) -> vitkit builds a model
    with exactly those tensors, or refuses. Numeric parity: the timm_resnetv2_bit and timm_hybrid_* fixtures."""
    d = REG / "timm" / "_shapes" / name
    shapes = json.loads((d / "shapes.json").read_text())
    raw = {k: torch.empty(v, device="meta") for k, v in shapes.items()}
    cfg = json.loads((d / "config.json").read_text())
    if REFUSED.search(name):
        with pytest.raises(CheckpointError):
            describe_folder(raw, cfg, name)
        return
    config, sd = describe_folder(raw, cfg, name)
    with torch.device("meta"):
        model = build_model(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}
    assert tuple(config.img_size) == tuple(cfg["pretrained_cfg"]["input_size"][1:])


def test_the_sweep_covers_timm_s_registry():
    """Every architecture of the six modules is in the sweep: built small, or at full size as shapes."""
    archs = json.loads((Path(vitkit.__file__).parent / "checkpoints" / "timm_archs.json").read_text())["archs"]
    assert set(archs) == set(TIMM["archs"]) and len(archs) > 250
    assert all(r["status"] in ("built", "shapes") for r in TIMM["archs"].values())
    loaded = [n for n in BUILT if not REFUSED.search(n)]
    assert len(loaded) > 150  # the families vitkit claims: ViT, DeiT, DINOv2, SigLIP, CLIP, EVA-02, NaFlexVit, BiT


HF_CLASSES = sorted(HF["classes"])
HF_REFUSED = {"Dinov2ForImageClassification": "dinov2_classifier"}


@pytest.mark.parametrize("name", HF_CLASSES)
def test_every_transformers_class_at_its_size_and_another(name):
    """transformers' outputs at the native size and, with `interpolate_pos_encoding=True` (its own resampling of
    the position grid: plain bicubic, antialiased for DINOv2 with registers), at a non-square one; vitkit loads the
    folder and resamples by the rule it recorded for the format (no `resample=` given)."""
    d = REG / "hf" / name
    x, xw = np.load(REG / "hf" / "input.npy"), np.load(REG / "hf" / "input_wide.npy")
    if name in HF_REFUSED:
        with pytest.raises(CheckpointError, match=HF_REFUSED[name]):
            vitkit.load(d)
        return
    for tag, inp, kw in (("", x, {}), ("_wide", xw, {"img_size": tuple(HF["versions"]["wide"])})):
        model = vitkit.load(d, **kw)
        with torch.no_grad():
            t = torch.from_numpy(inp)
            if (d / f"logits{tag}.npy").exists():
                assert np.abs(model(t).numpy() - np.load(d / f"logits{tag}.npy")).max() <= TOL
                continue
            hidden = np.load(d / f"hidden{tag}.npy")
            # ViTModel's pooler (tanh(dense(class token))) is left unused: the output is the normed class token
            # DeiTModel's too; vitkit's distilled DeiT without a head gives the mean of the class and distillation tokens
            pooled = (hidden[:, 0] if name == "ViTModel" else (hidden[:, 0] + hidden[:, 1]) / 2 if name == "DeiTModel"
                      else np.load(d / f"pooled{tag}.npy"))
            assert np.abs(model(t).numpy() - pooled).max() <= TOL
            out = model.forward_intermediates(t, layers=[-1], attention=False)
            # transformers' CLIP returns the last block's tokens before post_layernorm, the others after the norm
            feats = out["tokens"][model.config.depth - 1] if "CLIP" in name else out["features"]
            assert np.abs(feats.numpy() - hidden).max() <= TOL


def test_dinov2_classifier_loads_as_a_backbone_when_asked():
    model = vitkit.load(REG / "hf" / "Dinov2ForImageClassification", strict=False)
    assert "dinov2_classifier.weight" in model.load_report["unexpected"] and model.config.num_classes == 0


def test_a_compiled_or_ddp_model_s_state_dict_loads(tmp_path):
    """`torch.compile(model).state_dict()` prefixes every key with `_orig_mod.`; DDP with `module.`."""
    from safetensors.torch import save_file

    model = vitkit.create_model("vit_ti16", num_classes=3, img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    # torch's own wrappers name the keys: DataParallel as DDP does ("module."), torch.compile ("_orig_mod.")
    wrapped = torch.nn.DataParallel(torch.compile(model)).state_dict()
    assert all(k.startswith("module._orig_mod.") for k in wrapped)
    sd = {k: v.contiguous() for k, v in wrapped.items()}
    save_file(sd, tmp_path / "wrapped.safetensors")
    torch.save(sd, tmp_path / "wrapped.pth")
    for f in ("wrapped.safetensors", "wrapped.pth"):
        back = vitkit.load(tmp_path / f, num_heads=model.config.num_heads)
        with torch.no_grad():
            assert torch.equal(back(x), model(x))


def test_torchvision_at_another_size_resamples_as_torchvision():
    """torchvision's `interpolate_embeddings` resamples bicubically with aligned corners: recorded at load."""
    d = REG / "torchvision"
    meta = json.loads((d / "index.json").read_text())
    for tag, size in (("", meta["native"]), ("_big", meta["big"])):
        model = vitkit.load(d / "model.pth", num_heads=2, img_size=size)
        assert np.abs(_logits(model, np.load(d / f"input{tag}.npy")) - np.load(d / f"logits{tag}.npy")).max() <= TOL
    # the resampled table itself (the logits of a one-layer model move little with the method)
    assert np.abs(model.pos_embed.weight.detach().numpy() - np.load(d / "pos_embedding_big.npy")).max() <= TOL


def test_a_bare_timm_state_dict_resamples_as_timm(tmp_path):
    """Without a config.json, a timm state dict still resamples its grid as timm does (antialiased bicubic)."""
    row = TIMM["archs"]["vit_base_patch16_224"]
    model = vitkit.load(REG / "timm" / row["group"] / "model.safetensors", num_heads=2,
                        img_size=tuple(TIMM["versions"]["wide"]))
    assert model.config.pos_resample == "bicubic"
    xw = np.load(REG / "timm" / "input_wide.npy")
    assert np.abs(_logits(model, xw) - np.load(REG / "timm" / row["group"] / "logits_wide.npy")).max() <= TOL


def test_a_bare_state_dict_named_by_architecture_gets_its_sizes_checked_and_its_preprocessing(tmp_path):
    """Named `vit_base_patch16_224` (768 wide, 12 heads), a 16-wide file is refused unless the caller says its head
    count (timm refuses it on shape); the registered pretrained_cfg's preprocessing comes with the name."""
    row = TIMM["archs"]["deit_small_patch16_224"]
    f = REG / "timm" / row["group"] / "model.safetensors"
    with pytest.raises(CheckpointError, match="registered size"):
        vitkit.load(f, architecture="deit_small_patch16_224")
    m = vitkit.load(f, architecture="deit_small_patch16_224", num_heads=2)
    assert m.config.mean == (0.485, 0.456, 0.406) and m.config.interpolation == "bicubic" and m.config.crop_pct == 0.9
