"""timm's ViT-RelPos (timm.models.vision_transformer_relpos, issue 53): timm's own files (`save_for_hf` folders and their
bare model.safetensors, tests/fixtures/timm_relpos, made by `make_timm_relpos.py`) load into vitkit and give timm's
logits (<= 1e-4, fp32) at two widths, square and non-square grids, with a relative position MLP per block or one
shared, a class token pooled or averaged, residual post-norm blocks, qk-norm and qkv biases; timm's names build those
models with timm's parameter counts; vitkit exports them back as timm writes them; at other grids the MLP's offsets
are laid out anew as timm's `set_input_size` does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import layouts, timm_relpos
from vitkit.checkpoints.io import CheckpointError, read_safetensors
from vitkit.errors import UsageError

FIX = Path(__file__).parent / "fixtures" / "timm_relpos"
CASES = json.loads((FIX / "index.json").read_text())["cases"]
TOL = 1e-4
P = 4  # the fixtures' patch
RPN = {"rpn_3x3"}  # residual post-norm blocks: the bare file cannot tell them (the same names); the name does


def _logits(model, case: str, grid: str = "") -> np.ndarray:
    suffix = f"_{grid}" if grid else ""
    with torch.no_grad():
        return model(torch.from_numpy(np.load(FIX / case / f"input{suffix}.npy"))).numpy()


def _worst(model, case: str, grid: str = "") -> float:
    suffix = f"_{grid}" if grid else ""
    return float(np.abs(_logits(model, case, grid) - np.load(FIX / case / f"logits{suffix}.npy")).max())


def test_the_fixtures_cover_the_family():
    """Two widths, square and non-square grids, per-block and shared MLPs, a class token, post-norm, qk-norm."""
    archs = {row["architecture"] for row in CASES.values()}
    assert {"vit_relpos_small_patch16_224", "vit_srelpos_small_patch16_224", "vit_relpos_medium_patch16_cls_224",
            "vit_relpos_small_patch16_rpn_224", "vit_relpos_base_patch16_clsgap_224"} <= archs
    assert {row["model_args"]["embed_dim"] for row in CASES.values()} == {24, 32}
    assert any(row["input"][0] != row["input"][1] for row in CASES.values())
    assert all(row["timm_reads_back"] == 0.0 for row in CASES.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timm_relpos_folder_gives_timms_logits(case):
    model = vitkit.load(FIX / case)
    assert _worst(model, case) <= TOL
    c = model.config
    assert tuple(c.img_size) == tuple(CASES[case]["input"]) and c.pos_embed == "relative_mlp"
    assert c.rel_pos_shared == case.startswith("srelpos") and c.res_post_norm == (case in RPN)
    assert c.mean == (0.5, 0.5, 0.5) and c.crop_pct == 0.9 and c.interpolation == "bicubic"


@pytest.mark.parametrize("case", sorted(set(CASES) - RPN))
def test_a_bare_timm_relpos_state_dict_loads_by_its_tensors_and_by_its_name(case):
    """The folder's model.safetensors alone: the MLP tells the heads and its width, the size is the caller's (the MLP
    takes any grid), as timm's img_size= to create_model; named by its architecture as a timm user loads it."""
    row = CASES[case]
    size = tuple(row["input"])
    model = vitkit.load(FIX / case / "model.safetensors", img_size=size)
    assert _worst(model, case) <= TOL
    named = vitkit.load(FIX / case / "model.safetensors", architecture=row["architecture"],
                        num_heads=row["model_args"]["num_heads"], img_size=size)
    assert _worst(named, case) <= TOL


