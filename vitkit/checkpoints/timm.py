"""timm checkpoints <-> vitkit names: vision_transformer (with DeiT-III, DINOv2, SigLIP, CLIP), eva (EVA-02),
vision_transformer_hybrid and resnetv2 (BiT); and DINOv2's own release state dicts, which timm converts the same way.

Two containers:
- a state dict (`.safetensors`, `.pth`): tensors only. The architecture is what the tensors show plus timm's
  defaults (exact GELU, LayerNorm eps 1e-6, the head count of the standard width, the class token as the
  classifier unless an `fc_norm` says 'avg'); whoever loads it names the rest.
- a timm hub folder (`config.json` + `model.safetensors`, as `timm.models.push_to_hf_hub` writes and
  `timm.create_model("local-dir:PATH", pretrained=True)` reads): `architecture`, `model_args` (the constructor
  arguments that differ from the architecture's) and `pretrained_cfg` (preprocessing), so nothing is guessed.

vitkit's module names follow timm's, so most keys map one to one; the differences are the position embedding
(`pos_embed` is a module here: `pos_embed.weight`), BiT's 1x1-conv head (a Linear here) and the stem-only
hybrid (timm's backbone *is* the stem there: `patch_embed.backbone.conv`, `.norm`) and MobileCLIP's conv stem (timm's
last `patch_embed.backbone.{n}.conv` is vitkit's `patch_embed.proj`). timm's `Eva` (EVA-02) names
LayerScale `gamma_1`/`gamma_2`, keeps the query and value biases apart (`q_bias`, `v_bias`; the key has none) or the
three projections apart (`q_proj`, `k_proj`, `v_proj`), and packs SwiGLU's two input projections into one `mlp.fc1`
(gate rows first) unless the MLP has a norm. DINOv2's release names the registers `register_tokens`, keeps the
class token's position in `pos_embed[:, 0]` and a `mask_token`, and packs SwiGLU as `mlp.w12`/`mlp.w3`.

Neither a state dict nor timm's config.json names EVA-02's rotary embedding (a buffer, not saved): every `eva02_*`
model timm registers has it, with the 16x16 reference grid, so an EVA-style file with a SwiGLU MLP gets it too.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import torch

from ..models.resnet import backbone_stride
from ..safety import SIZE_BOUNDS
from . import timm_beit, timm_relpos, timm_sam
from .io import CheckpointError, expect_shape, fuse
import difflib

# timm's hybrid ResNet (StdConv2dSame, GroupNormAct): weight standardisation eps 1e-8 on the variance, GN eps 1e-5.
TIMM_HYBRID_NUMERICS = dict(hybrid_ws_eps=1e-8, hybrid_ws_eps_mode="var", hybrid_gn_eps=1e-5)
# The registered timm hybrids whose backbone (ResNet stages, width 1) a vitkit hybrid can be built as.
TIMM_HYBRID_ARCHS = {(): "vit_tiny_r_s16_p8_224", (2, 2, 2, 2): "vit_small_r26_s32_224",
                     (3, 4, 9): "vit_base_r50_s16_224", (3, 4, 6, 3): "vit_large_r50_s32_224"}
# timm's BiT models: (layers, width factor) -> name.
TIMM_BIT_ARCHS = {((3, 4, 6, 3), 1): "resnetv2_50x1_bit", ((3, 4, 6, 3), 3): "resnetv2_50x3_bit",
                  ((3, 4, 23, 3), 1): "resnetv2_101x1_bit", ((3, 4, 23, 3), 3): "resnetv2_101x3_bit",
                  ((3, 8, 36, 3), 2): "resnetv2_152x2_bit", ((3, 8, 36, 3), 4): "resnetv2_152x4_bit"}
_TIMM_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_STEM_ONLY = {"patch_embed.backbone.conv.": "patch_embed.backbone.stem.conv.",
              "patch_embed.backbone.norm.": "patch_embed.backbone.stem.norm."}


def is_timm_vit(keys) -> bool:
    embed = "patch_embed.proj.weight" in keys or CONV_STEM_FIRST in keys  # MCi: the stem's last conv embeds
    return embed and any(k.startswith("blocks.0.") for k in keys)


# timm's ConvStem (MobileCLIP's MCi, `vit_base_mci_224`): `patch_embed.backbone.{i}.conv` / `.bn` layers, the last a
# conv with a bias and no norm that embeds the patches (HybridEmbed with proj=False: no `patch_embed.proj`); vitkit's
# `conv_stem` has the same names, its last conv as `patch_embed.proj`.
CONV_STEM_FIRST = "patch_embed.backbone.0.conv.weight"
_CONV_STEM_KEY = re.compile(r"patch_embed\.backbone\.(\d+)\.(conv|bn)\.")
# The conv stems timm registers, by architecture (its entry point builds them; timm_archs.json names the module only):
# the conv + BatchNorm + GELU layers' channels and kernels (= strides, padding 0), and the embedding's kernel.
TIMM_CONV_STEMS = {"vit_base_mci_224": {"conv_stem": (192, 192), "conv_stem_kernels": (4, 2), "embed_kernel": 2}}


def conv_stem_to_vitkit(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's ConvStem names -> vitkit's: its last conv (no norm after it) is vitkit's `patch_embed.proj`; the
    conv + BatchNorm layers (running statistics and `num_batches_tracked` too) keep their names. A BatchNorm without
    its `num_batches_tracked` gets 0, torch's own rule for such a state dict (a counter: with momentum 0.1 it changes
    no output). Other files as they are."""
    if CONV_STEM_FIRST not in w:
        return w
    w = dict(w)
    for k in [k for k in w if _CONV_STEM_KEY.match(k) and k.endswith(".bn.running_mean")]:
        w.setdefault(k[: -len("running_mean")] + "num_batches_tracked", torch.tensor(0))
    if "patch_embed.proj.weight" in w:
        return w
    layers = sorted({int(m.group(1)) for k in w if (m := _CONV_STEM_KEY.match(k))})
    last = layers[-1]
    if layers != list(range(last + 1)) or any(k.startswith(f"patch_embed.backbone.{last}.bn.") for k in w):
        raise CheckpointError(f"timm conv stem layers {layers}: vitkit reads conv + BatchNorm layers 0.. and a last "
                              f"conv without a norm (MobileCLIP's MCi)")
    head = f"patch_embed.backbone.{last}.conv."
    return {("patch_embed.proj." + k[len(head):] if k.startswith(head) else k): v for k, v in w.items()}


