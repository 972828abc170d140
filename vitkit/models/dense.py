"""Multi-scale dense features for segmentation and detection heads: DINOv3's four evenly spaced layers (Siméoni et
al. 2025, arXiv 2508.10104, its dense evaluations; DPT and ViT-Adapter read four layers too), ViTDet's simple feature
pyramid from the last map (Li et al. 2022, arXiv 2203.16527, Sec. 3), and Swin's four stages (Liu et al. 2021, Sec.
3.1).

    image (B, C, H, W)
      -> ViT blocks; keep blocks i_1 < ... < i_n, their prefix tokens (class, registers) dropped, final norm applied
      -> each (B, D, H/P, W/P)                                                   "stage1" .. "stagen", stride P
      -> [strides=(s_1, ..., s_n)]: each resized bilinearly to (H/s_k, W/s_k)    parameter-free
    or, for a detector's neck (ViTDet):
      -> the last map (B, D, H/P, W/P) -> SimpleFeaturePyramid                    "p2" .. "p5" [+ "p6"], 256 channels
         4x: deconv 2x2/2, LayerNorm2d, GELU, deconv 2x2/2     stride P/4
         2x: deconv 2x2/2                                      stride P/2
         1x: identity                                          stride P
         0.5x: max-pool 2x2/2                                  stride 2P
         then per level: conv 1x1, LayerNorm2d, conv 3x3, LayerNorm2d (convs without bias); "p6": the last level
         subsampled by 2 (detectron2's LastLevelMaxPool)        stride 4P

`dense_features(model, images)` is the one call; `DenseBackbone(model, ...)` wraps it as an `nn.Module` with the
`out_channels`, `channels`, `strides` and `size_divisibility` a detectron2 or torchvision detector reads. Everything
reads `forward_intermediates(..., patch_grid=True)` of vit.py (or Swin's), so any image size the model takes
(dynamic_img_size), any patch size, hybrids (their stride is the patch size) and registers work unchanged.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..safety import SIZE_BOUNDS, check_alloc, gib
from .swin import SwinTransformer
from .vit import VisionTransformer

Stride = int | float | tuple[float, float]
SFP_SCALES = (4.0, 2.0, 1.0, 0.5)  # ViTDet's, detectron2's `SimpleFeaturePyramid(scale_factors=...)`


def dense_layer_indices(depth: int, n: int = 4) -> list[int]:
    """DINOv3's choice of `n` blocks for dense heads (`FOUR_EVEN_INTERVALS` in its segmentation, depth and detection
    evaluations): every (depth // n)-th block, ending at the last. Depth 12: [2, 5, 8, 11]; depth 40: [9, 19, 29, 39];
    depth 24 with n = 4: [4, 11, 17, 23], the indices DINOv3's paper (and DINOv2's DPT, Depth Anything) used for ViT-L,
    rather than [5, 11, 17, 23]."""
    if not 1 <= n <= depth:
        raise UsageError(f"asked for {n} evenly spaced layers of a model of depth {depth}: n is 1 to {depth} "
                         "(or name the blocks, layers=[...])")
    if depth == 24 and n == 4:
        return [4, 11, 17, 23]
    step = depth // n
    return [depth - 1 - (n - 1 - k) * step for k in range(n)]


def _resolve(layers: int | Sequence[int], depth: int, what: str) -> list[int]:
    """`layers` -> sorted, distinct indices in [0, depth): an int n is `dense_layer_indices(depth, n)`, a sequence is
    indices (negative counts from the end)."""
    if isinstance(layers, bool) or not isinstance(layers, (int, Sequence)) or isinstance(layers, str):
        raise UsageError(f"layers: an int (how many, evenly spaced) or a sequence of {what} indices, got {layers!r}")
    if isinstance(layers, int):
        return dense_layer_indices(depth, layers)
    if not layers:
        raise UsageError("layers: an empty sequence (ask for at least one)")
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not -depth <= i < depth]
    if bad:
        raise UsageError(f"{what} index {bad[0]!r} is out of range for a model of {depth} {what}s "
                         f"(valid: {-depth} to {depth - 1})")
    idx = sorted({i % depth for i in layers})
    if len(idx) != len(layers):
        raise UsageError(f"layers {list(layers)} name the same {what} twice")
    return idx


def _native(model: nn.Module) -> tuple[int, int]:
    """The stride in pixels of the model's patch grid (a hybrid's patch size is its total stride; a Swin's is its
    first stage's)."""
    return tuple(model.config.patch_size)


