"""BatchNorm2d that refuses running statistics which would give NaN: the conv stem's norms (MobileCLIP's MCi) and the
hybrid ResNet's with `hybrid_norm="batch"`. In eval mode a BatchNorm divides by sqrt(running_var + eps), so a file
with a negative or non-finite variance, or a non-finite mean, would load into a model that answers NaN."""
from __future__ import annotations

import torch
from torch import nn

from ...errors import CheckpointError

BN_EPS = 1e-5  # torch's and timm's BatchNorm2d default
STATS = ("running_mean", "running_var")


def check_stat(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """A CheckpointError naming `name` unless `t`, a running mean or variance, is a floating-point tensor finite in
    `dtype` (the buffer's: what the load casts it to; a float64 1e300 is inf in float32), the variance >= 0."""
    if not torch.is_tensor(t):
        return  # not a tensor: the load itself refuses it
    if not t.is_floating_point():
        raise CheckpointError(f"{name} is {t.dtype}: a BatchNorm's running statistics are floating point; the file is "
                              f"damaged")
    t = t.to(dtype)
    var = name.endswith("running_var")
    bad = ~torch.isfinite(t) | (t < 0 if var else torch.zeros_like(t, dtype=torch.bool))
    if bad.any():
        n = int(bad.sum())
        raise CheckpointError(f"{name} has {n} {'negative or ' if var else ''}non-finite entr{'y' if n == 1 else 'ies'} "
                              f"in {str(dtype).replace('torch.', '')} (min {float(t.min()):g}): a BatchNorm's running "
                              f"statistics must be finite, the variance >= 0; the file is damaged"
                              f"{'' if dtype == torch.float32 else f' or holds values beyond the model dtype ({dtype})'}")


class CheckedBatchNorm2d(nn.BatchNorm2d):
    """torch's BatchNorm2d; every path that loads it (a file, a run's resume, `load_state_dict`) checks the running
    statistics first (`check_stat`)."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for stat in STATS:
            if prefix + stat in state_dict and getattr(self, stat) is not None:
                check_stat(prefix + stat, state_dict[prefix + stat], getattr(self, stat).dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
