"""Multihead attention pooling (MAP, Lee et al. 2019; SigLIP's head, big_vision's `MAPHead`).

One learned query (the "probe") attends over the patch tokens; the result goes through a residual MLP:

    q = W_q probe (1, D);  k, v = W_kv x  (B, N, 2D)  ->  a = proj(softmax(q k^T / sqrt(d)) v)   (B, 1, D)
    out = a + MLP(LN(a))                                                                        -> (B, D)

Names follow timm's `AttentionPoolLatent` (latent, q, kv, proj, norm, mlp), so timm files map one to one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .mlp import Mlp
from .norm import LayerNorm


class AttentionPool(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, *, act: str = "gelu", norm_eps: float = 1e-6,
                 qkv_bias: bool = True, norm_layer=None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.randn(1, 1, dim) * dim**-0.5)
        self.q = Linear(dim, dim, bias=qkv_bias)
        self.kv = Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        # the residual MLP (none with mlp_dim 0: AIMv2's pooling ends at the projection)
        self.norm = (norm_layer(dim) if norm_layer else LayerNorm(dim, eps=norm_eps)) if mlp_dim else None
        self.mlp = Mlp(dim, mlp_dim, act=act) if mlp_dim else None

    def forward(self, x: torch.Tensor, return_attention: bool = False, valid: torch.Tensor | None = None):
        """Tokens (B, N, D) -> pooled (B, D); with `return_attention`, also the probe's weights (B, H, 1, N).
        valid: (B, N) bool, the tokens the probe may read (a packed batch's patches); None: all."""
        B, N, D = x.shape
        # the probe's query is the same for every image: projected once, then broadcast
        q = self.q(self.latent).view(1, 1, self.num_heads, self.head_dim).transpose(1, 2).expand(B, -1, -1, -1)  # (B, H, 1, hd)
        k, v = self.kv(x).split(D, dim=-1)  # each (B, N, D)
        k, v = (t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (k, v))  # each (B, H, N, hd)
        attn = None
        mask = None if valid is None else valid[:, None, None, :]  # (B, 1, 1, N)
        if return_attention:
            logits = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)  # (B, H, 1, N)
            attn = (logits if mask is None else logits.masked_fill(~mask, float("-inf"))).softmax(-1)
            a = attn @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, 1, hd)
        a = self.proj(a.transpose(1, 2).reshape(B, 1, D))  # (B, 1, D)
        if self.mlp is not None:
            a = a + self.mlp(self.norm(a))
        return (a[:, 0], attn) if return_attention else a[:, 0]
