"""Every model of the paper by name, and the ViTs that followed it: sizes declared once (Table 1), builders one line
each."""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .resnet import ResNetV2, ResNetV2Config
from .samvit import SamViTConfig, SamVisionTransformer
from .swin import SwinConfig, SwinTransformer
from .vit import VisionTransformer
from .vit_config import ViTConfig
from ..errors import UsageError
from ..safety import check_alloc

# arch -> (config class, model class)
ARCHS = {"vit": (ViTConfig, VisionTransformer), "resnetv2": (ResNetV2Config, ResNetV2), "swin": (SwinConfig, SwinTransformer),
         "samvit": (SamViTConfig, SamVisionTransformer)}  # SAM's image encoder: built by timm's names (samvit_*)

# Table 1: width D, depth L, MLP size, heads.
VIT_SIZES: dict[str, dict[str, int]] = {
    "Ti": dict(embed_dim=192, depth=12, mlp_dim=768, num_heads=3),
    "S": dict(embed_dim=384, depth=12, mlp_dim=1536, num_heads=6),
    "B": dict(embed_dim=768, depth=12, mlp_dim=3072, num_heads=12),
    "L": dict(embed_dim=1024, depth=24, mlp_dim=4096, num_heads=16),
    "H": dict(embed_dim=1280, depth=32, mlp_dim=5120, num_heads=16),
}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    paper_name: str
    arch: str  # "vit", "resnetv2" or "swin"
    kwargs: dict

    def default_config(self) -> ViTConfig | ResNetV2Config | SwinConfig:
        return ARCHS[self.arch][0](**self.kwargs)


_REGISTRY: dict[str, ModelEntry] = {}
_ALIASES: dict[str, tuple[str, dict]] = {}  # normalised alias -> (registered name, config overrides)


def register(name: str, paper_name: str, arch: str, **kwargs) -> None:
    _REGISTRY[name] = ModelEntry(name, paper_name, arch, kwargs)
    for alias in (paper_name, paper_name.replace("ViT-", "ViT_"), paper_name.replace("/", "_")):
        _ALIASES[_norm(alias)] = (name, {})


def alias(other_name: str, name: str, **overrides) -> None:
    """Another library's name for a registered model (timm's, say), with the settings that name implies."""
    _ALIASES[_norm(other_name)] = (name, overrides)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9+]", "", name.lower())


def vit(size: str, patch: int, **kw) -> dict:
    return dict(VIT_SIZES[size], patch_size=patch, **kw)


# ViT (Table 1 + the B/8 of the AugReg release and the Ti/S of DeiT/AugReg).
for _s, _p in [("Ti", 16), ("S", 16), ("S", 32), ("B", 8), ("B", 16), ("B", 32), ("L", 16), ("L", 32), ("H", 14)]:
    register(f"vit_{_s.lower()}{_p}", f"ViT-{_s}/{_p}", "vit", **vit(_s, _p))

# Hybrids (Sec. 3.1): ResNet features -> 1x1 patch embedding. (3, 4, 9) is R50 with stage 4 folded
# into stage 3 (output stride 16); (3, 4, 6, 3) keeps stage 4 (stride 32); R26 is (2, 2, 2, 2).
register("r50_vit_b16", "R50+ViT-B/16", "vit", **vit("B", 16, hybrid_layers=(3, 4, 9)))
register("r50_vit_b32", "R50+ViT-B/32", "vit", **vit("B", 32, hybrid_layers=(3, 4, 6, 3)))
register("r50_vit_l16", "R50+ViT-L/16", "vit", **vit("L", 16, hybrid_layers=(3, 4, 9)))
register("r50_vit_l32", "R50+ViT-L/32", "vit", **vit("L", 32, hybrid_layers=(3, 4, 6, 3)))
register("r26_vit_s32", "R26+ViT-S/32", "vit", **vit("S", 32, hybrid_layers=(2, 2, 2, 2)))
# AugReg's R+Ti/16: the ResNet stem alone (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool: stride 4), then an 8x8
# patch embedding on its feature map: a total stride of 32 (the "/16" of the release's name notwithstanding).
register("r_vit_ti16", "R+ViT-Ti/16", "vit", **vit("Ti", 32, hybrid_layers=()))
# timm's names of the published hybrids (the official R50+ViT-B/16 and the AugReg releases).
alias("vit_tiny_r_s16_p8_224", "r_vit_ti16")
alias("vit_tiny_r_s16_p8_384", "r_vit_ti16", img_size=384)
alias("vit_small_r26_s32_224", "r26_vit_s32")
alias("vit_small_r26_s32_384", "r26_vit_s32", img_size=384)
alias("vit_base_r50_s16_224", "r50_vit_b16")
alias("vit_base_r50_s16_384", "r50_vit_b16", img_size=384)
alias("vit_large_r50_s32_224", "r50_vit_l32")
alias("vit_large_r50_s32_384", "r50_vit_l32", img_size=384)

