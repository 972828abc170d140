"""Hugging Face transformers' ViT-layout folders (config.json + weights) <-> vitkit names: ViT (`ViTModel`,
`ViTForImageClassification`), DeiT (`DeiTModel`, `DeiTForImageClassificationWithTeacher`), MAE (`ViTMAEModel`,
`ViTMAEForPreTraining`: the encoder), MSN (`ViTMSNModel`, `ViTMSNForImageClassification`), I-JEPA (`IJepaModel`,
`IJepaForImageClassification`), BEiT and data2vec-vision (`BeitModel`, `BeitForImageClassification`,
`Data2VecVisionModel`, `Data2VecVisionForImageClassification`).

They share one layout: `embeddings.{cls_token, position_embeddings, patch_embeddings.projection}`, then
`encoder.layer.N.{layernorm_before, attention.attention.{query,key,value}, attention.output.dense, layernorm_after,
intermediate.dense, output.dense}` and `layernorm`, under the task class's prefix (`vit.`, `deit.`, `ijepa.`, `beit.`, `data2vec_vision.`). HF keeps separate
query/key/value Linears and a LayerNorm epsilon of 1e-12; its classifier reads the final-normed class token. ViTModel
files may carry a pooler, tanh(dense(class token)), which vitkit leaves unused (reported in
`model.load_report["unused"]`): the model's output is the normed class token, the features a classifier is
fine-tuned on (transformers' ViTForImageClassification and timm drop the pooler too).

What each family adds (`FAMILIES`, by config.json's model_type; a bare file by its keys):
- DeiT: a distillation token after the class token (`embeddings.distillation_token`; the position embedding covers
  both) and, with its teacher's head, two classifiers: `cls_classifier` on the class token, `distillation_classifier`
  on the distillation token, their logits averaged: vitkit's `distilled` model (timm's deit_*_distilled), `head` and
  `head_dist`. `DeiTForImageClassification` classifies the class token alone beside a distillation token, which no
  vitkit head does: refused. `DeiTModel`'s output is the mean of the two normed tokens (vitkit's distilled model
  without a head, as timm's `forward_head(pre_logits=True)`); its pooler is left unused as ViT's.
- MSN: the ViT itself (LayerNorm eps 1e-6); `ViTMSNModel` has no pooler: its feature is the normed class token.
- I-JEPA: no class token; the position embedding covers the patches. `IJepaForImageClassification` classifies the
  mean of the normed tokens: vitkit's "gap", which is also `IJepaModel`'s output (transformers' has no pooled one).
- BEiT, data2vec-vision: no bias on the keys (vitkit's k_bias=False); LayerScale `lambda_1`, `lambda_2`; a relative
  position bias per block (`...attention.relative_position_bias.relative_position_bias_table`) or one shared by all
  (`encoder.relative_position_bias...`, copied into every block: the same function), with BEiT's three entries for
  the class token's rows and columns, which vitkit's `pos_embed="relative"` has too; transformers resamples the table
  at another size by plain bilinear interpolation (`pos_resample="bilinear_noaa"`; timm's BEiT: "geometric"); a
  relative table at a non-square image_size is refused (transformers reads it with its height and width swapped).
  An absolute position embedding (`use_absolute_position_embeddings`) alone loads (resampled by plain bicubic);
  beside a relative bias it is refused.
  With `use_mean_pooling` the output is the LayerNorm of the mean patch token (`pooler.layernorm`: vitkit's "gap"
  with `fc_norm`), and no norm follows the blocks; else the normed class token. A model saved without its pooler
  (`Data2VecVisionModel`'s default) has no norm after the blocks: its output is the class token as the last block
  leaves it. BeitForMaskedImageModeling's visual-token head (`lm_head`) is left unused, with a note.
- MAE: the position embedding is MAE's fixed 2-D sin-cos table, stored as a (frozen) parameter: read as it is.
  transformers' ViTMAEModel masks `config.mask_ratio` of the patches at random in every forward (0.75 as
  pre-trained); vitkit computes the encoder on every patch, in order (transformers' output with mask_ratio=0 and
  `noise` = 0, 1, 2, ...): the features a classifier or a probe reads. ViTMAEForPreTraining's pixel decoder
  (`decoder.*`) is used in pre-training only: left unused, with a note in `model.load_report["notes"]`.
"""
from __future__ import annotations

