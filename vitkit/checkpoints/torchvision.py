"""torchvision `vit_*` state dicts -> vitkit names (import only)."""
from __future__ import annotations

import re

import torch

from .io import CheckpointError, rename

_BLOCK = {
    "ln_1": "norm1", "self_attention.out_proj": "attn.proj", "ln_2": "norm2",
    "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2", "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2",
}

_EXACT = {"class_token": "cls_token", "encoder.pos_embedding": "pos_embed.weight"}
_PREFIXES = {"conv_proj.": "patch_embed.proj.", "encoder.ln.": "norm.", "heads.head.": "head.", "heads.pre_logits.": "pre_logits.fc."}


def is_torchvision(keys) -> bool:
    return "conv_proj.weight" in keys and "encoder.pos_embedding" in keys


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    sd = {}
    for k, v in w.items():
        if ours := rename(k, _EXACT, _PREFIXES):
            sd[ours] = v
        elif m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_(weight|bias)$", k):
            sd[f"blocks.{m.group(1)}.attn.qkv.{m.group(2)}"] = v  # already fused q, k, v
        elif m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.(.+)\.(weight|bias)$", k):
            i, mod, leaf = m.groups()
            if mod not in _BLOCK:
                raise CheckpointError(f"unexpected torchvision ViT key {k!r}")
            sd[f"blocks.{i}.{_BLOCK[mod]}.{leaf}"] = v
        else:
            raise CheckpointError(f"unexpected torchvision ViT key {k!r}")
    # torchvision's weights expect ImageNet normalisation; `interpolate_embeddings` resamples the grid bicubically
    # with aligned corners.
    return sd, {"act": "gelu", "norm_eps": 1e-6, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
                "pos_resample": "bicubic_corners"}, []