def _stride(sh: float, sw: float) -> Stride:
    """A stride as a number when square (an int when whole: 16, or 3.5 for patch 14 at 4x), else (sh, sw)."""
    if sh != sw:
        return (sh, sw)
    return int(sh) if float(sh).is_integer() else sh


def size_divisibility(native: tuple[int, int], strides) -> int:
    """The least side length (in pixels) that is a multiple of the patch size and of every level's stride, so that
    each level's map is exactly the image over its stride (strides such as 3.5 count by their numerator, 7)."""
    n = math.lcm(*native)
    for s in strides:
        for v in (s if isinstance(s, tuple) else (s,)):
            n = math.lcm(n, Fraction(v).limit_denominator(1000).numerator)
    return n


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, (VisionTransformer, SwinTransformer)):
        raise UsageError(f"dense features need a ViT (or hybrid) or a Swin; got a {type(model).__name__}, which "
                         "exposes no patch grids")


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        kind = f"a tensor of shape {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise UsageError(f"dense features read one batch (B, C, H, W) of one size, got {kind}; images of different "
                         "sizes: call once per size, or pad them to one")


class _Plan:
    """What `dense_features` takes from a model: the indices (blocks of a ViT, stages of a Swin), the names, the
    channels and the native strides of each level."""

    def __init__(self, model: nn.Module, layers: int | Sequence[int]) -> None:
        _check_model(model)
        self.swin = isinstance(model, SwinTransformer)
        ph, pw = _native(model)
        if self.swin:
            c = model.config
            self.indices = _resolve(layers, len(c.depths), "stage")
            ends = [sum(c.depths[: s + 1]) - 1 for s in range(len(c.depths))]  # each stage's last block
            self.blocks = [ends[s] for s in self.indices]
            self.channels = [c.stage_dim(s) for s in self.indices]
            self.native = [(ph * 2**s, pw * 2**s) for s in self.indices]
            self.names = [f"stage{s + 1}" for s in self.indices]
            self.last = len(c.depths) - 1
        else:
            self.indices = _resolve(layers, len(model.blocks), "block")
            self.blocks = list(self.indices)
            self.channels = [model.embed_dim] * len(self.indices)
            self.native = [(ph, pw)] * len(self.indices)
            self.names = [f"stage{k + 1}" for k in range(len(self.indices))]


def _check_strides(strides: Sequence[float] | None, n: int) -> list[float] | None:
    if strides is None:
        return None
    if isinstance(strides, (int, float, str)) or len(strides) != n:
        raise UsageError(f"strides: one stride in pixels per level ({n} levels), got {strides!r}")
    out = []
    for s in strides:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 or not math.isfinite(s):
            raise UsageError(f"strides: positive numbers of pixels, got {strides!r}")
        out.append(float(s))
    return out


def _resized_hw(hw: tuple[int, int], native: tuple[int, int], stride: float) -> tuple[int, int]:
    """The (h', w') a map of `hw` at `native` stride has at `stride`: floor(h P/s) x floor(w P/s), at least 1."""
    return (max(1, math.floor(hw[0] * native[0] / stride + 1e-9)), max(1, math.floor(hw[1] * native[1] / stride + 1e-9)))


