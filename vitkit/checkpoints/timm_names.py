"""timm's model names as vitkit's: every architecture of timm's ViT modules (`timm_archs.json`), built from its
registered constructor arguments (`timm.arch_config`, the translation a timm folder's config.json is read with), the
user's keywords over them as timm takes them; the others refused by name and reason (`timm_table` lists them)."""
from __future__ import annotations

import difflib
import functools
import json
import re

from ..errors import UsageError
from ..models.registry import list_models
from . import timm, timm_relpos, timm_sam
from .io import CheckpointError

# timm's constructor arguments that shape the model, per model class: passed as timm passes them (`model_args`, over
# the registered ones). The rest (drop rates, weight_init, exportable, ...) and vitkit's own config fields are create_
# model's keywords (`create.translate_create_kwargs`).
_VIT_ARGS = {"img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "mlp_ratio", "qkv_bias", "qk_norm", "scale_attn_norm", "scale_mlp_norm", "proj_bias", "init_values",
             "class_token", "pos_embed", "no_embed_class", "reg_tokens", "pre_norm", "final_norm", "fc_norm",
             "pool_include_prefix", "dynamic_img_size", "embed_layer", "embed_norm_layer", "norm_layer", "act_layer",
             "block_fn", "mlp_layer", "attn_layer"}
_EVA_ARGS = {"img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
             "num_kv_heads", "qkv_bias", "qkv_fused", "qk_norm", "mlp_ratio", "swiglu_mlp", "swiglu_align_to",
             "scale_mlp", "scale_attn_inner", "attn_type", "norm_layer", "init_values", "attn_only_layer_scale",
             "class_token", "num_reg_tokens", "no_embed_class", "use_abs_pos_emb", "use_rot_pos_emb", "rope_type",
             "rope_grid_offset", "rope_grid_indexing", "rope_temperature", "rope_rotate_half", "rope_mrope_section",
             "use_post_norm", "use_pre_transformer_norm", "use_post_transformer_norm", "use_fc_norm",
             "attn_pool_num_heads", "attn_pool_mlp_ratio", "dynamic_img_size", "ref_feat_shape"}
_NOT_ARCH = {"drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate",
             "weight_init", "fix_init", "dynamic_img_pad", "rope_shift_coords", "rope_jitter_coords",
             "rope_rescale_coords"}
_BEIT_ARGS = {"img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
              "qkv_bias", "mlp_ratio", "swiglu_mlp", "scale_mlp", "norm_layer", "init_values", "use_abs_pos_emb",
              "use_rel_pos_bias", "use_shared_rel_pos_bias", "use_fc_norm"}
_RESNET_ARGS = {"layers", "channels", "in_chans", "num_classes", "width_factor", "stem_chs", "stem_type", "avg_down",
                "preact", "basic", "bottle_ratio", "conv_layer", "norm_layer", "act_layer"}
# vitkit's values of a field timm names the same (vitkit's pos_embed='learned_1d', mlp_layer='swiglu'): vitkit's
_VITKIT_VALUES = {"pos_embed": ("learned_1d", "learned_2d", "sincos_2d", "relative"), "mlp_layer": ("mlp", "swiglu")}

# timm's architectures of its ViT modules that vitkit refuses, by family: the translation refuses each (a
# CheckpointError naming the argument or the model class); this names the family for the message and the table.
REFUSED_FAMILIES = [
    (r"^naflexvit_.*_parfac", "NaFlexVit with factorized positions (a row and a column table, summed)"),
    (r"^resnetv2_\d+(d|t|d_\w+)?$", "ResNetV2 other than BiT: BatchNorm, EvoNorm, FRN, deep or tiered stems"),
    (r"_(xp|pwee)_", "parallel attention and MLP (ParallelScalingBlock)"),
    (r"_18x2_", "two parallel blocks per layer (ParallelThingsBlock)"),
    (r"_dpwee_", "parallel attention and MLP with differential attention (DiffParallelScalingBlock)"),
    (r"_resnet\d+d", "hybrids on a ResNet-D (vitkit's hybrids have BiT's ResNetV2)"),
]
# timm's ViT-like families outside the modules vitkit reads: refused by name, with what they add
OTHER_FAMILIES = [
    (r"^cait_", "CaiT: class-attention layers and talking heads"),
    (r"^xcit_", "XCiT: cross-covariance attention"),
    (r"^levit_", "LeViT: a convolutional stem and attention biases"),
    (r"^swinv2_", "Swin V2: scaled cosine attention and continuous relative positions (vitkit has Swin V1)"),
    (r"^swin_", "Swin V1 at a size vitkit does not register (vitkit: swin_{tiny,small,base,large}_patch4_window7_224, "
                "swin_{base,large}_patch4_window12_384)"),
    (r"^crossvit_", "CrossViT: two branches at two patch sizes"),
    (r"^pit_", "PiT: pooling layers between stages"),
    (r"^tnt_", "TNT: transformers inside the patches"),
    (r"^twins_", "Twins: locally grouped and sub-sampled attention"),
    (r"^pvt_v2", "PVT v2: spatial-reduction attention"),
    (r"^mvitv2_", "MViTv2: pooling attention"),
    (r"^convit_", "ConViT: gated positional self-attention"),
    (r"^volo_", "VOLO: outlook attention"),
    (r"^hiera", "Hiera: hierarchical mask-unit attention"),
    (r"^vitamin_", "ViTamin: convolutional stages before the transformer"),
    (r"^(efficientvit|fastvit|mobilevit|mobilevitv2)_", "a convolution-attention hybrid for mobile"),
]


