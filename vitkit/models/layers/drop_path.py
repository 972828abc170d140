"""Stochastic depth (Huang et al. 2016), as used by DeiT/AugReg ViT training, and token dropping (FLIP)."""
from __future__ import annotations

import torch
from torch import nn

from .tracing import is_fx_tracing
from ...errors import UsageError


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


class PatchDropout(nn.Module):
    """Token dropping in training (FLIP, Li et al. 2023; timm's `patch_drop_rate`): each image keeps a random
    max(1, int(N * (1 - rate))) of its N patch tokens, in random order, and every prefix token (class, registers);
    the blocks then run on fewer tokens. The identity in evaluation."""

    def __init__(self, rate: float = 0.0, num_prefix_tokens: int = 1) -> None:
        super().__init__()
        self.rate, self.num_prefix_tokens = float(rate), num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0 or not self.training:
            return x
        if is_fx_tracing():  # how many tokens to keep is computed from the input's length, unknown to a trace
            raise UsageError("patch_drop_rate: trace the model (torch.fx) in evaluation mode (model.eval()), where "
                             "it drops no token")
        p = self.num_prefix_tokens
        prefix, patches = x[:, :p], x[:, p:]  # (B, p, D), (B, N, D)
        B, N, D = patches.shape
        keep = max(1, int(N * (1.0 - self.rate)))
        idx = torch.randn(B, N, device=x.device).argsort(dim=1)[:, :keep]  # (B, K): a random K of each row's N
        patches = patches.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))  # (B, K, D)
        return torch.cat([prefix, patches], dim=1) if p else patches  # (B, p + K, D)

    def extra_repr(self) -> str:
        return f"rate={self.rate}, num_prefix_tokens={self.num_prefix_tokens}"
