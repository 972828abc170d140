"""The architecture of a checkpoint, read from its tensors alone (vitkit names), with hints for the rest."""
from __future__ import annotations

import math
import re

import torch

from ..models import ResNetV2Config, ViTConfig
from ..models.layers.patch_embed import to_2tuple
from ..models.registry import VIT_SIZES
from ..models.resnet import backbone_stride
from .io import CheckpointError

# Width -> heads in the standard sizes (Table 1); used when a format does not store the head count.
HEADS_BY_WIDTH = {v["embed_dim"]: v["num_heads"] for v in VIT_SIZES.values()}


def _count(sd: dict, pattern: str) -> int:
    return len({m.group(1) for k in sd if (m := re.match(pattern, k))})


def _square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def _patches(img_size, patch) -> int | None:
    """The number of patches of a stated resolution, or None (no resolution, or not divisible)."""
    if img_size is None:
        return None
    h, w = to_2tuple(img_size)
    if h % patch[0] or w % patch[1]:
        return None
    return (h // patch[0]) * (w // patch[1])


def infer_vit_config(sd: dict[str, torch.Tensor], hints: dict, img_size_if_unknown=None) -> ViTConfig:
    """Width, depth, MLP size, patch size, grid (resolution), token vs gap, pre-logits, classes, hybrid stages.

    `hints` (format facts, then user overrides) supply what the tensors cannot: the number of heads
    (default: the standard table), numerics (GELU flavour, LayerNorm eps), and `img_size`, the checkpoint's own
    resolution where the file records it. Without it a square grid is assumed when the position embedding's
    length allows one; `img_size_if_unknown` (a resolution asked for by the caller) is taken as the checkpoint's
    only when nothing else can tell the grid (a non-square token count, no absolute position embedding).
    """
    hints = dict(hints)
    w = sd["patch_embed.proj.weight"]
    d, k = w.shape[0], tuple(w.shape[2:])
    depth = _count(sd, r"blocks\.(\d+)\.")
    swiglu = "blocks.0.mlp.fc1_g.weight" in sd
    fc1 = "blocks.0.mlp.fc1_g.weight" if swiglu else "blocks.0.mlp.fc1.weight"
    cfg: dict = dict(embed_dim=d, depth=depth, mlp_dim=sd[fc1].shape[0] if depth else 4 * d)
    cfg["mlp_layer"] = "swiglu" if swiglu else "mlp"
    cfg["mlp_norm"] = "blocks.0.mlp.norm.weight" in sd
    cfg["qkv_bias"] = "blocks.0.attn.qkv.bias" in sd or "blocks.0.attn.q_bias" in sd
    cfg["k_bias"] = "blocks.0.attn.q_bias" not in sd  # EVA-02: query and value biases only
    cfg["qk_norm"] = "blocks.0.attn.q_norm.weight" in sd
    cfg["attn_norm"] = "blocks.0.attn.norm.weight" in sd
    # AIMv2: RMSNorm (a weight, no bias), a norm on the patch tokens, no bias on the projections
    if depth:
        cfg["norm"] = "rmsnorm" if "blocks.0.norm1.bias" not in sd else "layernorm"
        cfg["proj_bias"] = "blocks.0.attn.proj.bias" in sd
    cfg["patch_norm"] = "patch_embed.norm.weight" in sd
    if "rope.freqs" in sd:  # ROPE-ViT-Mixed's learned frequencies (2, depth, heads, head_dim / 2): the head count
        cfg["rope"], cfg["rope_indexing"] = "mixed", "xy"  # (x, y) as ROPE-ViT and every timm mixed model
        hints.setdefault("num_heads", sd["rope.freqs"].shape[2])
    # LayerScale: the value it was initialised with is not in the file (and changes nothing once trained)
    stated_init = hints.pop("init_values", None)
    cfg["init_values"] = (stated_init or 1e-5) if "blocks.0.ls1.gamma" in sd else None
    cfg["attn_only_layer_scale"] = "blocks.0.ls1.gamma" in sd and "blocks.0.ls2.gamma" not in sd  # (Sapiens2)
    if "blocks.0.attn.lambda_q1" in sd:  # differential attention (timm's DiffAttention)
        cfg["attn_layer"] = "diff"
    cfg["class_token"] = "cls_token" in sd
    cfg["distilled"] = "dist_token" in sd  # DeiT's distillation token (timm's names)
    cfg["reg_tokens"] = sd["reg_token"].shape[1] if "reg_token" in sd else 0
    cfg["mpp"] = "mpp_head.weight" in sd
    cfg["fc_norm"] = "fc_norm.weight" in sd
    cfg["final_norm"] = "norm.weight" in sd or cfg["fc_norm"]  # the Perception Encoder's aligned towers: none
    cfg["pre_norm"] = "norm_pre.weight" in sd
    cfg["patch_bias"] = "patch_embed.proj.bias" in sd
    cfg["classifier"] = ("map" if "attn_pool.latent" in sd else
                         "token" if cfg["class_token"] and not cfg["fc_norm"] else "gap")
    if "attn_pool.mlp.fc1.weight" in sd and sd["attn_pool.mlp.fc1.weight"].shape[0] != cfg["mlp_dim"]:
        cfg["pool_mlp_dim"] = sd["attn_pool.mlp.fc1.weight"].shape[0]
    elif "attn_pool.latent" in sd and "attn_pool.mlp.fc1.weight" not in sd:
        cfg["pool_mlp_dim"] = 0  # a pooling without its MLP (AIMv2's)
    cfg["representation_size"] = sd["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in sd else None
    cfg["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    # hybrid: ResNet stages and width; the embedding kernel sits on the backbone's feature map
    if "patch_embed.backbone.stem.conv.weight" in sd:
        stem = sd["patch_embed.backbone.stem.conv.weight"]
        stages = _count(sd, r"patch_embed\.backbone\.stages\.(\d+)\.")
        cfg["hybrid_layers"] = tuple(_count(sd, rf"patch_embed\.backbone\.stages\.{s}\.blocks\.(\d+)\.") for s in range(stages))
        cfg["hybrid_width"] = stem.shape[0] / 64
        cfg["in_chans"] = stem.shape[1]
        # a file does not record whether the stem pools (no weights): the paper's does, unless told otherwise
        pool = hints.pop("hybrid_stem_pool", True)
        if not isinstance(pool, bool):
            raise CheckpointError(f"hybrid_stem_pool must be True or False, got {pool!r}")
        cfg["hybrid_stem_pool"] = pool
        # BatchNorm's running statistics name the norm kind (GroupNorm has none)
        cfg["hybrid_norm"] = "batch" if "patch_embed.backbone.stem.norm.running_var" in sd else "group"
        stride = backbone_stride(cfg["hybrid_layers"], cfg["hybrid_stem_pool"])
        patch = (k[0] * stride, k[1] * stride)
    elif "patch_embed.backbone.0.conv.weight" in sd:  # a conv stem (MobileCLIP's MCi): each layer's channels, kernel
        n = _count(sd, r"patch_embed\.backbone\.(\d+)\.conv\.weight")
        convs = [sd[f"patch_embed.backbone.{i}.conv.weight"] for i in range(n)]
        if any(c.ndim != 4 or c.shape[2] != c.shape[3] or not c.shape[2] for c in convs) or 0 in k:
            raise CheckpointError(f"conv stem kernels {[tuple(c.shape) for c in convs]} and patch embedding "
                                  f"{tuple(w.shape)}: vitkit's are square, at least 1x1")
        kernels = tuple(c.shape[2] for c in convs)
        stated = hints.pop("conv_stem_strides", None)
        # A file does not record a conv's stride. Patchify convs (stride = kernel, padding 0: MCi's 4, 2 and the
        # 2x2 embedding) have power-of-two kernels; odd ones are overlapping convs (timm's default ConvStem: 3x3,
        # stride 2, padding 1), whose strides vitkit will not guess.
        if not stated and any(n & (n - 1) for n in (*kernels, *k)):
            raise CheckpointError(f"conv stem kernels {kernels} with a {k[0]}x{k[1]} patch embedding: a file does not "
                                  f"record its strides, and these are not patchify kernels (stride = kernel, as "
                                  f"MobileCLIP's MCi, 4, 2 and 2) but overlapping ones such as timm's default ConvStem "
                                  f"(3x3, stride 2); pass conv_stem_strides= (vitkit's last conv, the patch "
                                  f"embedding, always has stride = kernel)")
        strides = tuple(stated or kernels)  # the file cannot tell: patchify, as MCi
        strides = () if strides == kernels else strides
        cfg.update(conv_stem=tuple(c.shape[0] for c in convs), conv_stem_kernels=kernels, conv_stem_strides=strides,
                   in_chans=convs[0].shape[1])
        stride = math.prod(strides or kernels)
        patch = (k[0] * stride, k[1] * stride)
    else:
        cfg["in_chans"] = w.shape[1]
        patch = k
    cfg["patch_size"] = patch
    # position embedding -> kind and grid
    prefix = int(cfg["class_token"]) + int(cfg["distilled"]) + cfg["reg_tokens"]
    if "pos_embed.weight" in sd:
        cfg["pos_embed"] = "learned_1d"
        length = sd["pos_embed.weight"].shape[1]
        # Does it cover the prefix tokens (the paper) or the patches alone (no_embed_class: DeiT-III, DINOv2 with
        # registers)? The file's resolution tells; else the one of the two counts that is a square grid.
        nec = hints.pop("no_embed_class", None)
        if nec is None and prefix:
            stated_n = _patches(hints.get("img_size"), patch)
            if stated_n is not None:
                nec = stated_n == length
            else:
                nec = not _square(length - prefix) and _square(length)
        cfg["no_embed_class"] = bool(nec)
        n = length - (0 if nec else prefix)
        grid = None
    elif "pos_embed.row" in sd:
        cfg["pos_embed"] = "learned_2d"
        grid = (sd["pos_embed.row"].shape[0], sd["pos_embed.col"].shape[0])
        n = grid[0] * grid[1]
    elif "blocks.0.attn.rel_pos.table" in sd:
        cfg["pos_embed"] = "relative"
        t = sd["blocks.0.attn.rel_pos.table"]
        cells = t.shape[0] - (3 if prefix else 0)  # (2gh - 1)(2gw - 1)
        n, grid, rel_cells = None, None, cells
        side = math.isqrt(cells)
        if side * side == cells and side % 2:
            grid = ((side + 1) // 2,) * 2
        hints.setdefault("num_heads", t.shape[1])
    elif "blocks.0.attn.rel_pos.mlp.fc1.weight" in sd or "shared_rel_pos.mlp.fc1.weight" in sd:
        # the relative position MLP (timm's ViT-RelPos): no table, any grid; its width and the heads from its layers
        fc = "shared_rel_pos.mlp." if "shared_rel_pos.mlp.fc1.weight" in sd else "blocks.0.attn.rel_pos.mlp."
        cfg.update(pos_embed="relative_mlp", rel_pos_dim=sd[fc + "fc1.weight"].shape[0],
                   rel_pos_shared=fc.startswith("shared"))
        hints.setdefault("num_heads", sd[fc + "fc2.weight"].shape[0])
        n, grid = None, None
    else:
        cfg["pos_embed"] = hints.get("pos_embed", "none")
        n, grid = None, None

    def grid_of(size) -> tuple[int, int]:
        h, w = to_2tuple(size)
        if h % patch[0] or w % patch[1]:
            raise CheckpointError(f"img_size {(h, w)} is not divisible by the checkpoint's patch size {patch}")
        return (h // patch[0], w // patch[1])

    stated = hints.pop("img_size", None)
    if cfg["pos_embed"] == "relative" and stated is not None:  # the stated size must be one the tables are for
        g = grid_of(stated)
        if (2 * g[0] - 1) * (2 * g[1] - 1) != rel_cells:
            tables = f"a {grid[0]}x{grid[1]} grid" if grid else f"{rel_cells} relative positions"
            raise CheckpointError(f"img_size {to_2tuple(stated)} is a {g[0]}x{g[1]} grid, but the checkpoint's "
                                  f"relative position tables are for {tables}")
        grid = g
    if grid is None and stated is not None:
        grid = grid_of(stated)
        if n is not None and grid[0] * grid[1] != n:
            raise CheckpointError(f"img_size {to_2tuple(stated)} is a {grid[0]}x{grid[1]} grid, but the checkpoint's "
                                  f"position embedding holds {n} patches")
    if grid is None and n is not None and math.isqrt(n) ** 2 == n:
        grid = (math.isqrt(n),) * 2
    if grid is None and img_size_if_unknown is not None:
        g = grid_of(img_size_if_unknown)
        if n is None or g[0] * g[1] == n:
            grid = g
    if grid is None:
        if n is None:
            raise CheckpointError("cannot tell the resolution of this checkpoint from its tensors: pass img_size=")
        raise CheckpointError(f"the position embedding holds {n} patches, not a square grid: pass the checkpoint's "
                              f"img_size=(H, W)")
    cfg["img_size"] = (grid[0] * patch[0], grid[1] * patch[1])
    heads = hints.pop("num_heads", None) or HEADS_BY_WIDTH.get(d)
    if heads is None:
        raise CheckpointError(f"this format does not store the number of heads and width {d} is not a standard "
                              f"size: pass num_heads=")
    cfg["num_heads"] = heads
    cfg.update({k: v for k, v in hints.items() if k not in ("img_size",)})
    try:
        return ViTConfig(**cfg)
    except TypeError as e:
        raise CheckpointError(f"unknown option for a vit model: {e}") from e


def infer_resnetv2_config(sd: dict[str, torch.Tensor], hints: dict) -> ResNetV2Config:
    stem = sd["stem.conv.weight"]
    stages = _count(sd, r"stages\.(\d+)\.")
    layers = tuple(_count(sd, rf"stages\.{s}\.blocks\.(\d+)\.") for s in range(stages))
    channels = tuple(sd[f"stages.{s}.blocks.0.conv3.weight"].shape[0] for s in range(stages))
    cfg = dict(layers=layers, channels=channels, stem_width=stem.shape[0], in_chans=stem.shape[1],
               num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
               width_factor=max(1, stem.shape[0] // 64))
    hints = {k: v for k, v in hints.items() if k not in ("act", "norm_eps")}
    cfg.update(hints)
    try:
        return ResNetV2Config(**cfg)
    except TypeError as e:
        raise CheckpointError(f"unknown option for a resnetv2 (BiT) model: {e}") from e
