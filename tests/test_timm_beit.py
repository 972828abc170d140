"""timm's BEiT (timm.models.beit, issue 53): timm's own files (`save_for_hf` folders and their bare model.safetensors,
tests/fixtures/timm_beit, made by `make_registry_sweep.py beit`) load into vitkit and give timm's logits (<= 1e-4, fp32)
at two widths (BEiT-B's and BEiT v2-L's arguments, small), each at a square and a non-square grid, and with timm's
options (class-token pooling, a shared relative table alone and beside the blocks' own, SwiGLU without qkv biases, an
absolute position embedding); timm's names build those models; vitkit exports them back as timm writes them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import layouts, timm_beit
from vitkit.checkpoints.io import CheckpointError, read_safetensors
from vitkit.errors import UsageError

FIX = Path(__file__).parent / "fixtures" / "timm_beit"
CASES = json.loads((FIX / "index.json").read_text())["cases"]
TOL = 1e-4
# the cases timm builds with a per-block table each, as its registered names do (the bare file's own layout)
REGISTERED_LAYOUT = ["base_3x3", "base_2x5", "v2_large_4x3", "v2_large_3x3"]
SHARED = ["shared_table", "shared_and_own"]  # one table for every block: a file of it loads, timm's name does not build


def _logits(model, case: str) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.load(FIX / case / "input.npy"))).numpy()


def _worst(model, case: str) -> float:
    return float(np.abs(_logits(model, case) - np.load(FIX / case / "logits.npy")).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timm_beit_folder_gives_timms_logits(case):
    model = vitkit.load(FIX / case)
    assert _worst(model, case) <= TOL
    assert tuple(model.config.img_size) == tuple(CASES[case]["input"])  # its own grid, square or not
    if case != "absolute":
        assert model.config.pos_embed == "relative" and not model.config.k_bias


@pytest.mark.parametrize("case", REGISTERED_LAYOUT)
def test_a_bare_timm_beit_state_dict_loads_by_its_tensors_and_by_its_name(case):
    """The folder's model.safetensors alone: read from its tensors (the relative table tells the heads, and a square
    grid; a non-square one needs img_size=, as timm's img_size= to create_model), and named by its architecture as a
    timm user loads it (`architecture=`, with the sizes changed: num_heads, img_size)."""
    row = CASES[case]
    size = tuple(row["input"])
    hints = {} if size[0] == size[1] else {"img_size": size}
    with pytest.raises(CheckpointError, match="pass img_size") if size[0] != size[1] else _nothing():
        vitkit.load(FIX / case / "model.safetensors")
    assert _worst(vitkit.load(FIX / case / "model.safetensors", **hints), case) <= TOL
    named = vitkit.load(FIX / case / "model.safetensors", architecture=row["architecture"],
                        num_heads=row["model_args"]["num_heads"], img_size=size)
    assert _worst(named, case) <= TOL
    assert named.config.mean == ((0.5,) * 3 if row["architecture"].startswith("beit_") else (0.485, 0.456, 0.406))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", sorted(set(CASES) - set(SHARED)))
def test_timms_name_with_timms_keywords_builds_the_model_of_timms_file(case):
    """`vitkit.create_model(arch, **model_args)` as `timm.create_model` takes them: the same tensors (a strict load of
    timm's weights) and timm's logits."""
    row = CASES[case]
    model = vitkit.create_model(row["architecture"], **row["model_args"]).eval()
    model.load_state_dict(vitkit.load(FIX / case).state_dict(), strict=True)
    assert _worst(model, case) <= TOL


@pytest.mark.parametrize("case", SHARED)
def test_a_shared_table_loads_but_its_name_is_refused(case):
    """timm's `use_shared_rel_pos_bias` adds one table to every block's bias: summed into each block's own table, the
    same function (the folder test); built from the name it would have other parameters than timm's, so it is
    refused saying so."""
    row = CASES[case]
    with pytest.raises(UsageError, match="use_shared_rel_pos_bias=True has one relative table for all blocks"):
        vitkit.create_model(row["architecture"], **row["model_args"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_vitkits_timm_export_is_timms_file(case, tmp_path):
    """vitkit's export to timm of a timm BEiT folder: the tensors timm wrote, name for name (a shared table: each
    block's sum), and a config.json vitkit reads back to the same model (timm reads these exports to its own logits:
    `timm_reads_vitkit_export` in the fixtures' index.json, 0 to 3.6e-7)."""
    model = vitkit.load(FIX / case)
    out = vitkit.export(model, tmp_path / "export", to="timm")
    theirs, _ = read_safetensors(FIX / case / "model.safetensors")
    ours, _ = read_safetensors(out / "model.safetensors")
    if case in SHARED:
        assert timm_beit.SHARED_TABLE in theirs and timm_beit.SHARED_TABLE not in ours
    elif case != "absolute":  # (BEiT with a position table alone is timm's ViT with (q, 0, v) biases: exported so)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert _worst(vitkit.load(out), case) <= TOL
    cfg = json.loads((out / "config.json").read_text())
    expected = "beit_base_patch16_224" if case != "absolute" else "vit_base_patch16_224"
    assert cfg["architecture"] == expected
    assert CASES[case]["timm_reads_vitkit_export"] <= TOL


@pytest.mark.parametrize("case", REGISTERED_LAYOUT + ["swiglu_no_qkv_bias", "token_pool"])
def test_the_key_table_reads_both_ways(case):
    """`timm_beit.LAYOUT` read forwards gives vitkit's names, read backwards timm's file again, tensor for tensor."""
    w, _ = read_safetensors(FIX / case / "model.safetensors")
    sd, unused = layouts.read(timm_beit.LAYOUT, w)
    assert not unused and "blocks.0.attn.rel_pos.table" in sd and not any("relative_position" in k for k in sd)
    back, left = layouts.write(timm_beit.LAYOUT, sd)
    assert not left and sorted(back) == sorted(w) and all(torch.equal(back[k], w[k]) for k in w)


def test_what_vitkit_does_not_hold_is_refused(tmp_path):
    d = tmp_path / "both"
    shutil.copytree(FIX / "base_3x3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["use_abs_pos_emb"] = True  # a position table and a relative bias: one kind in vitkit
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="absolute position embedding beside its relative position bias"):
        vitkit.load(d)
    w, _ = read_safetensors(FIX / "base_3x3" / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected timm BEiT key 'blocks.0.attn.k_norm.weight'"):
        timm_beit.to_vitkit({**w, "blocks.0.attn.k_norm.weight": torch.ones(16)})
    with pytest.raises(UsageError, match="a norm inside a GELU MLP"):
        vitkit.create_model("beit_base_patch16_224", scale_mlp=True)
    with pytest.raises(UsageError, match="normalises after 'token' pooling"):
        vitkit.create_model("beit_base_patch16_224", global_pool="token", use_fc_norm=True)
    # older files keep the index buffers, a function of the grid: left unused
    sd, _, unused = timm_beit.to_vitkit({**w, "blocks.0.attn.relative_position_index": torch.zeros(10, 10)})
    assert unused == ["blocks.0.attn.relative_position_index"] and "blocks.0.attn.rel_pos.table" in sd


def test_timms_beit_names_build_with_timms_count():
    archs = {n: e for n, e in vitkit.checkpoints.timm.registered_archs().items() if e["class"] == "Beit"}
    assert sorted(archs) == ["beit_base_patch16_224", "beit_base_patch16_384", "beit_large_patch16_224",
                             "beit_large_patch16_384", "beit_large_patch16_512", "beitv2_base_patch16_224",
                             "beitv2_large_patch16_224"]
    with torch.device("meta"):
        for name, entry in archs.items():
            model = vitkit.create_model(name)
            assert sum(p.numel() for p in model.parameters()) == entry["built"]["params"], name
        assert sum(p.numel() for p in vitkit.create_model("beit_base_patch16_224").parameters()) == 86_530_984
        c = vitkit.create_model("beitv2_large_patch16_224").config  # the default tag's (in1k_ft_in22k_in1k)
        assert (c.num_classes, c.mean, c.crop_pct, c.init_values) == (1000, (0.485, 0.456, 0.406), 0.95, 1e-5)
        c = vitkit.create_model("beitv2_large_patch16_224.in1k_ft_in22k").config  # timm's cfg of that tag
        assert (c.num_classes, c.crop_pct) == (21841, 0.9)
