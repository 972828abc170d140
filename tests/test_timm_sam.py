"""timm's SAM image encoder (timm.models.vision_transformer_sam, issue 53): timm's own files (`save_for_hf` folders and
their bare model.safetensors, tests/fixtures/timm_sam, made by `make_registry_sweep.py sam`) load into vitkit and give
timm's logits (<= 1e-4, fp32) at two widths (SAM ViT-B's and ViT-L's arguments, small), at a square and a non-square
grid, with windows padded and global blocks; timm's samvit_base_patch16_224 (no position embedding, no neck) and a
model of global blocks alone; at another input size too (timm resamples in the forward, vitkit the same). timm's names
build those models with timm's parameter counts; vitkit exports them back as timm writes them; SAM's own release
names load the same way; what vitkit does not implement is refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
import vitkit.safety
from vitkit.checkpoints import layouts, timm_sam
from vitkit.checkpoints.io import CheckpointError, read_safetensors
from vitkit.errors import UsageError
from vitkit.models import SamViTConfig, SamVisionTransformer

FIX = Path(__file__).parent / "fixtures" / "timm_sam"
CASES = json.loads((FIX / "index.json").read_text())["cases"]
TOL = 1e-4
P = 4  # the fixtures' patch


def _worst(model, case: str, grid: str | None = None) -> float:
    """max |vitkit - timm| on the folder's input (at `grid`: its other input, timm's logits at that size)."""
    suffix = f"_{grid}" if grid else ""
    with torch.no_grad():
        ours = model(torch.from_numpy(np.load(FIX / case / f"input{suffix}.npy"))).numpy()
    return float(np.abs(ours - np.load(FIX / case / f"logits{suffix}.npy")).max())


def _img(grid: str) -> tuple[int, int]:
    h, w = map(int, grid.split("x"))
    return h * P, w * P


def test_the_fixtures_cover_sams_layouts():
    assert sorted(CASES) == ["all_global", "base_224_3x3", "base_5x5", "large_4x6"]
    assert CASES["large_4x6"]["input"] == [16, 24]  # a non-square grid
    assert all(row["timm_reads_back"] == 0.0 for row in CASES.values())
    # the logits are not small: a wrong window, table or neck would move them far past 1e-4
    assert all(np.abs(np.load(FIX / c / "logits.npy")).max() > 0.3 for c in CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timm_sam_folder_gives_timms_logits(case):
    row = CASES[case]
    model = vitkit.load(FIX / case)
    assert isinstance(model, SamVisionTransformer) and model.load_report["format"] == "timm-sam"
    assert _worst(model, case) <= TOL
    c, args = model.config, row["model_args"]
    assert tuple(c.img_size) == tuple(row["input"])
    assert c.window_size == (args["window_size"] or None)
    assert c.global_attn_indexes == tuple(args.get("global_attn_indexes", ()))
    assert model.num_classes == args["num_classes"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_at_another_size_as_timm(case):
    """timm's SAM takes any size, its position embedding (bicubic, antialiased) and global blocks' tables (linear)
    resampled in the forward: vitkit's model does the same as it is, and loaded at that size (`set_img_size`, the
    resampling done once)."""
    grid = CASES[case]["other"]
    assert _worst(vitkit.load(FIX / case), case, grid) <= TOL
    model = vitkit.load(FIX / case, img_size=_img(grid))
    assert tuple(model.config.img_size) == _img(grid)
    assert _worst(model, case, grid) <= TOL


@pytest.mark.parametrize("case", ["base_5x5", "large_4x6"])
def test_a_bare_timm_sam_state_dict_tells_its_model(case):
    """The folder's model.safetensors alone: the position embedding tells the grid, the relative tables the heads, the
    window and the global blocks (a table of the grid's)."""
    model = vitkit.load(FIX / case / "model.safetensors")
    assert model.config.global_attn_indexes == tuple(CASES[case]["model_args"]["global_attn_indexes"])
    assert _worst(model, case) <= TOL


def test_a_bare_file_that_does_not_tell_its_windows_or_grid_asks_for_them():
    """No position embedding (samvit_base_patch16_224): the resolution is asked for; global blocks alone: which blocks
    are global is asked for; named by timm's architecture, the registered global blocks (here overridden: the file is
    shrunk)."""
    f = FIX / "base_224_3x3" / "model.safetensors"
    with pytest.raises(CheckpointError, match="do not tell its resolution; pass img_size="):
        vitkit.load(f)
    assert _worst(vitkit.load(f, img_size=12), "base_224_3x3") <= TOL
    assert _worst(vitkit.load(f, global_attn_indexes=[0]), "base_224_3x3") <= TOL  # the global block's table: the grid
    g = FIX / "all_global" / "model.safetensors"
    with pytest.raises(CheckpointError, match="windows do not show in its tensors.*pass global_attn_indexes="):
        vitkit.load(g)
    model = vitkit.load(g, global_attn_indexes=[0, 1])
    assert model.config.window_size is None and _worst(model, "all_global") <= TOL
    row = CASES["base_5x5"]
    named = vitkit.load(FIX / "base_5x5" / "model.safetensors", architecture=row["architecture"], num_heads=2,
                        global_attn_indexes=[1])
    assert named.config.mean == (0.485, 0.456, 0.406) and _worst(named, "base_5x5") <= TOL
    with pytest.raises(CheckpointError, match=r"global_attn_indexes \[2, 5, 8, 11\]: the file's blocks are 0 .. 2"):
        vitkit.load(FIX / "base_5x5" / "model.safetensors", architecture=row["architecture"], num_heads=2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_timms_name_with_timms_keywords_builds_the_model_of_timms_file(case):
    """`vitkit.create_model(arch, **model_args)` as `timm.create_model` takes them: the same tensors (a strict load of
    timm's weights) and timm's logits."""
    row = CASES[case]
    model = vitkit.create_model(row["architecture"], **row["model_args"]).eval()
    model.load_state_dict(vitkit.load(FIX / case).state_dict(), strict=True)
    assert _worst(model, case) <= TOL


def test_timms_samvit_names_build_with_timms_count():
    archs = {n: e for n, e in vitkit.checkpoints.timm.registered_archs().items() if e["class"] == "VisionTransformerSAM"}
    assert sorted(archs) == ["samvit_base_patch16", "samvit_base_patch16_224", "samvit_huge_patch16",
                             "samvit_large_patch16"]
    with torch.device("meta"):
        for name, entry in archs.items():
            model = vitkit.create_model(name)
            named = list(model.named_parameters())
            assert sum(p.numel() for _, p in named) == entry["built"]["params"], name
            assert sum(p.numel() for n, p in named if not n.startswith("head.")) == entry["built"]["params_0"], name
            assert model.num_classes == entry["built"]["num_classes"]
        c = vitkit.create_model("samvit_base_patch16").config
        assert (c.img_size, c.window_size, c.global_attn_indexes, c.neck_chans, c.num_classes) == \
            ((1024, 1024), 14, (2, 5, 8, 11), 256, 0)
        assert sum(p.numel() for p in vitkit.create_model("samvit_base_patch16").parameters()) == 89_670_912
        c = vitkit.create_model("samvit_base_patch16_224").config
        assert (c.use_abs_pos, c.neck_chans, c.num_classes, c.crop_pct) == (False, 0, 1000, 0.9)
        assert vitkit.create_model("samvit_large_patch16", num_classes=10).num_classes == 10


@pytest.mark.parametrize("case", sorted(CASES))
def test_vitkits_timm_export_is_timms_file(case, tmp_path):
    """vitkit's export to timm of a timm SAM folder: the tensors timm wrote, name for name, and a config.json vitkit
    reads back to the same model (timm reads these exports to its own logits: `timm_reads_vitkit_export` in the
    fixtures' index.json)."""
    model = vitkit.load(FIX / case)
    out = vitkit.export(model, tmp_path / "export", to="timm")
    theirs, _ = read_safetensors(FIX / case / "model.safetensors")
    ours, _ = read_safetensors(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = vitkit.load(out)
    assert back.config.to_dict() == model.config.to_dict() and _worst(back, case) <= TOL
    assert json.loads((out / "config.json").read_text())["architecture"] == "samvit_base_patch16"
    assert CASES[case]["timm_reads_vitkit_export"] <= TOL
    native = vitkit.load(vitkit.export(model, tmp_path / "own.safetensors"))  # vitkit's own file keeps the config
    assert native.config.to_dict() == model.config.to_dict() and _worst(native, case) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_key_table_reads_both_ways(case):
    """`timm_sam.LAYOUT` read forwards gives vitkit's names, read backwards timm's file again, tensor for tensor."""
    w, _ = read_safetensors(FIX / case / "model.safetensors")
    sd, unused = layouts.read(timm_sam.LAYOUT, w)
    assert not unused and any(k.startswith("neck.norm") for k in sd) and not any(k.startswith("neck.0") for k in sd)
    back, left = layouts.write(timm_sam.LAYOUT, sd)
    assert not left and sorted(back) == sorted(w) and all(torch.equal(back[k], w[k]) for k in w)


def test_sams_own_release_names_load(tmp_path):
    """SAM's release files (facebookresearch/segment-anything): `image_encoder.` before the encoder's names, the MLP's
    `lin1` / `lin2` (timm's `checkpoint_filter_fn` renames them); the prompt encoder and mask decoder left unused; the
    blocks' LayerNorm eps SAM's code gives them (1e-6), the same model as timm's file otherwise."""
    w, _ = read_safetensors(FIX / "base_5x5" / "model.safetensors")
    sam = {"image_encoder." + k.replace("mlp.fc", "mlp.lin"): v for k, v in w.items() if not k.startswith("head.")}
    sam["prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"] = torch.randn(2, 4)
    sam["mask_decoder.iou_token.weight"] = torch.randn(1, 4)
    torch.save(sam, tmp_path / "sam_vit_b.pth")
    model = vitkit.load(tmp_path / "sam_vit_b.pth")
    assert sorted(model.load_report["unused"]) == ["mask_decoder.iou_token.weight",
                                                   "prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"]
    assert model.config.norm_eps == 1e-6  # SAM's own blocks (build_sam.py); timm's have PyTorch's default 1e-5
    model.reset_classifier(5)
    model.head.load_state_dict({"weight": w["head.fc.weight"], "bias": w["head.fc.bias"]})
    timms = vitkit.load(FIX / "base_5x5")
    for m in timms.blocks.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 1e-6
    x = torch.from_numpy(np.load(FIX / "base_5x5" / "input.npy"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), timms(x), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="LayerNorm eps 1e-5"):  # timm's config.json cannot say 1e-6
        vitkit.export(model, tmp_path / "timm", to="timm")


def test_what_vitkit_does_not_hold_is_refused(tmp_path):
    d = tmp_path / "rope"
    shutil.copytree(FIX / "base_5x5", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["use_rope"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="use_rope=True: rotary embeddings"):
        vitkit.load(d)
    w, _ = read_safetensors(FIX / "base_5x5" / "model.safetensors")
    for key, shape, words in [("blocks.0.attn.q_norm.weight", (12,), "qk_norm"),
                              ("blocks.1.ls1.gamma", (24,), "LayerScale"), ("norm_pre.weight", (24,), "pre_norm"),
                              ("head.norm.weight", (8,), "an MLP head")]:
        with pytest.raises(CheckpointError, match=rf"{key}: timm's SAM ViT with .*{words}"):
            timm_sam.to_vitkit({**w, key: torch.ones(shape)})
    for kw, words in [(dict(qk_norm=True), "qk_norm=True"), (dict(init_values=1e-5), "LayerScale"),
                      (dict(head_hidden_size=64), "an MLP head"), (dict(global_pool="max"), "global_pool='max'"),
                      (dict(norm_layer="rmsnorm"), "norm_layer='rmsnorm'")]:
        with pytest.raises(UsageError, match=words):
            vitkit.create_model("samvit_base_patch16", **kw)
    model = vitkit.load(FIX / "base_5x5")
    with pytest.raises(UsageError, match="global_pool='token'.*SAM ViT pools by the mean"):
        model.reset_classifier(3, "token")
    model.config.norm_eps = 1e-6
    with pytest.raises(CheckpointError, match="LayerNorm eps 1e-5"):
        vitkit.export(model, tmp_path / "eps", to="timm")
    with pytest.raises(CheckpointError, match="exports to 'vitkit' or 'timm' only"):
        vitkit.export(model, tmp_path / "hf", to="hf")
    with pytest.raises(UsageError, match="multiples of the patch size"):
        model(torch.zeros(1, 3, 10, 12))


def test_gradients_reach_every_parameter_and_intermediates_are_reachable():
    c = SamViTConfig(img_size=(12, 20), patch_size=4, embed_dim=16, depth=2, num_heads=2, window_size=2,
                     global_attn_indexes=(1,), neck_chans=8, num_classes=3)
    torch.manual_seed(0)
    model = SamVisionTransformer(c)
    model(torch.randn(2, 3, 12, 20)).square().sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()] == []
    model.eval()
    x = torch.randn(2, 3, 12, 20)
    with torch.no_grad():
        out = model.forward_intermediates(x)
        torch.testing.assert_close(out["logits"], model(x))
    assert out["tokens"][0].shape == (2, 3, 5, 16) and out["features"].shape == (2, 8, 3, 5)
    assert out["attention"][0].shape == (2, 6, 2, 4, 4)  # 3x5 padded to 4x6: six 2x2 windows
    assert out["attention"][1].shape == (2, 1, 2, 15, 15)  # the global block: the whole map
    torch.testing.assert_close(out["attention"][1].sum(-1), torch.ones(2, 1, 2, 15))


@pytest.mark.parametrize("name", ["samvit_base_patch16", "samvit_large_patch16", "samvit_huge_patch16",
                                  "samvit_base_patch16_224"])
def test_full_size_timm_files_tell_their_model(name):
    """timm's state dict of each registered name (shapes only, on the meta device) is read back to the model the name
    builds: at 1024 px the position embedding gives the 64x64 grid and the tables the 14x14 windows and the global
    blocks; samvit_base_patch16_224 (no position embedding, windows the size of its 14x14 grid) by its architecture."""
    with torch.device("meta"):
        model = vitkit.create_model(name)
    timm_sd = timm_sam.from_vitkit(model.state_dict(), model.config)
    sd, _, unused = timm_sam.to_vitkit(timm_sd)
    hints = {} if model.config.use_abs_pos else vitkit.checkpoints.timm.architecture_facts(name)
    want = {k: v for k, v in model.config.to_dict().items() if k not in ("mean", "std", "crop_pct")}
    got = timm_sam.infer_config(sd, hints).to_dict()
    assert not unused and {k: got[k] for k in want} == want
    if not model.config.use_abs_pos:
        with pytest.raises(CheckpointError, match="windows do not show"):
            timm_sam.infer_config(sd, {}, img_size_if_unknown=224)


def _bare(tmp_path, sd, name="bare.safetensors"):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / name))
    return tmp_path / name


def test_an_absurd_window_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """Red team N1: window_size 1024 on a 5x5 grid (config.json, or a bare file's 2047-row tables) padded the map to a
    million tokens: the forward hung or asked for 17 GB. The window is bounded against the grid and the attention's
    scores (batch 1, per head) checked against the memory at config time; SAM's own window larger than a small
    grid (padded to one window) still builds and runs."""
    d = tmp_path / "n1"
    shutil.copytree(FIX / "base_5x5", d)
    w, _ = read_safetensors(d / "model.safetensors")
    _bare(d, {k: v for k, v in w.items() if ".rel_pos_" not in k}, "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"].update(window_size=1024, use_rel_pos=False)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="window_size 1024 on the 5x5 patch grid"):
        vitkit.load(d)
    tables = {f"blocks.{i}.attn.rel_pos_{a}": torch.zeros(2047, 12) for i in (0, 2) for a in "hw"}
    with pytest.raises(UsageError, match="window_size 1024 on the 5x5 patch grid"):
        vitkit.load(_bare(tmp_path, {**w, **tables}))
    small = dict(img_size=20, patch_size=4, embed_dim=24, depth=2, num_heads=2, neck_chans=8, global_attn_indexes=(1,))
    model = SamVisionTransformer(SamViTConfig(window_size=14, **small)).eval()  # SAM's 14 on a 5x5 grid: padded
    with torch.no_grad():
        assert model(torch.randn(1, 3, 20, 20)).shape == (1, 8)
    monkeypatch.setattr(vitkit.safety, "memory_budget", lambda: 1 << 20)
    with pytest.raises(UsageError, match=r"window_size 64 on the 5x5 patch grid \(padded to 64x64.*refused before"):
        SamViTConfig(window_size=64, **small)
    with pytest.raises(UsageError, match="global attention on the 24x24 patch grid.*refused before"):
        SamViTConfig(**{**small, "img_size": 96}, window_size=None)


