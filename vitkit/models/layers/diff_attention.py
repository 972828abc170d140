"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv 2410.05258), as timm's `DiffAttention`
(`attn_layer='diff'`: the `vit_*_d*_reg1_gap_256` ViTs): each head's query and key are split into two halves, two
softmax maps are taken, and the second, scaled by a learned lambda, is subtracted from the first,

    A = softmax(q1 k1^T / sqrt(d)) - lambda * softmax(q2 k2^T / sqrt(d)),   out_h = RMSNorm(A v) * (1 - lambda_init),

with lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init, lambda_init = 0.8 - 0.6
exp(-0.3 i) for block i (the paper's schedule). The value keeps the head's full width (2d); the query and key rows of
head h are its two halves (channels [2hd, 2hd + d) and [2hd + d, 2hd + 2d) of the fused qkv's q and k), so the names
and the fused `qkv` are timm's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UsageError
from .linear import Linear
from .norm import RMSNorm


def lambda_init(block: int) -> float:
    """The paper's lambda_init for block `block` (counted from 0): 0.8 - 0.6 exp(-0.3 block)."""
    return 0.8 - 0.6 * math.exp(-0.3 * block)


class DiffAttention(nn.Module):
    """Self-attention as the difference of two softmax maps per head (the module docstring). The call is
    `Attention`'s: x (B, T, D) -> (B, T, D), with the maps (B, H, T, T) when asked (the difference), `queries` (the
    first tokens alone) and a packed batch's `mask`; no relative bias, rotary embedding or grouped key/value heads."""

    def __init__(self, dim: int, num_heads: int, block: int, *, qkv_bias: bool = True, qk_norm: bool = False,
                 inner_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer=None) -> None:
        super().__init__()
        if dim % (2 * num_heads):
            raise UsageError(f"differential attention splits each head in two: width {dim} is not divisible by "
                             f"2 x num_heads = {2 * num_heads}")
        self.num_heads, self.half = num_heads, dim // num_heads // 2  # d: the width of a query's or key's half
        self.scale = self.half ** -0.5
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = norm_layer(self.half) if qk_norm else None
        self.k_norm = norm_layer(self.half) if qk_norm else None
        self.attn_drop = attn_drop
        self.norm = norm_layer(dim) if inner_norm else None  # (timm's scale_norm, before the projection)
        self.proj = Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(self.half) * 0.1) for _ in range(4))
        self.sub_norm = RMSNorm(2 * self.half, eps=1e-5)  # on each head's output (its full width 2d)
        self.lambda_init = lambda_init(block)
        self.rel_pos = None  # (the block asks)

    def lambda_full(self) -> torch.Tensor:
        """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init, a scalar (fp32)."""
        l1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1).float())
        l2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2).float())
        return l1 - l2 + self.lambda_init

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                grid: tuple[int, int] | None = None, rope=None, mask: torch.Tensor | None = None):
        if rope is not None:
            raise UsageError("differential attention with a rotary embedding: no published model has both")
        B, T, D = x.shape
        H, d = self.num_heads, self.half
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, T, D)
        q = q.view(B, T, 2 * H, d).transpose(1, 2)  # (B, 2H, T, d): head h's halves are rows 2h and 2h + 1
        k = k.view(B, T, 2 * H, d).transpose(1, 2)
        v = v.view(B, T, H, 2 * d).transpose(1, 2)  # (B, H, T, 2d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if queries is not None:
            q = q[:, :, :queries]
        Q = q.shape[2]
        lam = self.lambda_full().to(q.dtype)
        drop = self.attn_drop if self.training else 0.0
        q = q.view(B, H, 2, Q, d)
        k = k.view(B, H, 2, T, d)
        if return_attention:
            logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, 2, Q, T)
            if mask is not None:
                logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
            maps = logits.softmax(dim=-1)
            attn = maps[:, :, 0] - lam * maps[:, :, 1]  # (B, H, Q, T)
            out = F.dropout(attn, drop) @ v  # (B, H, Q, 2d)
        else:
            attn = None
            a1 = F.scaled_dot_product_attention(q[:, :, 0], k[:, :, 0], v, attn_mask=mask, dropout_p=drop)
            a2 = F.scaled_dot_product_attention(q[:, :, 1], k[:, :, 1], v, attn_mask=mask, dropout_p=drop)
            out = a1 - lam * a2  # (B, H, Q, 2d)
        out = self.sub_norm(out) * (1 - self.lambda_init)
        out = out.transpose(1, 2).reshape(B, Q, D)  # (B, H, Q, 2d) -> (B, Q, D)
        if self.norm is not None:
            out = self.norm(out)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attention else out
