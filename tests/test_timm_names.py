"""timm's names as vitkit's (issue 53): every architecture of timm's ViT modules in `timm_archs.json` either builds with
exactly timm's parameter count (`built`, counted by timm 1.0.31 on the meta device:
tests/fixtures/make_registry_sweep.py archs) or is refused with a UsageError naming its family; the names built small by timm (tests/fixtures/registry,
tests/fixtures/backbones) take timm's weights strictly and give timm's outputs."""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import timm_table
from vitkit.checkpoints.timm import registered_archs
from vitkit.checkpoints.io import CheckpointError
from vitkit.errors import UsageError

ARCHS = registered_archs()
FIXTURES = Path(__file__).parent / "fixtures"
DOC = Path(__file__).parents[1] / "docs" / "timm.md"

# What vitkit does not implement, by timm's name -> words the refusal must carry (its family). Every other name must
# build with timm's count: a name that stops building, or starts to, fails here.
REFUSED = {
    r"^naflexvit_.*_parfac": "factorized",
    r"^resnetv2_\d+(d|t|d_\w+)?$": "other than BiT", r"_(xp|pwee)_": "ParallelScalingBlock",
    r"_18x2_": "ParallelThingsBlock", r"_dpwee_": "DiffParallelScalingBlock",
    r"_resnet\d+d": "ResNet-D",
}
# The names people type most (timm's download counts): all build, with timm's count.
COMMON = ["vit_base_patch16_224", "vit_small_patch16_224", "vit_large_patch16_224", "vit_tiny_patch16_224",
          "vit_base_patch32_224", "vit_base_patch16_384", "vit_large_patch16_384", "vit_huge_patch14_224",
          "vit_base_patch8_224", "vit_small_patch32_224", "deit_base_patch16_224", "deit_small_patch16_224",
          "deit_tiny_patch16_224", "deit_base_distilled_patch16_224", "deit3_base_patch16_224",
          "vit_base_patch16_clip_224", "vit_large_patch14_clip_224", "vit_base_patch16_clip_quickgelu_224",
          "vit_so400m_patch14_siglip_384", "vit_so400m_patch14_siglip_224", "vit_base_patch16_siglip_224",
          "vit_base_patch16_siglip_384", "flexivit_base", "vit_base_patch16_gap_224", "vit_small_patch14_dinov2",
          "vit_base_patch14_dinov2", "vit_large_patch14_reg4_dinov2", "eva02_base_patch14_224",
          "eva02_large_patch14_448", "vit_base_r50_s16_384", "vit_tiny_r_s16_p8_224", "resnetv2_50x1_bit",
          "vit_small_patch16_dinov3", "vit_pe_core_base_patch16_224", "aimv2_large_patch14_224",
          "vit_base_patch16_rope_224", "naflexvit_base_patch16_gap"]


def _refused(name: str) -> str | None:
    return next((words for pat, words in REFUSED.items() if re.search(pat, name)), None)


@contextlib.contextmanager
def _meta_without_init():
    """Models on the meta device, their initialisation skipped (it changes values, never which parameters exist)."""
    with contextlib.ExitStack() as stack:
        for fn in [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]:
            stack.enter_context(mock.patch.object(torch.nn.init, fn, lambda t, *a, **k: t))
        stack.enter_context(torch.device("meta"))
        yield


def _counts(model) -> tuple[int, int]:
    """(parameters, parameters outside the classifier heads)."""
    named = list(model.named_parameters())
    return (sum(p.numel() for _, p in named),
            sum(p.numel() for n, p in named if not n.startswith(("head.", "head_dist."))))


def test_every_timm_name_builds_with_timms_count_or_is_refused_by_family():
    assert len(ARCHS) == 317 and all("params" in e["built"] for e in ARCHS.values())
    wrong, built = {}, []
    with _meta_without_init():
        for name, entry in sorted(ARCHS.items()):
            words = _refused(name)
            if words:
                with pytest.raises(UsageError, match=rf"^timm's {name} \(.*{words}.*\) is not one vitkit implements"):
                    vitkit.create_model(name)
                continue
            model = vitkit.create_model(name)
            got, want = _counts(model), (entry["built"]["params"], entry["built"]["params_0"])
            if got != want or model.num_classes != entry["built"]["num_classes"]:
                wrong[name] = (got, want)
            built.append(name)
    assert not wrong
    assert len(built) == 291  # 246 of the six modules vitkit read first, the 2 res-post-norm ones, BEiT's 7,
    # ViT-RelPos's 14, Sapiens2's 5, BEiT-3's 4, SAM's 4, MCi, RADIO's 6 NaFlexVits and 2 differential


