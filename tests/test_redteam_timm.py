"""Red-team findings on vitkit's timm doors: a grouped-query folder whose q/k/v split is shifted, a config.json depth
that sizes per-block lists, a post-norm LayerScale export to timm, create_model(name, checkpoint_path=)'s
architecture check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from vitkit.errors import VitkitError

FIXTURES = Path(__file__).parent / "fixtures"
GQA = FIXTURES / "block_options" / "timm_gqa"


def _folder(dst: Path, tensors: dict, config: dict) -> Path:
    dst.mkdir(parents=True)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _gqa():
    return load_file(str(GQA / "model.safetensors")), json.loads((GQA / "config.json").read_text())


def test_gqa_split_shift_refused(tmp_path):
    """q+k+v rows add up to the fused qkv, but 16 query rows moved into the key: refused naming the three keys."""
    t, c = _gqa()
    b = "blocks.1.attn."
    for leaf in ("weight", "bias"):
        q, k, v = (t[f"{b}{n}_proj.{leaf}"] for n in "qkv")
        t[f"{b}q_proj.{leaf}"], t[f"{b}k_proj.{leaf}"], t[f"{b}v_proj.{leaf}"] = torch.cat([q, k]), v[:8], v[8:]
    with pytest.raises(VitkitError, match=r"blocks\.1\.attn\.q_proj\.weight of shape \(48, 32\).*k_proj.*v_proj"):
        vitkit.load(_folder(tmp_path / "shift", t, c))


@pytest.mark.parametrize("depth", [10**9, -1, 2.5, True])
def test_gqa_depth_bounded_before_lists(tmp_path, depth):
    """A config.json depth sizes [num_kv_heads] * depth: refused by its bounds first (10**9 took ~16 GB)."""
    t, c = _gqa()
    c["model_args"].update(num_kv_heads=2, depth=depth)
    with pytest.raises(VitkitError, match=r"depth=.*must be an integer in \[0, 1024\]"):
        vitkit.load(_folder(tmp_path / "deep", t, c))


def test_res_post_norm_layerscale_export_refused(tmp_path):
    """timm's ResPostBlock has no LayerScale: exporting one with init_values by name is refused, as the Eva path is."""
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                            mlp_dim=64, num_classes=3, res_post_norm=True, init_values=0.5)
    with pytest.raises(VitkitError, match=r"no LayerScale.*init_values=0\.5"):
        vitkit.export(m, tmp_path / "rpn_ls", to="timm")
    assert not (tmp_path / "rpn_ls" / "model.safetensors").exists()


BEIT = FIXTURES / "timm_beit" / "base_3x3"  # 12 px, patch 4, width 32, depth 2, 2 heads, 5 classes
BEIT_KW = dict(img_size=12, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.mark.parametrize("name,path,kw,differs", [
    ("vit_base_patch16_224", BEIT, BEIT_KW, r"pos_embed relative \(the name's: learned_1d\)"),
    ("vit_base_patch16_224", FIXTURES / "block_options" / "timm_post_norm",
     dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=3.0, num_classes=5),
     r"res_post_norm True \(the name's: False\)"),
])
def test_create_model_checkpoint_structure(name, path, kw, differs):
    """create_model(name, checkpoint_path=) refuses a file of another architecture naming the difference."""
    with pytest.raises(VitkitError, match=differs):
        vitkit.create_model(name, checkpoint_path=path, **kw)


def test_create_model_plain_vit_file_as_beit(tmp_path):
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=12, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                            mlp_dim=128, num_classes=5)
    out = vitkit.export(m, tmp_path / "plain", to="timm")
    with pytest.raises(VitkitError, match=r"pos_embed learned_1d \(the name's: relative\)"):
        vitkit.create_model("beit_base_patch16_224", checkpoint_path=out, **BEIT_KW)


def test_create_model_checkpoint_img_size_applied():
    """An explicit img_size other than the file's is applied as vitkit.load(img_size=) applies it, not ignored."""
    kw = {**BEIT_KW, "img_size": 16}
    m = vitkit.create_model("beit_base_patch16_224", checkpoint_path=BEIT, **kw)
    ref = vitkit.load(BEIT, img_size=16)
    assert tuple(m.config.img_size) == (16, 16)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x), ref.eval()(x))
