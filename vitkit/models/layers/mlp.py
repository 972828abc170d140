"""The Transformer MLP block (Sec. 3.1, Eq. 3): Linear D->M, GELU, dropout, Linear M->D, dropout; and SwiGLU.

Activations: exact GELU (the paper, timm, HF), its tanh approximation (the official JAX code, SigLIP) and CLIP's
"quick GELU" x * sigmoid(1.702 x) (OpenAI's CLIP weights were trained with it).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .linear import Linear
from ...errors import UsageError
from .norm import LayerNorm


ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")


class QuickGELU(nn.Module):
    """CLIP's GELU approximation: x * sigmoid(1.702 x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def make_act(act: str) -> nn.Module:
    if act not in ACTIVATIONS:
        raise UsageError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if act == "quick_gelu":
        return QuickGELU()
    # The official JAX code uses flax nn.gelu, i.e. the tanh approximation; timm and HF use exact GELU.
    return nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")


class Mlp(nn.Module):
    """fc2(norm(act(fc1 x))): the paper's MLP; `norm_layer` puts a norm on the hidden units (BEiT-3's sub-LN, timm's
    `scale_mlp_norm`), None: none."""

    def __init__(self, dim: int, hidden: int, *, act: str = "gelu", drop: float = 0.0, bias: bool = True,
                 norm_layer=None) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden, bias=bias)
        self.act = make_act(act)
        self.act_name = act
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden) if norm_layer is not None else None
        self.fc2 = Linear(hidden, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Official init: xavier-uniform kernels, biases normal(1e-6).
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            if fc.bias is not None:
                nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(self.fc1.forward_act(x, self.act_name, self.act))  # (B, T, M); oneDNN: GELU in the GEMM
        if self.norm is not None:
            h = self.norm(h)
        return self.drop2(self.fc2(h))


class SwiGLU(nn.Module):
    """The gated MLP of EVA-02, DINOv2-g, DINOv3-H+ and AIMv2 (Shazeer 2020): fc2(SiLU(fc1_g x) * fc1_x x), with an
    optional norm on the hidden units (EVA-02's `scale_mlp`, NormFormer's) and without biases (AIMv2). Names as timm's `SwiGLU`; the packed
    layouts (timm's GluMlp `fc1`, DINOv2's `w12`, HF's `weights_in`) are the gate's rows then the value's."""

    def __init__(self, dim: int, hidden: int, *, norm: bool = False, norm_eps: float = 1e-6, drop: float = 0.0,
                 bias: bool = True, norm_layer=None) -> None:
        super().__init__()

        self.fc1_g = Linear(dim, hidden, bias=bias)
        self.fc1_x = Linear(dim, hidden, bias=bias)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = (norm_layer or (lambda n: LayerNorm(n, eps=norm_eps)))(hidden) if norm else nn.Identity()
        self.fc2 = Linear(hidden, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)
        for fc in (self.fc1_g, self.fc1_x, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1_g(x)) * self.fc1_x(x)  # (B, T, M)
        return self.drop2(self.fc2(self.norm(self.drop1(h))))


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """flax's lecun_normal: truncated normal (2 sigma) with variance 1/fan_in."""
    fan_in = w[0].numel() if w.ndim > 1 else w.numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # stddev of a unit normal truncated at +-2
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)
