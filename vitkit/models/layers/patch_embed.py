"""Image to patch tokens (Sec. 3.1, Eq. 1): a conv with kernel = stride = P, then flatten the grid."""
from __future__ import annotations

import torch
from torch import nn

from ...machine.fast_linear import FastGemm
from .mlp import lecun_normal_
from .tracing import is_fx_tracing
from ...errors import UsageError


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    t = tuple(int(v) for v in x)
    if len(t) != 2:
        raise UsageError(f"expected an int or a pair, got {x!r}")
    return t  # type: ignore[return-value]


class PatchEmbed(FastGemm, nn.Module):
    """(B, C, H, W) -> (B, N, D) with N = (H / P) * (W / P), row-major over the grid.

    With a `backbone` (the hybrid of Sec. 3.1), the conv runs on the backbone's feature map and
    `patch_size` is the total stride: backbone stride x the embedding conv's own kernel.
    """

    def __init__(
        self,
        img_size: tuple[int, int],
        patch_size: tuple[int, int],
        in_chans: int,
        embed_dim: int,
        backbone: nn.Module | None = None,
        bias: bool = True,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        for s, p in zip(img_size, patch_size):
            if s % p:
                raise UsageError(f"image size {img_size} is not divisible by the patch size {patch_size}")
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.backbone = backbone
        if backbone is None:
            conv_in, kernel = in_chans, patch_size
        else:
            stride = backbone.stride
            if patch_size[0] % stride or patch_size[1] % stride:
                raise UsageError(f"hybrid patch size {patch_size} must be a multiple of the backbone stride {stride}")
            conv_in, kernel = backbone.num_features, (patch_size[0] // stride, patch_size[1] // stride)
        self.proj = nn.Conv2d(conv_in, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)  # CLIP: no bias
        lecun_normal_(self.proj.weight)
        if bias:
            nn.init.zeros_(self.proj.bias)
        self.norm = norm if norm is not None else nn.Identity()  # AIMv2: an RMSNorm on every patch token
        self.dynamic = False  # any H x W divisible by the patch size (dynamic_img_size), not img_size alone

    def check_input(self, x: torch.Tensor) -> None:
        expected = (self.in_chans, *self.img_size)
        if self.dynamic:
            if x.ndim == 4 and x.shape[1] == self.in_chans and x.shape[2] % self.patch_size[0] == 0 \
                    and x.shape[3] % self.patch_size[1] == 0 and x.shape[2] and x.shape[3]:
                return
            raise UsageError(f"expected input of shape (B, {self.in_chans}, H, W) with H and W multiples of the patch size "
                             f"{self.patch_size}, got {tuple(x.shape)}")
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise UsageError(
                f"expected input of shape (B, {expected[0]}, {expected[1]}, {expected[2]}) "
                f"(B, channels, height, width), got {tuple(x.shape)}"
            )

    def grid_for(self, x: torch.Tensor) -> tuple[int, int]:
        """The patch grid of an input image batch (B, C, H, W)."""
        return (x.shape[-2] // self.patch_size[0], x.shape[-1] // self.patch_size[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tracing = is_fx_tracing() or torch.compiler.is_compiling()
        if not tracing:
            self.check_input(x)
        if self.backbone is not None:
            # channels-last: the oneDNN/cuDNN convs run without layout reorders, and the final
            # flatten + transpose to tokens is then free (benchmarks/NOTES.md, section 7)
            x = x.contiguous(memory_format=torch.channels_last)
            x = self.backbone(x)  # (B, C, H, W) -> (B, C', H/s, W/s)
        if not tracing and x.device.type == "cpu":
            return self.norm(self._patches_matmul(x))
        x = self.proj(x)  # (B, D, gh, gw)
        return self.norm(x.flatten(2).transpose(1, 2))  # (B, D, gh, gw) -> (B, N, D)

    def embed_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """Flattened pixel patches (B, L, ph*pw*C), channel fastest (a packed batch's, timm NaFlex's and SigLIP 2's
        layout) -> tokens (B, L, D): the same map as `proj` on the image they came from."""
        kh, kw = self.proj.kernel_size
        if self.backbone is not None or (kh, kw) != tuple(self.patch_size):
            raise UsageError("pixel patches embed in a plain ViT only (a hybrid's ResNet reads whole images)")
        B, L, n = patches.shape
        c = self.in_chans
        if n != kh * kw * c:
            raise UsageError(f"patches of {n} values, expected {kh}x{kw}x{c} = {kh * kw * c} (ph, pw, C)")
        x = patches.reshape(B, L, kh, kw, c).permute(0, 1, 4, 2, 3).reshape(B, L, c * kh * kw)  # (ph, pw, C) -> (C, ph, pw)
        w = self.proj.weight
        return self.norm(self._linear(x, w, w.reshape(w.shape[0], -1), self.proj.bias))  # (B, L, D)

    def _patches_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The same map as `proj` (kernel = stride), as the paper writes Eq. 1: cut the image (or a hybrid's feature
        map) into flattened patches, then one matmul, on the packed fast GEMM where `pack_linears` allows. On a CPU
        1.1-1.5x faster than the conv forward and 1.2-2.9x with backward (`python benchmarks/ops.py patch-embed`,
        NOTES.md section 8); the weights keep the conv's layout. A hybrid's 1x1 embedding on its channels-last
        feature map is a matmul with no copy at all."""
        B, C, H, W = x.shape
        kh, kw = self.proj.kernel_size
        gh, gw = H // kh, W // kw
        x = x.reshape(B, C, gh, kh, gw, kw).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * kh * kw)  # (B, N, C*kh*kw)
        w = self.proj.weight
        return self._linear(x, w, w.reshape(w.shape[0], -1), self.proj.bias)  # (B, N, D)
