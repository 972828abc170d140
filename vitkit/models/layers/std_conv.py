"""Weight-standardised convolution (Qiao et al. 2019) as used by BiT and the ViT hybrid (Sec. 3.1, 4.1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from ...errors import UsageError


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """TensorFlow/flax 'SAME' padding: output = ceil(input / stride), the extra pixel at the bottom/right."""
    ih, iw = x.shape[-2:]
    # (ceil(i / s) - 1) * s + k - i, written with the remainder i % s alone: a constant wherever the size is a known
    # multiple of the stride, also for the symbolic sizes of an export (no ceil/max expressions to reason about)
    ph, pw = (max(kernel - (i % stride or stride), 0) for i in (ih, iw))
    if ph or pw:
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=value)
    return x


torch.fx.wrap("pad_same")  # one node in a torch.fx trace: its padding depends on the input's size


class StdConv2d(nn.Conv2d):
    """Conv2d whose kernel is standardised to zero mean and unit variance per output channel.

    Args:
        padding: "same" pads as TensorFlow/flax do (the official JAX hybrid); "symmetric" pads k // 2
            on every side (timm's BiT ResNetV2).
        eps: added to the variance (`eps_mode="var"`, timm: (w - m) / sqrt(v + eps)) or to the
            standard deviation (`eps_mode="std"`, the official JAX code: (w - m) / (sqrt(v) + eps)).
    """

    def __init__(
        self,
        in_chans: int,
        out_chans: int,
        kernel_size: int,
        stride: int = 1,
        *,
        padding: str = "symmetric",
        eps: float = 1e-8,
        eps_mode: str = "var",
    ) -> None:
        if padding not in ("same", "symmetric"):
            raise UsageError(f"padding must be 'same' or 'symmetric', got {padding!r}")
        if eps_mode not in ("var", "std"):
            raise UsageError(f"eps_mode must be 'var' or 'std', got {eps_mode!r}")
        sym = kernel_size // 2 if padding == "symmetric" else 0
        super().__init__(in_chans, out_chans, kernel_size, stride=stride, padding=sym, bias=False)
        self.same = padding == "same"
        self.eps, self.eps_mode = eps, eps_mode

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, unbiased=False)
        if self.eps_mode == "var":
            return (w - mean) * torch.rsqrt(var + self.eps)
        return (w - mean) / (var.sqrt() + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.same:
            x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, self.standardized_weight(), None, self.stride, self.padding)