# The paper's CNN baseline: BiT ResNet-v2 (Sec. 4.1).
register("bit_r50x1", "BiT-R50x1", "resnetv2", layers=(3, 4, 6, 3), width_factor=1)
register("bit_r101x1", "BiT-R101x1", "resnetv2", layers=(3, 4, 23, 3), width_factor=1)
register("bit_r50x3", "BiT-R50x3", "resnetv2", layers=(3, 4, 6, 3), width_factor=3)
register("bit_r152x4", "BiT-R152x4", "resnetv2", layers=(3, 8, 36, 3), width_factor=4)


# ---- the ViTs that followed the paper: the same encoder with a few options (vit.py's docstring) ----------------
# DINOv2 (Oquab et al. 2023): LayerScale, patch 14 at 518 (a 37x37 grid), self-supervised, no classifier; with
# registers (Darcet et al. 2023) the position embedding covers the patches alone; the giant uses SwiGLU.
_DINOV2 = dict(patch_size=14, img_size=518, init_values=1e-5, num_classes=0, mean=(0.485, 0.456, 0.406),
               std=(0.229, 0.224, 0.225), interpolation="bicubic")
_G = dict(embed_dim=1536, depth=40, num_heads=24, mlp_dim=4096, mlp_layer="swiglu")
for _s, _sz in [("s", VIT_SIZES["S"]), ("b", VIT_SIZES["B"]), ("l", VIT_SIZES["L"]), ("g", _G)]:
    _big = {"s": "S", "b": "B", "l": "L", "g": "g"}[_s]
    _timm = {"s": "small", "b": "base", "l": "large", "g": "giant"}[_s]
    register(f"dinov2_{_s}14", f"DINOv2 ViT-{_big}/14", "vit", **_sz, **_DINOV2)
    register(f"dinov2_{_s}14_reg4", f"DINOv2 ViT-{_big}/14 reg4", "vit", **_sz, **_DINOV2, reg_tokens=4, no_embed_class=True)
    alias(f"vit_{_timm}_patch14_dinov2", f"dinov2_{_s}14")
    alias(f"vit_{_timm}_patch14_reg4_dinov2", f"dinov2_{_s}14_reg4")
# DeiT-III (Touvron et al. 2022): LayerScale, the position embedding over the patches alone, ImageNet-1k at 224.
_DEIT3 = dict(init_values=1e-6, no_embed_class=True, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
              interpolation="bicubic")
for _s, _timm in [("s", "small"), ("b", "base"), ("l", "large")]:
    register(f"deit3_{_s}16", f"DeiT-III ViT-{_s.upper()}/16", "vit", **vit(_s.upper(), 16, **_DEIT3))
    alias(f"deit3_{_timm}_patch16_224", f"deit3_{_s}16")
