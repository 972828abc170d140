"""timm's SAM image encoder (`timm.models.vision_transformer_sam.VisionTransformerSAM`: samvit_base_patch16,
samvit_large_patch16, samvit_huge_patch16, samvit_base_patch16_224) <-> vitkit's `SamVisionTransformer`; also the
image encoder of SAM's own release files (facebookresearch/segment-anything: `image_encoder.` before every name, the
MLP's `lin1` / `lin2`), which timm converts the same way.

The names map by one table, `RULES` (a `layouts.Layout`), read forwards to load and backwards to export: timm's names
are vitkit's except the neck (timm's `nn.Sequential`, `neck.0` .. `neck.3`; a LayerNorm2d alone, `neck`, without
one) and the classifier (`head.fc`). What the tensors cannot tell, the windows (which blocks are global, the window's
side where no table shows it) and the resolution of a file without a position embedding, comes from timm's
config.json (the architecture's registered arguments, the folder's `model_args` over them) or the caller.
"""
from __future__ import annotations

import re

import torch

from . import layouts
from .io import CheckpointError
from .layouts import Layout, Rule
from ..models.samvit import SamViTConfig

_B = "blocks.{i}."
_NOT_HELD = ("{key}: timm's SAM ViT with {what}, which vitkit's SAM image encoder does not implement")
RULES: tuple[Rule, ...] = (
    Rule("pos_embed", "pos_embed"),  # (1, gh, gw, D): the patch grid, no class token
    Rule("patch_embed.proj.{w}", "patch_embed.proj.{w}"),
    Rule(_B + "norm1.{w}", _B + "norm1.{w}"),
    Rule(_B + "attn.qkv.{w}", _B + "attn.qkv.{w}"),  # rows: q, k, v, each head-major
    Rule(_B + "attn.rel_pos_h", _B + "attn.rel_pos_h"),  # (2h - 1, hd): h the window's side, or the map's rows
    Rule(_B + "attn.rel_pos_w", _B + "attn.rel_pos_w"),
    Rule(_B + "attn.proj.{w}", _B + "attn.proj.{w}"),
    Rule(_B + "norm2.{w}", _B + "norm2.{w}"),
    Rule(_B + "mlp.fc1.{w}", _B + "mlp.fc1.{w}"),
    Rule(_B + "mlp.fc2.{w}", _B + "mlp.fc2.{w}"),
    Rule(_B + "mlp.lin1.{w}", _B + "mlp.fc1.{w}", export=False),  # SAM's own names
    Rule(_B + "mlp.lin2.{w}", _B + "mlp.fc2.{w}", export=False),
    Rule("neck.0.weight", "neck.conv1.weight"),  # 1x1, D -> C, no bias
    Rule("neck.1.{w}", "neck.norm1.{w}"),  # LayerNorm2d, eps 1e-6
    Rule("neck.2.weight", "neck.conv2.weight"),  # 3x3, C -> C, no bias
    Rule("neck.3.{w}", "neck.norm2.{w}"),
    Rule("neck.{w}", "neck.norm.{w}"),  # neck_chans=None: a LayerNorm2d over D alone
    Rule("head.fc.{w}", "head.{w}"),
    # SAM's release: the prompt encoder and the mask decoder beside the image encoder, not this model's
    Rule("prompt_encoder.{*}", None, top=True),
    Rule("mask_decoder.{*}", None, top=True),
    # timm's options vitkit does not implement, refused by name
    *(Rule(_B + f"attn.{n}.{{w}}", refuse=_NOT_HELD.replace("{what}", "qk_norm")) for n in ("q_norm", "k_norm")),
    *(Rule(_B + f"{n}.gamma", refuse=_NOT_HELD.replace("{what}", "LayerScale (init_values)")) for n in ("ls1", "ls2")),
    Rule("norm_pre.{w}", refuse=_NOT_HELD.replace("{what}", "a norm before the blocks (pre_norm)")),
    Rule("head.{*}", refuse=_NOT_HELD.replace("{what}", "an MLP head (head_hidden_size)")),
)
LAYOUT = Layout("SAM ViT", RULES, source="timm", prefixes=("image_encoder.",))


