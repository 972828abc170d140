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

import torch

from . import layouts, timm
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


def is_release(keys) -> bool:
    return FIRST in keys


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(vitkit state dict, the facts of timm's vit_base_mci_224, the keys left unused: the text tower's)."""
    sd, unused = layouts.read(LAYOUT, w)
    return timm.conv_stem_to_vitkit(sd), timm.architecture_facts("vit_base_mci_224"), unused
