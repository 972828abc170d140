"""The BiT baseline's own .npz releases (google-research/big_transfer, the paper's CNN baseline) -> vitkit names.

Key names, all under `resnet/`: `root_block/standardized_conv2d/kernel` (the stem),
`block{s}/unit{u:02d}/{a,b,c}/standardized_conv2d/kernel` and `.../{a,b,c}/group_norm/{gamma,beta}` (the three
convs of a pre-activation bottleneck and the norms in front of them), `block{s}/unit{u:02d}/a/proj/
standardized_conv2d/kernel` (the projection shortcut), `group_norm/{gamma,beta}` (the final norm) and
`head/conv2d/{kernel,bias}` (a 1x1 conv classifier). Kernels are HWIO. Read with timm's BiT numerics
(weight standardisation eps 1e-8 on the variance, GroupNorm eps 1e-5), the defaults of `ResNetV2Config`.
"""
from __future__ import annotations

import re

import torch

from .io import CheckpointError

_CONV = {"a": "conv1", "b": "conv2", "c": "conv3"}
_NORM = {"a": "norm1", "b": "norm2", "c": "norm3"}
_LEAF = {"gamma": "weight", "beta": "bias"}


def is_bit_npz(keys) -> bool:
    return any(k.endswith("root_block/standardized_conv2d/kernel") for k in keys)


def _conv(k: torch.Tensor) -> torch.Tensor:
    return k.permute(3, 2, 0, 1).contiguous()  # HWIO -> OIHW


def _vec(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)  # GroupNorm gamma/beta: (C,), or (1, 1, 1, C) in older files


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(vitkit ResNetV2 state dict, facts, keys left unused)."""
    prefix = next(k for k in w if k.endswith("root_block/standardized_conv2d/kernel"))[: -len("root_block/standardized_conv2d/kernel")]
    sd: dict[str, torch.Tensor] = {}
    unused = []
    for key, v in w.items():
        if not key.startswith(prefix):
            unused.append(key)
            continue
        k = key[len(prefix):]
        if k == "root_block/standardized_conv2d/kernel":
            sd["stem.conv.weight"] = _conv(v)
        elif m := re.fullmatch(r"group_norm/(gamma|beta)", k):
            sd[f"norm.{_LEAF[m.group(1)]}"] = _vec(v)
        elif k == "head/conv2d/kernel":
            sd["head.weight"] = v.reshape(v.shape[-2], v.shape[-1]).t().contiguous()  # (1, 1, F, C) -> (C, F)
        elif k == "head/conv2d/bias":
            sd["head.bias"] = v
        elif m := re.fullmatch(r"block(\d+)/unit(\d+)/([abc])/(proj/)?(standardized_conv2d/kernel|group_norm/gamma|group_norm/beta)", k):
            s, u, part, proj, leaf = int(m.group(1)) - 1, int(m.group(2)) - 1, m.group(3), m.group(4), m.group(5)
            base = f"stages.{s}.blocks.{u}."
            if proj:
                if part != "a" or not leaf.startswith("standardized_conv2d"):
                    raise CheckpointError(f"unexpected BiT key {key!r}")
                sd[base + "downsample.conv.weight"] = _conv(v)
            elif leaf.startswith("standardized_conv2d"):
                sd[base + _CONV[part] + ".weight"] = _conv(v)
            else:
                sd[base + _NORM[part] + "." + _LEAF[leaf.split("/")[1]]] = _vec(v)
        else:
            unused.append(key)
    if "head.weight" in sd and sd["head.weight"].shape[0] == 0:
        del sd["head.weight"], sd["head.bias"]
    return sd, {}, sorted(unused)
