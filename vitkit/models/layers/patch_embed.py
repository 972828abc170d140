"""Image to patch tokens (Sec. 3.1, Eq. 1): a conv with kernel = stride = P, then flatten the grid."""
from __future__ import annotations

import torch
from torch import nn

from .mlp import lecun_normal_


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    t = tuple(int(v) for v in x)
    if len(t) != 2:
        raise ValueError(f"expected an int or a pair, got {x!r}")
    return t  # type: ignore[return-value]


class PatchEmbed(nn.Module):
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
    ) -> None:
        super().__init__()
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        for s, p in zip(img_size, patch_size):
            if s % p:
                raise ValueError(f"image size {img_size} is not divisible by the patch size {patch_size}")
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.backbone = backbone
        if backbone is None:
            conv_in, kernel = in_chans, patch_size
        else:
            stride = backbone.stride
            if patch_size[0] % stride or patch_size[1] % stride:
                raise ValueError(f"hybrid patch size {patch_size} must be a multiple of the backbone stride {stride}")
            conv_in, kernel = backbone.num_features, (patch_size[0] // stride, patch_size[1] // stride)
        self.proj = nn.Conv2d(conv_in, embed_dim, kernel_size=kernel, stride=kernel)
        lecun_normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def check_input(self, x: torch.Tensor) -> None:
        expected = (self.in_chans, *self.img_size)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"expected input of shape (B, {expected[0]}, {expected[1]}, {expected[2]}) "
                f"(B, channels, height, width), got {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        if self.backbone is not None:
            # channels-last: the oneDNN/cuDNN convs run without layout reorders, and the final
            # flatten + transpose to tokens is then free (benchmarks/NOTES.md, section 7)
            x = x.contiguous(memory_format=torch.channels_last)
            x = self.backbone(x)  # (B, C, H, W) -> (B, C', H/s, W/s)
        x = self.proj(x)  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, D, gh, gw) -> (B, N, D)
