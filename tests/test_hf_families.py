"""transformers' ViT families (issue 53), against outputs transformers computed itself
(tests/fixtures/make_hf_families.py): each folder `save_pretrained` wrote loads in vitkit and gives transformers'
output (<= 1e-4, fp32) at the native size and, with transformers' own resampling (`interpolate_pos_encoding=True`),
at a non-square one; or it is refused with a CheckpointError naming what vitkit does not read. Never a silent
difference: a tensor that changes the output is used or refused."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints import hf, hf_backbones, hf_vision
from vitkit.checkpoints.io import CheckpointError

F = Path(__file__).parent / "fixtures" / "hf_families"
TOL = 1e-4
X, XW = np.load(F / "input.npy"), np.load(F / "input_wide.npy")
WIDE = tuple(XW.shape[-2:])

# class folder -> what vitkit's output is, beside transformers' (test_loads_as_transformers_computes checks it)
LOADS = {
    "CLIPVisionModelWithProjection": "image_embeds: visual_projection is the head",
    "CLIPModel": "the image tower and visual_projection (get_image_features)",
    "CLIPForImageClassification": "the mean patch token before post_layernorm, classified",
    "SiglipForImageClassification": "the mean token after post_layernorm, classified",
    "MetaClip2VisionModelWithProjection": "image_embeds (CLIP's layout)",
    "Aimv2Model": "the image tower and visual_projection (get_image_features)",
    "MetaClip2Model": "the image tower and visual_projection (get_image_features)",
    "AltCLIPVisionModel": "pooler_output (CLIP's layout)",
    "ChineseCLIPVisionModel": "pooler_output (CLIP's layout)",
    "CLIPSegVisionModel": "pooler_output (CLIP's layout)",
    "AltCLIPModel": "the image tower and visual_projection (get_image_features)",
    "ChineseCLIPModel": "the image tower and visual_projection (get_image_features)",
    "CLIPSegModel": "the image tower and visual_projection (get_image_features)",
    "ViTMAEModel": "the encoder on every patch (transformers' with mask_ratio=0, patches in order)",
    "ViTMAEForPreTraining": "the encoder; the pixel decoder left unused, with a note",
    "DeiTForImageClassificationWithTeacher": "the mean of the class and distillation heads",
    "ViTMSNModel": "the normed class token",
    "ViTMSNForImageClassification": "logits",
    "IJepaModel": "the mean of the normed tokens",
    "IJepaForImageClassification": "logits",
    "BeitModel": "the LayerNorm of the mean patch token; a relative position bias per block",
    "BeitForImageClassification": "logits",
    "BeitModel_shared_cls": "the normed class token; one relative position bias shared by the blocks",
    "BeitModel_absolute": "the LayerNorm of the mean patch token; an absolute position embedding, no layer scale",
    "Data2VecVisionModel": "the class token as the last block leaves it (saved without a pooler)",
    "Data2VecVisionForImageClassification": "logits",
}
REFUSED = {"DeiTForImageClassification": "class token alone beside a distillation token"}
CLASSES = sorted(p.name for p in F.iterdir() if p.is_dir())


def _meta(name: str) -> dict:
    return json.loads((F / name / "meta.json").read_text())


def _max_diff(model, x: np.ndarray, expected: np.ndarray) -> float:
    with torch.no_grad():
        return float(np.abs(model(torch.from_numpy(x)).numpy() - expected).max())


def test_every_folder_is_accounted_for():
    assert set(CLASSES) == set(LOADS) | set(REFUSED) and not set(LOADS) & set(REFUSED)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_loads_as_transformers_computes(name):
    d = F / name
    model = vitkit.load(d)
    assert _max_diff(model, X, np.load(d / "out.npy")) <= TOL
    if (d / "hidden.npy").exists():  # the tokens: after the final norm, or CLIP's before post_layernorm
        with torch.no_grad():
            out = model.forward_intermediates(torch.from_numpy(X), layers=[-1], attention=False)
        clip = model.config.pre_norm
        feats = out["tokens"][model.config.depth - 1] if clip else out["features"]
        assert np.abs(feats.numpy() - np.load(d / "hidden.npy")).max() <= TOL
    if "wide_refused" in _meta(name):
        return
    wide = vitkit.load(d, img_size=WIDE)
    assert _max_diff(wide, XW, np.load(d / "out_wide.npy")) <= TOL


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name(name):
    with pytest.raises(CheckpointError, match=REFUSED[name]):
        vitkit.load(F / name)


# ---- what each family's folder holds, beside the outputs ----------------------------------------------------------

@pytest.mark.parametrize("name", ["CLIPVisionModelWithProjection", "CLIPModel", "MetaClip2VisionModelWithProjection",
                                  "MetaClip2Model", "Aimv2Model", "AltCLIPModel", "ChineseCLIPModel", "CLIPSegModel"])
def test_a_projection_is_the_head_without_bias(name):
    """`visual_projection` (no bias) is the head: its bias zero, nothing of the image tower left unused."""
    model = vitkit.load(F / name)
    assert model.config.num_classes == 24 and not model.head.bias.any()
    assert not [k for k in model.load_report["unused"] if k.startswith(("vision_model.", "visual_projection."))]
    vc = json.loads((F / name / "config.json").read_text())
    vc = vc.get("vision_config", vc)
    bare = vitkit.load(F / name / "model.safetensors", num_heads=2, strict=True,
                       **({"act": vc["hidden_act"], "norm_eps": vc["layer_norm_eps"]} if "Aimv2" not in name else {}))
    assert _max_diff(bare, X, np.load(F / name / "out.npy")) <= TOL


def test_the_tower_classifiers_report_what_the_logits_do_not_read():
    clip = vitkit.load(F / "CLIPForImageClassification")
    assert clip.config.classifier == "gap" and not clip.config.final_norm
    assert sorted(clip.load_report["unused"])[:2] == ["vision_model.post_layernorm.bias",
                                                      "vision_model.post_layernorm.weight"]
    siglip = vitkit.load(F / "SiglipForImageClassification")
    assert siglip.config.classifier == "gap" and "vision_model.head.probe" in siglip.load_report["unused"]


@pytest.mark.parametrize("name", ["ViTMAEModel", "ViTMAEForPreTraining"])
def test_mae_is_the_unmasked_encoder(name):
    """transformers masks 75% of the patches at random in every forward of a saved MAE (`mask_ratio`, kept in
    config.json); vitkit's model is the encoder on every patch, its position table the stored sin-cos one."""
    d = F / name
    assert json.loads((d / "config.json").read_text())["mask_ratio"] == 0.75
    model = vitkit.load(d)
    assert model.load_report["format"] == "hf" and model.config.num_classes == 0
    decoder = [k for k in model.load_report["unused"] if k.startswith("decoder.")]
    if name == "ViTMAEForPreTraining":
        assert decoder and "decoder" in model.load_report["notes"][0]
    else:
        assert not decoder and not model.load_report["notes"]
    # the fixed table: sin and cos of the grid positions (each value in [-1, 1], the class token's zero)
    pe = model.pos_embed.weight
    assert not pe[0, 0].any() and pe.abs().max() <= 1 and (pe[0, 1:] ** 2).sum(-1).allclose(torch.tensor(16.0))
    bare = vitkit.load(d / "model.safetensors", num_heads=2, strict=True)
    assert _max_diff(bare, X, np.load(d / "out.npy")) <= TOL