# SigLIP (Zhai et al. 2023) image towers: no class token, attention pooling (MAP), tanh-GELU; SoViT-400m/14 shape.
_SIGLIP = dict(class_token=False, classifier="map", act="gelu_tanh", num_classes=0, interpolation="bicubic")
register("siglip_b16", "SigLIP ViT-B/16", "vit", **vit("B", 16, **_SIGLIP))
register("siglip_so400m14", "SigLIP So400m/14", "vit", embed_dim=1152, depth=27, num_heads=16, mlp_dim=4304,
         patch_size=14, img_size=224, **_SIGLIP)
alias("vit_base_patch16_siglip_224", "siglip_b16")
alias("vit_so400m_patch14_siglip_224", "siglip_so400m14")
# EVA-02 (Fang et al. 2023): 2-D rotary embeddings on a 16x16 reference grid, SwiGLU (with a norm from B up), no
# key bias, average pooling + fc_norm; the masked-image-modelling backbones have no classifier.
_EVA02 = dict(patch_size=14, mlp_layer="swiglu", rope="eva", rope_ref_grid=(16, 16), k_bias=False, classifier="gap",
              class_token=True, fc_norm=True, num_classes=0, mean=(0.48145466, 0.4578275, 0.40821073),
              std=(0.26862954, 0.26130258, 0.27577711), interpolation="bicubic")
for _s, _timm in [("Ti", "tiny"), ("S", "small"), ("B", "base"), ("L", "large")]:
    _d = VIT_SIZES[_s]["embed_dim"]
    register(f"eva02_{_s.lower()}14", f"EVA-02-{_s}/14", "vit", **{**VIT_SIZES[_s], "mlp_dim": _d * 8 // 3},
             **_EVA02, mlp_norm=_s in ("B", "L"))
    alias(f"eva02_{_timm}_patch14_224", f"eva02_{_s.lower()}14")
# CLIP (Radford et al. 2021) image towers, OpenAI's: a LayerNorm before the blocks, no patch-embedding bias,
# LayerNorm eps 1e-5, quick GELU; the class token, normed, is the image embedding (before CLIP's projection).
_CLIP = dict(pre_norm=True, patch_bias=False, norm_eps=1e-5, act="quick_gelu", num_classes=0,
             mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711), interpolation="bicubic")
register("clip_b16", "CLIP ViT-B/16", "vit", **vit("B", 16, **_CLIP))
register("clip_l14", "CLIP ViT-L/14", "vit", **vit("L", 14, **_CLIP))
alias("vit_base_patch16_clip_quickgelu_224", "clip_b16")
alias("vit_large_patch14_clip_quickgelu_224", "clip_l14")

# ---- the backbones of 2025-26: the same encoder, with the options of `vit.py`'s docstring ----------------------
_IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), interpolation="bicubic")
# DINOv3 (Simeoni et al. 2025, arXiv 2508.10104): patch 16, a class token and 4 registers, LayerScale, no absolute
# position embedding but rotary embeddings on coordinates normalised to [-1, 1] (periods 100^(i / (d/4)), rotate-half),
# LayerNorm eps 1e-5, any image size; no classifier. The authors' image feature is the class token; timm's names pool
# the mean of the patches (its default), and its `_qkvb` ones have query and value biases (zero in the release).
_DINOV3 = dict(patch_size=16, img_size=256, class_token=True, reg_tokens=4, init_values=1e-5, pos_embed="none",
               rope="dinov3", rope_temperature=100.0, rope_half=True, qkv_bias=False, norm_eps=1e-5,
               dynamic_img_size=True, num_classes=0, crop_pct=1.0, **_IMAGENET)
