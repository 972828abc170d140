"""timm's model API on vitkit's models: the names a timm user reaches for, each the real thing over vitkit's config.

`TimmModelApi` is mixed into `VisionTransformer`, `ResNetV2` and `SwinTransformer`: `num_classes`, `pretrained_cfg`
(alias `default_cfg`), `get_classifier()`, `no_weight_decay()` and `head_hidden_size` here; `group_matcher()`,
`set_input_size()` and the pooling half of `reset_classifier(num_classes, global_pool, class_names=)` in each model,
where the module names and what may change differ. `translate_create_kwargs` maps timm's `create_model` keywords to
vitkit's config fields (`vitkit.create_model`). docs/timm.md has the table: timm's name, vitkit's, the differences.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any

from torch import nn

from ..errors import UsageError

# timm's ViT `global_pool` -> vitkit's `classifier`; the others timm knows ('', 'max', 'avgmax', 'prr') are refused
VIT_POOLS = {"token": "token", "avg": "gap", "map": "map"}
VIT_POOL_NAMES = {v: k for k, v in VIT_POOLS.items()}

# Parameters kept out of weight decay by name (as timm's `no_weight_decay()`, and vitkit's optimizer,
# `training/optim.py`, by the same substrings): learned tokens, position embeddings and relative-position tables, the
# attention-pooling probe. Norm weights and biases are left out by their shape (ndim <= 1), in timm and in vitkit.
NO_WEIGHT_DECAY = ("pos_embed", "cls_token", "dist_token", "reg_token", "mask_token", "rel_pos", "attn_pool.latent",
                   "relative_position_bias_table")

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
        from .layers.patch_embed import to_2tuple

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

# accepted and ignored: what they ask for is how vitkit's models are anyway
_NO_OPS = {"exportable": "vitkit's models export to ONNX as they are", "no_jit": "vitkit uses no TorchScript layers"}
# accepted at their timm defaults (the value vitkit's models have), refused otherwise: {name: (default, why not)}
_FIXED = {
    "scriptable": (None, "vitkit's models are not TorchScript-scriptable (torch.fx, torch.compile and torch.export are "
                         "the supported ways to capture them)"),
    "features_only": (False, "vitkit has no feature-extraction wrapper: use model.forward_intermediates(x) or "
                             "torch.fx feature extraction"),
    "out_indices": (None, "vitkit has no feature-extraction wrapper: model.forward_intermediates(x, layers=...)"),
    "pretrained_cfg": (None, "vitkit's preprocessing is the config's (mean, std, interpolation, crop_pct, img_size)"),
    "pretrained_cfg_overlay": (None, "vitkit's preprocessing is the config's (mean, std, interpolation, crop_pct, "
                                     "img_size)"),
    "cache_dir": (None, "vitkit's catalog caches in $VITKIT_HOME and the Hugging Face cache (HF_HOME)"),
    "patch_drop_rate": (0.0, "vitkit has no patch dropout"),
    "dynamic_img_pad": (False, "vitkit has no padding to the patch size: use a size divisible by it"),
    "final_norm": (True, "vitkit's ViT always has the final norm"),
    "proj_bias": (True, "vitkit's attention and MLP projections always have a bias"),
    "pool_include_prefix": (False, "vitkit's 'avg' pooling averages the patch tokens alone"),
    "fix_init": (False, "vitkit's initialisation is the official JAX one"),
    "drop_block_rate": (0.0, "vitkit's BiT has no DropBlock"),
    "output_stride": (32, "vitkit's BiT has output stride 32 (no dilation)"),
    "strict_img_size": (True, "vitkit's Swin is laid out for one resolution: set_input_size(img_size) for another"),
    "always_partition": (False, "vitkit's Swin uses one window for a stage whose map is no larger than the window"),
}
_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_POS_EMBEDS = {"learn": "learned_1d", "none": "none"}


def translate_create_kwargs(arch: str | None, base: dict, kw: dict) -> dict:
    """timm's `create_model` keywords -> vitkit config overrides. `arch` is "vit", "resnetv2", "swin" or None (a
    pretrained checkpoint whose architecture the file decides: the keywords that need one are then refused); `base`
    is the registry entry's settings. vitkit's own field names pass through unchanged (`_check_fields` judges them)."""
    kw = dict(kw)
    out: dict = {}
    for name, why in _NO_OPS.items():
        kw.pop(name, None)
    for name, (default, why) in _FIXED.items():
        if name in kw:
            value = kw.pop(name)
            if value != default and not (default is None and value is False):
                raise UsageError(f"{name}={value!r}: {why}")
    if "weight_init" in kw:
        value = kw.pop("weight_init")
        if value not in ("jax", "skip"):
            raise UsageError(f"weight_init={value!r}: vitkit initialises as the official JAX code does (timm's "
                             f"'jax'); it has no other scheme")
    if "act_layer" in kw:
        value = kw.pop("act_layer")
        if value not in _ACTS or arch not in ("vit", None):
            raise UsageError(f"act_layer={value!r}: vitkit's ViT takes act= {tuple(_ACTS)} (by name)")
        out["act"] = _ACTS[value]
    if "fc_norm" in kw and kw["fc_norm"] is None:  # timm's "decide from global_pool"
        del kw["fc_norm"]
    if isinstance(kw.get("pos_embed"), str) and kw["pos_embed"] in _POS_EMBEDS and arch in ("vit", None):
        out["pos_embed"] = _POS_EMBEDS[kw.pop("pos_embed")]
    if "mlp_ratio" in kw and arch in ("vit", None):
        if arch is None:
            raise UsageError("mlp_ratio with pretrained=True: the checkpoint fixes the MLP's width")
        ratio = kw.pop("mlp_ratio")
        out["mlp_dim"] = int(kw.get("embed_dim", base.get("embed_dim", 768)) * ratio)
    if arch == "swin" and "window_size" in kw and not isinstance(kw["window_size"], int):
        w = tuple(kw["window_size"])
        if len(set(w)) != 1:
            raise UsageError(f"window_size={w}: vitkit's Swin has square windows, one size for every stage")
        kw["window_size"] = w[0]
    # timm's ViT splits vitkit's one dropout rate: head (drop_rate), embeddings (pos_drop_rate), projections
    # (proj_drop_rate); vitkit's drop_rate is all of them (the paper's dropout), so the others must agree with it
    rate = kw.get("drop_rate", base.get("drop_rate", 0.0))
    for name in ("pos_drop_rate", "proj_drop_rate"):
        if name in kw:
            value = kw.pop(name)
            if value != rate:
                raise UsageError(f"{name}={value}: vitkit has one dropout rate, drop_rate={rate} (after the "
                                 f"embeddings, in the attention output and the MLP, before the head); pass drop_rate= "
                                 f"alone")
    if "global_pool" in kw:
        gp = kw.pop("global_pool")
        if arch is None:
            raise UsageError("global_pool needs the model's architecture")
        if arch != "vit":
            check_avg_pool(gp, "BiT" if arch == "resnetv2" else "Swin")
        else:
            if "classifier" in kw:
                raise UsageError("give global_pool (timm's name) or classifier (vitkit's), not both")
            out["classifier"] = vit_classifier(gp)
            # timm: fc_norm defaults to global_pool == 'avg' (the norm after the pooling); the class token stays
            # as the architecture has it (the paper's GAP, classifier='gap', has none)
            out["fc_norm"] = kw.pop("fc_norm", gp == "avg")
            if "class_token" not in kw:
                from .vit import ViTConfig

                out["class_token"] = ViTConfig(**{k: v for k, v in base.items()}).class_token
    out.update(kw)
    return out


def catalog_name(name: str) -> str:
    """The catalog entry `create_model(name, pretrained=True)` loads: the name itself, timm's hub copy of it
    ("timm/<name>", the first tag when the name has none, as timm picks its default), or a UsageError naming the
    catalog's entries for that model and how to list them all."""
    from ..checkpoints.catalog import CATALOG

    if name in CATALOG:
        return name
    if f"timm/{name}" in CATALOG:
        return f"timm/{name}"
    tagged = [k for k in CATALOG if k.startswith(f"timm/{name}.")]
    if tagged:
        return tagged[0]
    hints = []
    try:
        from .registry import get_entry

        stem = get_entry(name).paper_name.replace("/", "_")  # "ViT-B/16" -> the official release's "ViT-B_16-..."
        short = stem.removeprefix("ViT-")  # ... and AugReg's "augreg-B_16-..."
        hints = [k for k in CATALOG if k.startswith((f"{stem}-", f"augreg-{short}-"))]
    except UsageError:
        pass
    hints = hints or difflib.get_close_matches(name, list(CATALOG), n=5, cutoff=0.5)
    also = f"; candidates: {', '.join(hints)}" if hints else ""
    raise UsageError(f"no pretrained weights named {name!r} in vitkit's catalog{also}. `vitkit catalog` lists every "
                     f"entry (in Python: vitkit.checkpoints.catalog.CATALOG); vitkit.load(path) reads a file")