def is_timm_sam(keys) -> bool:
    """timm's SAM ViT (or SAM's own image encoder): the neck, or decomposed relative tables in the blocks."""
    return any(re.fullmatch(r"(image_encoder\.)?(neck\.(\d\.)?weight|blocks\.\d+\.attn\.rel_pos_h)", k) for k in keys)


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A timm SAM ViT state dict (or SAM's release file) -> (vitkit state dict, config facts, unused keys). SAM's own
    code builds its blocks' LayerNorms with eps 1e-6 (`build_sam.py`); timm's with PyTorch's default 1e-5."""
    sd, unused = layouts.read(LAYOUT, w)
    release = any(k.startswith(LAYOUT.prefixes) for k in w)
    return sd, ({"norm_eps": 1e-6} if release else {}), unused


def from_vitkit(sd: dict[str, torch.Tensor], config: SamViTConfig) -> dict[str, torch.Tensor]:
    """vitkit's SAM image encoder -> timm's names (`to_vitkit` read backwards)."""
    out, left = layouts.write(LAYOUT, sd)
    if left:
        raise CheckpointError(f"{', '.join(left[:4])} {'has' if len(left) == 1 else 'have'} no place in timm's SAM ViT")
    return out


# ---- timm's constructor arguments --------------------------------------------------------------------------------

# VisionTransformerSAM's defaults, where vitkit reads them (timm 1.0.31)
DEFAULTS = {"img_size": 1024, "patch_size": 16, "in_chans": 3, "embed_dim": 768, "depth": 12, "num_heads": 12,
            "mlp_ratio": 4.0, "qkv_bias": True, "use_abs_pos": True, "use_rel_pos": False, "window_size": 14,
            "global_attn_indexes": (), "neck_chans": 256, "global_pool": "avg"}
# the arguments vitkit takes at their default only: {name: (the defaults that mean "off", what it is)}
_ONLY_DEFAULT = {"qk_norm": ((None, False), "qk_norm (a norm of queries and keys)"),
                 "init_values": ((None, 0, 0.0), "LayerScale (init_values)"),
                 "pre_norm": ((None, False), "a norm before the blocks (pre_norm)"),
                 "use_rope": ((None, False), "rotary embeddings (use_rope)"),
                 "ref_feat_shape": ((None,), "rotary embeddings' reference grids (ref_feat_shape)"),
                 "head_hidden_size": ((None, 0), "an MLP head (head_hidden_size)"),
                 "embed_layer": ((None,), "another patch embedding (embed_layer)"),
                 "block_fn": ((None, "Block"), "another block (block_fn)"),
                 "mlp_layer": ((None, "Mlp"), "another MLP (mlp_layer)"),
                 "act_layer": ((None, "gelu", "GELU"), "another activation (act_layer)"),
                 "global_pool": (("avg",), "another pooling than the mean (global_pool)")}
# SAM's constructor arguments as create_model passes them (`timm_names.split_kwargs`)
ARGS = set(DEFAULTS) | set(_ONLY_DEFAULT) | {"num_classes", "norm_layer"}


def _norm_eps(arch: str, norm) -> float:
    """The blocks' LayerNorm eps from timm's norm_layer (None: nn.LayerNorm, eps 1e-5)."""
    if norm in (None, "LayerNorm", "layernorm"):
        return 1e-5
    if isinstance(norm, dict) and norm.get("partial") == "LayerNorm" and set(norm) <= {"partial", "eps"}:
        return float(norm.get("eps", 1e-5))
    raise CheckpointError(f"timm's {arch} sets norm_layer={norm!r}; vitkit's SAM image encoder has LayerNorm")


def _check_held(arch: str, args: dict) -> None:
    for key, (off, what) in _ONLY_DEFAULT.items():
        if key in args and args[key] not in off:
            raise CheckpointError(f"timm's {arch} sets {key}={args[key]!r}: {what}, which vitkit's SAM image encoder "
                                  f"does not implement")


def _window(v) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise CheckpointError(f"SAM ViT window_size={v!r}: must be a non-negative integer (0: every block global)")
    return v or None  # timm's 0: no windows, every block global


def _indexes(v) -> tuple[int, ...]:
    """global_attn_indexes as a tuple of block indexes, or a CheckpointError naming the field."""
    if not isinstance(v, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in v):
        raise CheckpointError(f"SAM ViT global_attn_indexes={v!r}: must be a list of block indexes (integers), e.g. "
                              f"[2, 5, 8, 11]")
    return tuple(v)


def _global_blocks(a: dict) -> tuple[int, ...]:
    """timm's global_attn_indexes of blocks that exist (timm asks `i in global_attn_indexes` of each block: an index
    past the depth names none, as the registered (2, 5, 8, 11) in a shallower model)."""
    depth = a["depth"]
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise CheckpointError(f"SAM ViT depth={depth!r}: must be an integer")
    return tuple(i for i in _indexes(a["global_attn_indexes"]) if 0 <= i < depth)


def _tables(sd: dict[str, torch.Tensor], d: int) -> tuple[int, dict[int, tuple[int, int]]]:
    """The blocks' count and, where the model has decomposed relative positions, each block's table lengths; a
    CheckpointError naming the missing blocks or tables, or a table of another shape than (2n - 1, head dim)."""
    found = sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    missing = sorted(set(range(len(found) and found[-1] + 1)) - set(found))
    if missing:
        raise CheckpointError(f"the SAM ViT's blocks are {found}: block{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} {'are' if len(missing) > 1 else 'is'} missing")
    depth = len(found)
    names = [f"blocks.{i}.attn.rel_pos_{a}" for i in range(depth) for a in "hw"]
    if not any(n in sd for n in names):
        return depth, {}
    absent = [n for n in names if n not in sd]
    if absent:
        raise CheckpointError(f"the SAM ViT's relative position tables are missing from {len(absent)} of its "
                              f"{len(names)} places: {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}")
    hd = sd[names[0]].shape[-1] if sd[names[0]].ndim == 2 else None
    for n in names:
        t = sd[n]
        if t.ndim != 2 or not t.shape[0] or not t.shape[1] or t.shape[1] != hd or d % t.shape[1]:
            raise CheckpointError(f"{n} has shape {tuple(t.shape)}: a SAM ViT's relative table is (2n - 1, head dim) "
                                  f"with one head dim for every table, a divisor of the width {d}")
    return depth, {i: (sd[f"blocks.{i}.attn.rel_pos_h"].shape[0], sd[f"blocks.{i}.attn.rel_pos_w"].shape[0])
                   for i in range(depth)}


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (list, tuple)) else (v, v)


