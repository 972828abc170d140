"""`create_model`: a registered architecture with random initialisation, with the weights of the pretrained catalog
(`pretrained=True`), or with a file's (`checkpoint_path=`), as `timm.create_model` builds them. It sits with the
checkpoints because two of its three ways load one; the architectures themselves are `vitkit.models`'."""
from __future__ import annotations

import difflib

from torch import nn

from ..errors import UsageError
from ..models.registry import ARCHS, lookup, build_config, build_model, config_with, get_entry
from ..models.timm_api import check_avg_pool, vit_classifier
from ..models.vit_config import ViTConfig
from .api import load
from . import timm_names
from .catalog import CATALOG, register_hub


def create_model(name: str, /, pretrained: bool = False, **overrides) -> nn.Module:
    """Build a registered model with random (official-style) initialisation, or with `pretrained=True` load it from
    vitkit's pretrained catalog, as `timm.create_model` does.

    Args:
        name: a short name from `list_models()` ("vit_b16"), the paper's name ("ViT-B/16") or timm's name of any
            architecture of timm's ViT modules vitkit implements ("vit_base_patch16_224", with or without a tag:
            "vit_base_patch16_224.augreg_in21k" builds that tag's head; `vitkit models --timm` lists them), built as
            timm registers it with timm's keywords over it. With `pretrained=True`: a catalog name
            ("ViT-B_16-i21k", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k") or timm's name with or without the
            tag ("vit_base_patch16_224.augreg2_in21k_ft_in1k", "swin_tiny_patch4_window7_224": the catalog's first
            entry of that architecture, as timm picks its default tag; else timm's hub repository of that tag);
            `vitkit catalog` lists them.
        pretrained: load the catalog's weights (`vitkit.load(name, **overrides)`) instead of initialising.
        **overrides: any config field by keyword (img_size, patch_size, in_chans, num_classes, num_heads,
            classifier, pos_embed, representation_size, drop_rate, drop_path_rate, patch_drop_rate, class_token,
            reg_tokens, dynamic_img_size, ...), and timm's keywords where they map (`translate_create_kwargs`):
            global_pool ('token', 'avg': the mean of the patch tokens with the norm after it as timm's default,
            'map'), mlp_ratio, act_layer (by name), pos_embed='learn', pos_drop_rate/proj_drop_rate (equal to
            drop_rate: vitkit has one dropout rate), checkpoint_path (the named model from a file: `vitkit.load`, its
            architecture checked against the name's). What has no vitkit equivalent is a UsageError saying so.
    """
    overrides = dict(overrides)
    checkpoint_path = overrides.pop("checkpoint_path", None)
    if pretrained and checkpoint_path:
        raise UsageError("pretrained=True loads the catalog's weights, checkpoint_path= a file of yours: give one")
    if pretrained:
        global_pool = overrides.pop("global_pool", None)  # the file decides the architecture; the pooling after
        return _loaded(catalog_name(name), translate_create_kwargs(None, {}, overrides), global_pool)
    if timm_names.split(name) is not None:  # timm's name, with or without a tag: the architecture timm registers
        return _timm_model(name, overrides, checkpoint_path)
    try:
        entry, implied = lookup(name)
    except UsageError:
        raise timm_names.unknown(name) from None
    if checkpoint_path:
        global_pool = overrides.pop("global_pool", None)
        kw = translate_create_kwargs(entry.arch, {**entry.kwargs, **implied}, overrides)
        return _loaded(checkpoint_path, kw, global_pool, expected=build_config(name, **kw))
    kw = translate_create_kwargs(entry.arch, {**entry.kwargs, **implied}, overrides)
    return build_model(build_config(name, **kw))


