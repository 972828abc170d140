"""Small building blocks of the Vision Transformer (arXiv 2010.11929, Sec. 3.1), one concept per file."""
from .attention import Attention, RelativePositionBias
from .drop_path import DropPath
from .linear import Linear, pack_linears
from .mlp import Mlp
from .norm import LayerNorm
from .patch_embed import PatchEmbed
from .pos_embed import (
    LearnedPosEmbed1d,
    LearnedPosEmbed2d,
    NoPosEmbed,
    SinCosPosEmbed2d,
    resample_pos_embed_grid,
)
from .std_conv import StdConv2d, pad_same

__all__ = [
    "Attention", "RelativePositionBias", "DropPath", "LayerNorm", "Linear", "pack_linears", "Mlp", "PatchEmbed", "LearnedPosEmbed1d",
    "LearnedPosEmbed2d", "NoPosEmbed", "SinCosPosEmbed2d", "resample_pos_embed_grid", "StdConv2d", "pad_same",
]
