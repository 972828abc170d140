"""Doors the red team found open: a checkpoint folder whose files contradict each other is refused by name, never
loaded with one of the two facts dropped in silence."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import vitkit
from vitkit.errors import VitkitError

from conftest import FIXTURES_HERE


def _copy(name: str, tmp_path: Path, edit) -> Path:
    d = tmp_path / name.replace("/", "_")
    shutil.copytree(FIXTURES_HERE / name, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_stated_size_contradicting_the_relative_tables_is_refused(tmp_path):
    """BEiT's relative position tables are for one grid: a config.json image_size (or timm's model_args img_size)
    of another is refused naming both, as a learned position table already is."""
    d = _copy("hf_families/BeitModel", tmp_path, lambda c: c.update(image_size=64))
    with pytest.raises(VitkitError, match=r"img_size \(64, 64\) is a 16x16 grid.*relative position tables are for a "
                                          r"4x4 grid"):
        vitkit.load(d)
    d = _copy("timm_beit/base_3x3", tmp_path, lambda c: c["model_args"].update(img_size=[16, 16]))
    with pytest.raises(VitkitError, match=r"img_size \(16, 16\) is a 4x4 grid.*tables are for a 3x3 grid"):
        vitkit.load(d)
    assert vitkit.load(_copy("hf_families/BeitModel", tmp_path / "same", lambda c: None)).config.img_size == (16, 16)


@pytest.mark.parametrize("to", ["timm", "hf"])
def test_a_folder_export_checks_every_file_before_writing_any(tmp_path, to):
    """A folder whose config.json is a symbolic link is refused before model.safetensors is replaced (it was
    refused only after: new weights beside the old config, a model that is neither)."""
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=4,
                            mlp_dim=64, num_classes=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (tmp_path / "elsewhere.json").write_text("{}")
    (out / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(VitkitError, match="symbolic link"):
        vitkit.export(m, out, to=to)
    assert (out / "model.safetensors").read_bytes() == b"old"


@pytest.mark.parametrize("arch, extra, said", [
    ("eva02_tiny_patch14_224", {}, r"architecture 'eva02_tiny_patch14_224' \(timm's Eva\)"),
    ("vit_base_patch16_224", {}, r"architecture 'vit_base_patch16_224' \(timm's VisionTransformer\)"),
    (None, {"block_fn": "ResPostBlock"}, "model_args block_fn"),
    (None, {"use_post_norm": True}, "model_args use_post_norm"),
])
def test_timm_beit_tensors_with_another_models_config_are_refused(tmp_path, arch, extra, said):
    """timm BEiT tensors come with a Beit's config.json only (timm refuses every one of these folders): never read
    by the BEiT table with another class's facts."""
    def edit(c):
        if arch:
            c["architecture"] = arch
        c["model_args"].update(extra)
    with pytest.raises(VitkitError, match=f"BEiT tensors.*{said}"):
        vitkit.load(_copy("timm_beit/base_3x3", tmp_path, edit))
