"""timm's ViT-RelPos (`timm.models.vision_transformer_relpos`: `vit_relpos_*`, `vit_srelpos_*`) <-> vitkit names: a
ViT without an absolute position embedding whose attention adds a bias per head and relative offset, computed by a
small MLP from the offset's log-spaced coordinates (Swin V2's continuous position bias, timm's `RelPosMlp` in its
'cr' mode: vitkit's `pos_embed="relative_mlp"`); one MLP per block, or one for the whole model (`shared_rel_pos`:
vitkit's `rel_pos_shared`). No class token and the patches' average unless asked (`class_token`, `global_pool`),
LayerScale at 1e-6, and residual post-norm blocks in the `_rpn_` ones (`ResPostRelPosBlock`: vitkit's
`res_post_norm`, whose norms timm initialises with init_values).

vitkit's module names are timm's here, so the key table (`RULES`, a `layouts.Layout`, read forwards to load and
backwards to export) is a list of the names the family has: what it does not list is refused by name. The MLP holds
no grid: at another resolution both compute the offsets of the new grid from the same weights (timm's
`set_input_size`, vitkit's `dynamic_img_size` or `vitkit.load(..., img_size=)`).

Not read: timm's other `rel_pos_type`s ('bias': a learned table, 'mlp_swin': Swin V2's sigmoid-gated MLP), which no
registered name uses; they are refused naming the argument. A bare state dict cannot tell the `_rpn_` blocks from the
others (the same names): pass `architecture=` for them, as timm's name says it.
"""
from __future__ import annotations

import re

import torch

from . import layouts
from .io import CheckpointError
from .layouts import Layout, Rule

_B = "blocks.{i}."
RULES: tuple[Rule, ...] = (
    Rule("cls_token", "cls_token"),  # class_token=True (the _cls_ and _clsgap_ names)
    Rule("patch_embed.proj.{w}", "patch_embed.proj.{w}"),
    Rule("shared_rel_pos.mlp.fc1.{w}", "shared_rel_pos.mlp.fc1.{w}"),  # shared_rel_pos: one MLP for every block
    Rule("shared_rel_pos.mlp.fc2.{w}", "shared_rel_pos.mlp.fc2.{w}"),
    Rule(_B + "norm1.{w}", _B + "norm1.{w}"),
    Rule(_B + "attn.qkv.{w}", _B + "attn.qkv.{w}"),  # rows q, k, v, each head-major
    Rule(_B + "attn.q_norm.{w}", _B + "attn.q_norm.{w}"),  # qk_norm
    Rule(_B + "attn.k_norm.{w}", _B + "attn.k_norm.{w}"),
    Rule(_B + "attn.rel_pos.mlp.fc1.{w}", _B + "attn.rel_pos.mlp.fc1.{w}"),  # 2 -> rel_pos_dim (ReLU)
    Rule(_B + "attn.rel_pos.mlp.fc2.{w}", _B + "attn.rel_pos.mlp.fc2.{w}"),  # rel_pos_dim -> heads
    Rule(_B + "attn.proj.{w}", _B + "attn.proj.{w}"),
    Rule(_B + "ls1.gamma", _B + "ls1.gamma"),  # init_values (not in the _rpn_ blocks)
    Rule(_B + "norm2.{w}", _B + "norm2.{w}"),
    Rule(_B + "mlp.fc1.{w}", _B + "mlp.fc1.{w}"),
    Rule(_B + "mlp.fc2.{w}", _B + "mlp.fc2.{w}"),
    Rule(_B + "ls2.gamma", _B + "ls2.gamma"),
    Rule("norm.{w}", "norm.{w}"),  # after the blocks (fc_norm=False)
    Rule("fc_norm.{w}", "fc_norm.{w}"),  # after the average instead (fc_norm=True)
    Rule("head.{w}", "head.{w}"),
)
LAYOUT = Layout("ViT-RelPos", RULES, source="timm")
_MLP = re.compile(r"(blocks\.\d+\.attn\.rel_pos|shared_rel_pos)\.mlp\.fc1\.weight")


