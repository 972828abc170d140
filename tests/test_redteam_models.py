"""Red-team findings in the models: sizes checked before they are allocated, configs that cannot be."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vitkit
from vitkit import safety
from vitkit.errors import UsageError, VitkitError
from vitkit.models.layers import RelativePositionBias

BEIT = Path(__file__).parent / "fixtures" / "timm_beit" / "base_3x3"


def test_relative_index_built_on_the_meta_device():
    """build_model's meta-device dry run counts the (T, T) index before it exists: it must not be built on the CPU."""
    with torch.device("meta"):
        rel = RelativePositionBias((64, 64), 2)
    assert rel.index.device.type == "meta" and rel.index.shape == (4097, 4097)
    assert RelativePositionBias((2, 2), 2).index.device.type == "cpu"


def test_beit_huge_grid_refused_before_building(monkeypatch):
    monkeypatch.setattr(safety, "memory_budget", lambda: 32 << 20)
    with pytest.raises(UsageError, match="refused before allocating"):
        vitkit.create_model("beit_base_patch16_224", pretrained=False, img_size=1024, embed_dim=32, depth=1,
                            num_heads=2)


def test_beit_load_img_size_refused_before_resampling(monkeypatch):
    monkeypatch.setattr(safety, "memory_budget", lambda: 32 << 20)
    with pytest.raises(VitkitError, match="relative position tables") as e:
        vitkit.load(BEIT, img_size=256)
    assert "\n" not in str(e.value)
    m = vitkit.load(BEIT)
    with pytest.raises(UsageError, match="relative position tables"):
        m.set_img_size(256)
    assert m.config.img_size == (12, 12)  # nothing changed by the refusal
    m.set_img_size(16)
    assert m.config.img_size == (16, 16)


def test_kv_full_blocks_that_leave_no_block_grouped():
    """kv_full_blocks >= depth / 2 groups no block: the config must not claim grouped-query attention."""
    from vitkit.models import ViTConfig
    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_dim=64, num_kv_heads=2)
    for full in (1, 10**30):
        c = ViTConfig(**kw, kv_full_blocks=full)
        assert (c.num_kv_heads, c.kv_full_blocks) == (None, 0)
        assert [c.kv_heads(b) for b in range(c.depth)] == [None, None] and "grouped" not in c.options()
    c = ViTConfig(**{**kw, "depth": 3}, kv_full_blocks=1)
    assert (c.num_kv_heads, c.kv_full_blocks, [c.kv_heads(b) for b in range(3)]) == (2, 1, [None, 2, None])


def test_geometric_beit_onnx_dynamic_size_refused_in_one_line(tmp_path):
    from vitkit.inference.export import export_model
    with pytest.raises(UsageError, match="geometric progression") as e:
        export_model(vitkit.load(BEIT), tmp_path / "beit.onnx", "onnx", dynamic_size=True)
    assert "\n" not in str(e.value) and not (tmp_path / "beit.onnx").exists()
