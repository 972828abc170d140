"""ResNets with weight-standardised convs and GroupNorm (BiT, Kolesnikov et al. 2020).

Two networks from the ViT paper live here:
- `ResNetBackbone`: the hybrid's feature extractor (Sec. 3.1 "Hybrid Architecture", App. D.2): the
  official JAX ResNet, post-activation bottlenecks, 'SAME' padding, no classifier; its feature map
  (output stride 4 * 2^(stages - 1), half that without the stem's max-pool) becomes the ViT's patch grid.
- `ResNetV2`: the paper's CNN baseline (Sec. 4.1 "BiT"), a pre-activation ResNet-v2 classifier.
Module names follow timm's so that its state dicts map one to one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .layers import DropPath, Linear, StdConv2d, pad_same
from .layers.batchnorm import BN_EPS, CheckedBatchNorm2d
from .layers.tracing import is_fx_tracing
from .timm_api import TimmModelApi, check_avg_pool, check_class_names, check_num_classes
from ..errors import UsageError
from ..safety import check_sizes, check_types
from .layers.patch_embed import to_2tuple

torch.fx.wrap("pad_same")  # one node in a torch.fx trace (its padding depends on the input's size)


def _gn(chans: int, eps: float) -> nn.GroupNorm:
    return nn.GroupNorm(32, chans, eps=eps)


HYBRID_NORMS = ("group", "batch")


def _norm_factory(kind: str, gn_eps: float):
    """The hybrid ResNet's norm: "group", the paper's GroupNorm(32) (eps `gn_eps`); "batch", BatchNorm2d (torch's
    eps 1e-5, momentum 0.1; its running statistics in eval mode): not in timm or the official format."""
    if kind == "group":
        return lambda chans: _gn(chans, gn_eps)
    if kind == "batch":
        return lambda chans: CheckedBatchNorm2d(chans, eps=BN_EPS)
    raise UsageError(f"hybrid_norm must be one of {HYBRID_NORMS}, got {kind!r}")


class Bottleneck(nn.Module):
    """Post-activation bottleneck of the official hybrid: relu(norm3(conv3(...)) + shortcut)."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, conv, norm) -> None:
        super().__init__()
        mid = out_chs // 4
        self.downsample = None
        if in_chs != out_chs or stride != 1:
            self.downsample = nn.Module()
            self.downsample.conv = conv(in_chs, out_chs, 1, stride)
            self.downsample.norm = norm(out_chs)
        self.conv1, self.norm1 = conv(in_chs, mid, 1), norm(mid)
        self.conv2, self.norm2 = conv(mid, mid, 3, stride), norm(mid)
        self.conv3, self.norm3 = conv(mid, out_chs, 1), norm(out_chs)
        nn.init.zeros_(self.norm3.weight)  # official: gn3 scale starts at zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        if self.downsample is not None:
            shortcut = self.downsample.norm(self.downsample.conv(x))
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(y + shortcut)


class _Stage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def backbone_stride(layers: tuple[int, ...], stem_pool: bool = True) -> int:
    """The hybrid ResNet's output stride: 4 from the stem (2 without its max-pool), then 2 for each stage after the
    first.

    `layers=()` is the stem alone (AugReg's R+Ti/16, timm's `vit_tiny_r_s16_p8_*`): stride 4."""
    return (4 if stem_pool else 2) * 2 ** max(len(layers) - 1, 0)