@pytest.mark.parametrize("value", ["1", ["a"], None, [[1]]])
def test_a_malformed_global_attn_indexes_is_named(tmp_path, value):
    """Red team W1: a config.json's or the caller's global_attn_indexes that is no list of integers."""
    with pytest.raises(CheckpointError, match=r"global_attn_indexes=.*must be a list of block indexes"):
        vitkit.load(FIX / "base_5x5" / "model.safetensors", global_attn_indexes=value)
    d = tmp_path / "w1"
    shutil.copytree(FIX / "base_5x5", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["global_attn_indexes"] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"global_attn_indexes=.*must be a list of block indexes"):
        vitkit.load(d)


def test_missing_blocks_and_malformed_tables_are_named(tmp_path):
    """Red team W2, W3: blocks 0, 1, 5; a block without its tables; a table of head dim 0 or of one dimension."""
    w, _ = read_safetensors(FIX / "base_5x5" / "model.safetensors")
    cases = [({k.replace("blocks.2.", "blocks.5."): v for k, v in w.items()},
              r"blocks are \[0, 1, 5\]: blocks 2, 3, 4 are missing"),
             ({k: v for k, v in w.items() if not k.startswith("blocks.1.attn.rel_pos")},
              "tables are missing .*blocks.1.attn.rel_pos_h, blocks.1.attn.rel_pos_w"),
             ({**w, "blocks.0.attn.rel_pos_h": torch.zeros(3, 0)}, r"blocks.0.attn.rel_pos_h has shape \(3, 0\)"),
             ({**w, "blocks.1.attn.rel_pos_w": torch.zeros(9)}, r"blocks.1.attn.rel_pos_w has shape \(9,\)")]
    for i, (sd, words) in enumerate(cases):
        with pytest.raises(CheckpointError, match=words):
            vitkit.load(_bare(tmp_path, sd, f"{i}.safetensors"))


def test_the_windows_advice_names_what_load_takes(tmp_path):
    """vitkit.load takes window_size= for a Swin only (it lays the windows out anew after loading): SAM's messages
    point to what the file's model is read from instead (its tables, config.json, global_attn_indexes=)."""
    w, _ = read_safetensors(FIX / "base_5x5" / "model.safetensors")
    with pytest.raises(CheckpointError, match="without relative position tables.*config.json's model_args window_size") as e:
        vitkit.load(_bare(tmp_path, {k: v for k, v in w.items() if ".rel_pos_" not in k}), global_attn_indexes=[1],
                    num_heads=2)
    assert "window_size=" not in str(e.value)
    d = tmp_path / "win3"
    shutil.copytree(FIX / "base_5x5", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_args"]["window_size"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="relative tables have .*pass the model's own img_size=") as e:
        vitkit.load(d)
    assert "window_size=" not in str(e.value)
