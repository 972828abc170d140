"""ViTConfig's groups: the paper's fields first, the extensions in their groups; flat access, flat checkpoints (also
those an earlier vitkit wrote) and a nested dict read back; a seeded model's weights and outputs unchanged."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import vitkit
from vitkit.errors import UsageError
from vitkit.models.registry import build_config, build_model, list_models
from vitkit.models.vit_config import GROUPS, ViTConfig

PREVIOUS = Path(__file__).parent / "fixtures" / "previous"  # written by vitkit b8729cc (make_previous_checkpoints.py)
PAPER = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_dim", "classifier",
         "representation_size", "drop_rate", "attn_drop_rate", "drop_path_rate", "qkv_bias", "act", "norm_eps",
         "hybrid_layers", "hybrid_width", "hybrid_ws_eps", "hybrid_ws_eps_mode", "hybrid_gn_eps")


def test_groups_cover_every_field_once_paper_first():
    groups = ViTConfig.groups()
    assert list(groups)[0] == "paper" and groups["paper"] == PAPER
    names = [n for g in groups.values() for n in g]
    assert names == [f.name for f in dataclasses.fields(ViTConfig)]  # each once, in the class's order
    assert set(groups) == {"paper", "stem", "position", "tokens", "pooling", "norms", "variants", "facts"}
    assert all(title for title, _ in GROUPS.values())


def test_flat_access_and_flat_dict_unchanged():
    c = ViTConfig(rope="eva", reg_tokens=2, init_values=1e-5)
    assert (c.rope, c.reg_tokens, c.init_values) == ("eva", 2, 1e-5)
    assert dataclasses.replace(c, rope=None).rope is None
    with safe_open(str(PREVIOUS / "vit_b16.safetensors"), framework="pt") as f:
        previous = set(json.loads(f.metadata()["config"]))
    assert set(c.to_dict()) == previous  # the 59 fields the previous vitkit writes and reads: nothing more
    d = ViTConfig(res_post_norm=True, num_kv_heads=4).to_dict()
    assert set(d) - previous == {"res_post_norm", "num_kv_heads"}  # newer fields written only when set


@pytest.mark.parametrize("name", [n for n in list_models() if build_config(n).arch == "vit"])
def test_dict_round_trips(name):
    c = build_config(name)
    assert ViTConfig.from_dict(c.to_dict()) == c
    nested = c.to_dict(nested=True)
    assert list(nested) == list(GROUPS) and nested["paper"]["embed_dim"] == c.embed_dim
    assert ViTConfig.from_dict(nested) == c
    assert ViTConfig.from_dict(json.loads(json.dumps(nested))) == c  # as a checkpoint's JSON holds it


def test_from_dict_refuses_by_name():
    flat = ViTConfig().to_dict()
    mixed = {k: v for k, v in flat.items() if k != "rope"} | {"position": {"rope": "eva"}}
    assert ViTConfig.from_dict(mixed).rope == "eva"
    with pytest.raises(UsageError, match="group 'norms' has no field.*'rope'"):
        ViTConfig.from_dict({"norms": {"rope": "eva"}})
    with pytest.raises(UsageError, match="field 'rope' is given twice"):
        ViTConfig.from_dict({"rope": "eva", "position": {"rope": "eva"}})
    with pytest.raises(UsageError, match=r"unknown ViTConfig field\(s\) \['ropes'\]"):
        ViTConfig.from_dict({"ropes": "eva"})


def test_describe_shows_the_paper_and_what_is_on():
    text = ViTConfig(rope="eva", pos_embed="none", num_kv_heads=4, class_names=["x"] * 1000).describe()
    lines = text.splitlines()
    assert lines[0].startswith("the paper's model") and "  embed_dim: 768" in lines
    assert "position and rotary embeddings:" in lines and "  rope: 'eva'" in lines and "  pos_embed: 'none'" in lines
    assert "  num_kv_heads: 4" in lines and "  class_names: 1000 names" in lines
    assert "norms:" not in lines  # nothing there differs from the default
    assert "norms:" in ViTConfig().describe(every=True).splitlines()


# ---- checkpoints written by the previous vitkit, and the same models built now -------------------------------

def _fixture_models() -> dict:
    return json.loads((PREVIOUS / "versions.json").read_text())


@pytest.mark.parametrize("name", sorted(_fixture_models()["models"]))
def test_previous_checkpoint_loads_to_the_same_model(name):
    meta = _fixture_models()
    path = PREVIOUS / f"{name}.safetensors"
    saved = load_file(str(path))
    # the same registry entry, seeded, builds the same parameters under the same names as the previous version
    torch.manual_seed(0)
    now = build_model(build_config(name, **{**meta["small"], **meta["models"][name]})).eval()
    with torch.no_grad():
        now.head.weight.normal_(generator=torch.Generator().manual_seed(2))
    state = now.state_dict()
    assert set(state) == set(saved)
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    # the flat config in its metadata loads, to the same outputs
    model = vitkit.load(path).eval()
    assert model.config == now.config
    out = load_file(str(PREVIOUS / "outputs.safetensors"))
    with torch.no_grad():
        # bitwise on the machine that wrote them; 1e-5 leaves room for another CPU's kernels (an AMD Zen 4, CPU
        # family 25, differs by up to 1.9e-6, rounding carried through the layers), not for a changed model
        torch.testing.assert_close(model(out[f"{name}.input"]), out[name], rtol=0, atol=1e-5)
        torch.testing.assert_close(now(out[f"{name}.input"]), out[name], rtol=0, atol=1e-5)