import math
import re

import torch

from .io import CheckpointError
from .layouts import QKV_INCOMPLETE, Layout, Rule, body, read, write

# transformers' model_type -> vitkit's family of the shared layout
FAMILIES = {"vit": "vit", "deit": "deit", "vit_mae": "mae", "vit_msn": "msn", "ijepa": "ijepa", "beit": "beit",
            "data2vec-vision": "beit"}
_NAMES = {"vit": "ViT", "deit": "DeiT", "mae": "MAE", "msn": "MSN", "ijepa": "I-JEPA", "beit": "BEiT"}
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# the task classes' prefixes before the encoder's names
_MODEL_PREFIXES = ("vit.", "deit.", "ijepa.", "beit.", "data2vec_vision.")
_REL_TABLE = "relative_position_bias.relative_position_bias_table"
_L = "encoder.layer.{i}."

# ---- the layout tables (`layouts`): transformers' names <-> vitkit's, read forwards by to_vitkit, backwards by
# from_vitkit ------------------------------------------------------------------------------------------------------
VIT_RULES = (
    Rule("classifier.{*}", "head.{*}", top=True),
    Rule("distillation_classifier.{*}", "head_dist.{*}", top=True),
    Rule("embeddings.cls_token", "cls_token"),
    Rule("embeddings.distillation_token", "dist_token"),
    Rule("embeddings.position_embeddings", "pos_embed.weight"),
    Rule("embeddings.patch_embeddings.projection.{*}", "patch_embed.proj.{*}"),
    Rule("embeddings.mask_token{*}", None),
    Rule("layernorm.{*}", "norm.{*}"),
    Rule("pooler.{*}", None),  # ViTModel's tanh(dense(class token)): not the model's output
    Rule(tuple(_L + f"attention.attention.{n}.weight" for n in ("query", "key", "value")), "blocks.{i}.attn.qkv.weight"),
    Rule(tuple(_L + f"attention.attention.{n}.bias" for n in ("query", "key", "value")), "blocks.{i}.attn.qkv.bias"),
    Rule(_L + "layernorm_before.{w}", "blocks.{i}.norm1.{w}"),
    Rule(_L + "attention.output.dense.{w}", "blocks.{i}.attn.proj.{w}"),
    Rule(_L + "layernorm_after.{w}", "blocks.{i}.norm2.{w}"),
    Rule(_L + "intermediate.dense.{w}", "blocks.{i}.mlp.fc1.{w}"),
    Rule(_L + "output.dense.{w}", "blocks.{i}.mlp.fc2.{w}"),
)
# DeiT with its teacher: the class token's head first (written for `head`), the ViT's names after
DEIT_RULES = (Rule("cls_classifier.{*}", "head.{*}", top=True), *VIT_RULES)
# MAE's pixel decoder, used in pre-training only
MAE_RULES = (Rule("decoder.{*}", None, top=True), *VIT_RULES)
BEIT_RULES = (
    Rule(_L + "lambda_1", "blocks.{i}.ls1.gamma"),
    Rule(_L + "lambda_2", "blocks.{i}.ls2.gamma"),
    Rule(_L + f"attention.attention.{_REL_TABLE}", "blocks.{i}.attn.rel_pos.table"),
    Rule(f"encoder.{_REL_TABLE}", "rel_pos.table"),  # one table shared by the blocks: `_beit` gives each a copy
    Rule("{*}relative_position_index", None),  # a function of the grid, which vitkit builds the same
    Rule("pooler.layernorm.{*}", "fc_norm.{*}"),
    Rule("lm_head.{*}", None),  # the visual-token head of masked image modeling
    # no bias on the keys: the query's and value's biases alone are vitkit's q_bias, v_bias (k_bias=False)
    Rule(tuple(_L + f"attention.attention.{n}.bias" for n in ("query", "key", "value")), "blocks.{i}.attn.qkv.bias",
         partial=("blocks.{i}.attn.q_bias", None, "blocks.{i}.attn.v_bias")),
    *VIT_RULES,
)
_RULES = {"vit": VIT_RULES, "deit": DEIT_RULES, "mae": MAE_RULES, "msn": VIT_RULES, "ijepa": VIT_RULES,
          "beit": BEIT_RULES}