def _preprocessing(pre: dict) -> dict:
    facts = {k: (tuple(pre[k]) if k in ("mean", "std") else pre[k])
             for k in ("mean", "std", "interpolation", "crop_pct") if k in pre}
    labels = pre.get("label_names")
    if isinstance(labels, list):
        facts["class_names"] = [str(x) for x in labels]
    return facts


def config_fields(arch: str, args: dict, pre: dict) -> dict:
    """vitkit SamViTConfig fields of `VisionTransformerSAM(**args)` (timm's registered arguments, the user's over
    them), or a CheckpointError naming what vitkit does not implement."""
    _check_held(arch, args)
    a = {**DEFAULTS, **args}
    return {"img_size": _pair(a["img_size"]), "patch_size": _pair(a["patch_size"]), "in_chans": a["in_chans"],
            "num_classes": a.get("num_classes", 0), "embed_dim": a["embed_dim"], "depth": a["depth"],
            "num_heads": a["num_heads"], "mlp_ratio": float(a["mlp_ratio"]), "qkv_bias": a["qkv_bias"],
            "window_size": _window(a["window_size"]), "global_attn_indexes": _global_blocks(a),
            "use_abs_pos": a["use_abs_pos"], "use_rel_pos": a["use_rel_pos"], "neck_chans": a["neck_chans"] or 0,
            "norm_eps": _norm_eps(arch, args.get("norm_layer")), **_preprocessing(pre)}


