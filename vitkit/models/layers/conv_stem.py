"""A convolutional stem before the patch embedding: MobileCLIP's MCi image encoder (Vasu et al. 2024, a ViT-B on
conv 4x4/4 + BatchNorm + GELU, conv 2x2/2 + BatchNorm + GELU, then the 2x2/2 patch embedding; timm's `ConvStem`).

The stem is the hybrid backbone of Sec. 3.1 in another kind: `PatchEmbed` runs it first and its own conv (kernel =
patch size / the stem's stride) is the stem's last conv, with a bias and no norm. Module names follow timm's
(`{i}.conv`, `{i}.bn`) so that its state dicts map one to one; timm's last conv is vitkit's `patch_embed.proj`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UsageError
from .batchnorm import BN_EPS, CheckedBatchNorm2d, check_stat



def stem_padding(kernel: int, stride: int) -> int:
    """The padding that makes a conv divide its input's size by its stride exactly (H -> H / s for H divisible by
    s): 0 for a patchify conv (kernel = stride, MCi's), 1 for a 3x3/2 conv."""
    return (kernel - stride + 1) // 2


def check_stem(channels: tuple[int, ...], kernels: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """A UsageError unless every layer has a kernel and a stride and divides the size by its stride exactly: a
    kernel no smaller than its stride (else pixels are skipped), and no even kernel at stride 1 (symmetric padding
    cannot keep the size)."""
    if not channels or not len(channels) == len(kernels) == len(strides):
        raise UsageError(f"conv stem {channels}: one kernel and one stride per layer, got kernels {kernels} and "
                         f"strides {strides}")
    if any(k < s for k, s in zip(kernels, strides)):
        raise UsageError(f"conv stem kernels {kernels} smaller than their strides {strides} skip pixels")
    if any(s == 1 and k % 2 == 0 for k, s in zip(kernels, strides)):
        raise UsageError(f"conv stem kernels {kernels} at strides {strides}: an even kernel at stride 1 cannot keep "
                         f"the size with symmetric padding")


def check_batchnorm_stats(sd: dict[str, torch.Tensor], prefix: str = "patch_embed.backbone.") -> None:
    """A CheckpointError naming the tensor where a conv stem BatchNorm's running variance (`...running_var` under
    `prefix`: vitkit's and timm's `patch_embed.backbone.{i}.bn.`, MobileCLIP's `image_encoder.model.patch_emb.`) has a negative or non-finite entry, or its running mean a non-finite one: the
    norm divides by sqrt(var + eps), so the model would give NaN. Call it on a state dict before building a model;
    `ConvBnAct` also checks what it is loaded with."""
    for k, t in sd.items():
        if k.startswith(prefix) and k.endswith((".running_var", ".running_mean")):
            check_stat(k, t)


class ConvBnAct(nn.Module):
    """conv (no bias) -> BatchNorm2d -> exact GELU. In eval mode the norm uses its running statistics, checked when
    loaded (`CheckedBatchNorm2d`)."""

    def __init__(self, in_chs: int, out_chs: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, kernel, stride, padding=stem_padding(kernel, stride), bias=False)
        self.bn = CheckedBatchNorm2d(out_chs, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.bn(self.conv(x)))  # (B, C, H, W) -> (B, C', H/s, W/s)


class ConvStem(nn.Sequential):
    """`len(channels)` conv + BatchNorm + GELU layers, layer i with `kernels[i]` and `strides[i]`; the patch embedding
    that follows is the stem's last conv. `stride` (the product of the strides) and `num_features` (the last
    layer's channels) are what `PatchEmbed` reads from a backbone."""

    def __init__(self, channels: tuple[int, ...], kernels: tuple[int, ...], strides: tuple[int, ...],
                 in_chans: int = 3) -> None:
        super().__init__()
        check_stem(channels, kernels, strides)
        in_chs = in_chans
        for i, (out_chs, k, s) in enumerate(zip(channels, kernels, strides)):
            self.add_module(str(i), ConvBnAct(in_chs, out_chs, k, s))
            in_chs = out_chs
        self.num_features = in_chs
        self.stride = math.prod(strides)

    def train(self, mode: bool = True) -> ConvStem:
        """As nn.Module's, but a frozen stem (no parameter requires a gradient: a linear probe, LoRA) stays in eval
        mode, so that its BatchNorm keeps the running statistics it was loaded with instead of following the batches
        (timm freezes BatchNorm the same way when it freezes a backbone)."""
        super().train(mode)
        if mode and not any(p.requires_grad for p in self.parameters()):
            for m in self.modules():
                m.training = False
        return self