def _timm_model(name: str, overrides: dict, checkpoint_path=None) -> nn.Module:
    """timm's `name` as `timm.create_model(name, **overrides)` builds it: the registered arguments with timm's keywords
    over them (`timm_names.config_fields`); the others (drop rates, vitkit's own fields) as for vitkit's names."""
    global_pool = overrides.pop("global_pool", None) if checkpoint_path else None
    explicit_size = "img_size" in overrides  # applied to the file's model as vitkit.load(img_size=) applies it
    arch, _ = timm_names.split(name)
    model_args, rest = timm_names.split_kwargs(arch, overrides)
    kind, fields = timm_names.config_fields(name, model_args)
    kw = translate_create_kwargs(kind, fields, rest)
    config = config_with(ARCHS[kind][0](**fields), **kw)
    if checkpoint_path:  # the file's architecture checked against the name's, as timm's strict load does
        hints = {**kw, **({"num_heads": config.num_heads} if kind == "vit" else {}),
                 **({"img_size": config.img_size} if explicit_size else {})}
        return _loaded(checkpoint_path, hints, global_pool, expected=config)
    return build_model(config)


# what a checkpoint must share with the model its name builds (create_model's checkpoint_path)
_STRUCTURE = {"vit": ("embed_dim", "depth", "num_heads", "patch_size", "hybrid_layers", "hybrid_stem_pool", "hybrid_norm",
                      "mlp_dim",
                      "mlp_layer", "rope", "class_token", "reg_tokens", "pos_embed", "res_post_norm", "num_kv_heads",
                      "kv_full_blocks"),
              "resnetv2": ("layers", "width_factor", "channels"),
              "swin": ("embed_dim", "depths", "num_heads", "patch_size"),
              "samvit": ("embed_dim", "depth", "num_heads", "patch_size", "window_size", "global_attn_indexes",
                         "use_abs_pos", "use_rel_pos", "neck_chans")}


def _loaded(path_or_name, kw: dict, global_pool: str | None, expected=None) -> nn.Module:
    """`vitkit.load(path_or_name, **kw)`, its architecture checked against `expected` (the config the name builds:
    create_model's checkpoint_path), then the pooling changed to timm's `global_pool` as `reset_classifier` changes
    it (the head and the norms kept)."""
    model = load(path_or_name, **kw)
    if expected is not None:
        c = model.config
        if c.arch != expected.arch:
            raise UsageError(f"{path_or_name} holds a {c.arch} model, not the {expected.arch} its name builds")
        diff = [f"{f} {getattr(c, f)} (the name's: {getattr(expected, f)})" for f in _STRUCTURE[c.arch]
                if getattr(c, f) != getattr(expected, f)]
        if diff:
            raise UsageError(f"{path_or_name} is not the model its name builds: {'; '.join(diff)}")
    if global_pool is not None:
        model._set_global_pool(global_pool)
    return model


def catalog_name(name: str) -> str:
    """The catalog entry `create_model(name, pretrained=True)` loads: the name itself, timm's hub copy of it
    ("timm/<name>", the first tag when the name has none, as timm picks its default), or a UsageError naming the
    catalog's entries for that model and how to list them all."""
    if name in CATALOG:
        return name
    if f"timm/{name}" in CATALOG:
        return f"timm/{name}"
    tagged = [k for k in CATALOG if k.startswith(f"timm/{name}.")]
    if tagged:
        return tagged[0]
    repo = timm_names.hub_repo(name)  # any weights timm publishes on the hub, by timm's name and tag
    if repo is not None:
        register_hub(repo, "timm", "timm hub weights (by timm's name)")
        return repo
    hints = []
    try:
        stem = get_entry(name).paper_name.replace("/", "_")  # "ViT-B/16" -> the official release's "ViT-B_16-..."
        short = stem.removeprefix("ViT-")  # ... and AugReg's "augreg-B_16-..."
        hints = [k for k in CATALOG if k.startswith((f"{stem}-", f"augreg-{short}-"))]
    except UsageError:
        pass
    hints = hints or difflib.get_close_matches(name, list(CATALOG), n=5, cutoff=0.5)
    also = f"; candidates: {', '.join(hints)}" if hints else ""
    raise UsageError(f"no pretrained weights named {name!r} in vitkit's catalog{also}. `vitkit catalog` lists every "
                     f"entry (in Python: vitkit.checkpoints.catalog.CATALOG); vitkit.load(path) reads a file")


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
    "dynamic_img_pad": (False, "vitkit has no padding to the patch size: use a size divisible by it"),
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
    for name in _NO_OPS:
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
                out["class_token"] = ViTConfig(**{k: v for k, v in base.items()}).class_token
    out.update(kw)
    return out
