"""The layers a `ViTConfig` asks for, built here: every option of the later ViTs is chosen once, in the factory of the
layer it changes, and `vit.py`'s model (and each `Block`) is handed the built layers instead of branching on options.

The model's constructor calls these in a fixed order (patch embedding, prefix tokens, position embedding, rotary
embedding, pre-norm, blocks, final norms, attention pooling): the random initialisation of a seeded model follows it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .layers import (
    Attention,
    AttentionPool,
    ConvStem,
    DropPath,
    LayerScale,
    Mlp,
    PatchEmbed,
    RelativePositionBias,
    RelativePositionMlp,
    Shared,
    RotaryEmbedding2d,
    SwiGLU,
    make_norm,
)
from .layers.block import Block, ResPostBlock
from .layers.diff_attention import DiffAttention
from .resnet import ResNetBackbone
from .vit_config import POS_EMBEDS, ViTConfig


def norm_layer(c: ViTConfig) -> Callable[[int], nn.Module]:
    """The config's norm (LayerNorm, or RMSNorm for AIMv2) as a function of the width."""
    return lambda dim: make_norm(c.norm, dim, c.norm_eps)


def norm_or_identity(c: ViTConfig, on: bool) -> nn.Module:
    """The config's norm over the model width where `on`, else Identity (a norm the model may not have)."""
    return norm_layer(c)(c.embed_dim) if on else nn.Identity()


def make_patch_embed(c: ViTConfig) -> PatchEmbed:
    """Eq. 1's patch embedding; for a hybrid, on the feature map of a ResNet built first (`hybrid_layers`) or of a
    conv stem (`conv_stem`, MobileCLIP's MCi: the embedding is the stem's last conv)."""
    backbone = None
    if c.conv_stem is not None:
        backbone = ConvStem(c.conv_stem, c.conv_stem_kernels, c.stem_strides, in_chans=c.in_chans)
    if c.hybrid_layers is not None:
        backbone = ResNetBackbone(c.hybrid_layers, width_factor=c.hybrid_width, in_chans=c.in_chans,
                                  ws_eps=c.hybrid_ws_eps, ws_eps_mode=c.hybrid_ws_eps_mode, gn_eps=c.hybrid_gn_eps,
                                  stem_pool=c.hybrid_stem_pool, norm=c.hybrid_norm)
    embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, c.embed_dim, backbone, bias=c.patch_bias,
                       norm=norm_layer(c)(c.embed_dim) if c.patch_norm else None)
    embed.dynamic = c.dynamic_img_size
    return embed


def make_prefix_tokens(c: ViTConfig) -> tuple[nn.Parameter | None, nn.Parameter | None, nn.Parameter | None]:
    """The learned tokens in front of the patches, each (1, n, D) or None: the class token (zeros, as the official
    code), DeiT's distillation token and the registers."""
    cls = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
    dist = nn.Parameter(torch.randn(1, 1, c.embed_dim) * 0.02) if c.distilled else None
    reg = nn.Parameter(torch.randn(1, c.reg_tokens, c.embed_dim) * 1e-6) if c.reg_tokens else None
    return cls, dist, reg


def make_pos_embed(c: ViTConfig) -> nn.Module:
    """The position embedding (`pos_embed`), over every prefix token (the paper) or none of them (no_embed_class),
    resampled to other grids by the config's method."""
    covered = 0 if c.no_embed_class else c.num_prefix_tokens
    pos_embed = POS_EMBEDS[c.pos_embed](c.grid_size, c.embed_dim, covered)
    pos_embed.method, pos_embed.square = c.pos_resample, c.pos_resample_square
    return pos_embed


def make_rope(c: ViTConfig) -> RotaryEmbedding2d | None:
    """The 2-D rotary embedding of the patch tokens' queries and keys, or None (`rope`)."""
    if not c.rope:
        return None
    return RotaryEmbedding2d(c.embed_dim // c.num_heads, c.grid_size, c.rope_ref_grid, c.rope_temperature,
                             kind=c.rope, indexing=c.rope_indexing, offset=c.rope_offset, half=c.rope_half,
                             depth=c.depth, num_heads=c.num_heads)