_DINOV3_SIZES = {  # name: (paper size, timm's size, table); H+ and 7B have SwiGLU (timm's hidden widths)
    "s16": ("S/16", "small", VIT_SIZES["S"]),
    "s16plus": ("S+/16", "small_plus", dict(VIT_SIZES["S"], mlp_layer="swiglu")),
    "b16": ("B/16", "base", VIT_SIZES["B"]),
    "l16": ("L/16", "large", VIT_SIZES["L"]),
    "h16plus": ("H+/16", "huge_plus", dict(embed_dim=1280, depth=32, num_heads=20, mlp_dim=5120, mlp_layer="swiglu")),
    "7b16": ("7B/16", "7b", dict(embed_dim=4096, depth=40, num_heads=32, mlp_dim=8192, mlp_layer="swiglu")),
}
for _k, (_paper, _timm, _sz) in _DINOV3_SIZES.items():
    register(f"dinov3_{_k}", f"DINOv3 ViT-{_paper}", "vit", **_sz, **_DINOV3)
    alias(f"vit_{_timm}_patch16_dinov3", f"dinov3_{_k}", classifier="gap")
    if _k != "7b16":
        alias(f"vit_{_timm}_patch16_dinov3_qkvb", f"dinov3_{_k}", classifier="gap", qkv_bias=True, k_bias=False)