@pytest.mark.parametrize("name", COMMON)
def test_the_common_names_build_as_timm(name):
    with _meta_without_init():
        model = vitkit.create_model(name, pretrained=False)
    assert _counts(model) == (ARCHS[name]["built"]["params"], ARCHS[name]["built"]["params_0"])


def test_perception_encoder_core_has_its_projection_head():
    """PE-Core's CLIP embedding is timm's head (768 -> 1024 for B/16, its bias zero in the release): vitkit's own name
    builds it too, and timm's name with the fixture's arguments takes timm's weights and gives timm's outputs."""
    with torch.device("meta"):
        assert vitkit.create_model("pe_core_b16").num_classes == 1024
        assert _counts(vitkit.create_model("pe_core_b16"))[0] == 93_673_984  # timm: 93,673,984 (was 92,886,528)
    d = FIXTURES / "backbones" / "timm_pe_core_b16"
    args = json.loads((d / "config.json").read_text())["model_args"]
    model = vitkit.create_model("vit_pe_core_base_patch16_224", **args).eval()
    model.load_state_dict(vitkit.load(d).state_dict(), strict=True)
    with torch.no_grad():
        out = model(torch.from_numpy(np.load(d / "input.npy")))
    assert np.abs(out.numpy() - np.load(d / "logits.npy")).max() <= 1e-4


def _registry_cases() -> list[str]:
    idx = json.loads((FIXTURES / "registry" / "timm" / "index.json").read_text())["archs"]
    return sorted(n for n, r in idx.items() if r["status"] == "built" and not _refused(n))


def test_timm_names_with_timms_keywords_take_timms_weights():
    """Every name timm built small (depth 1, width 16, patch 4, 12 px, 5 classes: the keywords a user passes), made by
    vitkit.create_model(name, **those keywords): the same tensors as timm's (a strict load of timm's weights) and
    timm's logits. One load per weight group (its names share weights and outputs)."""
    reg = FIXTURES / "registry" / "timm"
    idx = json.loads((reg / "index.json").read_text())["archs"]
    x = torch.from_numpy(np.load(reg / "input.npy"))
    names = _registry_cases()
    assert len(names) == 245  # (BEiT-3's 4, RADIO's 6 NaFlexVits and 2 differential among them)
    weights: dict[str, dict] = {}
    worst = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # models of 16 channels: a second thread only waits (16 ms per op on a busy machine)
    try:
        for name in names:
            group = idx[name]["group"]
            args = json.loads((reg / group / "configs" / f"{name}.json").read_text())["model_args"]
            model = vitkit.create_model(name, **args).eval()
            if group not in weights:
                weights[group] = vitkit.load(reg / group / "model.safetensors", architecture=name,
                                             num_heads=args["num_heads"], img_size=tuple(x.shape[-2:])).state_dict()
            model.load_state_dict(weights[group], strict=True)
            with torch.no_grad():
                worst = max(worst, float(np.abs(model(x).numpy() - np.load(reg / group / "logits.npy")).max()))
    finally:
        torch.set_num_threads(threads)
    assert worst <= 1e-4


