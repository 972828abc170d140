"""timm checkpoints <-> vitkit names: vision_transformer, vision_transformer_hybrid and resnetv2 (BiT).

Two containers:
- a state dict (`.safetensors`, `.pth`): tensors only. The architecture is what the tensors show plus timm's
  defaults (exact GELU, LayerNorm eps 1e-6, the head count of the standard width, the class token as the
  classifier unless an `fc_norm` says 'avg'); whoever loads it names the rest.
- a timm hub folder (`config.json` + `model.safetensors`, as `timm.models.push_to_hf_hub` writes and
  `timm.create_model("local-dir:PATH", pretrained=True)` reads): `architecture`, `model_args` (the constructor
  arguments that differ from the architecture's) and `pretrained_cfg` (preprocessing), so nothing is guessed.

vitkit's module names follow timm's, so most keys map one to one; the differences are the position embedding
(`pos_embed` is a module here: `pos_embed.weight`), BiT's 1x1-conv head (a Linear here) and the stem-only
hybrid (timm's backbone *is* the stem there: `patch_embed.backbone.conv`, `.norm`).
"""
from __future__ import annotations

import torch

from ..models.resnet import backbone_stride
from .io import CheckpointError

# timm ViT keys vitkit has no counterpart for (features it does not implement).
_UNSUPPORTED = ("reg_token", "attn.q_norm", "attn.k_norm", "ls1.gamma", "ls2.gamma", "attn_pool", "norm_pre")

# timm's hybrid ResNet (StdConv2dSame, GroupNormAct): weight standardisation eps 1e-8 on the variance, GN eps 1e-5.
TIMM_HYBRID_NUMERICS = dict(hybrid_ws_eps=1e-8, hybrid_ws_eps_mode="var", hybrid_gn_eps=1e-5)
# The registered timm hybrids whose backbone (ResNet stages, width 1) a vitkit hybrid can be built as.
TIMM_HYBRID_ARCHS = {(): "vit_tiny_r_s16_p8_224", (2, 2, 2, 2): "vit_small_r26_s32_224",
                     (3, 4, 9): "vit_base_r50_s16_224", (3, 4, 6, 3): "vit_large_r50_s32_224"}
# timm's BiT models: (layers, width factor) -> name.
TIMM_BIT_ARCHS = {((3, 4, 6, 3), 1): "resnetv2_50x1_bit", ((3, 4, 6, 3), 3): "resnetv2_50x3_bit",
                  ((3, 4, 23, 3), 1): "resnetv2_101x1_bit", ((3, 4, 23, 3), 3): "resnetv2_101x3_bit",
                  ((3, 8, 36, 3), 2): "resnetv2_152x2_bit", ((3, 8, 36, 3), 4): "resnetv2_152x4_bit"}
_TIMM_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh"}
_STEM_ONLY = {"patch_embed.backbone.conv.": "patch_embed.backbone.stem.conv.",
              "patch_embed.backbone.norm.": "patch_embed.backbone.stem.norm."}


def is_timm_vit(keys) -> bool:
    return "patch_embed.proj.weight" in keys and any(k.startswith("blocks.0.") for k in keys)


def is_timm_resnetv2(keys) -> bool:
    return "stem.conv.weight" in keys and any(k.startswith("stages.0.blocks.0.") for k in keys)


def is_timm_folder(hub_config: dict) -> bool:
    return "architecture" in hub_config


def vit_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    bad = sorted(k for k in w if any(u in k for u in _UNSUPPORTED))
    if bad:
        raise CheckpointError(f"this timm ViT uses features vitkit does not implement; offending keys: {bad[:8]}")
    sd, unused = {}, []
    for k, v in w.items():
        stem = next((p for p in _STEM_ONLY if k.startswith(p)), None)
        if k == "pos_embed":
            sd["pos_embed.weight"] = v
        elif stem:
            sd[_STEM_ONLY[stem] + k[len(stem):]] = v
        elif k.startswith("head.") and v.ndim == 2 and v.shape[0] == 0:
            unused.append(k)
        else:
            sd[k] = v
    facts: dict = {"act": "gelu", "norm_eps": 1e-6}
    if "patch_embed.backbone.stem.conv.weight" in sd:
        facts.update(TIMM_HYBRID_NUMERICS)
    return sd, facts, unused


def vit_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    if config.pos_embed != "learned_1d":
        raise CheckpointError(f"timm's ViT holds a learned 1-D position embedding, not {config.pos_embed!r}")
    if config.representation_size:
        raise CheckpointError("timm's ViT has no pre-logits layer (representation_size); export to vitkit or npz")
    if config.mpp:
        raise CheckpointError("timm has no masked-patch-prediction head: call model.drop_mpp() first, or export to vitkit")
    out = {}
    for k, v in sd.items():
        if k == "pos_embed.weight":
            k = "pos_embed"
        elif config.hybrid_layers == () and k.startswith("patch_embed.backbone.stem."):
            k = "patch_embed.backbone." + k[len("patch_embed.backbone.stem."):]  # timm's stem-only backbone
        out[k] = v
    return out


def resnetv2_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    sd = {}
    for k, v in w.items():
        if k == "head.fc.weight":
            sd["head.weight"] = v.flatten(1)  # (C, F, 1, 1) 1x1 conv -> (C, F) Linear
        elif k == "head.fc.bias":
            sd["head.bias"] = v
        else:
            sd[k] = v
    return sd, {}, []


def resnetv2_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k == "head.weight":
            out["head.fc.weight"] = v[:, :, None, None]
        elif k == "head.bias":
            out["head.fc.bias"] = v
        else:
            out[k] = v
    return out


# ---- timm hub folders: config.json ------------------------------------------------------------------------

