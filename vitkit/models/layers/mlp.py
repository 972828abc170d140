"""The Transformer MLP block (Sec. 3.1, Eq. 3): Linear D->M, GELU, dropout, Linear M->D, dropout."""
from __future__ import annotations

import math

import torch
from torch import nn

from .linear import Linear
from ...errors import UsageError


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, *, act: str = "gelu", drop: float = 0.0) -> None:
        super().__init__()
        if act not in ("gelu", "gelu_tanh"):
            raise UsageError(f"act must be 'gelu' or 'gelu_tanh', got {act!r}")
        self.fc1 = Linear(dim, hidden)
        # The official JAX code uses flax nn.gelu, i.e. the tanh approximation; timm and HF use exact GELU.
        self.act = nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
        self.drop1 = nn.Dropout(drop)
        self.fc2 = Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Official init: xavier-uniform kernels, biases normal(1e-6).
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """flax's lecun_normal: truncated normal (2 sigma) with variance 1/fan_in."""
    fan_in = w[0].numel() if w.ndim > 1 else w.numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # stddev of a unit normal truncated at +-2
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)
