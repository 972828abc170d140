"""LayerScale (Touvron et al., CaiT, arXiv 2103.17239): a learned per-channel scale on each residual branch.

DeiT-III, DINOv2 and EVA use it to start deep encoders close to the identity: `x + gamma * branch(x)` with gamma
initialised small (1e-5 in DINOv2, 1e-6 in DeiT-III). timm names the parameter `ls1.gamma` / `ls2.gamma`.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma  # (..., D) * (D,)
