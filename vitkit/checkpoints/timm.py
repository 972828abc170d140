"""timm state dicts <-> vitkit names: vision_transformer, vision_transformer_hybrid and resnetv2 (BiT).

vitkit's module names follow timm's, so most keys map one to one; the differences are the position
embedding (`pos_embed` is a module here: `pos_embed.weight`) and BiT's 1x1-conv head (a Linear here).
"""
from __future__ import annotations

import torch

from .io import CheckpointError

# timm ViT keys vitkit has no counterpart for (features it does not implement).
_UNSUPPORTED = ("reg_token", "attn.q_norm", "attn.k_norm", "ls1.gamma", "ls2.gamma", "attn_pool", "norm_pre")


def is_timm_vit(keys) -> bool:
    return "patch_embed.proj.weight" in keys and any(k.startswith("blocks.0.") for k in keys)


def is_timm_resnetv2(keys) -> bool:
    return "stem.conv.weight" in keys and any(k.startswith("stages.0.blocks.0.") for k in keys)


def vit_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    bad = sorted(k for k in w if any(u in k for u in _UNSUPPORTED))
    if bad:
        raise CheckpointError(f"this timm ViT uses features vitkit does not implement; offending keys: {bad[:8]}")
    sd, unused = {}, []
    for k, v in w.items():
        if k == "pos_embed":
            sd["pos_embed.weight"] = v
        elif k.startswith("head.") and v.ndim == 2 and v.shape[0] == 0:
            unused.append(k)
        else:
            sd[k] = v
    facts: dict = {"act": "gelu", "norm_eps": 1e-6}
    if "patch_embed.backbone.stem.conv.weight" in w:
        # timm's hybrids: StdConv2dSame with eps 1e-8 on the variance, GroupNormAct eps 1e-5.
        facts.update(hybrid_ws_eps=1e-8, hybrid_ws_eps_mode="var", hybrid_gn_eps=1e-5)
    return sd, facts, unused


def vit_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    if config.pos_embed != "learned_1d":
        raise CheckpointError(f"timm's ViT holds a learned 1-D position embedding, not {config.pos_embed!r}")
    if config.representation_size:
        raise CheckpointError("timm's ViT has no pre-logits layer (representation_size); export to vitkit or npz")
    return {("pos_embed" if k == "pos_embed.weight" else k): v for k, v in sd.items()}


def resnetv2_to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    sd = {}
    for k, v in w.items():
        if k == "head.fc.weight":
            sd["head.weight"] = v.flatten(1)  # (C, F, 1, 1) 1x1 conv -> (C, F) Linear
        elif k == "head.fc.bias":
            sd["head.bias"] = v
        else:
            sd[k] = v
    return sd, {}, []


def resnetv2_from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k == "head.weight":
            out["head.fc.weight"] = v[:, :, None, None]
        elif k == "head.bias":
            out["head.fc.bias"] = v
        else:
            out[k] = v
    return out