def is_timm_relpos(keys) -> bool:
    """timm's VisionTransformerRelPos: a relative position MLP in the blocks' attention, or one shared by all."""
    return any(_MLP.fullmatch(k) for k in keys)


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A timm VisionTransformerRelPos state dict -> (vitkit state dict, config facts, unused keys). The facts the
    tensors show: the MLP's width and heads, shared or per block, the class token, the pooling's norm."""
    sd, unused = layouts.read(LAYOUT, w)
    shared = "shared_rel_pos.mlp.fc1.weight" in sd
    if shared and any(k.startswith("blocks.") and ".rel_pos." in k for k in sd):
        raise CheckpointError("timm's ViT-RelPos with a shared relative position MLP beside the blocks' own: timm "
                              "builds one or the other")
    fc1 = sd["shared_rel_pos.mlp.fc1.weight" if shared else "blocks.0.attn.rel_pos.mlp.fc1.weight"]
    fc2 = sd["shared_rel_pos.mlp.fc2.weight" if shared else "blocks.0.attn.rel_pos.mlp.fc2.weight"]
    if fc1.ndim != 2 or fc1.shape[1] != 2 or fc2.ndim != 2 or fc2.shape[1] != fc1.shape[0]:
        raise CheckpointError(f"the relative position MLP's layers have shapes {tuple(fc1.shape)} and "
                              f"{tuple(fc2.shape)}: not (hidden, 2) and (heads, hidden)")
    facts: dict = {"act": "gelu", "norm_eps": 1e-6, "pos_embed": "relative_mlp", "rel_pos_dim": fc1.shape[0],
                   "rel_pos_shared": shared, "num_heads": fc2.shape[0]}
    if "fc_norm.weight" in sd:  # timm's 'avg' pooling with the norm after it (with or without a class token)
        facts.update(classifier="gap", fc_norm=True)
    elif "cls_token" not in sd:  # no class token: the patches' average (timm's default 'avg')
        facts["classifier"] = "gap"
    return sd, facts, unused


def from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """vitkit weights of a model with the relative position MLP -> timm VisionTransformerRelPos names."""
    out, left = layouts.write(LAYOUT, sd)
    if left:
        raise CheckpointError(f"{', '.join(left[:4])} {'has' if len(left) == 1 else 'have'} no place in timm's "
                              f"VisionTransformerRelPos (a ViT with the relative position MLP, at most a class token, "
                              f"LayerNorm)")
    return out


# ---- timm's constructor arguments --------------------------------------------------------------------------------

# VisionTransformerRelPos's own defaults where they differ from VisionTransformer's (no class token, the average
# without a norm after it, LayerScale 1e-6)
CLASS_DEFAULTS = {"global_pool": "avg", "class_token": False, "fc_norm": False, "init_values": 1e-6}
# its own arguments, read here
ARGS = {"rel_pos_type": "mlp", "rel_pos_dim": None, "shared_rel_pos": False}
# every argument timm's constructor takes that vitkit reads (the names a `create_model` keyword may be)
NAMES = {"img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
         "mlp_ratio", "qkv_bias", "qk_norm", "init_values", "class_token", "fc_norm", "block_fn", *ARGS}


def arg_facts(arch: str, args: dict) -> dict:
    """vitkit config facts from VisionTransformerRelPos's constructor arguments, or a CheckpointError naming what
    vitkit does not implement."""
    kind = args.get("rel_pos_type", "mlp")
    if kind != "mlp":
        raise CheckpointError(f"timm's {arch} sets rel_pos_type={kind!r}; vitkit implements its 'mlp' (the log-spaced "
                              f"offsets' MLP, 'cr' mode) alone")
    pool = args.get("global_pool", "avg")
    if pool == "token" and args.get("fc_norm"):
        raise CheckpointError(f"timm's {arch} normalises after 'token' pooling; vitkit's fc_norm follows the average "
                              f"alone")
    return {"pos_embed": "relative_mlp", "rel_pos_dim": args.get("rel_pos_dim") or 128,
            "rel_pos_shared": bool(args.get("shared_rel_pos", False)), "class_token": bool(args.get("class_token")),
            "fc_norm": bool(args.get("fc_norm")) and pool == "avg", "final_norm": True}


def folder_args(c) -> tuple[str, dict]:
    """(timm's architecture, its constructor arguments) for a vitkit config with the relative position MLP: the
    `_rpn_` name for residual post-norm blocks (its block class), every other argument spelled out."""
    if c.classifier not in ("token", "gap"):
        raise CheckpointError(f"timm's VisionTransformerRelPos pools the class token or the patches' average, not "
                              f"{c.classifier!r}")
    if c.distilled or c.reg_tokens or c.hybrid_layers is not None or c.mlp_layer != "mlp" or c.norm != "layernorm" \
            or c.norm_eps != 1e-6 or c.act != "gelu" or c.pre_norm or c.patch_norm or c.attn_norm or not c.k_bias \
            or not c.proj_bias or not c.patch_bias or not c.final_norm or c.num_kv_heads is not None or c.rope:
        raise CheckpointError("timm's VisionTransformerRelPos is a plain pre-norm ViT around its relative position "
                              "MLP (GELU, LayerNorm eps 1e-6, at most a class token): this model has options it does "
                              "not build (export to vitkit)")
    if c.res_post_norm and c.init_values is not None:
        raise CheckpointError("timm's res-post-norm relpos block (ResPostRelPosBlock) has no LayerScale: this model "
                              f"has init_values={c.init_values} with res_post_norm (export to vitkit)")
    ratio = c.mlp_dim / c.embed_dim
    if int(c.embed_dim * ratio) != c.mlp_dim:
        raise CheckpointError(f"timm computes its MLP width as int(D * mlp_ratio), which cannot give {c.mlp_dim}")
    args = {"img_size": list(c.img_size), "patch_size": list(c.patch_size), "in_chans": c.in_chans,
            "num_classes": c.num_classes, "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads,
            "mlp_ratio": ratio, "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "class_token": bool(c.class_token),
            "global_pool": "avg" if c.classifier == "gap" else "token", "fc_norm": c.fc_norm, "rel_pos_type": "mlp",
            "rel_pos_dim": c.rel_pos_dim, "shared_rel_pos": c.rel_pos_shared}
    if not c.res_post_norm:
        args["init_values"] = c.init_values  # None: no LayerScale (timm's `if init_values`)
    arch = "vit_relpos_base_patch16_rpn_224" if c.res_post_norm else "vit_relpos_base_patch16_224"
    return arch, args
