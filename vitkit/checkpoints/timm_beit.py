"""timm's BEiT (`timm.models.beit`: BEiT, Bao et al. 2021; BEiT v2, Peng et al. 2022) <-> vitkit names: a ViT with a
learned relative position bias in every block (App. D.4's bias, with BEiT's three entries for the class token's rows
and columns), LayerScale, query and value biases without a key bias, and the mean of the patch tokens with a norm after
it (timm's `global_pool='avg'`, `use_fc_norm`).

The names map by one table, `RULES` (timm's pattern -> vitkit's, a `layouts.Layout`), read forwards to load and
backwards to export. timm's shared table (`use_shared_rel_pos_bias`: `rel_pos_bias.*`, added to every block's bias)
is summed into each block's own table: the same bias, and every resampling vitkit applies to a table is linear in it,
so the sum stays the same function at other grids too. The index buffers older files keep (`relative_position_index`) are a
function of the grid, rebuilt by the model.

At another resolution than its own, timm resamples the relative table along a geometric progression of the offsets
(`resize_rel_pos_bias_table`, in `set_input_size` and when a file is loaded at another img_size): recorded as
`pos_resample="geometric"`, which vitkit's relative bias computes the same way
(`layers.pos_embed.resample_offset_table`), at a fixed size (`vitkit.load(folder, img_size=...)`) or at any
(`dynamic_img_size`), always from the file's own table. For a non-square file timm's loader (`checkpoint_filter_fn`)
assumes a square table and fails; its `set_input_size` knows the grid, as vitkit does.
"""
from __future__ import annotations

import re

import torch

from . import layouts
from .io import CheckpointError, expect_shape
from .layouts import Layout, Rule

# timm's name -> vitkit's (`layouts.Rule`: "{i}" a block's index, "{w}" weight or bias), read forwards to load and
# backwards to export. An MLP's layers: timm's Mlp (fc1, fc2) or its SwiGLU (`swiglu_mlp`: fc1_g, fc1_x, the hidden
# norm of `scale_mlp`, fc2), the names vitkit's have.
_B = "blocks.{i}."
RULES: tuple[Rule, ...] = (
    Rule("cls_token", "cls_token"),
    Rule("pos_embed", "pos_embed.weight"),  # use_abs_pos_emb: (1, 1 + N, D), the class token's position first
    Rule("patch_embed.proj.{w}", "patch_embed.proj.{w}"),
    Rule(_B + "norm1.{w}", _B + "norm1.{w}"),
    Rule(_B + "attn.qkv.weight", _B + "attn.qkv.weight"),  # rows: q, k, v, each head-major
    Rule(_B + "attn.q_bias", _B + "attn.q_bias"),  # no key bias (vitkit's k_bias=False)
    Rule(_B + "attn.v_bias", _B + "attn.v_bias"),
    Rule(_B + "attn.relative_position_bias_table", _B + "attn.rel_pos.table"),  # ((2gh-1)(2gw-1) + 3, H)
    Rule(_B + "attn.relative_position_index", None, export=False),  # older files: a function of the grid, rebuilt
    Rule("rel_pos_bias.relative_position_index", None, export=False),
    Rule(_B + "attn.proj.{w}", _B + "attn.proj.{w}"),
    Rule(_B + "gamma_1", _B + "ls1.gamma"),
    Rule(_B + "norm2.{w}", _B + "norm2.{w}"),
    *(Rule(_B + f"mlp.{fc}.{{w}}", _B + f"mlp.{fc}.{{w}}") for fc in ("fc1", "fc1_g", "fc1_x", "norm", "fc2")),
    Rule(_B + "gamma_2", _B + "ls2.gamma"),
    Rule("norm.{w}", "norm.{w}"),  # after the blocks (token pooling, or use_fc_norm=False)
    Rule("fc_norm.{w}", "fc_norm.{w}"),  # after the average (use_fc_norm)
    Rule("head.{w}", "head.{w}"),
)
LAYOUT = Layout("BEiT", RULES, source="timm")
SHARED_TABLE = "rel_pos_bias.relative_position_bias_table"  # added to every block's bias: summed into each (below)


