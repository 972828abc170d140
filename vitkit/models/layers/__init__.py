"""Small building blocks of the Vision Transformer (arXiv 2010.11929, Sec. 3.1), one concept per file."""
from .attention import Attention, RelativePositionBias, RelativePositionMlp, Shared
from .attention_pool import AttentionPool
from .conv_stem import ConvStem
from .drop_path import DropPath, PatchDropout
from .layer_scale import LayerScale
from .linear import Linear
from .mlp import Mlp, SwiGLU
from .norm import LayerNorm, RMSNorm, make_norm
from .patch_embed import PatchEmbed
from .pos_embed import (
    LearnedPosEmbed1d,
    LearnedPosEmbed2d,
    NoPosEmbed,
    SinCosPosEmbed2d,
    resample_pos_embed_grid,
)
from .rope import RotaryEmbedding2d
from .std_conv import StdConv2d, pad_same

__all__ = [
    "Attention", "AttentionPool", "RelativePositionBias", "RelativePositionMlp", "Shared", "DropPath", "PatchDropout", "LayerScale", "SwiGLU", "RotaryEmbedding2d", "LayerNorm", "RMSNorm", "make_norm", "Linear", "Mlp", "PatchEmbed", "LearnedPosEmbed1d",
    "LearnedPosEmbed2d", "NoPosEmbed", "SinCosPosEmbed2d", "resample_pos_embed_grid", "StdConv2d", "pad_same",
    "ConvStem",
]
