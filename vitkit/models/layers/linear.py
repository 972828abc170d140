"""`nn.Linear` that can run on this machine's fastest float32 CPU GEMM (`vitkit.machine.fast_linear`), turned on for
a whole model by `pack_linears`."""
from __future__ import annotations

import torch
from torch import nn

from ...machine.fast_linear import FastGemm


class Linear(FastGemm, nn.Linear):
    """`nn.Linear` (same parameters, state dict and initialisation) that can run on a packed fast GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.weight, self.bias)

    def forward_act(self, x: torch.Tensor, act: str, fallback: nn.Module) -> torch.Tensor:
        """`fallback(self(x))`, with a GELU (`act` gelu or gelu_tanh) fused into the GEMM where oneDNN runs it."""
        y = self._linear_act(x, self.weight, self.weight, self.bias, act)
        return fallback(self(x)) if y is None else y
