"""Apple's MobileCLIP release files (`mobileclip_b.pt`, `mobileclip_blt.pt`: the whole CLIP model) -> vitkit's MCi
image encoder, the ViT on a conv stem that timm builds as `vit_base_mci_224` and converts these files to
(`vision_transformer_hybrid._convert_mobileclip`).

The image tower's names map by one table (`RULES`, a `layouts.Layout`): the conv stem's blocks (`patch_emb.{i}.block.conv`
/ `.norm`; the third conv is the patch embedding), the pre-norm blocks (`transformer.{i}.pre_norm_mha`, `pre_norm_ffn`),
the position embedding (1, 1, N, D) over the patches alone and the CLIP projection (`classifier.proj`, (D, E): vitkit's
head, transposed, with a zero bias as timm gives it). The text tower and the logit scale are left unused. Everything
else the file does not say is timm's `vit_base_mci_224` (exact GELU, LayerNorm eps 1e-6, its preprocessing).
"""
from __future__ import annotations

import re

import torch

from ..models.layers.conv_stem import check_batchnorm_stats
from . import layouts, timm
from .infer import HEADS_BY_WIDTH
from .io import CheckpointError
from .layouts import Layout, Rule

_M = "image_encoder.model."
_B = _M + "transformer.{i}."
_V = "blocks.{i}."
RULES: tuple[Rule, ...] = (
    Rule(_M + "patch_emb.2.block.conv.{w}", "patch_embed.proj.{w}"),  # the stem's last conv: the patch embedding
    Rule(_M + "patch_emb.{i}.block.conv.weight", "patch_embed.backbone.{i}.conv.weight"),
    Rule(_M + "patch_emb.{i}.block.norm.{*}", "patch_embed.backbone.{i}.bn.{*}"),  # BatchNorm, running statistics too
    Rule(_M + "cls_token", "cls_token"),
    Rule(_M + "pos_embed.pos_embed.pos_embed", "pos_embed.weight", transform="lead_one"),  # (1, 1, N, D)
    Rule(_B + "pre_norm_mha.0.{w}", _V + "norm1.{w}"),
    Rule(_B + "pre_norm_mha.1.qkv_proj.{w}", _V + "attn.qkv.{w}"),
    Rule(_B + "pre_norm_mha.1.out_proj.{w}", _V + "attn.proj.{w}"),
    Rule(_B + "pre_norm_ffn.0.{w}", _V + "norm2.{w}"),
    Rule(_B + "pre_norm_ffn.1.{w}", _V + "mlp.fc1.{w}"),
    Rule(_B + "pre_norm_ffn.4.{w}", _V + "mlp.fc2.{w}"),
    Rule(_M + "post_transformer_norm.{w}", "norm.{w}"),
    Rule(_M + "classifier.proj", "head.weight", transform="transposed"),  # (D, E): the CLIP image projection
    Rule(None, "head.bias", fill="zeros_rows", like="head.weight", why="MobileCLIP's projection has no bias"),
    Rule("text_encoder.{*}", None),  # the text tower
    Rule("logit_scale", None),
)
LAYOUT = Layout("MobileCLIP release", RULES, source="Apple's")
FIRST = _M + "patch_emb.0.block.conv.weight"
ARCH = "vit_base_mci_224"  # the architecture timm converts these files to


def is_release(keys) -> bool:
    return FIRST in keys


def _check_release(w: dict[str, torch.Tensor]) -> None:
    """What the table cannot check before it maps the names: the stem's three layers (the third the patch
    embedding), square kernels of a positive size, the position embedding (1, 1, N, D), the projection (D, E)."""
    stem = sorted({int(m.group(1)) for k in w if (m := re.match(re.escape(_M) + r"patch_emb\.(\d+)\.", k))})
    if stem != [0, 1, 2]:
        extra = [k for k in w if k.startswith(_M + "patch_emb.") and not re.match(re.escape(_M) + r"patch_emb\.[012]\.", k)]
        raise CheckpointError(f"MobileCLIP release stem layers {stem} ({', '.join(extra[:2]) or 'missing layers'}): "
                              f"MobileCLIP's MCi stem has patch_emb.0 .. 2, the third conv the patch embedding")
    for i in range(3):
        k = f"{_M}patch_emb.{i}.block.conv.weight"
        t = w.get(k)
        if t is None or t.ndim != 4 or t.shape[2] != t.shape[3] or not t.shape[2] or not all(t.shape):
            raise CheckpointError(f"{k} has shape {None if t is None else tuple(t.shape)}: a conv (out, in, k, k) with "
                                  f"a square kernel of at least 1x1")
    d = w[_M + "patch_emb.2.block.conv.weight"].shape[0]
    pos = w.get(_M + "pos_embed.pos_embed.pos_embed")
    if pos is not None and (pos.ndim != 4 or tuple(pos.shape[:2]) != (1, 1) or pos.shape[3] != d or not pos.shape[2]):
        raise CheckpointError(f"{_M}pos_embed.pos_embed.pos_embed has shape {tuple(pos.shape)}: MobileCLIP's position "
                              f"embedding is (1, 1, N, {d})")
    proj = w.get(_M + "classifier.proj")
    if proj is not None and (proj.ndim != 2 or proj.shape[0] != d or not proj.shape[1]):
        raise CheckpointError(f"{_M}classifier.proj has shape {tuple(proj.shape)}: MobileCLIP's image projection is "
                              f"(width {d}, embedding dim)")


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(vitkit state dict, the facts of timm's vit_base_mci_224, the keys left unused: the text tower's). A file of
    another width or depth than vit_base_mci_224's (768, 12) does not get its 12 heads: the tensors cannot tell
    the heads, so the caller's num_heads= (or, for a standard ViT width, the standard table's, with a note)."""
    _check_release(w)
    check_batchnorm_stats(w, _M + "patch_emb.")
    sd, unused = layouts.read(LAYOUT, w)
    sd = timm.conv_stem_to_vitkit(sd)
    facts = timm.architecture_facts(ARCH)
    kw = timm.registered_archs()[ARCH]["kwargs"]
    width = sd["patch_embed.proj.weight"].shape[0]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    if (width, depth) != (kw["embed_dim"], kw["depth"]):
        facts.pop("num_heads")
        if width in HEADS_BY_WIDTH:
            facts["notes"] = [f"a MobileCLIP release {width} wide and {depth} deep, not {ARCH} ({kw['embed_dim']}, "
                              f"{kw['depth']}): {HEADS_BY_WIDTH[width]} heads as a standard ViT of that width unless "
                              f"num_heads= says otherwise"]
    return sd, facts, unused