# The Perception Encoder (Bolya et al. 2025, arXiv 2504.13181): a LayerNorm before the blocks and no patch bias (as
# CLIP), LayerNorm eps 1e-5, a learned position embedding plus axial rotary embeddings (column first, counted from 1,
# on a reference grid). PE-Core pools every token by attention (8 heads) into CLIP's embedding: the head, a projection
# to 512 (T, S), 1024 (B, L) or 1280 (G) dimensions whose bias is zero in the release, as timm holds it; the
# language- and spatially-aligned towers (PE-Lang, PE-Spatial) end without a final norm. The gigantic ones have no
# class token (and count from 0).
_PE = dict(class_token=True, pre_norm=True, patch_bias=False, norm_eps=1e-5, rope="eva", rope_indexing="xy", rope_offset=1.0,
           num_classes=0, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bicubic", crop_pct=1.0)
_PE_G = dict(embed_dim=1536, depth=50, num_heads=16, mlp_dim=8960, class_token=False, rope_offset=0.0)
_PE_MODELS = {  # name: (paper name, timm's name, size, patch, resolution, reference grid, extra)
    "pe_core_t16": ("PE-Core-T/16", "vit_pe_core_tiny_patch16_384", VIT_SIZES["Ti"], 16, 384, 24, {}),
    "pe_core_s16": ("PE-Core-S/16", "vit_pe_core_small_patch16_384", VIT_SIZES["S"], 16, 384, 24, {}),
    "pe_core_b16": ("PE-Core-B/16", "vit_pe_core_base_patch16_224", VIT_SIZES["B"], 16, 224, 14, {}),
    "pe_core_l14": ("PE-Core-L/14", "vit_pe_core_large_patch14_336", VIT_SIZES["L"], 14, 336, 24, {}),
    "pe_core_g14": ("PE-Core-G/14", "vit_pe_core_gigantic_patch14_448", _PE_G, 14, 448, 32, {}),
    "pe_lang_l14": ("PE-Lang-L/14", "vit_pe_lang_large_patch14_448", dict(VIT_SIZES["L"], depth=23), 14, 448, 32,
                    dict(init_values=0.1)),
    "pe_lang_g14": ("PE-Lang-G/14", "vit_pe_lang_gigantic_patch14_448", dict(_PE_G, depth=47), 14, 448, 32,
                    dict(init_values=0.1)),
    "pe_spatial_t16": ("PE-Spatial-T/16", "vit_pe_spatial_tiny_patch16_512", VIT_SIZES["Ti"], 16, 512, 32, {}),
    "pe_spatial_s16": ("PE-Spatial-S/16", "vit_pe_spatial_small_patch16_512", VIT_SIZES["S"], 16, 512, 32, {}),
    "pe_spatial_b16": ("PE-Spatial-B/16", "vit_pe_spatial_base_patch16_512", VIT_SIZES["B"], 16, 512, 32, {}),
    "pe_spatial_l14": ("PE-Spatial-L/14", "vit_pe_spatial_large_patch14_448", VIT_SIZES["L"], 14, 448, 32, {}),
    "pe_spatial_g14": ("PE-Spatial-G/14", "vit_pe_spatial_gigantic_patch14_448", _PE_G, 14, 448, 32,
                       dict(init_values=0.1)),
}
_PE_EMBED = {"t": 512, "s": 512, "b": 1024, "l": 1024, "g": 1280}  # PE-Core's CLIP embedding width, by size
for _k, (_paper, _timm, _sz, _p, _res, _ref, _extra) in _PE_MODELS.items():
    _pool_mlp = 4 * _sz["embed_dim"]  # the pooling's MLP ratio is 4 where the blocks' is not (G)
    _head = (dict(classifier="map", pool_heads=8, pool_prefix=True, num_classes=_PE_EMBED[_k.split("_")[-1][0]],
                  pool_mlp_dim=_pool_mlp if _pool_mlp != _sz.get("mlp_dim", _pool_mlp) else None)
             if "core" in _k else dict(classifier="gap", final_norm=False))
    register(_k, _paper, "vit", **{**_PE, **_sz, **_head, **_extra, "patch_size": _p, "img_size": _res,
                                   "rope_ref_grid": (_ref, _ref)})
    alias(_timm, _k)

# AIMv2 (Fini et al. 2024, arXiv 2411.14402): no class token, the mean of the tokens after the final norm, RMSNorm
# (eps 1e-5) everywhere and on the patch tokens, a bias-free SwiGLU and attention, a learned position embedding.
_AIMV2 = dict(patch_size=14, class_token=False, classifier="gap", qkv_bias=False, proj_bias=False, norm="rmsnorm",
              patch_norm=True, norm_eps=1e-5, mlp_layer="swiglu", num_classes=0, mean=(0.48145466, 0.4578275, 0.40821073),
              std=(0.26862954, 0.26130258, 0.27577711), interpolation="bicubic", crop_pct=1.0)
_AIMV2_SIZES = {"l14": ("L/14", "large", dict(embed_dim=1024, depth=24, num_heads=8, mlp_dim=2816)),
                "h14": ("H/14", "huge", dict(embed_dim=1536, depth=24, num_heads=12, mlp_dim=4096)),
                "1b14": ("1B/14", "1b", dict(embed_dim=2048, depth=24, num_heads=16, mlp_dim=5632)),
                "3b14": ("3B/14", "3b", dict(embed_dim=3072, depth=24, num_heads=24, mlp_dim=8192))}
for _k, (_paper, _timm, _sz) in _AIMV2_SIZES.items():
    register(f"aimv2_{_k}", f"AIMv2-{_paper}", "vit", **_sz, **_AIMV2)
    for _res in (224, 336, 448):
        alias(f"aimv2_{_timm}_patch14_{_res}", f"aimv2_{_k}", img_size=_res)

# ROPE-ViT (Heo et al. 2024, arXiv 2403.13298), DeiT-III recipes on ImageNet-1k: axial rotary embeddings (column first,
# base 100) instead of the position embedding, or learned per-head, per-block frequencies ("mixed", base 10); the
# "ape" ones keep a learned position embedding over the patches too.
_ROPEVIT = dict(class_token=True, init_values=1e-5, pos_embed="none", rope="eva", rope_indexing="xy",
                rope_temperature=100.0, crop_pct=0.9, **_IMAGENET)
for _s, _timm in [("S", "small"), ("B", "base"), ("L", "large")]:
    for _kind, _extra in [("", {}), ("_mixed", dict(rope="mixed", rope_temperature=10.0))]:
        for _ape, _pos in [("", {}), ("_ape", dict(pos_embed="learned_1d", no_embed_class=True))]:
            _name = f"ropevit_{_s.lower()}16{_kind}{_ape}"
            _paper = f"ROPE-ViT-{_s}/16 {'Mixed' if _kind else 'Axial'}{' + APE' if _ape else ''}"
            register(_name, _paper, "vit", **vit(_s, 16, **{**_ROPEVIT, **_extra, **_pos}))
            alias(f"vit_{_timm}_patch16_rope{_kind}{_ape}_224", _name)

# TIPSv2 (Google 2026): DINOv2's layout with one register and LayerScale initialised at 1, at 448; the g/14 has
# DINOv2-g's SwiGLU. No classifier; inputs in [0, 1] (no normalisation).
_TIPSV2 = dict(patch_size=14, img_size=448, init_values=1.0, reg_tokens=1, no_embed_class=True, num_classes=0,
               mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), interpolation="bicubic", crop_pct=1.0)