def folder_facts(cfg: dict, args: dict) -> dict:
    """What a timm SAM folder's config.json states beside its tensors (read as timm reads it: `args`, the registered
    arguments with model_args over them): the windows, the resolution, the heads, the preprocessing."""
    arch = cfg.get("architecture", "samvit")
    _check_held(arch, args)
    a = {**DEFAULTS, **args}
    facts = {"img_size": _pair(a["img_size"]), "window_size": _window(a["window_size"]),
             "global_attn_indexes": _global_blocks(a), "num_heads": a["num_heads"],
             "norm_eps": _norm_eps(arch, args.get("norm_layer")), **_preprocessing(cfg.get("pretrained_cfg") or {})}
    labels = cfg.get("label_names")
    if isinstance(labels, list):
        facts["class_names"] = [str(x) for x in labels]
    return facts


def folder_config(c: SamViTConfig) -> dict:
    """timm's config.json for a vitkit SAM image encoder (architecture + every constructor argument + pretrained_cfg)."""
    if c.norm_eps != 1e-5:
        raise CheckpointError(f"timm's SAM ViT has LayerNorm eps 1e-5 (norm_layer=nn.LayerNorm); this model's is "
                              f"{c.norm_eps}")
    patch = c.patch_size[0] if c.patch_size[0] == c.patch_size[1] else list(c.patch_size)
    args = {"img_size": list(c.img_size), "patch_size": patch, "in_chans": c.in_chans, "num_classes": c.num_classes,
            "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads, "mlp_ratio": c.mlp_ratio,
            "qkv_bias": c.qkv_bias, "window_size": c.window_size or 0,
            "global_attn_indexes": list(c.global_attn_indexes), "use_abs_pos": c.use_abs_pos,
            "use_rel_pos": c.use_rel_pos, "neck_chans": c.neck_chans}
    cfg = {"architecture": "samvit_base_patch16", "num_classes": c.num_classes, "num_features": c.num_features,
           "global_pool": "avg", "model_args": args,
           "pretrained_cfg": {"input_size": [c.in_chans, *c.img_size], "fixed_input_size": True,
                              "interpolation": c.interpolation, "crop_pct": c.crop_pct, "crop_mode": "center",
                              "mean": list(c.mean), "std": list(c.std), "num_classes": c.num_classes,
                              "first_conv": "patch_embed.proj", "classifier": "head.fc"}}
    if c.class_names:
        cfg["label_names"] = list(c.class_names)
    return cfg


# ---- the architecture from the tensors ------------------------------------------------------------------------