LAYOUTS = {fam: Layout(_NAMES[fam], rules, prefixes=_MODEL_PREFIXES, export_prefix="vit.",
                       incomplete=QKV_INCOMPLETE) for fam, rules in _RULES.items()}


def is_hf(keys) -> bool:
    return any(k.startswith(("embeddings.patch_embeddings.", *(p + "embeddings." for p in _MODEL_PREFIXES)))
               for k in keys)


def family(keys, hf_config: dict | None = None) -> str:
    """The family of a folder's config.json model_type (a CheckpointError naming one vitkit does not read), or of a
    bare file's keys."""
    if hf_config and "model_type" in hf_config:
        model_type = hf_config["model_type"]
        if model_type not in FAMILIES:
            raise CheckpointError(refusal(model_type))
        return FAMILIES[model_type]
    if any(k.startswith(("beit.", "data2vec_vision.")) for k in keys):
        return "beit"
    keys = {next((k[len(p):] for p in _MODEL_PREFIXES if k.startswith(p)), k) for k in keys}
    if any(k.endswith((".lambda_1", _REL_TABLE)) or k.startswith("pooler.layernorm.") for k in keys) or (
            "encoder.layer.0.attention.attention.query.bias" in keys
            and "encoder.layer.0.attention.attention.key.bias" not in keys):
        return "beit"
    if any(k.startswith("decoder.") for k in keys):
        return "mae"
    if "embeddings.distillation_token" in keys:
        return "deit"
    if "embeddings.cls_token" not in keys:
        return "ijepa"
    return "vit"  # MSN's files are ViT's (its LayerNorm eps, 1e-6, is in config.json alone)


def refusal(model_type: str) -> str:
    """Why vitkit does not read a transformers model_type, in one sentence."""
    why = REFUSED.get(model_type)
    return f"Hugging Face model_type {model_type!r} ({why or 'not a ViT family vitkit knows'}) is not one vitkit reads"


def check_model_type(hub_config: dict) -> None:
    """A CheckpointError naming a config.json's model_type when vitkit reads no model of that type (before its
    tensors are looked at: a family vitkit does not read may share a layout with one it does)."""
    model_type = hub_config.get("model_type")
    if isinstance(model_type, str) and model_type not in READS:
        raise CheckpointError(refusal(model_type))


# ---- transformers' vision model_types: what vitkit does with each (docs/checkpoints.md's table, checked by
# tests/test_hf_families.py against the model_types transformers maps to vision tasks) ----------------------------