def _check_resized(images: torch.Tensor, plan: _Plan, targets: list[float] | None) -> None:
    """The maps `targets` asks for, sized before anything runs: a side beyond the largest image size vitkit takes
    (a stride of a thousandth of a pixel asks for maps of 10^5 x 10^5), or more memory than this process has, is
    refused naming the strides."""
    if targets is None:
        return
    b, h, w = images.shape[0], images.shape[-2], images.shape[-1]
    side, total = SIZE_BOUNDS["img_size"][1], 0
    for name, nat, c, s in zip(plan.names, plan.native, plan.channels, targets):
        size = _resized_hw((h // nat[0], w // nat[1]), nat, s)
        if max(size) > side:
            raise UsageError(f"strides: {name} at stride {s:g} would be a {size[0]:,} x {size[1]:,} map of a {h} x {w} "
                             f"image, over {side:,} a side: refused (a stride is in pixels of the input, e.g. "
                             f"(4, 8, 16, 32))")
        total += b * c * size[0] * size[1] * max(images.element_size(), 4)
    check_alloc(total, f"dense features at strides {tuple(targets)} ({gib(total)} of maps)", UsageError)


def _resize(x: torch.Tensor, native: tuple[int, int], stride: float) -> torch.Tensor:
    """A map at `native` stride (B, C, h, w) -> at `stride`: (B, C, floor(h P/s), floor(w P/s)) (the size
    `F.interpolate(scale_factor=P/s)` gives), bilinear, as ViT-Adapter and DINOv3's adapter resize their four maps."""
    h, w = x.shape[-2:]
    size = _resized_hw((h, w), native, stride)
    if size == (h, w):
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)  # (B, C, h, w) -> (B, C, h', w')


def _levels(model: nn.Module, images: torch.Tensor, plan: _Plan, norm: bool) -> list[torch.Tensor]:
    """The maps of the plan's levels at their native strides, each (B, C, h, w)."""
    if plan.swin:
        out = model.forward_intermediates(images, attention=False)
        maps = []
        for s, i in zip(plan.indices, plan.blocks):
            t = out["features"] if norm and s == plan.last else out["tokens"][i]  # timm: the final norm on the last
            maps.append(t.permute(0, 3, 1, 2))  # (B, h, w, C) -> (B, C, h, w)
        return maps
    out = model.forward_intermediates(images, plan.blocks, attention=False, patch_grid=True, norm=norm)
    return [out["patch_grid"][i] for i in plan.blocks]  # each (B, D, gh, gw), prefix tokens dropped


def dense_features(model: nn.Module, images: torch.Tensor, layers: int | Sequence[int] = 4, *, norm: bool = True,
                   strides: Sequence[float] | None = None) -> OrderedDict[str, torch.Tensor]:
    """Multi-scale dense features in one call: an ordered dict of NCHW maps, shallow to deep.

    A ViT (or hybrid): the patch tokens of the chosen blocks as maps (B, D, H/P, W/P), prefix tokens (class,
    registers) dropped, named "stage1".."stagen" in block order. A Swin: its stage outputs (B, 2^s C, H/2^(s+2),
    W/2^(s+2)), "stage1".."stage4" by stage. `dense_strides(model, layers, strides)` says each level's stride.

    Args:
        model: a `VisionTransformer` (any patch size; any image size with dynamic_img_size) or a `SwinTransformer`.
        images: (B, C, H, W), one size.
        layers: an int n: n evenly spaced blocks ending at the last, DINOv3's choice for its dense heads
            (`dense_layer_indices`: depth 12 -> blocks 2, 5, 8, 11; depth 24 -> 4, 11, 17, 23); or block indices
            (negative counts from the end; [-4, -3, -2, -1] is timm's `forward_intermediates(indices=4)`).
            Note: unlike `forward_intermediates(layers=4)` (the last four), an int here is evenly spaced.
            For a Swin, the same over its stages (4: all four).
        norm: apply the model's final norm to every level (as DINOv3's `get_intermediate_layers` and DINOv2's dense
            heads read them). A Swin: the final norm on the last stage only, as timm's `forward_intermediates`.
        strides: None keeps each level at its native stride (P for a ViT); else one stride in pixels per level,
            each level resized bilinearly (parameter-free) from its (h, w) grid to floor(h P / s) x floor(w P / s),
            which is floor(H / s) x floor(W / s): `(4, 8, 16, 32)` for a patch-16 ViT is the 4x, 2x, 1x, 0.5x
            pyramid of ViT-Adapter / DINOv3's adapter ((3.5, 7, 14, 28) for patch 14).

    Returns:
        OrderedDict {name: (B, C_k, h_k, w_k)}.
    """
    _check_model(model)
    _check_images(images)
    plan = _Plan(model, layers)
    targets = _check_strides(strides, len(plan.names))
    _check_resized(images, plan, targets)
    maps = _levels(model, images, plan, norm)
    if targets is not None:
        maps = [_resize(m, nat, s) for m, nat, s in zip(maps, plan.native, targets)]
    return OrderedDict(zip(plan.names, maps))


def dense_strides(model: nn.Module, layers: int | Sequence[int] = 4,
                  strides: Sequence[float] | None = None) -> OrderedDict[str, Stride]:
    """{name: stride in pixels} of `dense_features(model, x, layers, strides=strides)`'s levels."""
    plan = _Plan(model, layers)
    targets = _check_strides(strides, len(plan.names))
    if targets is None:
        return OrderedDict((n, _stride(*nat)) for n, nat in zip(plan.names, plan.native))
    return OrderedDict((n, _stride(s, s)) for n, s in zip(plan.names, targets))


# ---- ViTDet's simple feature pyramid ------------------------------------------------------------------------------

class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map (detectron2's `LayerNorm` of ViTDet, ConvNeXt's): each pixel's C
    values normalised, eps 1e-6."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__(channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid (arXiv 2203.16527, Sec. 3, Fig. 2c; detectron2's `SimpleFeaturePyramid`):
    from one map at stride P, levels at 4x, 2x, 1x and 0.5x its resolution, each brought to `out_channels` by a
    1x1 and a 3x3 conv, each followed by LayerNorm2d.

    Args:
        in_channels: the map's channels D (the ViT's width).
        out_channels: every level's channels (256, as ViTDet's).
        scale_factors: any of 4, 2, 1, 0.5, in decreasing order; the level of scale s has stride P / s and is named
            p{log2(16 / s)} (4x -> p2, ..., 0.5x -> p5), detectron2's names for P = 16, kept for any P.
        top_block: add "p6", the last level subsampled by 2 (detectron2's `LastLevelMaxPool`: max-pool kernel 1,
            stride 2), as Mask R-CNN's RPN reads.
        norm: True: LayerNorm2d after each conv, convs without bias (ViTDet); False: no norm, convs with bias.
        patch_stride: the input map's stride in pixels (the ViT's patch size), for `strides`.
    """

    def __init__(self, in_channels: int, out_channels: int = 256, *, scale_factors: Sequence[float] = SFP_SCALES,
                 top_block: bool = False, norm: bool = True, patch_stride: int | tuple[int, int] = 16) -> None:
        super().__init__()
        scales = [float(s) for s in scale_factors]
        if not scales or any(s not in SFP_SCALES for s in scales) or scales != sorted(set(scales), reverse=True):
            raise UsageError(f"scale_factors: distinct values of {SFP_SCALES} in decreasing order, "
                             f"got {scale_factors!r}")
        if in_channels < 4 and 4.0 in scales:
            raise UsageError(f"in_channels {in_channels}: the 4x level needs at least 4 channels (D/4)")
        ph, pw = (patch_stride, patch_stride) if isinstance(patch_stride, int) else tuple(patch_stride)
        self.in_channels, self.out_channels, self.scale_factors = in_channels, out_channels, tuple(scales)
        self.top_block = top_block
        d = in_channels
        self.levels = nn.ModuleDict()
        strides = OrderedDict()
        for s in scales:
            if s == 4.0:
                layers = [nn.ConvTranspose2d(d, d // 2, 2, stride=2), LayerNorm2d(d // 2) if norm else nn.Identity(),
                          nn.GELU(), nn.ConvTranspose2d(d // 2, d // 4, 2, stride=2)]
                width = d // 4
            elif s == 2.0:
                layers, width = [nn.ConvTranspose2d(d, d // 2, 2, stride=2)], d // 2
            elif s == 1.0:
                layers, width = [], d
            else:
                layers, width = [nn.MaxPool2d(kernel_size=2, stride=2)], d
            layers += [nn.Conv2d(width, out_channels, 1, bias=not norm),
                       LayerNorm2d(out_channels) if norm else nn.Identity(),
                       nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=not norm),
                       LayerNorm2d(out_channels) if norm else nn.Identity()]
            name = f"p{int(math.log2(16 / s))}"  # 4x -> p2, 2x -> p3, 1x -> p4, 0.5x -> p5
            self.levels[name] = nn.Sequential(*layers)
            strides[name] = _stride(ph / s, pw / s)
        if top_block:
            last = scales[-1]
            strides[f"p{int(math.log2(16 / last)) + 1}"] = _stride(ph / last * 2, pw / last * 2)
        self.strides = strides
        self.channels = OrderedDict((n, out_channels) for n in strides)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        """(B, D, h, w) -> {"p2": (B, out, 4h, 4w), "p3": (B, out, 2h, 2w), "p4": (B, out, h, w),
        "p5": (B, out, floor(h/2), floor(w/2))[, "p6": (B, out, ceil(h'/2), ceil(w'/2)) of p5's (h', w')]}."""
        out = OrderedDict((name, level(x)) for name, level in self.levels.items())
        if self.top_block:
            name = list(self.strides)[-1]
            out[name] = F.max_pool2d(next(reversed(out.values())), kernel_size=1, stride=2)
        return out


# ---- the module a detector or segmentation head wraps ---------------------------------------------------------

class DenseBackbone(nn.Module):
    """A ViT (or Swin) as a dense backbone: `forward(images)` returns `dense_features`' ordered dict, or with
    `simple_fpn=True` ViTDet's pyramid "p2".."p5" (+ "p6") of the last map.

    Attributes (as detectron2's `Backbone` and torchvision's `BackboneWithFPN` expose them):
        out_channels: the levels' common channel count (an int, what torchvision's detectors read), or the list of
            them when they differ (a Swin's stages).
        channels, strides: {name: channels}, {name: stride in pixels}.
        size_divisibility: what an input side should be a multiple of for every level's stride to be exact.
        layers: the block indices read (a Swin: the stage indices).

    Args:
        model: a `VisionTransformer` or `SwinTransformer`. Nothing is frozen unless `frozen`.
        layers: as `dense_features` (default 4: DINOv3's evenly spaced blocks); with `simple_fpn`, one block
            (default the last).
        norm: the final norm on each level (see `dense_features`).
        strides: as `dense_features` (not with `simple_fpn`).
        simple_fpn: put ViTDet's `SimpleFeaturePyramid` (learnable) on the read map.
        out_channels, scale_factors, top_block: the pyramid's (see `SimpleFeaturePyramid`).
        frozen: the model's parameters get requires_grad=False, it stays in eval mode (no dropout or stochastic
            depth) when this module trains, and its forward runs without autograd; the pyramid still trains.
    """

    def __init__(self, model: nn.Module, *, layers: int | Sequence[int] | None = None, norm: bool = True,
                 strides: Sequence[float] | None = None, simple_fpn: bool = False, out_channels: int = 256,
                 scale_factors: Sequence[float] = SFP_SCALES, top_block: bool = False, frozen: bool = False) -> None:
        super().__init__()
        _check_model(model)
        if layers is None:
            layers = [-1] if simple_fpn else 4
        self.model, self.norm, self.frozen = model, norm, frozen
        self._plan = _Plan(model, layers)
        self._strides = _check_strides(strides, len(self._plan.names))
        self.layers = list(self._plan.indices)
        self.fpn = None
        if simple_fpn:
            if len(self._plan.names) != 1:
                raise UsageError(f"simple_fpn reads one map (ViTDet: the last block's); layers {layers!r} name "
                                 f"{len(self._plan.names)}")
            if strides is not None:
                raise UsageError("strides resize dense_features' levels; the simple feature pyramid makes its own")
            self.fpn = SimpleFeaturePyramid(self._plan.channels[0], out_channels, scale_factors=scale_factors,
                                            top_block=top_block, patch_stride=self._plan.native[0])
            self.channels, self.strides = OrderedDict(self.fpn.channels), OrderedDict(self.fpn.strides)
        else:
            self.channels = OrderedDict(zip(self._plan.names, self._plan.channels))
            self.strides = dense_strides(model, layers, strides)
        widths = list(self.channels.values())
        self.out_channels: int | list[int] = widths[0] if len(set(widths)) == 1 else widths
        self.size_divisibility = size_divisibility(self._plan.native[0], self.strides.values())
        if frozen:
            model.requires_grad_(False)
            model.eval()

    def train(self, mode: bool = True) -> DenseBackbone:
        super().train(mode)
        if self.frozen:
            self.model.eval()
        return self

    def forward(self, images: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        """(B, C, H, W) -> {name: (B, C_k, h_k, w_k)}, shallow (fine) to deep (coarse)."""
        _check_images(images)
        _check_resized(images, self._plan, self._strides)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            maps = _levels(self.model, images, self._plan, self.norm)
        if self.fpn is not None:
            return self.fpn(maps[0])
        if self._strides is not None:
            maps = [_resize(m, nat, s) for m, nat, s in zip(maps, self._plan.native, self._strides)]
        return OrderedDict(zip(self._plan.names, maps))