def conv_stem_from_vitkit(out: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """vitkit's conv stem -> timm's ConvStem names (the inverse of `conv_stem_to_vitkit`)."""
    if getattr(config, "conv_stem", None) is None:
        return out
    head = f"patch_embed.backbone.{len(config.conv_stem)}.conv."
    return {(head + k[len("patch_embed.proj."):] if k.startswith("patch_embed.proj.") else k): v
            for k, v in out.items()}


def is_timm_naflex(keys) -> bool:
    """timm's `NaFlexVit` (`naflexvit_*`): the patch embedding, tokens and position grid under `embeds.`."""
    return "embeds.proj.weight" in keys and any(k.startswith("blocks.0.") for k in keys)


# timm's NaFlexVit resamples its position grid with antialiased bicubic (the SigLIP ones: antialiased bilinear),
# corners not aligned; the `par` ones resample to a square and crop (aspect preserving).
NAFLEX_FACTS = {"no_embed_class": True, "naflex": True, "pos_resample": "bicubic", "dynamic_img_size": True}


def naflex_to_vitkit(w: dict[str, torch.Tensor], in_chans: int = 3) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A timm NaFlexVit state dict -> vitkit names: `embeds.proj` (a Linear over (ph, pw, C) patches) becomes the
    patch conv, `embeds.pos_embed` (1, gh, gw, D) the learned grid over the patches alone; the rest is timm's ViT."""
    classic = {}
    for k, v in w.items():
        if k == "embeds.proj.weight" and v.ndim == 2:
            p = round((v.shape[1] / in_chans) ** 0.5)
            if p * p * in_chans != v.shape[1]:
                raise CheckpointError(f"timm NaFlexVit patch embedding of {v.shape[1]} inputs is not P x P x "
                                      f"{in_chans} (pass in_chans=... for another channel count)")
            v = v.reshape(v.shape[0], p, p, in_chans).permute(0, 3, 1, 2)  # (D, ph*pw*C) -> (D, C, ph, pw)
            classic["patch_embed.proj.weight"] = v
        elif k.startswith("embeds.proj."):
            classic["patch_embed.proj." + k[len("embeds.proj."):]] = v
        elif k == "embeds.pos_embed":
            if v.ndim != 4:
                raise CheckpointError(f"timm NaFlexVit position embedding of shape {tuple(v.shape)}: vitkit reads the "
                                      f"learned grid (1, gh, gw, D), not factorized ones")
            classic["pos_embed"] = v.flatten(1, 2)  # (1, gh, gw, D) -> (1, gh * gw, D)
        elif k in ("embeds.cls_token", "embeds.reg_token"):
            classic[k[len("embeds."):]] = v
        elif k.startswith("embeds."):
            raise CheckpointError(f"timm NaFlexVit key {k!r} (an embedding option vitkit does not implement)")
        else:
            classic[k] = v
    sd, facts, unused = vit_to_vitkit(classic)
    return sd, {**facts, **NAFLEX_FACTS}, unused


def naflex_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """vitkit weights -> timm NaFlexVit names (the inverse of `naflex_to_vitkit`)."""
    out = {}
    # (no final norm is a NaFlexVit argument, RADIO's, not an Eva's: timm's ViT names)
    plain = dataclasses.replace(config, final_norm=True) if not config.final_norm else config
    for k, v in vit_from_vitkit(sd, plain).items():
        if k == "patch_embed.proj.weight":
            out["embeds.proj.weight"] = v.permute(0, 2, 3, 1).flatten(1)  # (D, C, ph, pw) -> (D, ph*pw*C)
        elif k.startswith("patch_embed.proj."):
            out["embeds.proj." + k[len("patch_embed.proj."):]] = v
        elif k == "pos_embed":
            gh, gw = config.grid_size
            out["embeds.pos_embed"] = v.reshape(1, gh, gw, -1)
        elif k in ("cls_token", "reg_token"):
            out["embeds." + k] = v
        else:
            out[k] = v
    return out


def is_timm_resnetv2(keys) -> bool:
    return "stem.conv.weight" in keys and any(k.startswith("stages.0.blocks.0.") for k in keys)


def is_timm_folder(hub_config: dict) -> bool:
    return "architecture" in hub_config


# EVA-02, as every `eva02_*` architecture of timm builds it: rotary embeddings on a 16x16 reference grid.
EVA02_ROPE = {"rope": "eva", "rope_ref_grid": (16, 16)}


def _is_eva(keys) -> bool:
    return any(re.match(r"blocks\.\d+\.(gamma_1|attn\.q_bias|attn\.q_proj\.weight)$", k) for k in keys)


def vit_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    if timm_beit.is_timm_beit(w):  # timm's Beit: its relative position tables (`timm_beit.KEYS`)
        return timm_beit.to_vitkit(w)
    if timm_relpos.is_timm_relpos(w):  # timm's ViT-RelPos: its relative position MLPs (`timm_relpos.RULES`)
        return timm_relpos.to_vitkit(w)
    w, facts, unused = dict(conv_stem_to_vitkit(w)), {"act": "gelu", "norm_eps": 1e-6}, []
    if "mask_token" in w:  # DINOv2's release: the masked-image-modelling token, unused by the backbone
        w.pop("mask_token")
        unused.append("mask_token")
    if "register_tokens" in w:  # DINOv2's release with registers: the class token's position folded into the token
        w["reg_token"] = w.pop("register_tokens")
        pe = w.pop("pos_embed")
        w["cls_token"], w["pos_embed"] = w["cls_token"] + pe[:, :1], pe[:, 1:]
        facts["no_embed_class"] = True
    eva = _is_eva(w)
    sd, split = {}, {}
    for k, v in w.items():
        stem = next((p for p in _STEM_ONLY if k.startswith(p)), None)
        m = re.match(r"(blocks\.\d+\.)(.+)$", k)
        if k == "pos_embed":
            sd["pos_embed.weight"] = v
        elif stem:
            sd[_STEM_ONLY[stem] + k[len(stem):]] = v
        elif k.startswith("head.") and v.ndim >= 1 and v.shape[0] == 0:
            unused.append(k)
        elif m and m.group(2) in ("gamma_1", "gamma_2"):
            sd[m.group(1) + ("ls1" if m.group(2) == "gamma_1" else "ls2") + ".gamma"] = v
        elif m and re.match(r"attn\.([qkv]_proj\.(weight|bias)|[qv]_bias)$", m.group(2)):
            split[(m.group(1), m.group(2))] = v
        elif m and m.group(2).startswith("mlp.w12."):
            sd[k.replace("mlp.w12.", "mlp.fc1.")] = v
        elif m and m.group(2).startswith("mlp.w3."):
            sd[k.replace("mlp.w3.", "mlp.fc2.")] = v
        else:
            sd[k] = v
    for blk in sorted({b for b, _ in split}):  # q/k/v apart -> one fused qkv; the key's bias is zero
        q = f"{blk}attn."
        if (blk, "attn.q_proj.weight") in split:
            width = split[(blk, "attn.q_proj.weight")].shape[-1]  # the embedding width: the query's rows too
            sd[q + "qkv.weight"] = _fuse_qkv({f"{q}{n}_proj.weight": split[(blk, f"attn.{n}_proj.weight")] for n in "qkv"},
                                             width)
            qb, vb = split.get((blk, "attn.q_proj.bias")), split.get((blk, "attn.v_proj.bias"))
            kb = split.get((blk, "attn.k_proj.bias"))
            if kb is not None:  # AttentionRope unfused: a key bias too, so one fused qkv bias (k_bias=True)
                sd[q + "qkv.bias"] = _fuse_qkv({f"{q}q_proj.bias": qb, f"{q}k_proj.bias": kb, f"{q}v_proj.bias": vb},
                                               width)
                continue
        else:
            qb, vb = split.get((blk, "attn.q_bias")), split.get((blk, "attn.v_bias"))
        if qb is not None:  # vitkit's k_bias=False attention has the same two parameters
            sd[q + "q_bias"], sd[q + "v_bias"] = qb, vb
    for k in [k for k in sd if k.endswith("mlp.fc1.weight")]:  # packed SwiGLU: fc1 twice as wide as fc2 reads
        blk = k[: -len("mlp.fc1.weight")]
        if sd[k].shape[0] == 2 * sd[blk + "mlp.fc2.weight"].shape[1]:
            for leaf in ("weight", "bias"):
                if blk + f"mlp.fc1.{leaf}" in sd:
                    g, x = sd.pop(blk + f"mlp.fc1.{leaf}").chunk(2)  # gate rows first: SiLU(gate) * value
                    sd[blk + f"mlp.fc1_g.{leaf}"], sd[blk + f"mlp.fc1_x.{leaf}"] = g, x
    if eva and "blocks.0.mlp.fc1_g.weight" in sd and "pos_embed.weight" in sd and "rope.freqs" not in sd:
        facts.update(EVA02_ROPE)  # (DINOv3-H+ has SwiGLU too, but no absolute position embedding)
    if "patch_embed.backbone.stem.conv.weight" in sd and "patch_embed.backbone.stem.norm.running_var" not in sd:
        facts.update(TIMM_HYBRID_NUMERICS)  # (running statistics: a BatchNorm hybrid, vitkit's own, its numerics)
    return sd, facts, unused


def _fuse_qkv(parts: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """timm's separate query, key and value projections (keys in that order) -> vitkit's fused rows q, k, v. With
    grouped-query attention (Sapiens2) the key and value have fewer rows than the query (num_kv_heads x head width);
    the key and value must have one shape, and the query `width` (the embedding width) rows: the fused total alone
    (checked against the block's D + 2 x num_kv_heads x head width) would let rows move between the three."""
    (qn, q), *kv = parts.items()
    k_and_v = fuse(dict(kv))
    if q.shape[1:] != k_and_v.shape[1:] or q.shape[0] != width or q.shape[0] < kv[0][1].shape[0]:
        raise CheckpointError(f"{qn} of shape {tuple(q.shape)} beside {kv[0][0]} of shape {tuple(kv[0][1].shape)} and "
                              f"{kv[1][0]} of shape {tuple(kv[1][1].shape)}: not a query of the embedding width "
                              f"({width} rows) and its key and value (num_kv_heads x head width rows each, the same "
                              f"input width)")
    return torch.cat([q, k_and_v])  # (D + 2 kv, ...)


def eva_style(config) -> bool:
    """Whether timm holds this model as an `Eva` (rotary embeddings, SwiGLU, norms inside attention or the MLP,
    PE's pooling of every token); AIMv2's RMSNorm and bias-free SwiGLU are timm's VisionTransformer."""
    if getattr(config, "norm", "layernorm") == "rmsnorm":
        return False
    return bool(config.rope or config.mlp_layer == "swiglu" or config.attn_norm or config.mlp_norm
                or getattr(config, "pool_prefix", False) or not getattr(config, "final_norm", True))


def vit_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    if config.pos_embed == "relative":  # timm's Beit holds the relative position bias
        return timm_beit.from_vitkit(sd, config)
    if config.pos_embed == "relative_mlp":  # timm's VisionTransformerRelPos, its MLP
        return timm_relpos.from_vitkit(sd, config)
    if getattr(config, "attn_layer", "standard") != "standard" and (eva_style(config) or config.naflex
                                                                    or config.norm == "rmsnorm"):
        raise CheckpointError("timm holds differential attention in its VisionTransformer alone: this model's other "
                              "options (rotary embeddings, SwiGLU, RMSNorm, NaFlex) are another class's")
    if getattr(config, "attn_only_layer_scale", False) and not eva_style(config):
        raise CheckpointError("timm holds LayerScale on the attention branch alone (attn_only_layer_scale) in its Eva "
                              "only, whose blocks this model's other options do not fit: export to vitkit")
    if getattr(config, "num_kv_heads", None) is not None:
        raise CheckpointError("a timm export of grouped-query attention (num_kv_heads) is not offered: export to "
                              "vitkit")
    none_ok = config.pos_embed == "none" and (eva_style(config) or config.norm == "rmsnorm")  # Eva, AIMv2: optional
    if config.pos_embed != "learned_1d" and not none_ok:
        raise CheckpointError(f"timm's ViT holds a learned 1-D position embedding, not {config.pos_embed!r}")
    if config.representation_size:
        raise CheckpointError("timm's ViT has no pre-logits layer (representation_size); export to vitkit or npz")
    if config.mpp:
        raise CheckpointError("timm has no masked-patch-prediction head: call model.drop_mpp() first, or export to vitkit")
    if config.hybrid_layers is not None and not getattr(config, "hybrid_stem_pool", True):
        raise CheckpointError("timm's hybrid ResNets keep the stem's max-pool: a hybrid built with "
                              "hybrid_stem_pool=False has no timm equivalent (export to vitkit)")
    if config.hybrid_layers is not None and getattr(config, "hybrid_norm", "group") != "group":
        raise CheckpointError("timm's ViT hybrids hold GroupNorm ResNets: a hybrid built with hybrid_norm='batch' has "
                              "no timm equivalent (export to vitkit)")
    eva = eva_style(config)
    if eva and (config.hybrid_layers is not None or getattr(config, "conv_stem", None) is not None or config.distilled):
        raise CheckpointError("timm's Eva (rotary embeddings, SwiGLU) has no hybrid backbone or distillation token")
    out = {}
    for k, v in sd.items():
        m = re.match(r"(blocks\.\d+\.)(.+)$", k)
        if k == "pos_embed.weight":
            k = "pos_embed"
        elif config.hybrid_layers == () and k.startswith("patch_embed.backbone.stem."):
            k = "patch_embed.backbone." + k[len("patch_embed.backbone.stem."):]  # timm's stem-only backbone
        elif eva and m and m.group(2) in ("ls1.gamma", "ls2.gamma"):
            k = m.group(1) + ("gamma_1" if m.group(2) == "ls1.gamma" else "gamma_2")
        elif eva and m and m.group(2) == "attn.qkv.bias" and not config.k_bias:
            qb, _, vb = v.chunk(3)  # EvaAttention: query and value biases apart
            out[m.group(1) + "attn.q_bias"], out[m.group(1) + "attn.v_bias"] = qb, vb
            continue
        elif eva and not config.mlp_norm and m and m.group(2).startswith("mlp.fc1_g."):  # GluMlp: one packed fc1
            leaf = m.group(2).rsplit(".", 1)[1]
            out[m.group(1) + f"mlp.fc1.{leaf}"] = torch.cat([v, sd[m.group(1) + f"mlp.fc1_x.{leaf}"]])
            continue
        elif eva and not config.mlp_norm and m and m.group(2).startswith("mlp.fc1_x."):
            continue
        out[k] = v
    return conv_stem_from_vitkit(out, config)


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
    return {"input_size": [c.in_chans, *c.img_size], "fixed_input_size": c.arch == "vit" and not c.dynamic_img_size,
            "interpolation": c.interpolation, "crop_pct": c.crop_pct, "crop_mode": "center", "mean": list(c.mean), "std": list(c.std),
            "num_classes": c.num_classes}


def folder_config(c) -> dict:
    """The config.json of a timm hub folder holding a vitkit model, or a CheckpointError naming what timm's
    constructors cannot express."""
    if c.arch == "vit" and getattr(c, "conv_stem", None) is not None and (
            c.naflex or eva_style(c) or c.norm != "layernorm" or c.pos_embed == "relative" or c.distilled
            or c.res_post_norm or c.norm_eps != 1e-6):
        raise CheckpointError("timm registers one ViT on a conv stem, MobileCLIP's vit_base_mci_224: a "
                              "VisionTransformer (LayerNorm eps 1e-6, no distillation token, no res-post-norm, rotary "
                              "embeddings, SwiGLU or relative positions); export to vitkit")
    if c.arch == "vit" and getattr(c, "conv_stem", None) is not None and c.conv_stem_strides:
        raise CheckpointError(f"timm's MCi stem has patchify convs (padding 0, stride = kernel): conv_stem_strides "
                              f"{c.conv_stem_strides} are not the kernels {c.conv_stem_kernels}; export to vitkit")
    if c.arch == "vit" and c.naflex:
        return naflex_folder_config(c)
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
    if c.patch_bias == c.pre_norm:
        raise CheckpointError("timm builds the patch embedding without bias exactly when there is a pre-norm (CLIP); "
                              f"this model has pre_norm={c.pre_norm} and patch_bias={c.patch_bias}")
    if c.pos_embed == "relative":  # timm's Beit, every constructor argument in model_args
        args = timm_beit.folder_args(c)
        cfg.update(architecture="beit_base_patch16_224", num_features=c.embed_dim, global_pool=args["global_pool"],
                   model_args=args)
        cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": "patch_embed.proj", "classifier": "head"}
        return cfg
    if c.pos_embed == "relative_mlp":  # timm's VisionTransformerRelPos, every constructor argument in model_args
        arch, args = timm_relpos.folder_args(c)
        cfg.update(architecture=arch, num_features=c.embed_dim, global_pool=args["global_pool"], model_args=args)
        cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": "patch_embed.proj", "classifier": "head"}
        return cfg
    if eva_style(c):
        return _eva_folder_config(c, cfg)
    if c.norm == "rmsnorm":
        return _aimv2_folder_config(c, cfg)
    mlp_ratio = c.mlp_dim / c.embed_dim
    args: dict = {"img_size": list(c.img_size), "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads,
                  "mlp_ratio": mlp_ratio, "qkv_bias": c.qkv_bias, "class_token": c.class_token, "in_chans": c.in_chans,
                  "global_pool": "token" if c.classifier == "token" else "avg", "act_layer": _TIMM_ACTS[c.act]}
    if c.classifier == "gap":
        args["fc_norm"] = c.fc_norm
    if c.attn_layer != "standard":  # differential attention (written only where set)
        args["attn_layer"] = c.attn_layer
    if c.classifier == "map":
        args["global_pool"] = "map"
    modern = {"init_values": c.init_values, "reg_tokens": c.reg_tokens, "no_embed_class": c.no_embed_class,
              "pre_norm": c.pre_norm, "qk_norm": c.qk_norm, "dynamic_img_size": c.dynamic_img_size}
    defaults = {"init_values": None, "reg_tokens": 0, "no_embed_class": False, "pre_norm": False, "qk_norm": False,
                "dynamic_img_size": False}
    args.update({k: v for k, v in modern.items() if v != defaults[k]})
    if c.res_post_norm and (c.distilled or c.hybrid_layers is not None or c.norm_eps != 1e-6):
        raise CheckpointError("timm registers res-post-norm ViTs (ResPostBlock) as vit_base_patch16_rpn_224 alone: "
                              "no distillation token, hybrid or LayerNorm eps other than 1e-6")
    if c.res_post_norm and c.init_values is not None:  # ResPostBlock reads init_values as its norms' initial weight
        raise CheckpointError("timm's res-post-norm block (ResPostBlock, vit_base_patch16_rpn_224) has no LayerScale: "
                              f"this model has init_values={c.init_values} with res_post_norm (export to vitkit)")
    if c.norm_eps == 1e-5:
        args["pre_norm"] = c.pre_norm  # the CLIP architecture's own default is True
    first_conv = "patch_embed.proj"
    if c.distilled and c.hybrid_layers is not None:
        raise CheckpointError("timm registers no distilled hybrid")
    if c.norm_eps not in (1e-6, 1e-5) or (c.norm_eps == 1e-5 and (c.distilled or c.hybrid_layers is not None)):
        raise CheckpointError(f"timm's ViTs use LayerNorm eps 1e-6 (1e-5 for the CLIP ones), not {c.norm_eps}")
    if c.conv_stem is not None:  # timm's HybridEmbed(proj=False) on a ConvStem: the stem's last conv embeds
        arch, args["patch_size"], args["no_embed_class"] = "vit_base_mci_224", [1, 1], c.no_embed_class
        first_conv = "patch_embed.backbone.0.conv"
    elif c.hybrid_layers is None:
        # the CLIP architecture is the one whose LayerNorms have eps 1e-5 (the rest of it is in model_args)
        # the res-post-norm one is the architecture whose blocks are timm's ResPostBlock (no LayerScale)
        arch = ("deit_base_distilled_patch16_224" if c.distilled else "vit_base_patch16_rpn_224" if c.res_post_norm
                else "vit_base_patch16_clip_224" if c.norm_eps == 1e-5 else "vit_base_patch16_224")
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


_NAFLEX_MODES = {"bicubic": ("bicubic", True, False), "bilinear_aa": ("bilinear", True, False),
                 "bilinear": ("bilinear", False, True), "bicubic_noaa": ("bicubic", False, False),
                 "bilinear_noaa": ("bilinear", False, False)}


def naflex_folder_config(c) -> dict:
    """The config.json of a timm hub folder holding a vitkit model as timm's NaFlexVit (every constructor argument
    that matters spelled out in model_args, so the architecture's own defaults do not)."""
    eva = c.rope or c.mlp_layer == "swiglu" or c.attn_norm or c.mlp_norm or c.pool_prefix  # (no final norm: RADIO's)
    if c.hybrid_layers is not None or c.distilled or c.pos_embed != "learned_1d" or eva or c.qk_norm:
        raise CheckpointError("timm's NaFlexVit holds a plain ViT with a learned position grid: no hybrid, "
                              "distillation token, rotary embeddings, SwiGLU or inner norms")
    if c.act not in ("gelu", "gelu_tanh") or c.norm_eps != 1e-6 or c.pre_norm != (not c.patch_bias):
        raise CheckpointError("timm's NaFlexVit: exact or tanh GELU, LayerNorm eps 1e-6, a patch bias unless "
                              "there is a pre-norm")
    if not c.no_embed_class and c.num_prefix_tokens:
        raise CheckpointError("timm's NaFlexVit gives the class and register tokens no position: this model's "
                              "position embedding covers them (no_embed_class=False)")
    mode, aa, corners = _NAFLEX_MODES[c.pos_resample]
    pool = {"token": "token", "gap": "avg", "map": "map"}[c.classifier]
    arch = ("naflexvit_base_patch16_siglip" if c.classifier == "map" and c.act == "gelu_tanh" else
            "naflexvit_base_patch16_map" if c.classifier == "map" else
            "naflexvit_base_patch16_par_gap" if c.pos_resample_square else "naflexvit_base_patch16_gap")
    args = {"patch_size": list(c.patch_size), "in_chans": c.in_chans, "embed_dim": c.embed_dim, "depth": c.depth,
            "num_heads": c.num_heads, "mlp_ratio": c.mlp_dim / c.embed_dim, "qkv_bias": c.qkv_bias,
            "init_values": c.init_values, "class_token": c.class_token, "reg_tokens": c.reg_tokens,
            "pos_embed_grid_size": list(c.grid_size), "pos_embed_interp_mode": mode, "pos_embed_antialias": aa,
            "pos_embed_align_corners": corners, "pos_embed_ar_preserving": c.pos_resample_square,
            "global_pool": pool, "fc_norm": c.fc_norm, "pre_norm": c.pre_norm, "act_layer": _TIMM_ACTS[c.act],
            "num_classes": c.num_classes}
    if not c.final_norm:  # RADIO's NaFlexVits (written only where set: other exports' config.json as before)
        args["final_norm"] = False
    if int(c.embed_dim * args["mlp_ratio"]) != c.mlp_dim:
        raise CheckpointError(f"timm computes the MLP width as int(D * mlp_ratio), which cannot give {c.mlp_dim}")
    cfg = {"architecture": arch, "num_classes": c.num_classes, "num_features": c.embed_dim, "global_pool": pool,
           "model_args": args}
    if c.class_names:
        cfg["label_names"] = list(c.class_names)
    cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "fixed_input_size": False, "first_conv": "embeds.proj",
                             "classifier": "head"}
    return cfg


def _aimv2_folder_config(c, cfg: dict) -> dict:
    """timm's VisionTransformer arguments for an AIMv2-style model (RMSNorm eps 1e-5, on the patch tokens too, a
    bias-free SwiGLU): the `aimv2_*` architecture, whose norms these are, with the sizes in model_args."""
    if not c.patch_norm or c.mlp_layer != "swiglu" or c.norm_eps != 1e-5 or c.classifier not in ("gap", "token"):
        raise CheckpointError("timm holds RMSNorm ViTs as AIMv2 (eps 1e-5, a norm on the patch tokens, SwiGLU, token "
                              "or average pooling): this model differs")
    ratio = c.mlp_dim / c.embed_dim
    if int(c.embed_dim * ratio) != c.mlp_dim:
        raise CheckpointError(f"timm computes the MLP width as int(D * mlp_ratio), which cannot give {c.mlp_dim}")
    pool = "token" if c.classifier == "token" else "avg"
    args = {"img_size": list(c.img_size), "patch_size": list(c.patch_size), "in_chans": c.in_chans,
            "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads, "mlp_ratio": ratio,
            "qkv_bias": c.qkv_bias, "proj_bias": c.proj_bias, "class_token": c.class_token, "global_pool": pool,
            "fc_norm": c.fc_norm, "final_norm": c.final_norm, "init_values": c.init_values, "reg_tokens": c.reg_tokens,
            "no_embed_class": c.no_embed_class, "pre_norm": c.pre_norm, "qk_norm": c.qk_norm,
            "scale_attn_norm": c.attn_norm, "scale_mlp_norm": c.mlp_norm,
            "pos_embed": "learn" if c.pos_embed == "learned_1d" else "none", "dynamic_img_size": c.dynamic_img_size}
    cfg.update(architecture="aimv2_large_patch14_224", num_features=c.embed_dim, global_pool=pool, model_args=args)
    cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": "patch_embed.proj", "classifier": "head"}
    return cfg



def _eva_folder_config(c, cfg: dict) -> dict:
    """timm's `Eva` constructor arguments for a model with rotary embeddings (EVA-02, ROPE-ViT, PE, DINOv3) or a
    SwiGLU MLP; the architecture whose LayerNorm eps it has (1e-6: EVA-02's, 1e-5: DINOv3's), every other argument
    in model_args."""
    hidden = c.mlp_dim
    ratio = hidden / c.embed_dim
    if int(c.embed_dim * ratio) != hidden:
        raise CheckpointError(f"timm's Eva computes its MLP width as int(D * mlp_ratio), which cannot give {hidden}")
    if c.norm_eps not in (1e-6, 1e-5) or (c.act != "gelu" and (c.mlp_layer != "swiglu" or c.classifier == "map")):
        raise CheckpointError("timm's Eva uses LayerNorm eps 1e-6 or 1e-5 and exact GELU: this model differs "
                              f"(norm_eps {c.norm_eps}, act {c.act!r})")
    if c.hybrid_layers is not None or c.distilled or c.pos_embed not in ("learned_1d", "none"):
        raise CheckpointError("timm's Eva has no hybrid backbone, distillation token or other position embedding")
    if not c.proj_bias or c.patch_norm or (c.patch_bias == c.pre_norm):
        raise CheckpointError("timm's Eva has projection biases, no norm on the patch tokens, and a patch bias "
                              "exactly when there is no pre-norm: this model differs")
    if c.classifier == "map" and not c.pool_prefix:
        raise CheckpointError("timm's Eva pools every token by attention (pool_prefix=True); this model pools the "
                              "patches alone")
    pool = {"token": "token", "gap": "avg", "map": "map"}[c.classifier]
    args = {"img_size": list(c.img_size), "patch_size": list(c.patch_size), "in_chans": c.in_chans,
            "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads, "mlp_ratio": ratio,
            "qkv_bias": c.qkv_bias, "qkv_fused": True, "swiglu_mlp": c.mlp_layer == "swiglu", "scale_mlp": c.mlp_norm,
            "scale_attn_inner": c.attn_norm, "qk_norm": c.qk_norm, "init_values": c.init_values,
            "class_token": c.class_token, "num_reg_tokens": c.reg_tokens, "no_embed_class": c.no_embed_class,
            "use_pre_transformer_norm": c.pre_norm, "use_fc_norm": c.fc_norm, "global_pool": pool,
            "use_rot_pos_emb": c.rope is not None, "rope_temperature": c.rope_temperature,
            "ref_feat_shape": list(c.rope_ref_grid) if c.rope_ref_grid else None,
            "dynamic_img_size": c.dynamic_img_size, "use_abs_pos_emb": c.pos_embed == "learned_1d",
            "attn_type": "rope" if c.qkv_bias and c.k_bias else "eva", "use_post_transformer_norm": c.final_norm and not c.fc_norm}
    if c.attn_only_layer_scale:  # Sapiens2's LayerScale on the attention alone (written only where set)
        args["attn_only_layer_scale"] = True
    if c.res_post_norm:  # EvaBlockPostNorm (written only where set: the same config.json as before otherwise)
        if c.qk_norm or c.init_values is not None:
            raise CheckpointError("timm's Eva post-norm block (use_post_norm) has no qk-norm and no LayerScale")
        args["use_post_norm"] = True
    if c.rope:
        args.update(rope_type={v: k for k, v in _ROPE_TYPES.items()}[c.rope], rope_grid_indexing=c.rope_indexing,
                    rope_grid_offset=c.rope_offset, rope_rotate_half=c.rope_half)
    if c.classifier == "map":
        args.update(attn_pool_num_heads=c.pool_heads or c.num_heads,
                    attn_pool_mlp_ratio=(c.mlp_dim if c.pool_mlp_dim is None else c.pool_mlp_dim) / c.embed_dim)
    arch = "eva02_tiny_patch14_224" if c.norm_eps == 1e-6 else "vit_small_patch16_dinov3"
    cfg.update(architecture=arch, num_features=c.embed_dim, global_pool=pool, model_args=args)
    cfg["pretrained_cfg"] = {**_pretrained_cfg(c), "first_conv": "patch_embed.proj", "classifier": "head"}
    return cfg


# ---- what a timm architecture's name means: its registered constructor arguments ----------------------------

ARCHS_FILE = Path(__file__).with_name("timm_archs.json")


@functools.lru_cache(maxsize=1)
def registered_archs() -> dict[str, dict]:
    """{architecture: {module, class, kwargs, input_size, fixed_input_size}}: what each architecture timm registers
    in the families vitkit reads passes to its model class (`tests/fixtures/make_registry_sweep.py archs` captures
    it from timm itself; layers are named, partials carry their keywords), with the modules read beside them
    (`more_archs`: beit, vision_transformer_relpos, vision_transformer_sam)."""
    doc = json.loads(ARCHS_FILE.read_text())
    return {**doc["archs"], **doc.get("more_archs", {})}


# The model classes' own defaults where they differ from VisionTransformer's (timm's Eva and Beit pool by the average;
# ViT-RelPos too, without a class token, with LayerScale).
_CLASS_DEFAULTS = {"Eva": {"global_pool": "avg"}, "Beit": timm_beit.CLASS_DEFAULTS,
                   "VisionTransformerRelPos": timm_relpos.CLASS_DEFAULTS}
# timm's model classes vitkit implements as its ViT or BiT; VisionTransformerSAM is its own model (`timm_sam`)
TIMM_CLASSES = ("VisionTransformer", "VisionTransformerDistilled", "Eva", "NaFlexVit", "ResNetV2", "Beit",
                "VisionTransformerRelPos")


def timm_args(cfg: dict) -> tuple[str | None, dict]:
    """(timm's model class, its constructor arguments) for a timm config.json, as `timm.create_model` resolves them:
    the architecture's registered arguments first, the folder's `model_args` over them. An architecture this table
    does not know (a newer timm) gives `model_args` alone, read with timm's constructor defaults."""
    entry = registered_archs().get(cfg.get("architecture", ""))
    args = {**_CLASS_DEFAULTS.get(entry["class"], {}), **entry["kwargs"]} if entry else {}
    args.update(cfg.get("model_args") or {})
    return (entry["class"] if entry else None), args


def _arch_facts(arch: str) -> dict:
    """What a timm architecture's name fixes, for a name the table does not know (its registered defaults)."""
    facts: dict = {}
    if arch.startswith("naflexvit_"):
        facts.update(NAFLEX_FACTS)
        if arch.endswith("_siglip"):
            facts.update(pos_resample="bilinear_aa", act="gelu_tanh")
        if "_par_" in arch:
            facts["pos_resample_square"] = True
    if arch.startswith("eva02_"):
        facts.update(EVA02_ROPE)
    if re.match(r"vit_.*_clip_", arch):
        facts.update(norm_eps=1e-5, pre_norm=True)
        if "quickgelu" in arch:
            facts["act"] = "quick_gelu"
    return facts


_UNSUPPORTED_NAMES = re.compile(r"naflexvit_.*parfac")
# timm's rope_type -> vitkit's rope (`layers/rope.py`) and back; 'base' (a pixel grid and bands) and 'mrope' are others
_ROPE_TYPES = {"cat": "eva", "mixed": "mixed", "dinov3": "dinov3"}
# timm constructor arguments -> vitkit config fields (VisionTransformer's, Eva's and NaFlexVit's names)
_MODEL_ARGS = {"init_values": "init_values", "reg_tokens": "reg_tokens", "num_reg_tokens": "reg_tokens",
               "no_embed_class": "no_embed_class", "pre_norm": "pre_norm", "use_pre_transformer_norm": "pre_norm",
               "qk_norm": "qk_norm", "dynamic_img_size": "dynamic_img_size", "scale_mlp": "mlp_norm",
               "scale_mlp_norm": "mlp_norm", "scale_attn_inner": "attn_norm", "scale_attn_norm": "attn_norm",
               "scale_attn_inner_norm": "attn_norm", "rope_temperature": "rope_temperature",
               "attn_only_layer_scale": "attn_only_layer_scale"}
# Arguments vitkit takes only at their default (anything else is another architecture).
# (the train-time rotary coordinate augmentations change nothing at inference: a fine-tuning run does not apply them)
_ONLY_DEFAULT = {"embed_layer": None, "block_fn": None, "use_naflex": False, "use_post_norm": False,
                 "attn_type": "eva", "num_kv_heads": None, "attn_only_layer_scale": False,
                 "class_token_pos": None, "pos_embed": "learn",
                 "attn_layer": None,
                 "attn_gated": False, "input_norm_layer": None, "embed_proj_type": "linear", "rope_mrope_section": None,
                 "rope_ref_feat_shape": None, "weight_init": "",
                 "dynamic_img_pad": False, "pos_embed_use_grid_sample": False, "use_key_only_attn_mask": False}
# Arguments vitkit reads from timm's Eva only (its rotary embeddings, PE's pooling): elsewhere (NaFlexVit) refused
_EVA_ONLY = {"rope_type": "cat", "rope_grid_offset": 0.0, "rope_grid_indexing": "ij", "rope_rotate_half": False,
             "attn_pool_num_heads": None, "attn_pool_mlp_ratio": None, "use_abs_pos_emb": True,
             "rope_shift_coords": None, "rope_jitter_coords": None, "rope_rescale_coords": None}
_SAME = {"pos_embed": ("learn", "learned", "none"), "rope_type": ("cat", ""), "attn_pool_mlp_ratio": (None,), "attn_type": ("eva", "standard", "rope"),
         "weight_init": ("", "skip"),
         # read into vitkit's res_post_norm (`_block_facts`)
         "block_fn": ("ResPostBlock", "ResPostRelPosBlock"), "use_post_norm": (True,),
         "attn_layer": ("diff",)}  # differential attention: read into vitkit's attn_layer (`folder_facts`)
# timm's MLP layers that are the paper's MLP or a SwiGLU vitkit reads from the tensors
_MLP_LAYERS = {None, "Mlp", "SwiGLUPacked", "SwiGLU"}


def _norm_layer(norm, default: float) -> tuple[str, float]:
    """(vitkit's norm, eps) from timm's norm_layer argument (None, "layernorm", "rmsnorm", or a partial of LayerNorm
    or RmsNorm)."""
    if norm is None or norm in ("layernorm", "LayerNorm"):
        return "layernorm", default
    if norm in ("rmsnorm", "RmsNorm"):
        return "rmsnorm", 1e-6  # timm's RmsNorm default
    if isinstance(norm, dict) and norm.get("partial") in ("LayerNorm", "RmsNorm") and set(norm) <= {"partial", "eps"}:
        kind = "rmsnorm" if norm["partial"] == "RmsNorm" else "layernorm"
        return kind, float(norm.get("eps", 1e-6 if kind == "rmsnorm" else 1e-5))
    raise CheckpointError(f"timm's config asks for norm_layer {norm!r}: vitkit's ViTs use LayerNorm or RMSNorm")


def folder_facts(cfg: dict) -> dict:
    """vitkit config facts from a timm hub config.json (what the tensors cannot tell), read as timm reads it: the
    architecture's registered arguments, the folder's model_args over them, its pretrained_cfg for the input."""
    arch = cfg["architecture"]
    cls, args = timm_args(cfg)
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
    if arch.startswith("resnetv2") or cls == "ResNetV2":
        return {**facts, **_resnetv2_facts(arch, args, pre)}
    if cls is not None and cls not in TIMM_CLASSES:
        raise CheckpointError(f"timm's {arch} is a {cls}, a model class vitkit does not implement (vitkit: "
                              f"{', '.join(TIMM_CLASSES)})")
    if _UNSUPPORTED_NAMES.match(arch):
        raise CheckpointError(f"timm's {arch} uses a rotary, factorized or patch scheme vitkit does not implement "
                              f"(vitkit: EVA-02's rotary embeddings, NaFlexVit's learned grid)")
    naflex = cls == "NaFlexVit" or arch.startswith("naflexvit_")
    if cls is None:
        facts.update(_arch_facts(arch))
    elif naflex:
        facts.update(NAFLEX_FACTS)
    eva = cls == "Eva" or (cls is None and arch.startswith("eva"))
    # timm resamples a learned grid with `resample_abs_pos_embed`: antialiased bicubic, corners not aligned
    facts.setdefault("pos_resample", "bicubic")
    act = args.get("act_layer") or facts.get("act", "gelu")
    mlp = args.get("mlp_layer")
    if isinstance(mlp, dict):  # GluMlp(act_layer=SiLU, gate_last=False) is timm's SwiGLUPacked: gate rows first
        swiglu = mlp.get("partial") == "GluMlp" and mlp.get("act_layer") in ("SiLU", "silu") and not mlp.get("gate_last", True)
        mlp = "SwiGLUPacked" if swiglu else repr(mlp)
    if mlp in ("SwiGLUPacked", "SwiGLU", "GluMlp") and act in ("silu", "SiLU"):
        act = "gelu"  # SwiGLU's own SiLU gate (vitkit's swiglu MLP); no other layer uses act_layer
    if act not in _TIMM_ACTS:
        raise CheckpointError(f"timm's {arch} uses act_layer {act!r}, which vitkit does not implement")
    facts["act"] = _TIMM_ACTS[act]
    if "norm_layer" in args:
        facts["norm"], facts["norm_eps"] = _norm_layer(args["norm_layer"], 1e-6)
    if args.get("embed_norm_layer") is not None:  # AIMv2: a norm on the patch tokens, the blocks' own kind
        if _norm_layer(args["embed_norm_layer"], 1e-6) != (facts.get("norm", "layernorm"), facts.get("norm_eps", 1e-6)):
            raise CheckpointError(f"timm's {arch} normalises its patch tokens with another norm than its blocks "
                                  f"({args['embed_norm_layer']!r}), which vitkit does not implement")
        facts["patch_norm"] = True
    if mlp not in _MLP_LAYERS:
        raise CheckpointError(f"timm's {arch} uses mlp_layer {args['mlp_layer']!r}, which vitkit does not implement")
    if "num_heads" in args:
        facts["num_heads"] = args["num_heads"]
    pool = args.get("global_pool", cfg.get("global_pool", "token"))
    if pool not in ("token", "avg", "map"):
        raise CheckpointError(f"timm's {arch} pools by global_pool {pool!r}; vitkit pools by 'token', 'avg' or 'map'")
    facts["classifier"] = {"token": "token", "avg": "gap", "map": "map"}[pool]
    for key, ours in _MODEL_ARGS.items():
        if key in args:
            facts[ours] = args[key]
    if "init_values" in facts and not facts["init_values"]:
        facts["init_values"] = None  # timm's blocks have LayerScale only `if init_values` (0: none)
    facts.update(_block_facts(arch, args, eva))
    if eva and "use_rot_pos_emb" in args:
        facts.update(_eva_rope_facts(arch, args))
    if eva and args.get("attn_pool_num_heads"):  # the Perception Encoder's pooling: its own head count
        facts["pool_heads"] = args["attn_pool_num_heads"]
    if facts["classifier"] == "map" and (eva or args.get("pool_include_prefix")):
        facts["pool_prefix"] = True  # timm's Eva pools every token, its VisionTransformer the patches alone
    # the resolution, as timm's create_model settles it: model_args, else the entry point's own argument, else the
    # pretrained_cfg's input size where that is fixed (timm's default: not fixed; a dynamic size never is)
    user = cfg.get("model_args") or {}
    fixed = pre.get("fixed_input_size", False) and not args.get("dynamic_img_size") and args.get("strict_img_size", True)
    if naflex:
        pass  # any size: the position grid's own (from the tensors) is the native one
    elif "img_size" in user or "img_size" in args:
        facts["img_size"] = args["img_size"]
    elif "input_size" in pre and (fixed or args.get("use_abs_pos_emb") is False or args.get("pos_embed") == "none"):
        facts["img_size"] = tuple(pre["input_size"][1:])  # (no position table to tell the native grid: the cfg's)
    patch = args.get("patch_size")
    if "img_size" in facts and isinstance(patch, (int, list, tuple)) and "embed_layer" not in args:
        # timm's patch conv drops what is left over (384 px in patches of 14: a 27x27 grid, 6 px unread); vitkit
        # takes the size the grid reads
        facts["img_size"] = tuple(s - s % p for s, p in zip(pair(facts["img_size"]), pair(patch)))
    if naflex:
        mode = (args.get("pos_embed_interp_mode", "bicubic"), args.get("pos_embed_antialias", True),
                args.get("pos_embed_align_corners", False))
        method = {("bicubic", True, False): "bicubic", ("bilinear", True, False): "bilinear_aa",
                  ("bilinear", False, True): "bilinear", ("bicubic", False, False): "bicubic_noaa",
                  ("bilinear", False, False): "bilinear_noaa"}.get(tuple(mode))
        if method is None:
            raise CheckpointError(f"timm's {arch} resamples positions as {mode} (mode, antialias, align_corners), "
                                  f"which vitkit does not implement")
        facts["pos_resample"] = method
        facts["pos_resample_square"] = bool(args.get("pos_embed_ar_preserving", False))
        if args.get("fc_norm") is not None:
            facts["fc_norm"] = bool(args["fc_norm"])
    embed = args.get("embed_layer")
    if isinstance(embed, dict) and embed.get("partial") == "HybridEmbed":
        backbone = embed.get("backbone") or {}
        conv_stem = backbone.get("module") == "ConvStem" and embed.get("proj") is False  # MCi: no projection
        if conv_stem and not set(embed) - {"partial", "backbone", "proj"}:
            args = {k: v for k, v in args.items() if k != "embed_layer"}
        elif backbone.get("module") not in ("ResNetV2", "Sequential") or set(embed) - {"partial", "backbone"}:
            raise CheckpointError(f"timm's {arch} embeds patches with a {backbone.get('module')} backbone; vitkit's "
                                  f"hybrids have a BiT ResNetV2 (the paper's) or MobileCLIP's conv stem")
        else:
            args = {k: v for k, v in args.items() if k != "embed_layer"}
            facts.update(TIMM_HYBRID_NUMERICS)
    if args.get("pool_include_prefix") and facts["classifier"] != "map":
        raise CheckpointError(f"timm's {arch} averages the prefix tokens with the patches (pool_include_prefix), "
                              f"which vitkit does not implement (its 'avg' pools the patches alone)")
    only_default = _ONLY_DEFAULT if eva else {**_ONLY_DEFAULT, **_EVA_ONLY}  # what vitkit reads from an Eva alone
    if eva:  # grouped key/value heads (`_block_facts`), LayerScale on the attention alone (`_MODEL_ARGS`)
        only_default = {k: v for k, v in only_default.items() if k not in ("num_kv_heads", "attn_only_layer_scale")}
    if cls == "Beit":  # its positions, pooling and key bias: its own arguments (timm_beit)
        only_default = {k: v for k, v in only_default.items() if k not in timm_beit.ARGS}
        facts.update(timm_beit.arg_facts(arch, args))
    if cls == "VisionTransformerRelPos":  # its relative position MLP, tokens and pooling (timm_relpos)
        facts.update(timm_relpos.arg_facts(arch, args))
    if args.get("attn_layer") == "diff":
        if eva or naflex:
            raise CheckpointError(f"timm's {arch} asks for differential attention in a {cls}: timm builds it in its "
                                  f"VisionTransformer alone")
        facts["attn_layer"] = "diff"
    for key, default in only_default.items():
        value = args.get(key, default)
        if value != default and value not in _SAME.get(key, ()):
            raise CheckpointError(f"timm's {arch} sets {key}={value!r}, which vitkit does not implement")
    return facts


def _block_facts(arch: str, args: dict, eva: bool) -> dict:
    """timm's block variants vitkit has as config fields: residual post-norm (Eva's `use_post_norm`, EVA-02-CLIP-E;
    VisionTransformer's `block_fn=ResPostBlock`: neither has LayerScale, timm's ResPostBlock initialises its norms'
    weights with init_values) and grouped-query attention (Eva's `num_kv_heads`, per block: Sapiens2 groups the
    middle blocks alone, vitkit's `kv_full_blocks` keeps that many full at each end)."""
    facts: dict = {}
    if eva and args.get("use_post_norm") and (args.get("qk_norm") or args.get("attn_only_layer_scale")
                                              or any(h is not None for h in _listed(args.get("num_kv_heads")))):
        raise CheckpointError(f"timm's {arch} asks for post-norm blocks with qk-norm, grouped key/value heads or "
                              f"attention-only LayerScale, which timm's Eva does not build")
    if (eva and args.get("use_post_norm")) or args.get("block_fn") in ("ResPostBlock", "ResPostRelPosBlock"):
        facts.update(res_post_norm=True, init_values=None)
    kv = args.get("num_kv_heads") if eva else None
    if kv is not None:
        heads, depth = args.get("num_heads", 12), args.get("depth", 12)
        lo, hi = SIZE_BOUNDS["depth"]  # before any per-block list is sized by it
        if isinstance(depth, bool) or not isinstance(depth, int) or not lo <= depth <= hi:
            raise CheckpointError(f"timm's {arch} has depth={str(depth)[:40]}: must be an integer in [{lo}, {hi}]")
        kv = [heads if h is None else h for h in (kv if isinstance(kv, (list, tuple)) else [kv] * depth)]
        groups = sorted(set(kv) - {heads})
        if len(kv) != depth or len(groups) > 1:
            raise CheckpointError(f"timm's {arch} has num_kv_heads {kv}: vitkit groups its blocks' keys and values "
                                  f"into one number of heads")
        if groups:
            ends = next(i for i, h in enumerate(kv) if h != heads)  # full blocks at the start (and so at the end)
            if kv != [heads] * ends + groups * (depth - 2 * ends) + [heads] * ends:
                raise CheckpointError(f"timm's {arch} has num_kv_heads {kv}: vitkit keeps full heads in as many "
                                      f"blocks at each end and groups the middle ones (kv_full_blocks)")
            facts.update(num_kv_heads=groups[0], kv_full_blocks=ends)
    return facts


def _listed(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _eva_rope_facts(arch: str, args: dict) -> dict:
    """The rotary embedding of a timm Eva (EVA-02, ROPE-ViT, the Perception Encoder, DINOv3) from its arguments."""
    if not args["use_rot_pos_emb"]:
        return {"rope": None, "rope_ref_grid": None}
    rope_type = args.get("rope_type", "cat")
    kind = _ROPE_TYPES.get(rope_type)
    if kind is None:
        raise CheckpointError(f"timm's {arch} sets rope_type={rope_type!r}, which vitkit does not implement "
                              f"(vitkit: {sorted(_ROPE_TYPES)})")
    facts = {"rope": kind, "rope_indexing": args.get("rope_grid_indexing", "ij"),
             "rope_offset": 0.0 if kind == "mixed" else float(args.get("rope_grid_offset", 0.0)),  # mixed: timm ignores it
             "rope_half": bool(args.get("rope_rotate_half"))}
    ref = args.get("ref_feat_shape")
    if kind != "eva" or ref is None:  # timm's dinov3 and mixed embeddings take no reference grid
        facts["rope_ref_grid"] = (EVA02_ROPE["rope_ref_grid"] if kind == "eva" and "ref_feat_shape" not in args
                                  and arch.startswith("eva02_") else None)
    else:
        facts["rope_ref_grid"] = tuple(ref) if isinstance(ref, (list, tuple)) else (ref, ref)
    return facts


# ---- timm's names built without a file: the registered arguments, the user's over them -------------------------

def arch_config(arch: str, model_args: dict | None = None, tag: str | None = None) -> tuple[str, dict]:
    """("vit" or "resnetv2", vitkit config fields) of the model `timm.create_model(arch[.tag], **model_args)` builds
    with random weights. The arguments are read as a folder's config.json is (`folder_facts`: the architecture's
    registered arguments, `model_args` over them, the tag's pretrained_cfg for the classes, channels and preprocessing);
    the sizes a file's tensors would tell come from the same arguments and timm's constructor defaults. What vitkit
    does not implement is the CheckpointError `folder_facts` raises for such a folder."""
    entry = registered_archs()[arch]
    built = entry.get("built", {})
    tag_row = {k: v for k, v in built.get("tags", {}).get(tag, {}).items() if k != "hub"} if tag else {}
    pre = {**entry.get("pretrained_cfg", {}), "input_size": entry["input_size"],
           "fixed_input_size": entry["fixed_input_size"], **tag_row}
    user = dict(model_args or {})
    # timm's create_model: the pretrained_cfg's classes and channels unless given (its image size: folder_facts)
    classes = tag_row.get("num_classes", built.get("num_classes"))
    if classes is not None and classes >= 0:
        user.setdefault("num_classes", classes)
    user.setdefault("in_chans", pre["input_size"][0])
    if pre["fixed_input_size"] and cls_of(arch) != "ResNetV2":  # a dynamic size too: its position table's grid
        user.setdefault("img_size", list(pre["input_size"][1:]))
    cfg = {"architecture": arch, "model_args": user, "pretrained_cfg": pre}
    if cls_of(arch) == "VisionTransformerSAM":  # SAM's image encoder: its own model and arguments (timm_sam)
        return "samvit", timm_sam.config_fields(arch, timm_args(cfg)[1], pre)
    facts = folder_facts(cfg)
    cls, args = timm_args(cfg)
    if cls == "ResNetV2":
        sizes = {"layers": tuple(args["layers"]), "width_factor": args.get("width_factor", 1),
                 "num_classes": args["num_classes"], "in_chans": args["in_chans"]}
        if args.get("channels") not in (None, [256, 512, 1024, 2048]):
            raise CheckpointError(f"timm's {arch} has stage widths {args['channels']}; vitkit's BiT has the standard "
                                  f"ones")
        return "resnetv2", {**sizes, **facts}
    return "vit", {**_vit_sizes(arch, cls, args, facts), **facts}


def cls_of(arch: str) -> str:
    """timm's model class of a registered architecture."""
    return registered_archs()[arch]["class"]


def _vit_sizes(arch: str, cls: str | None, args: dict, facts: dict) -> dict:
    """The sizes and layout of a timm ViT (VisionTransformer, its distilled DeiT, Eva, NaFlexVit) from its constructor
    arguments and the class's defaults: what `infer_vit_config` reads from a file's tensors."""
    eva, naflex = cls == "Eva", cls == "NaFlexVit"
    if cls == "Beit":
        timm_beit.check_buildable(arch, args)
    if naflex and (args.get("swiglu_mlp") or not args.get("qkv_fused", True) or args.get("attn_gated")):
        raise CheckpointError(f"timm's {arch} is a NaFlexVit with EVA-style blocks (SwiGLU, unfused or gated "
                              f"attention), which vitkit does not implement")
    d, depth, heads = args.get("embed_dim", 768), args.get("depth", 12), args.get("num_heads", 12)
    hidden = int(d * args.get("mlp_ratio", 4.0))
    pool = args.get("global_pool", "avg" if eva else "map" if naflex else "token")
    out: dict = {"embed_dim": d, "depth": depth, "num_heads": heads, "num_classes": args["num_classes"],
                 "in_chans": args["in_chans"], "qkv_bias": args.get("qkv_bias", True),
                 "proj_bias": args.get("proj_bias", True)}
    mlp = args.get("mlp_layer")
    mlp = mlp.get("partial") if isinstance(mlp, dict) else mlp
    if (eva or cls == "Beit") and args.get("swiglu_mlp"):  # timm's SwiGLU of int(D * mlp_ratio) hidden units
        align = args.get("swiglu_align_to", 0)
        out.update(mlp_layer="swiglu", mlp_dim=hidden + (-hidden % align if align else 0))
    elif mlp in ("SwiGLUPacked", "GluMlp"):  # one fc1 of `hidden` rows: the gate and the value, half each
        out.update(mlp_layer="swiglu", mlp_dim=hidden // 2)
    elif mlp == "SwiGLU":
        out.update(mlp_layer="swiglu", mlp_dim=hidden)
    else:
        out.update(mlp_layer="mlp", mlp_dim=hidden)
    pre_norm = args.get("use_pre_transformer_norm" if eva else "pre_norm", False)
    out.update(pre_norm=pre_norm, patch_bias=not pre_norm, class_token=args.get("class_token", not naflex))
    if eva:
        # EvaAttention: the key has no bias (q_bias, v_bias); AttentionRope ('rope'): one fused qkv bias
        out["k_bias"] = args.get("attn_type", "eva") == "rope"
        use_fc = args["use_fc_norm"] if args.get("use_fc_norm") is not None else pool == "avg"
        post = args["use_post_transformer_norm"] if args.get("use_post_transformer_norm") is not None else not use_fc
        absolute = args.get("use_abs_pos_emb", True)
    else:
        use_fc = args["fc_norm"] if args.get("fc_norm") is not None else pool in ("avg", "avgmax", "max")
        post = args.get("final_norm", True) and not use_fc
        use_fc = use_fc and args.get("final_norm", True)
        absolute = args.get("pos_embed", "learned" if naflex else "learn") not in ("", "none")
    if use_fc and post:
        raise CheckpointError(f"timm's {arch} normalises both after the blocks and after the pooling, which vitkit "
                              f"does not implement")
    if use_fc and pool != "avg":
        raise CheckpointError(f"timm's {arch} normalises after {pool!r} pooling; vitkit's fc_norm follows the "
                              f"average alone")
    out.update(fc_norm=bool(use_fc), final_norm=bool(use_fc or post))
    out["pos_embed"] = "learned_1d" if absolute else "none"  # (ViT-RelPos: its own, in folder_facts)
    if pool == "map":  # the attention pooling's MLP: the blocks' ratio unless its own (Eva, NaFlexVit)
        ratio = (args.get("attn_pool_mlp_ratio") if eva or naflex else None) or args.get("mlp_ratio", 4.0)
        if int(d * ratio) != out["mlp_dim"]:
            out["pool_mlp_dim"] = int(d * ratio)
    patch = args.get("patch_size", 16)
    patch = tuple(patch) if isinstance(patch, (list, tuple)) else (patch, patch)
    if cls == "VisionTransformerDistilled":
        out["distilled"] = True
    embed = args.get("embed_layer")
    if isinstance(embed, dict) and embed.get("partial") == "HybridEmbed" and embed.get("backbone", {}).get(
            "module") == "ConvStem":  # MobileCLIP's stem, its layers as the entry point builds them
        if arch not in TIMM_CONV_STEMS or patch != (1, 1):
            raise CheckpointError(f"timm's {arch} has a ConvStem whose layers vitkit does not know (vitkit: "
                                  f"{', '.join(TIMM_CONV_STEMS)}, timm's patch_size 1)")
        stem = TIMM_CONV_STEMS[arch]
        out.update(conv_stem=stem["conv_stem"], conv_stem_kernels=stem["conv_stem_kernels"])
        patch = (math.prod(stem["conv_stem_kernels"]) * stem["embed_kernel"],) * 2
    elif isinstance(embed, dict) and embed.get("partial") == "HybridEmbed":
        layers = tuple(embed.get("backbone", {}).get("stages", ()))
        out["hybrid_layers"] = layers
        patch = tuple(p * backbone_stride(layers) for p in patch)  # vitkit's patch: the backbone's stride times timm's
    out["patch_size"] = patch
    if naflex:  # the learned grid's own size (pos_embed_grid_size, else the image size's)
        grid = args.get("pos_embed_grid_size")
        size = args.get("img_size")
        grid = tuple(grid) if grid else tuple(s // p for s, p in zip(pair(size), patch)) if size else (16, 16)
        out["img_size"] = tuple(g * p for g, p in zip(grid, patch))
    elif "img_size" not in facts:
        out["img_size"] = pair(args.get("img_size", 224))
    return out


def pair(v) -> tuple[int, int]:
    """timm's size argument (an int or a pair) as a pair."""
    return tuple(v) if isinstance(v, (list, tuple)) else (v, v)


def architecture_facts(arch: str) -> dict:
    """What a registered timm architecture's name fixes for a bare state dict of it (as
    `timm.create_model(arch, pretrained_cfg_overlay=dict(file=...))` builds it): its constructor arguments; the
    resolution comes from the tensors (a square grid) or the caller."""
    if arch not in registered_archs():

        near = difflib.get_close_matches(arch, registered_archs(), n=3)
        raise CheckpointError(f"architecture {arch!r} is not one timm {json.loads(ARCHS_FILE.read_text())['timm_version']} "
                              f"registers in the families vitkit reads" + (f" (did you mean {', '.join(near)}?)" if near else ""))
    entry = registered_archs()[arch]
    kw = entry["kwargs"]
    pre = {**entry.get("pretrained_cfg", {}), "input_size": entry.get("input_size")}
    if entry["class"] == "VisionTransformerSAM":  # its global blocks: the registered ones; its grid and window: the
        cfg = {"architecture": arch, "pretrained_cfg": pre}  # tensors' (or the caller's)
        facts = timm_sam.folder_facts(cfg, timm_args(cfg)[1])
        return {k: v for k, v in facts.items() if k not in ("img_size", "window_size")}
    facts = folder_facts({"architecture": arch, "pretrained_cfg": pre})
    absolute = kw.get("use_abs_pos_emb", True) and kw.get("pos_embed", "learn") != "none" \
        and entry["class"] != "VisionTransformerRelPos"  # (its MLP takes any grid: the registered size stands)
    if absolute or kw.get("use_rel_pos_bias") or kw.get("use_shared_rel_pos_bias"):
        facts.pop("img_size", None)  # the position table's grid says it (BEiT's relative table: a square one)
    facts.pop("rel_pos_dim", None)  # (ViT-RelPos: its MLP's width, the tensors say it)
    return facts


def check_architecture_sizes(arch: str, sd: dict[str, torch.Tensor], hints: dict) -> None:
    """A state dict named by a timm architecture must have its registered width and depth, as timm's strict load
    demands, unless the caller says what changed (`num_heads=`, as a timm user passes embed_dim/depth/num_heads to
    create_model): the head count is the one size the tensors cannot show."""
    kw = registered_archs()[arch]["kwargs"]
    if "patch_embed.proj.weight" not in sd or "num_heads" in hints:
        return
    width = sd["patch_embed.proj.weight"].shape[0]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    want = {"embed_dim": (kw.get("embed_dim"), width), "depth": (kw.get("depth"), depth)}
    wrong = {k: v for k, v in want.items() if v[0] is not None and v[0] != v[1]}
    if wrong:
        raise CheckpointError(f"the file is not timm's {arch} at its registered size ("
                              + ", ".join(f"{k} {got} in the file, {reg} registered" for k, (reg, got) in wrong.items())
                              + "): pass num_heads=... for the size it was built at")


def _resnetv2_facts(arch: str, args: dict, pre: dict) -> dict:
    """BiT: timm's ResNetV2 with the 'fixed' stem, StdConv2d (eps 1e-8) and GroupNorm; the other ResNetV2s
    (BatchNorm, EvoNorm, FRN, deep or tiered stems) are refused."""
    conv = args.get("conv_layer")
    bit = isinstance(conv, dict) and conv.get("partial") == "StdConv2d"
    if args and (not bit or args.get("stem_type", "fixed") != "fixed" or args.get("norm_layer") not in (None, "GroupNormAct")
                 or args.get("basic") or args.get("avg_down")):
        raise CheckpointError(f"timm's {arch} is not a BiT ResNetV2 (StdConv2d, GroupNorm, the 'fixed' stem): "
                              f"vitkit reads the BiT ones only")
    return {"img_size": tuple(pre["input_size"][1:])} if "input_size" in pre else {}


# ---- Meta's DINOv3 release (facebookresearch/dinov3 hub files), which timm's checkpoint filter converts ----------

# DINOv3's widths -> heads (the release does not store them): S, S+, B, L, H+, 7B
DINOV3_HEADS = {384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32}
DINOV3_FACTS = {"rope": "dinov3", "rope_temperature": 100.0, "rope_half": True, "pos_embed": "none",
                "dynamic_img_size": True, "norm_eps": 1e-5, "num_classes": 0, "classifier": "token", "img_size": 256,
                "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "interpolation": "bicubic", "crop_pct": 1.0}


def is_dinov3_release(keys) -> bool:
    """DINOv3's RoPE periods buffer, or its registers beside the masked qkv bias (other `storage_tokens` files,
    Sapiens2's, are not this layout)."""
    return "rope_embed.periods" in keys or ("storage_tokens" in keys and any(k.endswith("qkv.bias_mask") for k in keys))


def dinov3_release_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """Meta's DINOv3 names -> vitkit's: `storage_tokens` are the registers; `qkv.bias` is q | 0 | v under
    `qkv.bias_mask` (the keys have no bias: vitkit's k_bias=False, or no bias at all where q and v are zero);
    SwiGLU's `w1`/`w2`/`w3` are the gate, the value and the output. The rotary periods (stored in bf16) are
    recomputed in fp32 from their base, as timm and transformers do; the masked-modelling token, the local-crop norm
    and the projector heads are unused."""
    sd, unused = {}, []
    facts = dict(DINOV3_FACTS)
    for k, v in w.items():
        m = re.match(r"(blocks\.\d+\.)(.+)$", k)
        if k == "storage_tokens":
            sd["reg_token"] = v
        elif k == "rope_embed.periods":  # T^(i / (d/4)), i < d/4: its base must be the one vitkit uses
            p = v.double().flatten()
            if len(p) > 1 and not abs(float(p[-1]) ** (len(p) / (len(p) - 1)) / 100.0 - 1) <= 0.02:  # NaN too
                raise CheckpointError(f"DINOv3 release with rotary periods {p.tolist()}: not the base-100 periods of "
                                      f"DINOv3's models (rope_temperature=...)")
            unused.append(k)
        elif k == "mask_token" or k.startswith(("local_cls_norm", "projectors", "head.")):
            unused.append(k)
        elif m and m.group(2) in ("attn.qkv.bias_mask", "attn.qkv.bias"):
            continue  # below, per block
        elif m and m.group(2).startswith("mlp.w") and m.group(2)[5] in "123":
            sd[m.group(1) + {"1": "mlp.fc1_g", "2": "mlp.fc1_x", "3": "mlp.fc2"}[m.group(2)[5]] + m.group(2)[6:]] = v
        else:
            sd[k] = v
    biased = False
    width = w["patch_embed.proj.weight"].shape[0] if "patch_embed.proj.weight" in w else None
    for k in [k for k in w if k.endswith("attn.qkv.bias")]:
        if width is not None:  # q | k | v of the model's width: what the mask multiplies (a wrong shape would broadcast)
            expect_shape(k, w[k], (3 * width,), "the query, key and value biases of the model's width")
        elif w[k].ndim != 1 or len(w[k]) % 3:
            raise CheckpointError(f"{k}: shape {tuple(w[k].shape)}, expected (3 x width,)")
        q, _, v = w[k].chunk(3)
        mask = w.get(k + "_mask")
        if mask is not None:
            mq, _, mv = expect_shape(k + "_mask", mask, tuple(w[k].shape), "one 0 or 1 per entry of the qkv bias").chunk(3)
            q, v = q * mq, v * mv
        elif w[k].chunk(3)[1].any():
            raise CheckpointError(f"{k}: a key bias with no bias_mask; DINOv3's keys have none (vitkit's k_bias=False)")
        if q.any() or v.any():
            biased = True
        sd[k[: -len("qkv.bias")] + "q_bias"], sd[k[: -len("qkv.bias")] + "v_bias"] = q, v
    if not biased:  # every block's query and value biases are zero: the model without them (timm's non-qkvb)
        sd = {k: v for k, v in sd.items() if not k.endswith(("attn.q_bias", "attn.v_bias"))}
    if width in DINOV3_HEADS:
        facts["num_heads"] = DINOV3_HEADS[width]
    return sd, facts, unused