_CLIP_LIKE = "the image tower; {}'s `visual_projection` is the head"
# model_type -> the classes whose folders vitkit reads (each checked against transformers' own outputs)
READS = {
    "vit": "ViTModel, ViTForImageClassification",
    "deit": "DeiTModel, DeiTForImageClassificationWithTeacher (DeiTForImageClassification refused: one head beside "
            "the distillation token)",
    "vit_mae": "ViTMAEModel, ViTMAEForPreTraining: the encoder on every patch (the decoder left unused)",
    "vit_msn": "ViTMSNModel, ViTMSNForImageClassification",
    "ijepa": "IJepaModel, IJepaForImageClassification (the mean of the tokens)",
    "beit": "BeitModel, BeitForImageClassification (relative position bias, per block or shared)",
    "data2vec-vision": "Data2VecVisionModel, Data2VecVisionForImageClassification (BEiT's layout)",
    "dinov2": "Dinov2Model (Dinov2ForImageClassification's classifier of [class token, mean patch token] refused; "
              "strict=False loads its backbone)",
    "dinov2_with_registers": "Dinov2WithRegistersModel",
    "dinov3_vit": "DINOv3ViTModel, DINOv3ViTBackbone's weights",
    "aimv2_vision_model": "Aimv2VisionModel (the native-resolution tower refused)",
    "aimv2": "Aimv2Model: " + _CLIP_LIKE.format("AIMv2"),
    "siglip_vision_model": "SiglipVisionModel",
    "siglip": "SiglipModel (the image tower), SiglipForImageClassification",
    "siglip2_vision_model": "Siglip2VisionModel (NaFlex)",
    "siglip2": "Siglip2Model (the image tower; Siglip2ForImageClassification refused)",
    "clip_vision_model": "CLIPVisionModel, CLIPVisionModelWithProjection",
    "clip": "CLIPModel: " + _CLIP_LIKE.format("CLIP") + "; CLIPForImageClassification",
    "metaclip_2_vision_model": "MetaClip2VisionModel, MetaClip2VisionModelWithProjection (CLIP's layout)",
    "metaclip_2": "MetaClip2Model: " + _CLIP_LIKE.format("MetaCLIP 2"),
    "altclip_vision_model": "AltCLIPVisionModel (CLIP's layout)",
    "altclip": "AltCLIPModel: " + _CLIP_LIKE.format("AltCLIP"),
    "chinese_clip_vision_model": "ChineseCLIPVisionModel (CLIP's layout)",
    "chinese_clip": "ChineseCLIPModel: " + _CLIP_LIKE.format("Chinese-CLIP"),
    "clipseg_vision_model": "CLIPSegVisionModel (CLIP's layout)",
    "clipseg": "CLIPSegModel: " + _CLIP_LIKE.format("CLIPSeg") + " (CLIPSegForImageSegmentation's decoder refused)",
    "swin": "SwinModel, SwinForImageClassification",
}
_CNN = "a convolutional network, not a ViT"
_STAGED = "a hierarchical transformer (stages of different widths), not a plain ViT"
_DETR = "a DETR detector: a CNN backbone and an encoder-decoder over its features"
_VIDEO = "a video transformer (tubelets, time)"
_VLM = "a vision-language model; its image tower is not one of the model_types vitkit reads"
# model_type -> what it is: the reason vitkit's refusal names
REFUSED = {
    "bit": "BiT in transformers' names: vitkit reads BiT's own .npz and timm's resnetv2 files",
    "convnext": _CNN, "convnextv2": _CNN, "dinov3_convnext": _CNN, "efficientnet": _CNN, "hgnet_v2": _CNN,
    "mobilenet_v1": _CNN, "mobilenet_v2": _CNN, "pp_lcnet": _CNN, "regnet": _CNN, "resnet": _CNN, "textnet": _CNN,
    "poolformer": "PoolFormer: pooling in place of attention, in stages",
    "swiftformer": "SwiftFormer: a convolutional hybrid in stages",
    "cvt": _STAGED, "dinat": _STAGED, "focalnet": _STAGED, "glpn": _STAGED, "levit": _STAGED, "pvt": _STAGED,
    "pvt_v2": _STAGED, "segformer": _STAGED, "mobilevit": _STAGED, "mobilevitv2": _STAGED,
    "hiera": "Hiera: a hierarchical ViT with mask-unit attention",
    "swinv2": "Swin V2: scaled cosine attention and a continuous position bias; vitkit reads Swin (V1)",
    "donut-swin": "Donut's Swin encoder (its own layout); vitkit reads transformers' Swin",
    "swin2sr": "Swin2SR: an image super-resolution network",
    "conditional_detr": _DETR, "dab-detr": _DETR, "deformable_detr": _DETR, "detr": _DETR, "table-transformer": _DETR,
    "yolos": "YOLOS: a ViT with detection tokens and heads",
    "vitdet": "ViTDet: windowed attention with decomposed relative positions (a detection backbone)",
    "dpt": "DPT: a dense-prediction network around a ViT",
    "depth_pro": "Depth Pro: multi-scale ViT encoders for depth",
    "pixio": "Pixio: several class tokens (n_cls_tokens)",
    "timesformer": _VIDEO, "videomae": _VIDEO, "vivit": _VIDEO, "videoprism": _VIDEO,
    "videoprism_vision_model": _VIDEO,
    "imagegpt": "ImageGPT: an autoregressive transformer over colour clusters",
    "perceiver": "Perceiver: cross-attention to a latent array",
    "align": "ALIGN: an EfficientNet image tower", "align_vision_model": "ALIGN: an EfficientNet image tower",
    "blip": "BLIP: its ViT in its own layout (fused qkv)", "blip_vision_model": "BLIP: its ViT in its own layout (fused qkv)",
    "blip-2": "BLIP-2: its ViT in its own layout and a Q-Former",
    "blip_2_vision_model": "BLIP-2: its ViT in its own layout (fused qkv)",
    "mlcd": "MLCD: 2-D rotary embeddings and a class token's own position", "mlcd_vision_model":
        "MLCD: 2-D rotary embeddings and a class token's own position",
    "tipsv2": "TIPSv2 in transformers' names: vitkit reads timm's TIPSv2",
    "tipsv2_vision_model": "TIPSv2 in transformers' names: vitkit reads timm's TIPSv2",
    "timm_wrapper": "a timm model wrapped by transformers: load the timm model's own hub folder or state dict",
    "timm_backbone": "a timm model wrapped by transformers: load the timm model's own hub folder or state dict",
    "cohere2_vision": _VLM, "llama4": _VLM, "mllama": _VLM, "shieldgemma2": _VLM,
}