def infer_config(sd: dict[str, torch.Tensor], hints: dict, img_size_if_unknown=None) -> SamViTConfig:
    """Width, depth, patch, MLP, neck, head and (from the relative tables) the heads from the tensors; the grid from
    the position embedding; the windows from the tables where they tell them (a table of the grid's is a global
    block's), else from `hints` (a config.json's, or the caller's: window_size, global_attn_indexes, img_size)."""
    hints = dict(hints)
    if "global_attn_indexes" in hints:
        hints["global_attn_indexes"] = _indexes(hints["global_attn_indexes"])
    if "window_size" in hints:
        hints["window_size"] = _window(hints["window_size"])
    w = sd["patch_embed.proj.weight"]
    d, patch = w.shape[0], tuple(w.shape[2:])
    depth, tables = _tables(sd, d)
    rel = bool(tables)
    cfg: dict = {"embed_dim": d, "depth": depth, "patch_size": patch, "in_chans": w.shape[1],
                 "qkv_bias": "blocks.0.attn.qkv.bias" in sd, "use_abs_pos": "pos_embed" in sd, "use_rel_pos": rel,
                 "neck_chans": sd["neck.conv1.weight"].shape[0] if "neck.conv1.weight" in sd else 0,
                 "num_classes": sd["head.weight"].shape[0] if "head.weight" in sd else 0}
    if depth:
        cfg["mlp_ratio"] = sd["blocks.0.mlp.fc1.weight"].shape[0] / d
    if rel:
        cfg["num_heads"] = d // sd["blocks.0.attn.rel_pos_h"].shape[1]
    elif "num_heads" not in hints:
        raise CheckpointError("a SAM ViT without relative positions: its tensors do not tell its heads; pass "
                              "num_heads=")
    img, stated = hints.get("img_size"), [i for i in hints.get("global_attn_indexes", ()) if i in tables]
    if "pos_embed" in sd:
        grid = tuple(sd["pos_embed"].shape[1:3])
    elif img is not None:
        grid = tuple(s // p for s, p in zip(_pair(img), patch))
    elif stated:  # a global block's tables are the grid's
        grid = tuple((n + 1) // 2 for n in tables[stated[0]])
    elif img_size_if_unknown is not None:
        grid = tuple(s // p for s, p in zip(_pair(img_size_if_unknown), patch))
    else:
        raise CheckpointError("a SAM ViT without a position embedding: its tensors do not tell its resolution; pass "
                              "img_size=")
    cfg["img_size"] = tuple(g * p for g, p in zip(grid, patch))
    if "window_size" not in hints:  # the windowed blocks' tables tell the window's side
        on_grid = (2 * grid[0] - 1, 2 * grid[1] - 1)
        stated = hints.get("global_attn_indexes")
        if stated is not None and any(not 0 <= i < depth for i in stated):
            raise CheckpointError(f"global_attn_indexes {list(stated)}: the file's blocks are 0 .. {depth - 1}; pass "
                                  f"the model's own global_attn_indexes=")
        windowed = {i: t for i, t in tables.items() if (i not in stated if stated is not None else t != on_grid)}
        sides = set(windowed.values())
        if not tables:  # vitkit.load takes window_size= for a Swin only: the window comes with timm's config.json
            raise CheckpointError("a SAM ViT without relative position tables: its window's side does not show in "
                                  "its tensors; load it from its timm folder (config.json's model_args window_size and "
                                  "global_attn_indexes)")
        if len(sides) > 1 or any(h != w for h, w in sides) or (not sides and stated is None):
            raise CheckpointError("the SAM ViT's windows do not show in its tensors (which blocks attend globally, "
                                  "and the window's side): pass global_attn_indexes= (or, for a bare timm file, its "
                                  "architecture='samvit_base_patch16' ...)")
        cfg["window_size"] = (sides.pop()[0] + 1) // 2 if sides else None  # every block global: no windows
        cfg["global_attn_indexes"] = tuple(i for i in tables if i not in windowed)
    cfg.update({k: v for k, v in hints.items() if k not in ("act",)})
    cfg["img_size"] = _pair(cfg["img_size"])
    try:
        config = SamViTConfig(**cfg)
    except TypeError as e:
        raise CheckpointError(f"unknown option for a SAM ViT: {e}") from e
    for i, t in tables.items():  # the tables must be those of the windows and grid the config lays out
        win = config.block_window(i)
        want = (2 * win - 1,) * 2 if win else tuple(2 * g - 1 for g in config.grid_size)
        if t != want:
            where = f"{win}x{win} windows" if win else f"the {config.grid_size[0]}x{config.grid_size[1]} patch grid"
            raise CheckpointError(f"block {i}'s relative tables have {t} rows, not those of {where} {want}: pass the "
                                  f"model's own img_size= and global_attn_indexes= (the window's side: its tables', or "
                                  f"config.json's model_args window_size)")
    return config
