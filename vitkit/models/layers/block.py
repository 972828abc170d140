"""One pre-norm encoder block (Eq. 2-3 of arXiv 2010.11929): x + MSA(LN(x)), then x + MLP(LN(x)).

The block is built from the layers it is handed (the model's factory, `vit_layers.make_block`, picks them from the
config): two norms, the attention, the MLP, and on each residual branch a LayerScale (or Identity) and a DropPath.
`ResPostBlock` is the same block with the norms moved onto the residual branches' outputs (`res_post_norm`).
"""
from __future__ import annotations

import torch
from torch import nn

from .tracing import is_fx_tracing


# torch.fx with dynamic_img_size: the patch grid is read from the input's shape when the traced module runs, so the
# relative bias's table for it is one call in the graph, run with the real grid (as `pad_same` in resnet.py),
# instead of Python branches on traced sizes.
def _attention_at(attn: nn.Module, x: torch.Tensor, grid: tuple[int, int], rope, mask) -> torch.Tensor:
    return attn(x, grid=tuple(grid), rope=rope, mask=mask)


torch.fx.wrap("_attention_at")


class Block(nn.Module):
    """x + drop_path1(ls1(attn(norm1(x)))), then x + drop_path2(ls2(mlp(norm2(x)))); the state-dict names are
    timm's (blocks.N.norm1, .attn, .ls1, .norm2, .mlp, .ls2)."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, ls1: nn.Module, drop_path1: nn.Module,
                 norm2: nn.Module, mlp: nn.Module, ls2: nn.Module, drop_path2: nn.Module) -> None:
        super().__init__()
        # registered in this order (parameters(), and so the optimizer's groups, follow it)
        self.norm1, self.attn, self.ls1, self.drop_path1 = norm1, attn, ls1, drop_path1
        self.norm2, self.mlp, self.ls2, self.drop_path2 = norm2, mlp, ls2, drop_path2

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                grid: tuple[int, int] | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None):
        """(B, T, D) -> (B, T, D); with `queries`, only the first `queries` tokens' outputs: (B, queries, D) (every
        token is normed for the keys and values; only the queries go on); with `return_attention`, also the
        softmax weights (B, H, T, T).
        `grid`: the input's patch grid when it is not the model's (dynamic_img_size: the relative bias);
        `rope`: the rotary embedding's (sin, cos) for that grid; `mask`: a packed batch's keys (B, 1, 1, T)."""
        y = self._attend(self.norm1(x), return_attention, queries, grid, rope, mask)
        if return_attention:
            y, attn = y
        x = (x if queries is None else x[:, :queries]) + self.drop_path1(self.ls1(y))  # (B, T or queries, D)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x, attn) if return_attention else x

    def _attend(self, x: torch.Tensor, return_attention: bool, queries: int | None, grid, rope, mask):
        if return_attention:
            return self.attn(x, return_attention=True, grid=grid, rope=rope, mask=mask)
        if queries is not None:
            return self.attn(x, queries=queries, grid=grid, rope=rope, mask=mask)
        if grid is not None and self.attn.rel_pos is not None and is_fx_tracing():  # the bias's table for the grid
            return _attention_at(self.attn, x, grid, rope, mask)
        return self.attn(x, grid=grid, rope=rope, mask=mask)


class ResPostBlock(Block):
    """The residual post-norm block (Swin V2's res-post-norm; timm's `EvaBlockPostNorm`, EVA-02-CLIP-E "enormous"):
    each branch reads the un-normed stream and its output is normed before the residual add,
    x + drop_path1(ls1(norm1(attn(x)))), then x + drop_path2(ls2(norm2(mlp(x)))). The same layers and names as
    `Block`."""

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                grid: tuple[int, int] | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None):
        """As `Block.forward`: (B, T, D) -> (B, T, D) (or (B, queries, D)), with the softmax weights if asked."""
        y = self._attend(x, return_attention, queries, grid, rope, mask)
        if return_attention:
            y, attn = y
        x = (x if queries is None else x[:, :queries]) + self.drop_path1(self.ls1(self.norm1(y)))  # (B, T or queries, D)
        x = x + self.drop_path2(self.ls2(self.norm2(self.mlp(x))))
        return (x, attn) if return_attention else x