class ResNetBackbone(nn.Module):
    """The hybrid's ResNet: stem (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool), then bottleneck stages.

    Args:
        layers: blocks per stage; (3, 4, 9) is the paper's R50 with stage 4 folded into stage 3; () is the
            stem alone.
        width_factor: stem width 64 * width_factor; stage i outputs 256 * width_factor * 2^i channels.
        padding: "same" (official JAX and timm hybrids) or "symmetric".
        ws_eps, ws_eps_mode: weight standardisation; the official code adds 1e-5 to the std.
        gn_eps: GroupNorm epsilon (flax default 1e-6).
        norm: "group" (the paper's GroupNorm) or "batch" (BatchNorm2d; `_norm_factory`).
        stem_pool: the stem's max-pool; False leaves the first stage at half the input's resolution (not the paper's:
            for small images, where a 28 px image would otherwise reach its first stage at 7x7).
    """

    def __init__(
        self,
        layers: tuple[int, ...] = (3, 4, 9),
        *,
        width_factor: float = 1.0,
        stem_pool: bool = True,
        in_chans: int = 3,
        padding: str = "same",
        ws_eps: float = 1e-5,
        ws_eps_mode: str = "std",
        gn_eps: float = 1e-6,
        norm: str = "group",
    ) -> None:
        super().__init__()
        width = int(64 * width_factor)
        make_norm = _norm_factory(norm, gn_eps)

        def conv(i: int, o: int, k: int, s: int = 1) -> StdConv2d:
            return StdConv2d(i, o, k, s, padding=padding, eps=ws_eps, eps_mode=ws_eps_mode)

        self.same, self.stem_pool = padding == "same", stem_pool
        self.norm_kind = norm
        self.stem = nn.Module()
        self.stem.conv = conv(in_chans, width, 7, 2)
        self.stem.norm = make_norm(width)
        stages, in_chs = [], width
        for i, n in enumerate(layers):
            out_chs = width * 4 * 2**i
            blocks = [Bottleneck(in_chs if j == 0 else out_chs, out_chs, (1 if i == 0 else 2) if j == 0 else 1, conv, make_norm) for j in range(n)]
            stages.append(_Stage(blocks))
            in_chs = out_chs
        self.stages = nn.Sequential(*stages)
        self.num_features = in_chs
        self.stride = backbone_stride(layers, stem_pool)
        for m in self.modules():
            if isinstance(m, StdConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def train(self, mode: bool = True) -> ResNetBackbone:
        """As nn.Module's, but a frozen backbone with BatchNorm (no parameter requires a gradient: a linear probe,
        LoRA) stays in eval mode, so that its norms keep their running statistics (as `ConvStem` does)."""
        super().train(mode)
        if mode and not any(p.requires_grad for p in self.parameters()):
            for m in self.modules():
                m.training = False
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem.conv(x)  # (B, C, H, W) -> (B, w, H/2, W/2)
        if self.norm_kind == "group" and not is_fx_tracing() and x.device.type == "cpu" and torch.is_grad_enabled() \
                and not x.requires_grad:  # a frozen stem (model.stem_init=pca-frozen) before a trained GroupNorm:
            x = x.contiguous()  # torch's CPU GroupNorm backward crashes on a channels-last input needing no gradient
        x = F.relu(self.stem.norm(x))
        if self.stem_pool:
            x = self._max_pool(x)  # (B, w, H/4, W/4)
        return self.stages(x)  # (B, C', H/s, W/s)

    def _max_pool(self, x: torch.Tensor) -> torch.Tensor:
        tracing = is_fx_tracing()  # torch.fx: no shapes or layouts to read, the general paths (one `pad_same` node)
        # The CPU max-pool is 14x faster channels-last than NCHW (benchmarks/NOTES.md, section 8). A 1-channel input
        # leaves the stem NCHW: GroupNorm, much slower channels-last, returns to NCHW after the pool; BatchNorm's
        # stages run faster channels-last (section 52: 1.18x the eager fp32 step, 1.03-1.07x compiled bf16), so stay.
        nchw = not tracing and not x.is_contiguous(memory_format=torch.channels_last)
        if nchw:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.same and not tracing and x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0:
            # 'SAME' pads one row/column at the bottom/right only: exactly ceil_mode, without a padded copy
            x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        elif self.same:
            x = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)
        else:
            x = F.max_pool2d(x, 3, 2, padding=1)
        return x.contiguous() if nchw and self.norm_kind == "group" else x