def support(model_type: str) -> tuple[bool, str]:
    """(True, the classes vitkit reads) or (False, why it refuses the model_type)."""
    if model_type in READS:
        return True, READS[model_type]
    return False, REFUSED.get(model_type, "not a ViT family vitkit knows")


def table(w, hf_config: dict | None = None) -> tuple[Layout, frozenset[str], dict]:
    """The layout table these tensors are read by, its variant flags and what its reshapes need (none here)."""
    return LAYOUTS[family(w, hf_config)], frozenset(), {}


def to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A transformers ViT-layout model's tensors (and config.json) -> (vitkit state dict, facts, unused keys)."""
    fam = family(w, hf_config)
    layout, variant, ctx = table(w, hf_config)
    sd, unused = read(layout, w, variant, ctx)
    # the pre-training heads (MAE's pixel decoder, BEiT's visual-token head) go last, with a note
    decoder = [k for k in unused if k.startswith("decoder.") or body(layout, k).startswith("lm_head.")]
    unused = [k for k in unused if k not in decoder] + decoder
    if "dist_token" in sd and "head.weight" in sd and "head_dist.weight" not in sd:
        raise CheckpointError("transformers' DeiTForImageClassification classifies the class token alone beside a "
                              "distillation token, which no vitkit head does (vitkit's distilled DeiT averages the two "
                              "tokens' heads: DeiTForImageClassificationWithTeacher)")
    facts: dict = {"act": "gelu", "norm_eps": 1e-12, "pos_resample": "bicubic_noaa"}  # ViTEmbeddings' interpolation
    if fam == "beit":
        facts.update(_beit(sd, sd.pop("rel_pos.table", None), hf_config))
    if decoder:
        what = ("MAE's pixel decoder ({n} tensors, decoder.*) reconstructs masked patches" if fam == "mae" else
                "BEiT's visual-token head ({n} tensors, lm_head.*) predicts masked patches' tokens")
        facts["notes"] = [what.format(n=len(decoder)) + " in pre-training only: left unused; the model is the "
                          "encoder on every patch"]
    if hf_config:
        c = hf_config
        act = c.get("hidden_act", "gelu")
        if act not in _ACT:
            raise CheckpointError(f"unsupported Hugging Face hidden_act {act!r}")
        facts.update(num_heads=c["num_attention_heads"], norm_eps=c.get("layer_norm_eps", 1e-12), act=_ACT[act])
        if fam == "beit" and c.get("layer_scale_init_value", 0) > 0 and "blocks.0.ls1.gamma" in sd:
            facts["init_values"] = c["layer_scale_init_value"]
        if "image_size" in c:
            facts["img_size"] = c["image_size"]
        labels = c.get("id2label") or {}
        names = [labels[str(j)] if str(j) in labels else labels.get(j) for j in range(len(labels))]
        if names and not all(re.fullmatch(r"LABEL_\d+", n or "") for n in names):
            facts["class_names"] = names
    return sd, facts, unused