# ---- DeiT, MSN, I-JEPA ----------------------------------------------------------------------------------------

def test_deit_with_its_teacher_s_head_is_vitkit_s_distilled_deit():
    model = vitkit.load(F / "DeiTForImageClassificationWithTeacher")
    c = model.config
    assert c.distilled and c.num_prefix_tokens == 2 and c.num_classes == 5 and not model.load_report["unused"]
    # both heads count: the class token's alone is not transformers' output
    with torch.no_grad():
        cls_only = model.head(model.forward_features(torch.from_numpy(X))[:, 0]).numpy()
    assert np.abs(cls_only - np.load(F / "DeiTForImageClassificationWithTeacher" / "out.npy")).max() > 100 * TOL


@pytest.mark.parametrize("name, hints", [("DeiTForImageClassificationWithTeacher", {}), ("IJepaModel", {}),
                                         ("IJepaForImageClassification", {}),
                                         ("ViTMSNModel", {"norm_eps": 1e-6}),
                                         ("ViTMSNForImageClassification", {"norm_eps": 1e-6})])
def test_bare_files(name, hints):
    """A bare model.safetensors: the family from its keys (MSN's is ViT's layout: its eps is in config.json)."""
    model = vitkit.load(F / name / "model.safetensors", num_heads=2, strict=True, **hints)
    assert _max_diff(model, X, np.load(F / name / "out.npy")) <= TOL