class PreActBottleneck(nn.Module):
    """ResNet-v2 bottleneck: norm+ReLU first; the projection shortcut takes the pre-activated input."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, conv, gn_eps: float, drop_path: float = 0.0) -> None:
        super().__init__()
        mid = out_chs // 4
        self.downsample = None
        if in_chs != out_chs or stride != 1:
            self.downsample = nn.Module()
            self.downsample.conv = conv(in_chs, out_chs, 1, stride)
        self.norm1, self.conv1 = _gn(in_chs, gn_eps), conv(in_chs, mid, 1)
        self.norm2, self.conv2 = _gn(mid, gn_eps), conv(mid, mid, 3, stride)
        self.norm3, self.conv3 = _gn(mid, gn_eps), conv(mid, out_chs, 1)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_pre = F.relu(self.norm1(x))
        shortcut = self.downsample.conv(x_pre) if self.downsample is not None else x
        y = self.conv1(x_pre)
        y = self.conv2(F.relu(self.norm2(y)))
        y = self.conv3(F.relu(self.norm3(y)))
        return self.drop_path(y) + shortcut


@dataclass
class ResNetV2Config:
    """Configuration of the BiT ResNet-v2 classifier (the paper's CNN baseline).

    mean, std, interpolation, crop_pct and img_size are the preprocessing the weights expect (the network
    itself takes any size of at least 32 x 32)."""

    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_factor: int = 1
    channels: tuple[int, ...] | None = None  # stage outputs; None: (256, 512, 1024, 2048) * width_factor
    stem_width: int | None = None  # None: 64 * width_factor
    img_size: tuple[int, int] = (224, 224)
    in_chans: int = 3
    num_classes: int = 1000
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    ws_eps: float = 1e-8
    gn_eps: float = 1e-5
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    interpolation: str = "bilinear"
    crop_pct: float = 0.875
    class_names: list[str] | None = field(default=None, repr=False)
    arch: str = "resnetv2"

    def __post_init__(self) -> None:
        check_types(self)
        self.mean, self.std = tuple(self.mean), tuple(self.std)

        self.img_size = to_2tuple(self.img_size)
        self.layers = tuple(self.layers)
        if self.channels is None:
            self.channels = tuple(c * self.width_factor for c in (256, 512, 1024, 2048))[: len(self.layers)]
        self.channels = tuple(self.channels)
        if self.stem_width is None:
            self.stem_width = 64 * self.width_factor
        check_sizes(self)
        if len(self.channels) != len(self.layers):
            raise UsageError(f"channels {self.channels} and layers {self.layers} differ in length")

    def to_dict(self) -> dict:
        return asdict(self)


class ResNetV2(TimmModelApi, nn.Module):
    """BiT: pre-activation ResNet-v2 with StdConv2d and GroupNorm(32); stem 7x7/2 conv, pad 1, 3x3/2 max-pool.

    timm's model API (`TimmModelApi`, docs/timm.md): num_classes, pretrained_cfg, get_classifier, reset_classifier
    (num_classes, global_pool), no_weight_decay, group_matcher, ..."""

    _first_conv = "stem.conv"

    def __init__(self, config: ResNetV2Config) -> None:
        super().__init__()
        c = self.config = config

        def conv(i: int, o: int, k: int, s: int = 1) -> StdConv2d:
            return StdConv2d(i, o, k, s, padding="symmetric", eps=c.ws_eps, eps_mode="var")

        self.stem = nn.Module()
        self.stem.conv = conv(c.in_chans, c.stem_width, 7, 2)
        n_blocks = sum(c.layers)
        dpr = [c.drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]
        stages, in_chs, k = [], c.stem_width, 0
        for i, (n, out_chs) in enumerate(zip(c.layers, c.channels)):
            blocks = []
            for j in range(n):
                stride = (1 if i == 0 else 2) if j == 0 else 1
                blocks.append(PreActBottleneck(in_chs, out_chs, stride, conv, c.gn_eps, dpr[k]))
                in_chs, k = out_chs, k + 1
            stages.append(_Stage(blocks))
        self.stages = nn.Sequential(*stages)
        self.grad_checkpointing = False  # `set_grad_checkpointing`: recompute each block's activations in the backward
        self.num_features = in_chs
        self.norm = _gn(in_chs, c.gn_eps)
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = Linear(in_chs, c.num_classes) if c.num_classes else nn.Identity()
        for m in self.modules():
            if isinstance(m, StdConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)  # BiT zero-initialises the head
            nn.init.zeros_(self.head.bias)

    def check_input(self, x: torch.Tensor) -> None:
        if is_fx_tracing():
            return
        expected = (self.config.in_chans, *self.config.img_size)
        if x.ndim != 4 or x.shape[1] != expected[0]:
            raise UsageError(f"expected input of shape (B, {expected[0]}, H, W) (default H, W = {expected[1:]}), got {tuple(x.shape)}")
        if min(x.shape[-2:]) < 32:
            raise UsageError(f"ResNetV2 needs images of at least 32x32, got {tuple(x.shape)}")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, F, H/32, W/32), after the final norm and ReLU."""
        self.check_input(x)
        x = self.stem.conv(x)  # (B, w, H/2, W/2)
        x = F.max_pool2d(F.pad(x, (1, 1, 1, 1)), 3, 2)  # (B, w, H/4, W/4)
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            for stage in self.stages:
                for blk in stage.blocks:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        else:
            x = self.stages(x)
        return F.relu(self.norm(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean(dim=(2, 3))  # (B, F, h, w) -> (B, F)
        if pre_logits:
            return x
        return self.head(self.head_drop(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each residual block's activations in the backward instead of storing them (training memory)."""
        self.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None,
                         class_names: list[str] | None = None) -> None:
        """A new zero-initialised head, as for fine-tuning; timm's order (`global_pool`: 'avg', the mean, is the only
        pooling; None keeps it), class names by keyword."""
        num_classes = check_num_classes(num_classes)
        names = check_class_names(num_classes, class_names, global_pool)
        self._set_global_pool(global_pool)
        self.config.num_classes, self.config.class_names = num_classes, names
        w = self.norm.weight
        self.head = nn.Identity()
        if num_classes:
            self.head = Linear(self.num_features, num_classes, device=w.device, dtype=w.dtype)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def _set_global_pool(self, global_pool: str | None) -> None:
        check_avg_pool(global_pool, "BiT")

    @property
    def global_pool(self) -> str:
        return "avg"

    def _fixed_input_size(self) -> bool:
        return False  # a CNN: any size of at least 32 x 32 (config.img_size is the preprocessing's)

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups for layer-wise LR decay (`timm_api.layer_groups`): the stem, then each block
        (each stage with `coarse`), the final norm with the last, the head last (no pattern); timm's own patterns,
        the module names being timm's."""
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)" if coarse else [
            (r"^stages\.(\d+)\.blocks\.(\d+)", None), (r"^norm\.", (99999,))])