for _k, _paper, _timm, _sz in [("b14", "B/14", "base", VIT_SIZES["B"]), ("l14", "L/14", "large", VIT_SIZES["L"]),
                               ("so400m14", "So400m/14", "so400m", dict(embed_dim=1152, depth=27, num_heads=16, mlp_dim=4304)),
                               ("g14", "g/14", "giant", _G)]:
    register(f"tipsv2_{_k}", f"TIPSv2 ViT-{_paper}", "vit", **_sz, **_TIPSV2)
    alias(f"vit_{_timm}_patch14_reg1_tipsv2", f"tipsv2_{_k}")

# Swin Transformer (Liu et al. 2021, Table 1): C, depths, heads; patch 4, window 7 at 224 (12 at 384).
SWIN_SIZES = {"T": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
              "S": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
              "B": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
              "L": dict(embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48))}
for _s, _timm in [("T", "tiny"), ("S", "small"), ("B", "base"), ("L", "large")]:
    register(f"swin_{_s.lower()}", f"Swin-{_s}", "swin", **SWIN_SIZES[_s])
    alias(f"swin_{_timm}_patch4_window7_224", f"swin_{_s.lower()}")
    if _s in ("B", "L"):
        register(f"swin_{_s.lower()}_384", f"Swin-{_s} 384", "swin", **SWIN_SIZES[_s], img_size=384, window_size=12,
                 crop_pct=1.0)
        alias(f"swin_{_timm}_patch4_window12_384", f"swin_{_s.lower()}_384")


def list_models(pattern: str | None = None) -> list[str]:
    """Names of the registered models, optionally filtered by a glob pattern ("vit_*")."""
    return [n for n in _REGISTRY if not pattern or fnmatch.fnmatch(n, pattern)]


def lookup(name: str) -> tuple[ModelEntry, dict]:
    """The entry a name builds and the config settings the name implies (timm's name of a 384 px model: img_size)."""
    if name in _REGISTRY:
        return _REGISTRY[name], {}
    hit = _ALIASES.get(_norm(name))
    if hit is None:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[hit[0]], hit[1]


def get_entry(name: str) -> ModelEntry:
    """The registry entry for a short name ("vit_b16"), a paper name ("ViT-B/16", "R50+ViT-B/16") or timm's name
    of a published hybrid ("vit_tiny_r_s16_p8_384": the entry, whose resolution the name fixes at build time)."""
    return lookup(name)[0]


def build_config(name: str, /, **overrides) -> ViTConfig | ResNetV2Config | SwinConfig:
    entry, implied = lookup(name)
    cls = ARCHS[entry.arch][0]
    _check_fields(cls, overrides)
    return cls(**{**entry.kwargs, **implied, **overrides})


# What a name does not fix: the preprocessing, head, resolution, regularisation and how the grid is resampled
_NOT_ARCHITECTURE = {"img_size", "in_chans", "num_classes", "class_names", "mean", "std", "interpolation", "crop_pct",
                     "drop_rate", "attn_drop_rate", "drop_path_rate", "patch_drop_rate", "dynamic_img_size",
                     "pos_resample", "pos_resample_square", "naflex"}
_SIZE_FIELDS = ("arch", "embed_dim", "depth", "num_heads", "patch_size", "mlp_dim", "hybrid_layers", "layers",
                "width_factor", "depths", "window_size")