def test_tags_and_old_names_select_timms_classes_and_weights():
    with torch.device("meta"):
        assert vitkit.create_model("vit_base_patch16_224").num_classes == 1000
        m = vitkit.create_model("vit_base_patch16_224.augreg_in21k")  # the tag's head, as timm.create_model builds it
        assert m.num_classes == 21843
        assert vitkit.create_model("vit_base_patch16_224_in21k").num_classes == 21843  # timm's old name for it
        assert vitkit.create_model("vit_base_patch16_224.dino").config.mean == (0.485, 0.456, 0.406)
        assert vitkit.create_model("vit_base_patch16_224.augreg_in21k", num_classes=3).num_classes == 3
    with pytest.raises(UsageError, match=r"no pretrained tag 'nope'.*augreg2_in21k_ft_in1k"):
        vitkit.create_model("vit_base_patch16_224.nope")
    from vitkit.checkpoints.catalog import CATALOG
    from vitkit.checkpoints.create import catalog_name

    # pretrained=True: the catalog's entry where it has one, else timm's hub repository of that tag (registered)
    assert catalog_name("vit_base_patch16_224") == "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"
    repo = catalog_name("vit_base_patch16_224.augreg_in21k")
    assert repo == "timm/vit_base_patch16_224.augreg_in21k" and CATALOG[repo].format == "timm"
    assert catalog_name("deit_base_distilled_patch16_224") == "timm/deit_base_distilled_patch16_224.fb_in1k"
    with pytest.raises(UsageError, match="timm/vit_base_patch16_clip_224.metaclip_400m"):
        catalog_name("vit_base_patch16_clip_quickgelu_224.metaclip_400m")


def test_timms_keywords_over_a_timm_name():
    kw = dict(img_size=384, num_classes=10, global_pool="avg", drop_path_rate=0.1, depth=2)
    with torch.device("meta"):
        c = vitkit.create_model("vit_base_patch16_224", **kw).config
        assert (c.img_size, c.num_classes, c.classifier, c.fc_norm, c.final_norm, c.drop_path_rate, c.depth) == \
            ((384, 384), 10, "gap", True, True, 0.1, 2)
        c = vitkit.create_model("eva02_base_patch14_224", global_pool="token").config  # Eva: no fc_norm then
        assert (c.classifier, c.fc_norm, c.rope, c.mlp_layer) == ("token", False, "eva", "swiglu")
        c = vitkit.create_model("vit_small_patch14_dinov2", mlp_ratio=2, act_layer="gelu_tanh",
                                pos_embed="learn").config
        assert (c.mlp_dim, c.act, c.pos_embed) == (768, "gelu_tanh", "learned_1d")
        assert vitkit.create_model("vit_so400m_patch14_siglip_384").config.img_size == (378, 378)  # the grid timm reads
        assert vitkit.create_model("resnetv2_50x1_bit", num_classes=7).num_classes == 7
    for kw, match in [(dict(act_layer="relu"), "act_layer 'relu'"), (dict(global_pool="max"), "global_pool 'max'"),
                      (dict(block_fn="ParallelScalingBlock"), "block_fn"), (dict(proj_drop_rate=0.3), "one dropout rate"),
                      (dict(features_only=True), "forward_intermediates"), (dict(colour=1), "unknown option")]:
        with pytest.raises(UsageError, match=match):
            vitkit.create_model("vit_base_patch16_224", **kw)


def test_a_timm_name_with_checkpoint_path(tmp_path):
    kw = dict(img_size=32, depth=2, embed_dim=48, num_heads=3, num_classes=4)
    src = vitkit.create_model("vit_base_patch16_224", **kw).eval()
    path = vitkit.save(src, tmp_path / "m.safetensors")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.create_model("vit_base_patch16_224", checkpoint_path=path, **kw)(x), src(x))
    m = vitkit.create_model("vit_base_patch16_224", checkpoint_path=path, global_pool="avg", **kw)
    assert m.global_pool == "avg"
    with pytest.raises(UsageError, match=r"not the model its name builds: embed_dim 48 \(the name's: 384\)"):
        vitkit.create_model("vit_small_patch16_224", checkpoint_path=path, img_size=32, num_classes=4)


def test_names_vitkit_does_not_build_say_why():
    with pytest.raises(UsageError, match=r"^timm's vit_base_patch16_xp_224 \(parallel attention and MLP "
                                         r"\(ParallelScalingBlock\)\) is not one vitkit implements"):
        vitkit.create_model("vit_base_patch16_xp_224")
    with pytest.raises(UsageError, match=r"timm's cait_s24_224 \(CaiT"):  # a family outside timm_archs.json
        vitkit.create_model("cait_s24_224")
    with pytest.raises(UsageError, match=r"unknown model 'vit_base_patch16_225'.*did you mean vit_base_patch16_224"):
        vitkit.create_model("vit_base_patch16_225")
    with pytest.raises(UsageError, match="unknown model 'vit_z99'"):
        vitkit.create_model("vit_z99")
    assert vitkit.create_model("swin_tiny_patch4_window7_224").config.arch == "swin"  # vitkit's aliases still


