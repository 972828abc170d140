"""Swin Transformer checkpoints <-> vitkit names: timm's `swin_transformer` (state dicts and hub folders), the
official microsoft/Swin-Transformer `.pth` files, and transformers' `SwinModel` / `SwinForImageClassification`.

vitkit's Swin uses timm's names, with the classifier as `head` (timm: `head.fc`). The official files put patch
merging at the end of stages 0-2 (`layers.N.downsample`, N < 3), timm at the start of stages 1-3; they also save the
`relative_position_index` and `attn_mask` buffers, which vitkit rebuilds. transformers keeps separate query, key and
value Linears and its own names for everything else (and patch merging at the end of a stage, as the official code).

No Swin file records its input resolution, except timm's and transformers' config.json. Without one, the resolution
is the one the windows were laid out for: window x 2^(stages - 1) x patch (224 for window 7, 384 for window 12), or,
where the last stage's window is smaller than the others (a map smaller than the window), that map's size x 2^(stages
- 1) x patch.
"""
from __future__ import annotations

import math
import re

import torch

from ..models.swin import SwinConfig
from .io import CheckpointError, fuse

_BUFFERS = ("relative_position_index", "attn_mask")


def is_swin(keys) -> bool:
    return any(re.match(r"(swin\.)?(layers|encoder\.layers)\.0\.blocks\.0\.(attn\.relative_position_bias_table|"
                        r"attention\.self\.relative_position_bias_table)$", k) for k in keys)


def is_hf_swin(keys) -> bool:
    return any(k.endswith("attention.self.relative_position_bias_table") for k in keys)


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """timm's or the official names -> vitkit's (the official layout told by `layers.0.downsample`)."""
    official = any(k.startswith("layers.0.downsample.") for k in w)
    sd, unused = {}, []
    for k, v in w.items():
        if k.endswith(_BUFFERS):
            continue  # buffers vitkit rebuilds from the windows
        if official:
            k = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) + 1}.downsample", k)
        k = k.replace("head.fc.", "head.")
        if k.startswith("head.") and v.ndim >= 1 and v.shape[0] == 0:
            unused.append(k)
            continue
        sd[k] = v
    return sd, {}, unused