def _beit(sd: dict[str, torch.Tensor], shared: torch.Tensor | None, hf_config: dict | None = None) -> dict:
    """BEiT's positions: the shared relative table copied into every block; the resampling rule of what it has
    (transformers' `BeitRelativePositionBias`: plain bilinear, also with `interpolate_pos_encoding=True`, whose second
    interpolation of the (T, T) bias to (T, T) is the identity)."""
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    if shared is not None:
        if "blocks.0.attn.rel_pos.table" in sd:
            raise CheckpointError("BEiT with a shared relative position bias and one per block, added together: "
                                  "vitkit's blocks have one table each")
        for i in range(depth):
            sd[f"blocks.{i}.attn.rel_pos.table"] = shared.clone()
    relative = "blocks.0.attn.rel_pos.table" in sd
    if relative and "pos_embed.weight" in sd:
        raise CheckpointError("BEiT with an absolute position embedding beside its relative position bias "
                              "(use_absolute_position_embeddings with a relative bias): vitkit's models have one kind")
    c = hf_config or {}
    size, patch = c.get("image_size"), c.get("patch_size")
    if relative and isinstance(size, (list, tuple)) and isinstance(patch, int) and size[0] // patch != size[1] // patch:
        raise CheckpointError(f"BEiT with a relative position bias at a non-square grid (image_size {list(size)}, "
                              f"patch {patch}): transformers reads its table as a (2 * width - 1) x (2 * height - 1) "
                              f"grid and resamples that to (2 * height - 1) x (2 * width - 1) at every size, its own "
                              f"included (BeitRelativePositionBias), which vitkit does not reproduce; a square "
                              f"image_size loads")
    return {"pos_resample": "bilinear_noaa"} if relative else {}


