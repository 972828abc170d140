"""torchvision `vit_*` state dicts -> vitkit names (import only)."""
from __future__ import annotations

import re

import torch

from .io import CheckpointError

_BLOCK = {
    "ln_1": "norm1", "self_attention.out_proj": "attn.proj", "ln_2": "norm2",
    "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2", "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2",
}


def is_torchvision(keys) -> bool:
    return "conv_proj.weight" in keys and "encoder.pos_embedding" in keys


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    sd = {}
    for k, v in w.items():
        if k == "class_token":
            sd["cls_token"] = v
        elif k == "encoder.pos_embedding":
            sd["pos_embed.weight"] = v
        elif k.startswith("conv_proj."):
            sd["patch_embed.proj." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("encoder.ln."):
            sd["norm." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("heads.head."):
            sd["head." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("heads.pre_logits."):
            sd["pre_logits.fc." + k.rsplit(".", 1)[1]] = v
        elif m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_(weight|bias)$", k):
            sd[f"blocks.{m.group(1)}.attn.qkv.{m.group(2)}"] = v  # already fused q, k, v
        elif m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.(.+)\.(weight|bias)$", k):
            i, mod, leaf = m.groups()
            if mod not in _BLOCK:
                raise CheckpointError(f"unexpected torchvision ViT key {k!r}")
            sd[f"blocks.{i}.{_BLOCK[mod]}.{leaf}"] = v
        else:
            raise CheckpointError(f"unexpected torchvision ViT key {k!r}")
    # torchvision's weights expect ImageNet normalisation.
    return sd, {"act": "gelu", "norm_eps": 1e-6, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}, []