def from_vitkit(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitkit's names -> timm's."""
    return {("head.fc." + k[len("head."):] if k.startswith("head.") else k): v for k, v in sd.items()}


_HF_BLOCK = {"layernorm_before": "norm1", "attention.output.dense": "attn.proj", "layernorm_after": "norm2",
             "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}


def hf_to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    sd, qkv, unused = {}, {}, []
    for k, v in w.items():
        key = k.removeprefix("swin.")
        if key.endswith(_BUFFERS) or key.startswith("pooler"):
            continue
        if m := re.match(r"encoder\.layers\.(\d+)\.blocks\.(\d+)\.(.+)\.(weight|bias)$", key):
            s, b, mod, leaf = m.groups()
            p = f"layers.{s}.blocks.{b}."
            if a := re.match(r"attention\.self\.(query|key|value)$", mod):
                qkv[(p, leaf, a.group(1))] = v
            elif mod in _HF_BLOCK:
                sd[p + f"{_HF_BLOCK[mod]}.{leaf}"] = v
            else:
                raise CheckpointError(f"unexpected Hugging Face Swin key {k!r}")
        elif m := re.match(r"encoder\.layers\.(\d+)\.blocks\.(\d+)\.attention\.self\.relative_position_bias_table$", key):
            sd[f"layers.{m.group(1)}.blocks.{m.group(2)}.attn.relative_position_bias_table"] = v
        elif m := re.match(r"encoder\.layers\.(\d+)\.downsample\.(reduction|norm)\.(weight|bias)$", key):
            sd[f"layers.{int(m.group(1)) + 1}.downsample.{m.group(2)}.{m.group(3)}"] = v  # end of stage N -> start of N+1
        elif m := re.match(r"embeddings\.patch_embeddings\.projection\.(weight|bias)$", key):
            sd[f"patch_embed.proj.{m.group(1)}"] = v
        elif m := re.match(r"embeddings\.norm\.(weight|bias)$", key):
            sd[f"patch_embed.norm.{m.group(1)}"] = v
        elif m := re.match(r"layernorm\.(weight|bias)$", key):
            sd[f"norm.{m.group(1)}"] = v
        elif m := re.match(r"classifier\.(weight|bias)$", k):
            sd[f"head.{m.group(1)}"] = v
        elif key.startswith("embeddings.mask_token"):
            unused.append(k)
        else:
            raise CheckpointError(f"unexpected Hugging Face Swin key {k!r}")
    for p, leaf in sorted({(p, leaf) for p, leaf, _ in qkv}):
        sd[p + f"attn.qkv.{leaf}"] = fuse({f"{p}attention.self.{n}.{leaf}": qkv[(p, leaf, n)]
                                          for n in ("query", "key", "value")})
    facts: dict = {}
    c = hf_config or {}
    if c.get("model_type", "swin") != "swin":
        raise CheckpointError(f"Hugging Face model_type {c.get('model_type')!r} is not a Swin")
    if c.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"unsupported Hugging Face Swin hidden_act {c.get('hidden_act')!r}")
    for ours, theirs in (("img_size", "image_size"), ("window_size", "window_size"), ("norm_eps", "layer_norm_eps")):
        if theirs in c:
            facts[ours] = c[theirs]
    labels = c.get("id2label") or {}
    names = [labels.get(str(j)) for j in range(len(labels))]
    if names and not all(re.fullmatch(r"LABEL_\d+", n or "") for n in names):
        facts["class_names"] = names
    return sd, facts, unused


def infer_swin_config(sd: dict[str, torch.Tensor], hints: dict) -> SwinConfig:
    """Width, depths, heads, windows, patch, MLP ratio, classes from the tensors; the resolution from `hints`
    (a config.json's) or from the windows (this module's docstring)."""
    hints = dict(hints)
    w = sd["patch_embed.proj.weight"]
    stages = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    depths = tuple(len({m.group(1) for k in sd if (m := re.match(rf"layers\.{s}\.blocks\.(\d+)\.", k))}) for s in range(stages))
    tables = [sd[f"layers.{s}.blocks.0.attn.relative_position_bias_table"] for s in range(stages)]
    heads = tuple(t.shape[1] for t in tables)
    wins = []
    for s, t in enumerate(tables):
        side = math.isqrt(t.shape[0])
        if side * side != t.shape[0] or side % 2 == 0:
            raise CheckpointError(f"stage {s}'s relative-position table has {t.shape[0]} rows: not a square window's")
        wins.append((side + 1) // 2)
    window = hints.pop("window_size", None) or max(wins)
    patch = tuple(w.shape[2:])
    d = w.shape[0]
    img = hints.pop("img_size", None)
    if img is None:
        last = wins[-1] if wins[-1] < window else window  # a map smaller than the window shows in its table
        img = tuple(last * 2 ** (stages - 1) * p for p in patch)
    cfg = dict(embed_dim=d, depths=depths, num_heads=heads, window_size=window, patch_size=patch, in_chans=w.shape[1],
               mlp_ratio=sd["layers.0.blocks.0.mlp.fc1.weight"].shape[0] / d,
               qkv_bias="layers.0.blocks.0.attn.qkv.bias" in sd, img_size=img,
               num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0)
    cfg.update({k: v for k, v in hints.items() if k not in ("act", "num_heads")})
    try:
        config = SwinConfig(**cfg)
    except TypeError as e:
        raise CheckpointError(f"unknown option for a swin model: {e}") from e
    for s, win in enumerate(wins):  # the tables must be the windows this resolution lays out
        if config.stage_window(s)[0][0] != win:
            raise CheckpointError(f"stage {s}'s relative-position table is for {win}x{win} windows, but at img_size "
                                  f"{config.img_size} the stage's windows are {config.stage_window(s)[0]}: pass the "
                                  f"checkpoint's own img_size= (and window_size=)")
    return config


def folder_config(c: SwinConfig) -> dict:
    """timm's config.json for a vitkit Swin (architecture + model_args + pretrained_cfg)."""
    args = {"img_size": list(c.img_size), "patch_size": c.patch_size[0], "window_size": c.window_size,
            "embed_dim": c.embed_dim, "depths": list(c.depths), "num_heads": list(c.num_heads),
            "mlp_ratio": c.mlp_ratio, "qkv_bias": c.qkv_bias, "in_chans": c.in_chans, "num_classes": c.num_classes}
    if c.patch_size[0] != c.patch_size[1] or c.norm_eps != 1e-5:
        raise CheckpointError("timm's Swin takes a square patch and LayerNorm eps 1e-5")
    cfg = {"architecture": "swin_tiny_patch4_window7_224", "num_classes": c.num_classes, "num_features": c.num_features,
           "global_pool": "avg", "model_args": args,
           "pretrained_cfg": {"input_size": [c.in_chans, *c.img_size], "fixed_input_size": True,
                              "interpolation": c.interpolation, "crop_pct": c.crop_pct, "crop_mode": "center",
                              "mean": list(c.mean), "std": list(c.std), "num_classes": c.num_classes,
                              "first_conv": "patch_embed.proj", "classifier": "head.fc"}}
    if c.class_names:
        cfg["label_names"] = list(c.class_names)
    return cfg


def folder_facts(cfg: dict) -> dict:
    """vitkit Swin fields from a timm config.json."""
    args, pre = cfg.get("model_args") or {}, cfg.get("pretrained_cfg") or {}
    facts: dict = {}
    for key in ("mean", "std", "interpolation", "crop_pct"):
        if key in pre:
            facts[key] = tuple(pre[key]) if key in ("mean", "std") else pre[key]
    if "img_size" in args:
        facts["img_size"] = args["img_size"]
    elif "input_size" in pre:
        facts["img_size"] = tuple(pre["input_size"][1:])
    m = re.search(r"window(\d+)", cfg.get("architecture", ""))
    if "window_size" in args:
        facts["window_size"] = args["window_size"]
    elif m:
        facts["window_size"] = int(m.group(1))
    for key in ("norm_layer", "embed_layer", "act_layer", "head_dim", "always_partition", "strict_img_size"):
        if args.get(key) not in (None, True if key == "strict_img_size" else None, False if key == "always_partition" else None):
            raise CheckpointError(f"timm's config.json sets {key}={args[key]!r}, which vitkit's Swin does not implement")
    labels = cfg.get("label_names") or pre.get("label_names")
    if isinstance(labels, list):
        facts["class_names"] = [str(x) for x in labels]
    return facts