def _pretrained_cfg(c) -> dict:
    """timm's preprocessing record for a vitkit config."""
    return {"input_size": [c.in_chans, *c.img_size], "fixed_input_size": c.arch == "vit", "interpolation": c.interpolation,
            "crop_pct": c.crop_pct, "crop_mode": "center", "mean": list(c.mean), "std": list(c.std),
            "num_classes": c.num_classes}


def folder_config(c) -> dict:
    """The config.json of a timm hub folder holding a vitkit model, or a CheckpointError naming what timm's
    constructors cannot express."""
    cfg: dict = {"num_classes": c.num_classes}
    if c.class_names:
        cfg["label_names"] = list(c.class_names)
    if c.arch != "vit":
        arch = TIMM_BIT_ARCHS.get((tuple(c.layers), c.width_factor))
        standard = tuple(x * c.width_factor for x in (256, 512, 1024, 2048))
        if arch is None or tuple(c.channels) != standard or c.stem_width != 64 * c.width_factor:
            raise CheckpointError(f"timm registers the BiT models {sorted(TIMM_BIT_ARCHS.values())} only, not layers "
                                  f"{tuple(c.layers)}, channels {tuple(c.channels)}: export a timm state dict (a "
                                  f".safetensors file) and build the model by hand")
        cfg.update(architecture=arch, num_features=c.channels[-1], global_pool="avg", model_args={"in_chans": c.in_chans})
        cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": "stem.conv", "classifier": "head.fc"}
        return cfg
    if c.act not in _TIMM_ACTS:
        raise CheckpointError(f"timm's ViT has no activation {c.act!r}")
    mlp_ratio = c.mlp_dim / c.embed_dim
    args: dict = {"img_size": list(c.img_size), "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads,
                  "mlp_ratio": mlp_ratio, "qkv_bias": c.qkv_bias, "class_token": c.class_token, "in_chans": c.in_chans,
                  "global_pool": "token" if c.classifier == "token" else "avg", "act_layer": _TIMM_ACTS[c.act]}
    if c.classifier == "gap":
        args["fc_norm"] = c.fc_norm
    first_conv = "patch_embed.proj"
    if c.distilled and c.hybrid_layers is not None:
        raise CheckpointError("timm registers no distilled hybrid")
    if c.hybrid_layers is None:
        arch = "deit_base_distilled_patch16_224" if c.distilled else "vit_base_patch16_224"
        args["patch_size"] = list(c.patch_size)
    else:
        arch = TIMM_HYBRID_ARCHS.get(tuple(c.hybrid_layers))
        if arch is None or c.hybrid_width != 1:
            raise CheckpointError(f"timm registers hybrids with the ResNet stages {sorted(TIMM_HYBRID_ARCHS)} at width 1 "
                                  f"only, not {tuple(c.hybrid_layers)} at width {c.hybrid_width}: export a timm state "
                                  f"dict (a .safetensors file) and build the backbone by hand")
        stride = backbone_stride(c.hybrid_layers)
        args["patch_size"] = [p // stride for p in c.patch_size]  # timm's embedding kernel on the feature map
        first_conv = "patch_embed.backbone.conv" if c.hybrid_layers == () else "patch_embed.backbone.stem.conv"
    cfg.update(architecture=arch, num_features=c.embed_dim, global_pool=args["global_pool"], model_args=args)
    cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": first_conv, "classifier": "head"}
    return cfg


def folder_facts(cfg: dict) -> dict:
    """vitkit config facts from a timm hub config.json (what the tensors cannot tell)."""
    args = cfg.get("model_args") or {}
    pre = cfg.get("pretrained_cfg") or {}
    facts: dict = {}
    for key in ("mean", "std", "interpolation", "crop_pct"):
        if key in pre:
            facts[key] = tuple(pre[key]) if key in ("mean", "std") else pre[key]
    labels = cfg.get("label_names") or pre.get("label_names")
    if isinstance(labels, list):
        facts["class_names"] = [str(x) for x in labels]
    elif isinstance(labels, dict):
        facts["class_names"] = [str(labels[k]) for k in sorted(labels, key=int)]
    arch = cfg["architecture"]
    if arch.startswith("resnetv2"):
        if "input_size" in pre:
            facts["img_size"] = tuple(pre["input_size"][1:])
        return facts
    act = args.get("act_layer", "gelu")
    if act not in _TIMM_ACTS:
        raise CheckpointError(f"timm's config.json asks for act_layer {act!r}, which vitkit does not implement")
    facts["act"] = _TIMM_ACTS[act]
    if "num_heads" in args:
        facts["num_heads"] = args["num_heads"]
    pool = args.get("global_pool", cfg.get("global_pool", "token"))
    if pool not in ("token", "avg"):
        raise CheckpointError(f"timm's config.json asks for global_pool {pool!r}; vitkit pools by 'token' or 'avg'")
    facts["classifier"] = "token" if pool == "token" else "gap"
    if "img_size" in args:
        facts["img_size"] = args["img_size"]
    elif "input_size" in pre:
        facts["img_size"] = tuple(pre["input_size"][1:])
    for key in ("norm_layer", "embed_layer", "block_fn", "mlp_layer"):
        if args.get(key) is not None:
            raise CheckpointError(f"timm's config.json sets {key}={args[key]!r}, which vitkit does not implement")
    unsupported = {"pre_norm": False, "no_embed_class": False, "reg_tokens": 0, "qk_norm": False, "init_values": None,
                   "dynamic_img_size": False, "use_naflex": False}
    for key, default in unsupported.items():
        if args.get(key, default) != default:
            raise CheckpointError(f"timm's config.json sets {key}={args[key]!r}, which vitkit does not implement")
    return facts
