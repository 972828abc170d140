"""The normalisation layers: LayerNorm (the paper's; it keeps a low-precision token stream in its dtype under
CUDA autocast) and RMSNorm (AIMv2: no centring, no bias)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tracing import is_fx_tracing

NORMS = ("layernorm", "rmsnorm")


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm`, except for a bf16/fp16 input under CUDA autocast (`lowp_stream`): CUDA autocast runs
    layer_norm in fp32, so the norm would write an fp32 tensor that the next Linear casts back; here it reads
    and writes the input's dtype (the kernel still accumulates its statistics in fp32), as CPU autocast
    already does. An fp32 input (the default token stream) takes the ordinary path: nothing changes there.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fx_tracing():
            return super().forward(x)
        if x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and torch.is_autocast_enabled("cuda"):
            w = None if self.weight is None else self.weight.to(x.dtype)
            b = None if self.bias is None else self.bias.to(x.dtype)
            with torch.autocast("cuda", enabled=False):
                return F.layer_norm(x, self.normalized_shape, w, b, self.eps)
        return super().forward(x)


class RMSNorm(nn.RMSNorm):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019; AIMv2): timm's `RmsNorm`, transformers'
    `Aimv2RMSNorm`; one parameter, `weight`. A bf16/fp16 input (`lowp_stream` under autocast) is normed in its dtype
    with the weight cast to it, so the fused kernel runs (it accumulates in fp32), as `LayerNorm` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fx_tracing():
            return super().forward(x)
        if x.dtype in (torch.bfloat16, torch.float16) and self.weight is not None and self.weight.dtype != x.dtype:
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
        return super().forward(x)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The model's norm layer of width `dim`: "layernorm" or "rmsnorm" (`NORMS`)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return LayerNorm(dim, eps=eps)
