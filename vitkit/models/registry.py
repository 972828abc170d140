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

from .resnet import ResNetV2, ResNetV2Config
from .swin import SwinConfig, SwinTransformer
from .vit import VisionTransformer
from .vit_config import ViTConfig

# arch -> (config class, model class)
ARCHS = {"vit": (ViTConfig, VisionTransformer), "resnetv2": (ResNetV2Config, ResNetV2), "swin": (SwinConfig, SwinTransformer)}
from ..errors import UsageError
from ..safety import check_alloc

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


def build_model(config: ViTConfig | ResNetV2Config | SwinConfig) -> nn.Module:
    """The model a config describes, with random initialisation. A config whose model would not fit in this
    process's memory (a hostile or mistyped size) is refused before anything is allocated."""
    build = ARCHS[config.arch][1]
    if torch.get_default_device().type != "meta":
        with torch.device("meta"):
            shell = build(config)
        nbytes = sum(t.numel() * t.element_size() for t in itertools.chain(shell.parameters(), shell.buffers()))
        params = sum(p.numel() for p in shell.parameters())
        check_alloc(nbytes, f"the {config.arch} model of this config ({params:,} parameters)", UsageError)
    return build(config)