def from_vitkit(sd: dict[str, torch.Tensor], config) -> tuple[dict[str, torch.Tensor], dict]:
    """vitkit weights -> `ViTForImageClassification`'s (ViT's table read backwards) and its config.json, or a
    CheckpointError naming what that class cannot hold."""
    c = config
    if c.distilled or c.mpp:
        raise CheckpointError("HF ViTForImageClassification has no distillation token or masked-patch head (HF's DeiT is "
                              "another model type); export to vitkit or timm")
    if c.classifier != "token" or c.pos_embed != "learned_1d" or c.representation_size or c.hybrid_layers is not None:
        raise CheckpointError("HF ViTForImageClassification holds a class-token ViT with a learned 1-D position "
                              "embedding and no pre-logits layer or hybrid ResNet; export to vitkit or npz instead")
    if not (c.patch_bias and c.proj_bias and c.final_norm):
        raise CheckpointError("HF ViTForImageClassification has biases on the patch embedding and every projection and a "
                              "LayerNorm after the blocks; export to vitkit or timm instead")
    out, _ = write(LAYOUTS["vit"], sd)  # what the table does not write, the read-back check names
    names = c.class_names or [f"LABEL_{j}" for j in range(c.num_classes)]
    hf_config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": c.embed_dim, "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads,
        "intermediate_size": c.mlp_dim, "hidden_act": "gelu" if c.act == "gelu" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "initializer_range": 0.02,
        "layer_norm_eps": c.norm_eps, "image_size": _int_or_pair(c.img_size), "patch_size": _int_or_pair(c.patch_size),
        "num_channels": c.in_chans, "qkv_bias": c.qkv_bias, "encoder_stride": c.patch_size[0],
        "id2label": {str(j): n for j, n in enumerate(names)}, "label2id": {n: j for j, n in enumerate(names)},
    }
    return out, hf_config


# PIL's resampling codes, as transformers' image processors store them
_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}
PREPROCESSOR_FILE = "preprocessor_config.json"


def preprocessor_config(c) -> dict:
    """The checkpoint's evaluation preprocessing as a transformers image processor reads it: ViTImageProcessor
    (resize to the model's size) when crop_pct is 1, else DeiTImageProcessor (resize to size / crop_pct, centre
    crop to size), the same as vitkit's shorter-side resize and crop for square images. Mean, std and the
    resampling filter are kept as they are."""
    h, w = c.img_size
    d = {"do_resize": True, "resample": _RESAMPLE.get(c.interpolation, 2), "do_rescale": True,
         "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(c.mean), "image_std": list(c.std)}
    if c.crop_pct >= 1.0:
        return {"image_processor_type": "ViTImageProcessor", "size": {"height": h, "width": w}, **d}
    # floor, as vitkit's (and timm's) evaluation resize: the same pixels for square images
    return {"image_processor_type": "DeiTImageProcessor",
            "size": {"height": math.floor(h / c.crop_pct), "width": math.floor(w / c.crop_pct)},
            "do_center_crop": True, "crop_size": {"height": h, "width": w}, **d}


def preprocessing_facts(pre: dict) -> dict:
    """mean, std, interpolation and crop_pct from a transformers preprocessor_config.json ({} for an empty one)."""
    facts: dict = {}
    if pre.get("do_normalize", True) and "image_mean" in pre and "image_std" in pre:
        facts["mean"], facts["std"] = tuple(float(v) for v in pre["image_mean"]), tuple(float(v) for v in pre["image_std"])
    codes = {v: k for k, v in _RESAMPLE.items()}
    if pre.get("resample") in codes:
        facts["interpolation"] = codes[pre["resample"]]
    size, crop = pre.get("size") or {}, pre.get("crop_size") or {}
    resize_to = size.get("height") or size.get("shortest_edge")
    if pre.get("do_center_crop") and resize_to and crop.get("height"):
        facts["crop_pct"] = _crop_pct(crop["height"], resize_to)
    elif pre.get("do_resize", True) and (size.get("height") or size.get("shortest_edge")):
        facts["crop_pct"] = 1.0  # resized to the model's size, nothing cropped
    return facts


def _crop_pct(crop: int, size: int) -> float:
    """The shortest decimal p with floor(crop / p) == size (vitkit's resize of a crop_pct): 0.875 for 224 of 256.
    The file holds the sizes only, so this is the crop_pct whose preprocessing is the same, not always the one
    written (0.875 at 32 px resizes to 36, and reads back as 0.88)."""
    for digits in range(1, 9):
        p = math.floor(crop / size * 10**digits) / 10**digits
        if p > 0 and math.floor(crop / p) == size:
            return p
    return crop / (size + 0.5)


def _int_or_pair(hw: tuple[int, int]) -> int | list[int]:
    return hw[0] if hw[0] == hw[1] else list(hw)