def make_rel_pos(c: ViTConfig) -> RelativePositionBias | RelativePositionMlp | None:
    """A block's relative position bias: BEiT's learned table ("relative"), the MLP of the offsets ("relative_mlp"),
    or None."""
    if c.pos_embed == "relative":
        rel = RelativePositionBias(c.grid_size, c.num_heads, c.num_prefix_tokens)
        rel.method = c.pos_resample
        return rel
    if c.pos_embed == "relative_mlp":
        return RelativePositionMlp(c.grid_size, c.num_heads, c.rel_pos_dim, c.num_prefix_tokens)
    return None


def make_shared_rel_pos(c: ViTConfig) -> RelativePositionMlp | None:
    """The relative position MLP all blocks share (`rel_pos_shared`: timm's `shared_rel_pos`), or None."""
    return make_rel_pos(c) if c.rel_pos_shared else None


def make_block(c: ViTConfig, index: int, shared_rel_pos: nn.Module | None = None) -> Block:
    """Encoder block `index` of the config `c`: its layers built here and handed to `Block` (or `ResPostBlock`,
    res_post_norm), in this order (the random initialisation of a seeded model follows it). Stochastic depth grows
    linearly over the blocks, from 0 to drop_path_rate. `shared_rel_pos`: the model's relative position MLP, read by
    every block (`rel_pos_shared`)."""
    drop_path = c.drop_path_rate * index / max(c.depth - 1, 1)
    rel = Shared(shared_rel_pos) if shared_rel_pos is not None else make_rel_pos(c)
    d = c.embed_dim
    norm1 = norm_layer(c)(d)
    if c.attn_layer == "diff":
        attn = DiffAttention(d, c.num_heads, index, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, inner_norm=c.attn_norm,
                             proj_bias=c.proj_bias, attn_drop=c.attn_drop_rate, proj_drop=c.drop_rate,
                             norm_layer=norm_layer(c))
    else:
        attn = Attention(d, c.num_heads, qkv_bias=c.qkv_bias, attn_drop=c.attn_drop_rate, proj_drop=c.drop_rate,
                         rel_pos=rel, qk_norm=c.qk_norm, inner_norm=c.attn_norm, norm_eps=c.norm_eps,
                         rope_prefix=c.num_prefix_tokens, k_bias=c.k_bias, proj_bias=c.proj_bias,
                         rope_half=c.rope_half, norm_layer=norm_layer(c), num_kv_heads=c.kv_heads(index))
    ls1 = LayerScale(d, c.init_values) if c.init_values is not None else nn.Identity()
    norm2 = norm_layer(c)(d)
    if c.mlp_layer == "swiglu":
        mlp = SwiGLU(d, c.mlp_dim, norm=c.mlp_norm, drop=c.drop_rate, bias=c.proj_bias, norm_layer=norm_layer(c))
    else:
        mlp = Mlp(d, c.mlp_dim, act=c.act, drop=c.drop_rate, bias=c.proj_bias,
                  norm_layer=norm_layer(c) if c.mlp_norm else None)
    ls2 = LayerScale(d, c.init_values) if c.init_values is not None and not c.attn_only_layer_scale else nn.Identity()
    block = ResPostBlock if c.res_post_norm else Block
    return block(norm1, attn, ls1, DropPath(drop_path), norm2, mlp, ls2, DropPath(drop_path))


def make_attn_pool(c: ViTConfig) -> AttentionPool | None:
    """The attention pooling of classifier 'map' (SigLIP; the Perception Encoder's own heads and MLP width), or None."""
    if c.classifier != "map":
        return None
    return AttentionPool(c.embed_dim, c.pool_heads or c.num_heads, c.mlp_dim if c.pool_mlp_dim is None else c.pool_mlp_dim,
                         act=c.act, norm_eps=c.norm_eps, norm_layer=norm_layer(c))