def test_post_norm_blocks_are_named_by_the_architecture():
    """A bare `_rpn_` file has the names of the pre-norm blocks: read as those it would be another function (0.40
    off), so without LayerScale to tell it is refused unless told (test_red_team_cases_are_refused_by_name); named
    by its architecture it is timm's."""
    row = CASES["rpn_3x3"]
    f = FIX / "rpn_3x3" / "model.safetensors"
    assert _worst(vitkit.load(f, img_size=12, res_post_norm=False), "rpn_3x3") > 100 * TOL
    named = vitkit.load(f, architecture=row["architecture"], num_heads=2, img_size=12)
    assert named.config.res_post_norm and named.config.init_values is None
    assert _worst(named, "rpn_3x3") <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_timms_name_with_timms_keywords_builds_the_model_of_timms_file(case):
    """`vitkit.create_model(arch, **model_args)` as `timm.create_model` takes them: timm's parameter count, the same
    tensors (a strict load of timm's weights) and timm's logits."""
    row = CASES[case]
    model = vitkit.create_model(row["architecture"], **row["model_args"]).eval()
    assert sum(p.numel() for p in model.parameters()) == row["params"]
    model.load_state_dict(vitkit.load(FIX / case).state_dict(), strict=True)
    assert _worst(model, case) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_vitkits_timm_export_is_timms_file(case, tmp_path):
    """vitkit's export to timm of a timm ViT-RelPos folder: the tensors timm wrote, name for name, and a config.json
    vitkit reads back to the same model (timm reads these exports to its own logits: `timm_reads_vitkit_export`)."""
    model = vitkit.load(FIX / case)
    out = vitkit.export(model, tmp_path / "export", to="timm")
    theirs, _ = read_safetensors(FIX / case / "model.safetensors")
    ours, _ = read_safetensors(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert _worst(vitkit.load(out), case) <= TOL
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == ("vit_relpos_base_patch16_rpn_224" if case in RPN else "vit_relpos_base_patch16_224")
    assert CASES[case]["timm_reads_vitkit_export"] <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_key_table_reads_both_ways(case):
    """`timm_relpos.LAYOUT` read forwards gives vitkit's names, read backwards timm's file again, tensor for tensor."""
    w, _ = read_safetensors(FIX / case / "model.safetensors")
    sd, unused = layouts.read(timm_relpos.LAYOUT, w)
    assert not unused
    back, left = layouts.write(timm_relpos.LAYOUT, sd)
    assert not left and sorted(back) == sorted(w) and all(torch.equal(back[k], w[k]) for k in w)


RESIZED = sorted((case, grid) for case, row in CASES.items() for grid in row.get("resized", []))


@pytest.mark.parametrize("case,grid", RESIZED)
def test_a_timm_relpos_at_another_grid_gives_timms_logits(case, grid):
    """timm's `set_input_size` lays the MLP's offsets out for the new grid (the weights unchanged): vitkit loaded at
    that size, or taking any (`dynamic_img_size`), gives its logits."""
    h, w = map(int, grid.split("x"))
    assert _worst(vitkit.load(FIX / case, img_size=(h * P, w * P)), case, grid) <= TOL
    assert _worst(vitkit.load(FIX / case, dynamic_img_size=True), case, grid) <= TOL


def test_timms_relpos_names_build_with_timms_count():
    archs = {n: e for n, e in vitkit.checkpoints.timm.registered_archs().items()
             if e["class"] == "VisionTransformerRelPos"}
    assert len(archs) == 14
    with torch.device("meta"):
        for name, entry in archs.items():
            model = vitkit.create_model(name)
            assert sum(p.numel() for p in model.parameters()) == entry["built"]["params"], name
        c = vitkit.create_model("vit_srelpos_small_patch16_224").config
        assert (c.rel_pos_shared, c.rel_pos_dim, c.class_token, c.classifier, c.init_values) == (True, 384, False,
                                                                                                  "gap", 1e-6)


def test_what_vitkit_does_not_hold_is_refused(tmp_path):
    w, _ = read_safetensors(FIX / "small_3x3" / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected timm ViT-RelPos key 'blocks.0.attn.rel_pos.mlp.fc3.weight'"):
        timm_relpos.to_vitkit({**w, "blocks.0.attn.rel_pos.mlp.fc3.weight": torch.ones(2, 2)})
    s, _ = read_safetensors(FIX / "srelpos_3x3" / "model.safetensors")
    with pytest.raises(CheckpointError, match="a shared relative position MLP beside the blocks' own"):
        timm_relpos.to_vitkit({**s, **{k: v for k, v in w.items() if ".rel_pos." in k}})
    with pytest.raises(UsageError, match="rel_pos_type='bias'"):
        vitkit.create_model("vit_relpos_small_patch16_224", rel_pos_type="bias")
    d = tmp_path / "swin"
    shutil.copytree(FIX / "small_3x3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["rel_pos_type"] = "mlp_swin"  # Swin V2's sigmoid-gated MLP: another function
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rel_pos_type='mlp_swin'"):
        vitkit.load(d)
    with pytest.raises(UsageError, match="rel_pos_dim and rel_pos_shared are the MLP relative bias's"):
        vitkit.create_model("vit_s16", rel_pos_shared=True)
    model = vitkit.create_model("vit_relpos_small_patch16_224", depth=1, embed_dim=32, num_heads=2, img_size=32)
    with pytest.raises(UsageError, match="packed batches need an absolute position embedding"):
        model([torch.randn(3, 32, 16)])


def test_a_relpos_model_trains_and_its_shared_mlp_is_one_set_of_weights():
    """Gradients reach the MLP (per block and shared); the shared one appears once among the parameters and in the
    state dict, and every block reads it."""
    torch.manual_seed(0)
    model = vitkit.create_model("vit_srelpos_small_patch16_224", depth=2, embed_dim=32, num_heads=2, img_size=16,
                                patch_size=4, num_classes=3, rel_pos_dim=8)
    names = [n for n, _ in model.named_parameters() if "rel_pos" in n]
    assert names == ["shared_rel_pos.mlp.fc1.weight", "shared_rel_pos.mlp.fc1.bias", "shared_rel_pos.mlp.fc2.weight",
                     "shared_rel_pos.mlp.fc2.bias"]
    assert all(b.attn.rel_pos.module is model.shared_rel_pos for b in model.blocks)
    torch.nn.init.normal_(model.head.weight)  # (the head starts at zero: no gradient would reach further)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    assert model.shared_rel_pos.mlp.fc1.weight.grad.abs().sum() > 0


def test_red_team_cases_are_refused_by_name(tmp_path):
    """Issue 53's red team (benchmarks/NOTES.md section 42): a bare _rpn_ file (the names of pre-norm blocks) is
    refused unless named or told; a folder whose config.json's patch contradicts the tensors is refused (timm refuses
    it); a size of 0 is a UsageError; the bias at an absurd grid (dynamic_img_size) is refused before allocating."""
    f = FIX / "rpn_3x3" / "model.safetensors"
    with pytest.raises(CheckpointError, match="without LayerScale: the residual post-norm blocks"):
        vitkit.load(f, img_size=12)
    assert _worst(vitkit.load(f, img_size=12, res_post_norm=True, num_heads=2), "rpn_3x3") <= TOL
    d = tmp_path / "patch"
    shutil.copytree(FIX / "small_3x3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["patch_size"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"patch_size 8 but the patch embedding's kernel is \(4, 4\)"):
        vitkit.load(d)
    model = vitkit.load(FIX / "small_3x3")
    with pytest.raises(UsageError, match="not a positive multiple of patch_size"):
        model.set_img_size(0)
    assert tuple(model.config.img_size) == (12, 12)  # left as it was
    dyn = vitkit.load(FIX / "small_3x3", dynamic_img_size=True)  # the bias a block asks for at a 4096 x 4096 grid
    with pytest.raises(UsageError, match="relative position bias at a 4096x4096 grid needs .* refused before allocating"):
        dyn.blocks[0].attn.rel_pos((4096, 4096))
