"""timm's model API on vitkit's models: the names a timm user reaches for, each the real thing over vitkit's config.

`TimmModelApi` is mixed into `VisionTransformer`, `ResNetV2` and `SwinTransformer`: `num_classes`, `pretrained_cfg`
(alias `default_cfg`), `get_classifier()`, `no_weight_decay()` and `head_hidden_size` here; `group_matcher()`,
`set_input_size()` and the pooling half of `reset_classifier(num_classes, global_pool, class_names=)` in each model,
where the module names and what may change differ. timm's `create_model` keywords map to vitkit's config fields in
`vitkit.checkpoints.create`. docs/timm.md has the table: timm's name, vitkit's, the differences.
"""
from __future__ import annotations

import math
import re
from typing import Any

from torch import nn

from ..errors import UsageError
from .layers.patch_embed import to_2tuple

# timm's ViT `global_pool` -> vitkit's `classifier`; the others timm knows ('', 'max', 'avgmax', 'prr') are refused
VIT_POOLS = {"token": "token", "avg": "gap", "map": "map"}
VIT_POOL_NAMES = {v: k for k, v in VIT_POOLS.items()}

# Parameters kept out of weight decay by name (as timm's `no_weight_decay()`, and vitkit's optimizer,
# `training/optim.py`, by the same substrings): learned tokens, position embeddings and relative-position tables, the
# attention-pooling probe. Norm weights and biases are left out by their shape (ndim <= 1), in timm and in vitkit.
NO_WEIGHT_DECAY = ("pos_embed", "cls_token", "dist_token", "reg_token", "mask_token", "rel_pos", "attn_pool.latent",
                   "relative_position_bias_table", "rope.freqs")

# timm's group_matcher: a group's ordinal suffix that merges it into the group before (the final norm into the last
# block)
MATCH_PREV_GROUP = (99999,)