@functools.lru_cache(maxsize=1)
def deprecated() -> dict[str, str]:
    """timm's old names of these modules -> today's, with the tag ("vit_base_patch16_224_in21k" ->
    "vit_base_patch16_224.augreg_in21k"), which timm.create_model still takes (with a warning)."""
    return json.loads(timm.ARCHS_FILE.read_text()).get("deprecated", {})


def split(name: str) -> tuple[str, str | None] | None:
    """(architecture, tag) of a timm name vitkit's table knows ("vit_base_patch16_224.augreg_in21k", or an old name
    timm maps to one), or None."""
    archs = timm.registered_archs()
    arch, _, tag = deprecated().get(name, name).partition(".")
    if arch not in archs:
        return None
    if tag and tag not in archs[arch].get("built", {}).get("tags", {}):
        tags = ", ".join(archs[arch].get("built", {}).get("tags", {})) or "none"
        raise UsageError(f"timm has no pretrained tag {tag!r} for {arch} (its tags: {tags})")
    return arch, tag or None


def hub_repo(name: str) -> str | None:
    """The Hugging Face hub repository timm loads `name`'s pretrained weights from (`pretrained=True`): its tag's
    (the default tag's without one), `timm/<architecture>.<tag>`; None where timm has no weights on the hub for it
    (or the name is not timm's); a UsageError where timm keeps them under another architecture's repository (whose
    config.json describes that architecture, not this one)."""
    hit = split(name)
    if hit is None:
        return None
    arch, tag = hit
    built = timm.registered_archs()[arch].get("built", {})
    tag = tag or built.get("default_tag")
    row = built.get("tags", {}).get(tag) if tag else None
    if row is None or row.get("hub") is False:
        return None
    if "hub" in row:
        raise UsageError(f"timm keeps the weights of {arch}.{tag} in {row['hub']}, whose config.json describes another "
                         f"architecture: register it (vitkit.checkpoints.catalog.register_hub({row['hub']!r}, "
                         f"'timm')) and vitkit.load it as that architecture")
    return f"timm/{arch}.{tag}"


def family(arch: str) -> str | None:
    """The refused family an architecture belongs to, in words, or None."""
    return next((why for pat, why in REFUSED_FAMILIES + OTHER_FAMILIES if re.search(pat, arch)), None)


@functools.lru_cache(maxsize=None)
def refusal(arch: str) -> str | None:
    """Why vitkit does not build timm's `arch` as registered (None: it does)."""
    try:
        timm.arch_config(arch)
    except (CheckpointError, UsageError) as e:
        return str(e)
    return None


def _refused(arch: str, reason: str) -> UsageError:
    why = family(arch) or re.sub(rf"^timm's {re.escape(arch)} ", "", reason)
    return UsageError(f"timm's {arch} ({why}) is not one vitkit implements. `vitkit models --timm` lists the timm "
                      f"names vitkit builds")


def split_kwargs(arch: str, kwargs: dict) -> tuple[dict, dict]:
    """(timm's constructor arguments, the rest) of create_model's keywords for timm's `arch`."""
    cls = timm.cls_of(arch)
    names = (_RESNET_ARGS if cls == "ResNetV2" else _EVA_ARGS if cls == "Eva" else _BEIT_ARGS if cls == "Beit" else
             timm_relpos.NAMES if cls == "VisionTransformerRelPos" else
             timm_sam.ARGS if cls == "VisionTransformerSAM" else
             (set(timm.registered_archs()[arch]["kwargs"]) | {"img_size", "in_chans", "num_classes"}) - _NOT_ARCH
             if cls == "NaFlexVit" else _VIT_ARGS)
    model_args, rest = {}, {}
    for k, v in kwargs.items():
        vitkit_value = k in _VITKIT_VALUES and v in _VITKIT_VALUES[k]
        (model_args if k in names and not vitkit_value else rest)[k] = v
    return model_args, rest


def config_fields(name: str, model_args: dict | None = None) -> tuple[str, dict]:
    """("vit" or "resnetv2", vitkit config fields) of timm's `name` (a tag selects the classes and preprocessing
    its weights have, as in timm) built with `model_args`, or a UsageError naming why vitkit does not build it (a
    refused name by its family, unless the keywords change what vitkit lacks)."""
    arch, tag = split(name) or (None, None)
    if arch is None:
        raise unknown(name)
    try:
        return timm.arch_config(arch, model_args, tag)
    except (CheckpointError, UsageError) as e:
        reason = refusal(arch)
        if reason:
            raise _refused(arch, reason) from e
        asked = ", ".join(f"{k}={v!r}" for k, v in (model_args or {}).items())
        raise UsageError(f"{e} (asked for with {asked})") from e


def unknown(name: str) -> UsageError:
    """The error for a name neither vitkit nor its table of timm's names knows: a timm family vitkit does not
    implement by its reason, else the nearest names."""
    why = next((w for pat, w in OTHER_FAMILIES if re.search(pat, name)), None)
    if why:
        return UsageError(f"timm's {name} ({why}) is not one vitkit implements. `vitkit models --timm` lists the "
                          f"timm names vitkit builds")
    near = difflib.get_close_matches(name, list_models() + sorted(timm.registered_archs()), n=3, cutoff=0.7)
    return UsageError(f"unknown model {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else "")
                      + "; `vitkit models` lists vitkit's names, `vitkit models --timm` timm's")
