"""Stochastic depth (Huang et al. 2016), as used by DeiT/AugReg ViT training."""
from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Drops the whole residual branch per sample with probability `p`, rescaling the survivors."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"