def check_num_classes(num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise UsageError(f"num_classes must be an int >= 0 (0: no head, the pooled features), got {num_classes!r}")
    return num_classes


def check_class_names(num_classes: int, class_names: Any, global_pool: Any) -> list[str] | None:
    """The class names reset_classifier stores, checked before anything changes; a list where timm's `global_pool`
    goes (vitkit's old positional order) is a UsageError saying so."""
    if global_pool is not None and not isinstance(global_pool, str):
        raise UsageError(f"reset_classifier(num_classes, global_pool=None, class_names=None) takes timm's order, the "
                         f"pooling second ('token', 'avg', 'map'); got {type(global_pool).__name__} {global_pool!r}: "
                         f"pass class names by keyword, reset_classifier({num_classes}, class_names=[...])")
    if class_names is None:
        return None
    if isinstance(class_names, str) or not all(isinstance(n, str) for n in class_names):
        raise UsageError(f"class_names must be a list of strings, got {class_names!r}")
    names = list(class_names)
    if num_classes and len(names) != num_classes:
        raise UsageError(f"{len(names)} class names for {num_classes} classes")
    return names


def vit_classifier(global_pool: str) -> str:
    """timm's `global_pool` name -> vitkit's ViT `classifier`, or a UsageError naming what vitkit has."""
    if global_pool not in VIT_POOLS:
        raise UsageError(f"global_pool={global_pool!r}: vitkit's ViT pools by 'token' (the class token), 'avg' (the "
                         f"mean of the patch tokens) or 'map' (attention pooling); timm's '', 'max', 'avgmax' and "
                         f"'prr' have no vitkit equivalent (forward_features(x) gives the unpooled tokens)")
    return VIT_POOLS[global_pool]


def check_avg_pool(global_pool: str | None, what: str) -> None:
    """A model that pools by the mean alone (BiT, Swin): timm's 'avg' is it, anything else a UsageError."""
    if global_pool is not None and global_pool != "avg":
        raise UsageError(f"global_pool={global_pool!r}: vitkit's {what} pools by the mean over the feature map alone "
                         f"(timm's 'avg'); forward_features(x) gives the map unpooled")


class TimmModelApi:
    """timm's names over a vitkit model's config. A model class sets `_first_conv` (the first conv's module name, for
    `pretrained_cfg`) and defines `group_matcher`, `_set_global_pool` and, where a size may change, `set_input_size`."""

    _first_conv = "patch_embed.proj"

    @property
    def num_classes(self) -> int:
        """The head's classes (0: `model(x)` gives the pooled features); `reset_classifier` changes it."""
        return self.config.num_classes

    @property
    def head_hidden_size(self) -> int:
        """The width of the features the head reads (timm: `head_hidden_size`; vitkit and timm: `num_features`)."""
        return self.num_features

    def _fixed_input_size(self) -> bool:
        return True

    def _classifier_names(self) -> str | tuple[str, ...]:
        return "head"

    @property
    def pretrained_cfg(self) -> dict:
        """timm's preprocessing record, from this model's config as it is now: what `timm.data.resolve_data_config(
        model=model)` reads (input_size, interpolation, crop_pct, crop_mode, mean, std), the classes, and vitkit's
        names of the first conv and the classifier."""
        c = self.config
        cfg = {"input_size": (c.in_chans, *c.img_size), "fixed_input_size": self._fixed_input_size(),
               "interpolation": c.interpolation, "crop_pct": c.crop_pct, "crop_mode": "center",
               "mean": tuple(c.mean), "std": tuple(c.std), "num_classes": c.num_classes,
               "first_conv": self._first_conv, "classifier": self._classifier_names()}
        if c.class_names:
            cfg["label_names"] = tuple(c.class_names)
        return cfg

    default_cfg = pretrained_cfg  # timm's older name

    def get_classifier(self) -> nn.Module:
        """The classifier: a Linear, or nn.Identity when num_classes is 0."""
        return self.head

    def no_weight_decay(self) -> set[str]:
        """The parameters timm keeps out of weight decay by name, as vitkit's names: learned tokens, position
        embeddings, relative-position tables, the attention-pooling probe (what `NO_WEIGHT_DECAY` names). timm's
        optimizer factory matches each name with fnmatch; norms and biases go by their shape there and in vitkit."""
        return {n for n, _ in self.named_parameters() if any(t in n for t in NO_WEIGHT_DECAY)}

    def _check_patch_size(self, patch_size) -> None:

        if patch_size is not None and to_2tuple(patch_size) != tuple(self.config.patch_size):
            raise UsageError(f"patch_size {to_2tuple(patch_size)}: vitkit keeps a model's patch size "
                             f"{tuple(self.config.patch_size)} (timm resamples the patch embedding's kernel; vitkit "
                             f"does not): create the model with patch_size= and train or load it at that size")


def layer_groups(model: nn.Module, coarse: bool = False) -> dict[int, list[str]]:
    """{group id: parameter names}, the groups `model.group_matcher(coarse)` describes, as timm's layer-wise LR decay
    forms them: each name takes the ordinal of the first pattern that matches it (the group's position in the dict,
    then the pattern's captured numbers, then its suffix); names no pattern matches (the head) come last; ordinals
    ending in 99999 join the group before; groups are numbered from 0 in order."""
    matcher = model.group_matcher(coarse=coarse)
    patterns = []
    for i, spec in enumerate(matcher.values()):
        if spec is None:
            continue
        for regex, suffix in (spec if isinstance(spec, (list, tuple)) else [(spec, None)]):
            patterns.append((re.compile(regex), i, suffix))

    def ordinal(name: str) -> tuple[float, ...]:
        for regex, i, suffix in patterns:
            m = regex.match(name)
            if m:
                return (i, *(float(g) for g in m.groups() if g is not None), *(suffix or ()))
        return (math.inf,)

    by_ordinal: dict[tuple, list[str]] = {}
    for name, _ in model.named_parameters():
        by_ordinal.setdefault(ordinal(name), []).append(name)
    groups: dict[int, list[str]] = {}
    gid = -1
    for key in sorted(by_ordinal):
        if gid < 0 or key[-1] != MATCH_PREV_GROUP[0]:
            gid += 1
        groups.setdefault(gid, []).extend(by_ordinal[key])
    return groups


# ---- timm's create_model keywords -> vitkit's config fields -------------------------------------------------------