def test_ijepa_has_no_class_token_and_averages():
    for name in ("IJepaModel", "IJepaForImageClassification"):
        c = vitkit.load(F / name).config
        assert not c.class_token and c.classifier == "gap" and not c.fc_norm and c.num_prefix_tokens == 0


# ---- BEiT, data2vec-vision -------------------------------------------------------------------------------------

def test_beit_is_a_relative_bias_with_the_class_token_s_entries_and_layer_scale():
    model = vitkit.load(F / "BeitForImageClassification")
    c = model.config
    assert c.pos_embed == "relative" and c.pos_resample == "bilinear_noaa" and not c.k_bias and c.qkv_bias
    assert c.init_values == 0.1 and c.classifier == "gap" and c.fc_norm and c.num_classes == 5
    table = model.blocks[0].attn.rel_pos.table
    assert table.shape == (7 * 7 + 3, 2) and not torch.equal(table, model.blocks[1].attn.rel_pos.table)
    shared = vitkit.load(F / "BeitModel_shared_cls")
    assert shared.config.classifier == "token" and torch.equal(shared.blocks[0].attn.rel_pos.table,
                                                                shared.blocks[1].attn.rel_pos.table)


def test_beit_resamples_its_table_as_transformers_and_the_rule_matters():
    """At 12x20 transformers resamples the 7x7 table to 5x9 by plain bilinear interpolation: vitkit by the rule it
    records, also when the model takes any size (dynamic_img_size); the official bilinear (corners aligned) is off."""
    d = F / "BeitModel"
    for model in (vitkit.load(d, img_size=WIDE), vitkit.load(d, dynamic_img_size=True)):
        assert _max_diff(model, XW, np.load(d / "out_wide.npy")) <= TOL
    assert _max_diff(vitkit.load(d, img_size=WIDE, resample="bilinear"), XW, np.load(d / "out_wide.npy")) > 100 * TOL


@pytest.mark.parametrize("name", ["BeitModel", "BeitForImageClassification", "BeitModel_absolute",
                                  "Data2VecVisionForImageClassification"])
def test_beit_bare_files(name):
    model = vitkit.load(F / name / "model.safetensors", num_heads=2, strict=True)
    assert _max_diff(model, X, np.load(F / name / "out.npy")) <= TOL


def test_beit_resamples_as_transformers_not_as_timm():
    """The rule is a fact of the checkpoint's source: transformers' BEiT and data2vec-vision resample the table by
    plain bilinear interpolation (`interpolate_pos_encoding=True`: its second interpolation, of the (T, T) bias to
    (T, T), changes nothing), timm's BEiT by a geometric progression of the offsets, which here is off."""
    for name in ("BeitModel", "BeitModel_shared_cls", "Data2VecVisionModel"):
        assert vitkit.load(F / name).config.pos_resample == "bilinear_noaa"
        assert _max_diff(vitkit.load(F / name, img_size=WIDE), XW, np.load(F / name / "out_wide.npy")) <= TOL
    geometric = vitkit.load(F / "BeitModel", img_size=WIDE, resample="geometric")
    assert _max_diff(geometric, XW, np.load(F / "BeitModel" / "out_wide.npy")) > 100 * TOL