def test_the_docs_table_is_the_generated_one():
    """docs/timm.md holds `python -m vitkit.checkpoints.timm_table --markdown`'s table as it is now."""
    assert timm_table.markdown() in DOC.read_text()


def test_models_cli_lists_timms_names(capsys):
    from vitkit.cli import main

    assert main(["models", "--timm", "--pattern", "vit_base_patch16_224*"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"vit_base_patch16_224\s+86\.57 M\s+builds", out)
    main(["models", "--timm", "--pattern", "vit_dpwee*"])
    assert "refused: parallel attention and MLP with differential attention" in capsys.readouterr().out


BLOCK_OPTIONS = FIXTURES / "block_options"


@pytest.mark.parametrize("folder, name", [("timm_post_norm", "eva02_enormous_patch14_clip_224"),
                                          ("timm_gqa", "vit_base_patch16_sapiens2")])
def test_post_norm_and_grouped_query_attention_from_timms_folders(folder, name):
    """timm's Eva with `use_post_norm` (EVA-02-CLIP-E: vitkit's res_post_norm) and with grouped key/value heads in its
    middle block (`num_kv_heads` [4, 2, 4]: vitkit's num_kv_heads=2, kv_full_blocks=1), written by timm's save_for_hf
    (tests/fixtures/block_options: a 4x4 grid, a 4x3 one): vitkit.load gives timm's logits, and timm's name with the
    folder's model_args builds the same tensors. (The registry sweep's eva02_enormous_patch14_clip_224 and
    vit_base_patch16_rpn_224, timm's ViT with ResPostBlock, are timm's at a 3x3 and a 2x5 grid.)"""
    d = BLOCK_OPTIONS / folder
    x = torch.from_numpy(np.load(d / "input.npy"))
    loaded = vitkit.load(d)
    c = loaded.config
    assert (c.res_post_norm, c.num_kv_heads, c.kv_full_blocks) == ((True, None, 0) if folder == "timm_post_norm" else
                                                                   (False, 2, 1))
    args = json.loads((d / "config.json").read_text())["model_args"]
    model = vitkit.create_model(name, **args).eval()
    model.load_state_dict(loaded.state_dict(), strict=True)
    with torch.no_grad():
        for m in (loaded, model):
            assert np.abs(m(x).numpy() - np.load(d / "logits.npy")).max() <= 1e-4


def test_a_post_norm_model_exports_to_timm(tmp_path):
    """vitkit's res_post_norm exports as timm's vit_base_patch16_rpn_224 (ResPostBlock; an Eva post-norm block without
    rotary embeddings or SwiGLU is that block with (q, 0, v) biases): vitkit reads it back to the same logits (timm
    read the exports of this folder and of the registry's two post-norm ones to timm's logits, 0 difference); a
    grouped-query attention export to timm is refused."""
    d = BLOCK_OPTIONS / "timm_post_norm"
    x = torch.from_numpy(np.load(d / "input.npy"))
    out = vitkit.export(vitkit.load(d), tmp_path / "rpn", to="timm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "vit_base_patch16_rpn_224" and "init_values" not in cfg["model_args"]
    with torch.no_grad():
        assert np.abs(vitkit.load(out)(x).numpy() - np.load(d / "logits.npy")).max() <= 1e-4
    with pytest.raises(CheckpointError, match="grouped-query attention"):
        vitkit.export(vitkit.load(BLOCK_OPTIONS / "timm_gqa"), tmp_path / "gqa", to="timm")


def test_post_norm_with_what_timm_does_not_build_is_refused(tmp_path):
    """timm's Eva builds post-norm blocks without qk-norm (its constructor asserts it): such a folder is refused."""
    d = tmp_path / "pn"
    d.mkdir()
    (d / "model.safetensors").write_bytes((BLOCK_OPTIONS / "timm_post_norm" / "model.safetensors").read_bytes())
    cfg = json.loads((BLOCK_OPTIONS / "timm_post_norm" / "config.json").read_text())
    cfg["model_args"]["qk_norm"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="post-norm blocks with qk-norm"):
        vitkit.load(d)
