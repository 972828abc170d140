"""timm's BEiT (timm.models.beit, issue 53): timm's own files (`save_for_hf` folders and their bare model.safetensors,
tests/fixtures/timm_beit, made by `make_registry_sweep.py beit`) load into vitkit and give timm's logits (<= 1e-4, fp32)
at two widths (BEiT-B's and BEiT v2-L's arguments, small), each at a square and a non-square grid, and with timm's
options (class-token pooling, a shared relative table alone and beside the blocks' own, SwiGLU without qkv biases, an
absolute position embedding); timm's names build those models; vitkit exports them back as timm writes them. At other
grids (`index.json`'s `resized`: timm's `set_input_size`) vitkit resizes the relative tables as timm does
(`pos_resample="geometric"`), loaded at that size or taking any."""
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
    with torch.device("meta"):  # scale_mlp in Beit's GELU MLP: a norm on its hidden units, as timm's Mlp has it
        normed = vitkit.create_model("beit_base_patch16_224", scale_mlp=True)
        assert normed.config.mlp_norm and tuple(normed.blocks[0].mlp.norm.weight.shape) == (3072,)
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


# ---- at another grid: timm's resize_rel_pos_bias_table (issue 53) ------------------------------------------------

RESIZED = sorted((case, grid) for case, row in CASES.items() for grid in row.get("resized", {}))
P = 4  # the fixtures' patch


def _at(model, case: str, grid: str) -> float:
    """max |vitkit - timm| on the folder's input at `grid`, timm's logits after its own `set_input_size`."""
    with torch.no_grad():
        ours = model(torch.from_numpy(np.load(FIX / case / f"input_{grid}.npy"))).numpy()
    return float(np.abs(ours - np.load(FIX / case / f"logits_{grid}.npy")).max())


def _img(grid: str) -> tuple[int, int]:
    h, w = map(int, grid.split("x"))
    return h * P, w * P


def test_the_resized_fixtures_cover_a_square_and_a_non_square_file():
    assert ("base_3x3", "4x5") in RESIZED and ("base_3x3", "6x6") in RESIZED and ("v2_large_4x3", "6x6") in RESIZED
    # timm's two paths agree where both run; its pretrained_cfg path cannot tell a non-square file's grid
    for case, grid in RESIZED:
        via_cfg = CASES[case]["resized"][grid]["pretrained_cfg_vs_set_input_size"]
        square = CASES[case]["input"][0] == CASES[case]["input"][1]
        assert via_cfg == 0.0 if square else via_cfg.startswith("ValueError: Cannot infer non-square")


@pytest.mark.parametrize("case,grid", RESIZED)
def test_a_timm_beit_at_another_grid_gives_timms_logits(case, grid):
    """A 3x3 file at 4x5, 6x6 and 2x2, a 4x3 one at 6x6 and 3x5, a 3x2 one with a shared table at 4x5: timm resizes the
    tables by its geometric progression (`set_input_size`, or `create_model(..., img_size=)` for a square file), and
    so does vitkit's model, loaded at that size or taking any (`dynamic_img_size`); the file records the rule."""
    model = vitkit.load(FIX / case, img_size=_img(grid))
    assert model.config.pos_resample == "geometric"
    assert _at(model, case, grid) <= TOL
    assert _at(vitkit.load(FIX / case, dynamic_img_size=True), case, grid) <= TOL
    # the rule matters: a linear resampling of the same table is not timm's function
    for other in ("bilinear", "bilinear_noaa"):
        assert _at(vitkit.load(FIX / case, img_size=_img(grid), resample=other), case, grid) > 100 * TOL


def test_a_bare_timm_beit_file_at_another_grid_resamples_as_timm():
    """The bare state dict (timm's names say it is timm's) and the one named by its architecture, as a timm user
    passes `create_model(arch, pretrained=True, img_size=...)`: the same rule."""
    assert _at(vitkit.load(FIX / "base_3x3" / "model.safetensors", img_size=_img("4x5")), "base_3x3", "4x5") <= TOL
    row = CASES["base_3x3"]
    named = vitkit.load(FIX / "base_3x3" / "model.safetensors", architecture=row["architecture"],
                        num_heads=row["model_args"]["num_heads"], img_size=_img("6x6"))
    assert named.config.pos_resample == "geometric" and _at(named, "base_3x3", "6x6") <= TOL
    assert vitkit.create_model(row["architecture"], **row["model_args"]).config.pos_resample == "geometric"


def test_set_img_size_and_exports_keep_the_rule(tmp_path):
    """`set_img_size` on a loaded model is timm's `set_input_size`; vitkit's own file keeps the rule it records (a
    file vitkit wrote before the rule was timm's says "bilinear", and stays so); timm's export is read back as timm's."""
    model = vitkit.load(FIX / "v2_large_4x3")
    model.set_img_size(_img("3x5"))
    assert _at(model, "v2_large_4x3", "3x5") <= TOL
    ours = vitkit.export(vitkit.load(FIX / "base_3x3"), tmp_path / "geo.safetensors")
    assert _at(vitkit.load(ours, img_size=_img("4x5")), "base_3x3", "4x5") <= TOL
    old = vitkit.load(FIX / "base_3x3")
    old.config.pos_resample = "bilinear"
    back = vitkit.load(vitkit.export(old, tmp_path / "old.safetensors"), img_size=_img("4x5"))
    assert back.config.pos_resample == "bilinear" and _at(back, "base_3x3", "4x5") > 100 * TOL
    folder = vitkit.export(vitkit.load(FIX / "v2_large_4x3"), tmp_path / "timm", to="timm")
    assert _at(vitkit.load(folder, img_size=_img("6x6")), "v2_large_4x3", "6x6") <= TOL


def test_geometric_is_a_relative_tables_rule():
    from vitkit.models.layers.pos_embed import geometric_offsets, resample_offset_table, resample_pos_embed_grid

    table = torch.randn(5, 7, 2)
    assert resample_offset_table(table, (5, 7), "geometric") is table  # its own size: the table itself
    # one axis changed: both remapped, as timm's (the kept one along r = 1.01: its outer offsets read in between)
    same_rows = resample_offset_table(table, (5, 9), "geometric")
    assert same_rows.shape == (5, 9, 2) and not torch.allclose(same_rows[:, 4], table[:, 3])
    assert torch.equal(same_rows[2, 4], table[2, 3])  # the centre (0, 0) stays
    # 3 steps 1, r, r^2 out to the new outermost offset 4: r = (sqrt(13) - 1) / 2; the ratio is at most 1.5 (a 5-row
    # table at 11 rows: its steps reach 2.5, the offsets beyond hold the outermost value)
    r = (13**0.5 - 1) / 2
    assert geometric_offsets(7, 9) == pytest.approx([-4, -1 - r, -1, 0, 1, 1 + r, 4], abs=1e-5)
    assert geometric_offsets(5, 11) == pytest.approx([-2.5, -1, 0, 1, 2.5], abs=1e-5)
    with pytest.raises(UsageError, match="'geometric' .* is for a table of relative offsets"):
        resample_pos_embed_grid(torch.zeros(3, 3, 4), (4, 4), "geometric")
    with pytest.raises(UsageError, match="pos_resample='geometric' resamples a relative position table"):
        vitkit.create_model("vit_ti16", pos_resample="geometric")
    with pytest.raises(UsageError, match="'geometric'"):
        vitkit.load(FIX / "absolute", img_size=16, resample="geometric")