def test_beit_with_a_relative_table_at_a_non_square_size_is_refused(tmp_path):
    """transformers reads a non-square BEiT's table as a (2w - 1) x (2h - 1) grid and resamples it to (2h - 1) x
    (2w - 1) at every size, its own included (0.05 from vitkit's reading at the native size, on logits of ~1, when
    this was written): refused, never a silent difference; a square one given as a list loads."""
    src = F / "BeitModel"
    d = tmp_path / "wide"
    shutil.copytree(src, d)
    cfg = json.loads((src / "config.json").read_text())
    for size, refused in (([16, 24], True), ([16, 16], False)):  # 4x6 patches; 4x4 (patch 4)
        (d / "config.json").write_text(json.dumps({**cfg, "image_size": size}))
        if refused:
            with pytest.raises(CheckpointError, match="non-square grid .* transformers reads its table"):
                vitkit.load(d)
        else:
            assert vitkit.load(d).config.pos_embed == "relative"


def test_beit_with_absolute_and_relative_positions_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    src = F / "BeitModel"
    sd = load_file(src / "model.safetensors")
    sd["embeddings.position_embeddings"] = torch.zeros(1, 17, 32)
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError, match="absolute position embedding beside"):
        vitkit.load(tmp_path)


# ---- the sweep: every vision model_type transformers maps, read or refused by name ---------------------------

TYPES = json.loads((F / "model_types.json").read_text())
DOCS = Path(__file__).parents[1] / "docs" / "checkpoints.md"
BEGIN, END = "<!-- hf-model-types: generated by `python tests/test_hf_families.py` -->", "<!-- /hf-model-types -->"
REFUSED_TYPES = sorted(mt for mt in TYPES["model_types"] if not hf.support(mt)[0])


def model_types_table() -> str:
    rows = TYPES["model_types"]
    reads = [mt for mt in rows if hf.support(mt)[0]]
    lines = [f"transformers {TYPES['versions']['transformers']} maps {len(rows)} model_types to vision tasks (image "
             f"classification, image features, masked image modeling, zero-shot image classification, and the "
             f"latter's vision towers): vitkit reads {len(reads)}, and refuses the other {len(rows) - len(reads)} "
             f"by name.", "", "| model_type | transformers' classes | vitkit |", "|---|---|---|"]
    for mt, row in rows.items():
        ok, what = hf.support(mt)
        lines.append(f"| `{mt}` | {', '.join(row['classes']) or row['config']} | "
                     f"{'**reads**: ' + what if ok else 'refused: ' + what} |")
    return "\n".join(lines)


def test_every_transformers_vision_model_type_is_classified():
    """Each model_type transformers maps to a vision task is read (a parity fixture exists for it) or refused with
    its own reason; what vitkit reads is exactly what its converters' family tables hold."""
    assert not [mt for mt in TYPES["model_types"] if hf.support(mt) == (False, "not a ViT family vitkit knows")]
    assert set(hf.READS) == set(hf.FAMILIES) | set(hf_vision.FAMILIES) | set(hf_backbones.FAMILIES) | {"swin"}
    fixtures = {json.loads(p.read_text()).get("model_type") for p in (F.parent).glob("**/config.json")}
    assert set(hf.READS) <= fixtures  # every type vitkit reads has a folder transformers wrote, tested against it
    assert len(REFUSED_TYPES) > 40 and not set(hf.READS) & set(hf.REFUSED)


@pytest.mark.parametrize("model_type", REFUSED_TYPES)
def test_a_refused_model_type_is_named_even_in_a_vit_s_layout(model_type, tmp_path):
    """A config.json of a model_type vitkit does not read is refused by name before its tensors are looked at,
    here a plain ViT's tensors that would otherwise load."""
    src = F.parent / "registry" / "hf" / "ViTModel"
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    with pytest.raises(CheckpointError, match=f"model_type '{model_type}' \\(" + "[^)]"):
        vitkit.load(tmp_path)


def test_docs_table_is_the_sweep():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"docs/checkpoints.md lacks the {BEGIN} section"
    got = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert got == model_types_table(), "run `python tests/test_hf_families.py` to rewrite docs/checkpoints.md's table"


if __name__ == "__main__":  # rewrite the docs' table from the sweep
    if "--print" in sys.argv:
        print(model_types_table())
    else:
        text = DOCS.read_text()
        head, rest = text.split(BEGIN, 1)
        DOCS.write_text(head + BEGIN + "\n" + model_types_table() + "\n" + END + rest.split(END, 1)[1])