def name_of(config: ViTConfig | ResNetV2Config | SwinConfig) -> str:
    """The registered name of the architecture `config` describes (a loaded checkpoint's: `vit_b16`, `deit3_b16`):
    the first whose every architectural field agrees, else the first of the same size (width, depth, heads, patch,
    stages) as "NAME-like"; else a description of its size ("vit (width 64, depth 2, 4 heads, patch 16, MLP 256)")."""
    def fields(c, names=None):
        d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in _NOT_ARCHITECTURE}
        return {k: d.get(k) for k in names} if names else d

    own, size = fields(config), fields(config, _SIZE_FIELDS)
    same_size = None
    for name in _REGISTRY:
        c = build_config(name)
        if type(c) is not type(config):
            continue
        if fields(c) == own:
            return name
        if same_size is None and fields(c, _SIZE_FIELDS) == size:
            same_size = name
    if same_size is not None:
        return f"{same_size}-like"
    shown = {"patch_size": lambda v: f"patch {v[0]}" if v[0] == v[1] else f"patch {v}", "embed_dim": "width {}".format,
             "depth": "depth {}".format, "num_heads": "{} heads".format, "mlp_dim": "MLP {}".format}
    return f"{config.arch} ({', '.join(shown.get(k, lambda v, k=k: f'{k} {v}')(v) for k, v in size.items() if k != 'arch' and v is not None)})"


def config_with(config: ViTConfig | ResNetV2Config, **overrides) -> ViTConfig | ResNetV2Config:
    """A copy of `config` with fields replaced by keyword; unknown keywords raise a ValueError naming the valid ones."""
    _check_fields(type(config), overrides)
    overrides = dict(overrides)
    # fields derived in __post_init__ are derived again unless given
    if isinstance(config, ViTConfig) and "classifier" in overrides:
        overrides.setdefault("class_token", None)
    if isinstance(config, ResNetV2Config) and {"layers", "width_factor"} & set(overrides):
        overrides.setdefault("channels", None)
        overrides.setdefault("stem_width", None)
    return dataclasses.replace(config, **overrides)


def _check_fields(cls: type, overrides: dict) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} - {"arch"}
    unknown = set(overrides) - fields
    if unknown:
        arch = next(a for a, (c, _) in ARCHS.items() if c is cls)
        raise UsageError(f"unknown option(s) {sorted(unknown)} for a {arch} model; valid: {sorted(fields)} (and timm's "
                         f"create_model keywords where they map: docs/timm.md)")


# In-place initialisation that leaves a tensor's shape as it is: on a meta tensor it has nothing to fill
_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "zeros_", "ones_", "constant_",
                    "exponential_", "random_", "bernoulli_", "erfinv_", "mul_", "div_", "add_", "sub_", "clamp_",
                    "copy_"})


class _SkipFillsOnMeta(TorchFunctionMode):
    """Sizing a model on the meta device skips its initialisation's fills of meta tensors (`nn.init.normal_` and
    the like): there they compute nothing, but run torch's Python decompositions, whose first call imports
    torch._dynamo (a second or more of a command's start: benchmarks/NOTES.md section 60)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if getattr(func, "__name__", None) in _FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def build_on_meta(config: ViTConfig | ResNetV2Config | SwinConfig) -> nn.Module:
    """The model a config describes on the meta device, uninitialised: its shapes, no memory."""
    with torch.device("meta"), _SkipFillsOnMeta():
        return ARCHS[config.arch][1](config)


def build_model(config: ViTConfig | ResNetV2Config | SwinConfig) -> nn.Module:
    """The model a config describes, with random initialisation. A config whose model would not fit in this
    process's memory (a hostile or mistyped size) is refused before anything is allocated."""
    build = ARCHS[config.arch][1]
    if torch.get_default_device().type != "meta":
        shell = build_on_meta(config)
        nbytes = sum(t.numel() * t.element_size() for t in itertools.chain(shell.parameters(), shell.buffers()))
        params = sum(p.numel() for p in shell.parameters())
        check_alloc(nbytes, f"the {config.arch} model of this config ({params:,} parameters)", UsageError)
    return build(config)