def is_timm_beit(keys) -> bool:
    """timm's Beit: a relative position table in the blocks' attention, or one shared by all."""
    return SHARED_TABLE in keys or any(re.fullmatch(r"blocks\.\d+\.attn\.relative_position_bias_table", k) for k in keys)


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A timm Beit state dict -> (vitkit state dict, config facts, unused keys)."""
    sd, unused = layouts.read(LAYOUT, {k: v for k, v in w.items() if k != SHARED_TABLE})
    shared = w.get(SHARED_TABLE)
    if shared is not None:  # one table for all blocks, added to each block's own: summed into each
        for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")}):
            key = f"blocks.{i}.attn.rel_pos.table"
            own = sd.get(key)
            sd[key] = shared.clone() if own is None else expect_shape(key, own, tuple(shared.shape), "the shared "
                                                                      "table's shape") + shared
    relative = "blocks.0.attn.rel_pos.table" in sd
    if relative and "pos_embed.weight" in sd:
        raise CheckpointError("timm's BEiT with an absolute position embedding beside its relative position bias "
                              "(use_abs_pos_emb with use_rel_pos_bias): vitkit's models have one kind")
    facts: dict = {"act": "gelu", "norm_eps": 1e-6}  # timm's Beit: exact GELU, timm's LayerNorm (eps 1e-6)
    if relative:
        facts["pos_resample"] = "geometric"  # timm's resize_rel_pos_bias_table (the docstring)
    return sd, facts, unused


def from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """vitkit weights of a model with a relative position bias -> timm Beit names (`to_vitkit` read backwards). The
    fused qkv bias an export hands over, (q, 0, v), is split into timm's query and value biases."""
    if config.qkv_bias and config.k_bias:
        raise CheckpointError("timm's Beit has query and value biases only; this model has a key bias (k_bias=True)")
    own = dict(sd)
    for k in [k for k in own if re.fullmatch(r"blocks\.\d+\.attn\.qkv\.bias", k)]:
        q, key_bias, value = own.pop(k).chunk(3)
        if key_bias.any():
            raise CheckpointError(f"{k}: a nonzero key bias, which timm's Beit has no place for")
        own[k[: -len("qkv.bias")] + "q_bias"], own[k[: -len("qkv.bias")] + "v_bias"] = q, value
    out, left = layouts.write(LAYOUT, own)
    if left:
        raise CheckpointError(f"{', '.join(left[:4])} {'has' if len(left) == 1 else 'have'} no place in timm's Beit (a "
                              f"ViT with a relative position bias, a class token and no other prefix tokens, "
                              f"LayerNorm, no inner norms)")
    return out


# ---- timm's constructor arguments --------------------------------------------------------------------------------

# Beit's own arguments, read here; the others (sizes, qkv_bias, mlp_ratio, scale_mlp, init_values, norm_layer,
# global_pool) are read as VisionTransformer's are. `head_init_scale` scales the head's initialisation alone.
ARGS = {"use_abs_pos_emb": True, "use_rel_pos_bias": False, "use_shared_rel_pos_bias": False, "use_fc_norm": None,
        "swiglu_mlp": False, "head_init_scale": 0.001}
CLASS_DEFAULTS = {"global_pool": "avg"}


def arg_facts(arch: str, args: dict) -> dict:
    """vitkit config facts from timm Beit's constructor arguments, or a CheckpointError naming what vitkit does not
    implement."""
    relative = bool(args.get("use_rel_pos_bias") or args.get("use_shared_rel_pos_bias"))
    absolute = bool(args.get("use_abs_pos_emb", True))
    if relative and absolute:
        raise CheckpointError(f"timm's {arch} has an absolute position embedding beside its relative position bias "
                              f"(use_abs_pos_emb with use_rel_pos_bias): vitkit's models have one kind")
    pool = args.get("global_pool", CLASS_DEFAULTS["global_pool"])
    fc_norm = args["use_fc_norm"] if args.get("use_fc_norm") is not None else pool == "avg"
    if fc_norm and pool != "avg":
        raise CheckpointError(f"timm's {arch} normalises after {pool!r} pooling; vitkit's fc_norm follows the average "
                              f"alone")
    facts = {"pos_embed": "relative" if relative else "learned_1d" if absolute else "none", "k_bias": False,
             "class_token": True, "fc_norm": bool(fc_norm), "final_norm": True, "rope": None, "rope_ref_grid": None}
    if relative:
        facts["pos_resample"] = "geometric"
    return facts


def check_buildable(arch: str, args: dict) -> None:
    """What vitkit builds as timm does, parameter for parameter: not one table shared by all blocks."""
    if args.get("use_shared_rel_pos_bias"):
        raise CheckpointError(f"timm's {arch} with use_shared_rel_pos_bias=True has one relative table for all "
                              f"blocks; vitkit's blocks have one each (a file of it loads: the shared table summed "
                              f"into every block's)")


def folder_args(c) -> dict:
    """timm Beit's constructor arguments for a vitkit config with a relative position bias (every one spelled out,
    so the registered architecture's own do not count)."""
    if c.classifier not in ("token", "gap"):
        raise CheckpointError(f"timm's Beit pools the class token or the patches' average, not {c.classifier!r}")
    ratio = c.mlp_dim / c.embed_dim
    if int(c.embed_dim * ratio) != c.mlp_dim:
        raise CheckpointError(f"timm's Beit computes its MLP width as int(D * mlp_ratio), which cannot give {c.mlp_dim}")
    return {"img_size": list(c.img_size), "patch_size": list(c.patch_size), "in_chans": c.in_chans,
            "num_classes": c.num_classes, "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads,
            "mlp_ratio": ratio, "qkv_bias": c.qkv_bias, "swiglu_mlp": c.mlp_layer == "swiglu", "scale_mlp": c.mlp_norm,
            "init_values": c.init_values, "use_abs_pos_emb": False, "use_rel_pos_bias": True,
            "use_shared_rel_pos_bias": False, "use_fc_norm": c.fc_norm,
            "global_pool": "avg" if c.classifier == "gap" else "token"}
