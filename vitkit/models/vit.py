"""The Vision Transformer of "An Image Is Worth 16x16 Words" (arXiv 2010.11929), read top to bottom.

    image (B, C, H, W)
      -> patches: conv, kernel = stride = P         (B, N, D)     Eq. 1, or a ResNet first (hybrid)
      -> prepend the learnable [class] token        (B, 1 + N, D)
      -> add the position embedding, dropout
      -> L pre-norm blocks: x + MSA(LN(x)); x + MLP(LN(x))          Eq. 2, 3
      -> final LayerNorm on every token                              Eq. 4
      -> pool: the class token ('token') or the mean of all tokens ('gap')
      -> [pre-logits Linear + tanh] -> head Linear (zero-initialised)

Images of different sizes and aspect ratios run as one packed batch (NaViT, SigLIP 2's NaFlex: `forward_packed`,
`layers/packing.py`): a row of patches per image, each with its own resampled position grid, attention masked to its
own tokens and pooled alone.

The ViTs that followed (DeiT-III, DINOv2, SigLIP, EVA-02, CLIP) are the same encoder with a few options, each a
config field that is off by default (so the paper's models are unchanged) and each a small module in `layers/`:
LayerScale on both residual branches (`init_values`), register tokens after the class token (`reg_tokens`), a
position embedding over the patches alone (`no_embed_class`), a LayerNorm before the blocks (`pre_norm`, CLIP) and a
patch embedding without bias (`patch_bias`, CLIP), qk-norm, a LayerNorm inside attention (`attn_norm`) and inside
the MLP (`mlp_norm`), the SwiGLU MLP (`mlp_layer`), 2-D rotary embeddings (`rope`, EVA-02), CLIP's quick GELU
(`act`), and pooling by attention (`classifier='map'`, SigLIP) or by the mean with a norm after it (`fc_norm`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from .layers import (
    Attention,
    AttentionPool,
    DropPath,
    LayerNorm,
    LayerScale,
    Linear,
    LearnedPosEmbed1d,
    LearnedPosEmbed2d,
    Mlp,
    NoPosEmbed,
    PatchEmbed,
    RelativePositionBias,
    RotaryEmbedding2d,
    SinCosPosEmbed2d,
    SwiGLU,
)
from .layers.mlp import ACTIVATIONS, lecun_normal_
from .layers.packing import PackedBatch, as_packed, grid_sizes, key_mask, masked_mean
from .layers.patch_embed import to_2tuple
from .layers.pos_embed import RESAMPLE_METHODS
from .layers.tracing import is_fx_tracing
from .resnet import ResNetBackbone, backbone_stride
from .timm_api import VIT_POOL_NAMES, TimmModelApi, check_class_names, check_num_classes, vit_classifier
from ..errors import UsageError
from ..safety import check_sizes, check_types

CLASSIFIERS = ("token", "gap", "map")
MLP_LAYERS = ("mlp", "swiglu")
ROPES = (None, "eva")
POS_EMBEDS = {
    "learned_1d": LearnedPosEmbed1d,
    "learned_2d": LearnedPosEmbed2d,
    "sincos_2d": SinCosPosEmbed2d,
    "none": NoPosEmbed,
    "relative": NoPosEmbed,  # the relative bias lives in every attention layer instead
}


@dataclass
class ViTConfig:
    """Everything that defines a ViT. Serialised into every vitkit checkpoint.

    Args:
        img_size: input resolution, an int or (height, width); must be divisible by patch_size.
        patch_size: P; for hybrids the total stride (backbone stride x the embedding kernel).
        in_chans: input channels (1 for grayscale).
        num_classes: classes of the head; 0 makes `model(x)` return the pooled features.
        embed_dim, depth, num_heads, mlp_dim: D, L, heads and the MLP width (4D in the paper).
        classifier: "token" (the class token), "gap" (global average pooling of the patch tokens) or "map"
            (multihead attention pooling: a learned query attends over the patch tokens, then a residual MLP;
            SigLIP's head).
        class_token: prepend a class token; None means "only when classifier == 'token'".
        fc_norm: with "gap", normalise after pooling (timm's 'avg') instead of every token before it.
        pos_embed: "learned_1d" | "learned_2d" | "sincos_2d" | "none" | "relative".
        representation_size: width of the pre-logits Linear + tanh (pre-training head); None: no layer.
        drop_rate, attn_drop_rate, drop_path_rate: dropout, attention dropout, stochastic depth
            (the latter linear over depth from 0 to the given rate).
        qkv_bias: bias on the query/key/value projections. k_bias: False: none on the keys (EVA-02).
        act: "gelu" (exact), "gelu_tanh" (the official JAX code's and SigLIP's approximation) or "quick_gelu"
            (OpenAI CLIP's x * sigmoid(1.702 x)).
        norm_eps: LayerNorm epsilon (1e-6 official and timm, 1e-12 HF).
        hybrid_layers: blocks per ResNet stage for a hybrid (e.g. (3, 4, 9)); () the ResNet stem alone
            (AugReg's R+Ti/16); None: a plain ViT.
        hybrid_width: the ResNet width factor; hybrid_ws_eps/_mode, hybrid_gn_eps: its numerics.
        mean, std, interpolation, crop_pct: the preprocessing the weights expect.
        class_names: names of the head's classes, if known.
        dynamic_img_size: accept any H x W divisible by the patch size, the position embedding resampled to each
            input's grid on the fly (bilinear, as `vitkit.load(..., img_size=...)` does; cached per grid).
        distilled: DeiT's distillation token: a second prefix token with its own head, trained against a teacher's
            predictions; at inference the two heads' logits are averaged.
        mpp: the masked-patch-prediction head of Sec. 4.6 (a learnable mask embedding and a Linear to the 8^C
            colour codes of a patch's 3-bit mean colour), for self-supervised pre-training.
        init_values: LayerScale (CaiT, DeiT-III, DINOv2): a learned per-channel scale on both residual branches,
            initialised to this value; None: none.
        reg_tokens: register tokens (Darcet et al. 2023, "Vision Transformers Need Registers"): learned tokens after
            the class token that the model may use as scratch space; no head reads them.
        no_embed_class: the position embedding covers the patches only (DeiT-III, DINOv2 with registers, big_vision);
            False: it covers the prefix tokens too, as in the paper.
        pre_norm: a LayerNorm on the tokens before the first block (CLIP's `ln_pre`).
        patch_bias: a bias on the patch embedding (CLIP has none).
        qk_norm: a LayerNorm on every head's queries and keys.
        attn_norm: a LayerNorm on the attention heads' output before the projection (EVA-02 CLIP's sub-LN).
        mlp_layer: "mlp" (the paper's) or "swiglu" (fc2(SiLU(W_g x) * W_x x): EVA-02, DINOv2-g); with "swiglu",
            mlp_dim is the width of the gated hidden layer.
        mlp_norm: a LayerNorm on the SwiGLU's hidden units (EVA-02's `scale_mlp`).
        rope: "eva": 2-D rotary embeddings of the patch tokens' queries and keys, as EVA-02 (`layers/rope.py`);
            None: none. rope_ref_grid: the grid whose coordinates the rotation uses at every resolution (EVA-02:
            (16, 16)); None: the grid itself. rope_temperature: the base of the frequencies.
        pos_resample: how a packed batch (images of other sizes, `forward` on a list of images) resamples the
            learned position grid to each image's: "bilinear" (the official method), "bicubic" (timm's NaFlexVit),
            "bilinear_aa" (SigLIP 2), "bicubic_noaa" (transformers' DINOv2). pos_resample_square: resample to the
            square of the image's longer side and read the top-left part (timm's `pos_embed_ar_preserving`).
        naflex: the weights came from (or go to) a NaFlex model, timm's `NaFlexVit` or SigLIP 2's tower: a timm
            export writes a NaFlexVit (`embeds.*` names, a Linear patch embedding over (ph, pw, C) patches).
    """

    img_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (16, 16)
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    classifier: str = "token"
    class_token: bool | None = None
    fc_norm: bool = False
    pos_embed: str = "learned_1d"
    representation_size: int | None = None
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    qkv_bias: bool = True
    k_bias: bool = True
    act: str = "gelu"
    norm_eps: float = 1e-6
    hybrid_layers: tuple[int, ...] | None = None
    hybrid_width: float = 1.0
    hybrid_ws_eps: float = 1e-5
    hybrid_ws_eps_mode: str = "std"
    hybrid_gn_eps: float = 1e-6
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    interpolation: str = "bilinear"
    crop_pct: float = 0.875
    class_names: list[str] | None = field(default=None, repr=False)
    dynamic_img_size: bool = False
    distilled: bool = False
    mpp: bool = False
    init_values: float | None = None
    reg_tokens: int = 0
    no_embed_class: bool = False
    pre_norm: bool = False
    patch_bias: bool = True
    qk_norm: bool = False
    attn_norm: bool = False
    mlp_layer: str = "mlp"
    mlp_norm: bool = False
    rope: str | None = None
    rope_ref_grid: tuple[int, int] | None = None
    rope_temperature: float = 10000.0
    pos_resample: str = "bilinear"
    pos_resample_square: bool = False
    naflex: bool = False
    arch: str = "vit"

    def __post_init__(self) -> None:
        check_types(self)
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        self.img_size, self.patch_size = to_2tuple(self.img_size), to_2tuple(self.patch_size)
        if self.rope_ref_grid is not None:
            self.rope_ref_grid = to_2tuple(self.rope_ref_grid)
        check_sizes(self)
        if self.classifier not in CLASSIFIERS:
            raise UsageError(f"classifier must be one of {CLASSIFIERS}, got {self.classifier!r}")
        if self.pos_embed not in POS_EMBEDS:
            raise UsageError(f"pos_embed must be one of {tuple(POS_EMBEDS)}, got {self.pos_embed!r}")
        if self.class_token is None:
            self.class_token = self.classifier == "token"
        if self.classifier == "token" and not self.class_token:
            raise UsageError("classifier='token' needs class_token=True")
        if self.distilled and (self.classifier != "token" or self.representation_size):
            raise UsageError("distilled=True (DeiT) needs classifier='token' and no pre-logits layer")
        if self.mpp and self.hybrid_layers is not None:
            raise UsageError("mpp (masked patch prediction) predicts the colour of pixel patches: a plain ViT only")
        if self.fc_norm and self.classifier != "gap":
            raise UsageError("fc_norm applies to classifier='gap' only")
        if self.act not in ACTIVATIONS:
            raise UsageError(f"act must be one of {ACTIVATIONS}, got {self.act!r}")
        if self.mlp_layer not in MLP_LAYERS:
            raise UsageError(f"mlp_layer must be one of {MLP_LAYERS}, got {self.mlp_layer!r}")
        if self.mlp_norm and self.mlp_layer != "swiglu":
            raise UsageError("mlp_norm (a LayerNorm inside the MLP) is implemented for mlp_layer='swiglu' only")
        if self.pos_resample not in RESAMPLE_METHODS:
            raise UsageError(f"pos_resample must be one of {RESAMPLE_METHODS}, got {self.pos_resample!r}")
        if self.rope not in ROPES:
            raise UsageError(f"rope must be one of {ROPES}, got {self.rope!r}")
        if self.rope and (self.embed_dim // self.num_heads) % 4:
            raise UsageError(f"rope needs a head width divisible by 4, got {self.embed_dim // self.num_heads}")
        if self.reg_tokens < 0:
            raise UsageError(f"reg_tokens must be >= 0, got {self.reg_tokens}")
        if self.reg_tokens and self.distilled:
            raise UsageError("register tokens beside DeiT's distillation token: no published model has both")
        if self.embed_dim % self.num_heads:
            raise UsageError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.hybrid_layers is not None:
            self.hybrid_layers = tuple(self.hybrid_layers)
            if any(n < 1 for n in self.hybrid_layers):
                raise UsageError(f"hybrid_layers {self.hybrid_layers}: every stage needs at least one block "
                                 f"(() is the ResNet stem alone)")
            if (64 * self.hybrid_width) % 32:  # the ResNet's GroupNorms have 32 groups; its narrowest is 64 * width
                raise UsageError(f"hybrid_width {self.hybrid_width}: must be a multiple of 0.5 (GroupNorm's 32 groups)")
            stride = backbone_stride(self.hybrid_layers)
            if any(p % stride for p in self.patch_size):
                raise UsageError(f"patch_size {self.patch_size} (the hybrid's total stride) is not a multiple of its "
                                 f"ResNet's stride {stride} ({len(self.hybrid_layers)} stage(s))")
        for s, p in zip(self.img_size, self.patch_size):
            if s % p:
                raise UsageError(f"img_size {self.img_size} is not divisible by patch_size {self.patch_size}")
        if self.class_names is not None and self.num_classes and len(self.class_names) != self.num_classes:
            raise UsageError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens in front of the patch grid: the class token, DeiT's distillation token, the registers."""
        return int(bool(self.class_token)) + int(self.distilled) + self.reg_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def to_dict(self) -> dict:
        return asdict(self)

    def options(self) -> list[str]:
        """The later-ViT options this config turns on, in words (for a run's one-line model description)."""
        on = [f"LayerScale {self.init_values:g}" if self.init_values is not None else "",
              f"{self.reg_tokens} registers" if self.reg_tokens else "",
              "position embedding over the patches only" if self.no_embed_class else "",
              "pre-norm" if self.pre_norm else "", "qk-norm" if self.qk_norm else "",
              "attention sub-norm" if self.attn_norm else "",
              ("SwiGLU with a norm" if self.mlp_norm else "SwiGLU") if self.mlp_layer == "swiglu" else "",
              "2-D RoPE" if self.rope else "", "no key bias" if not self.k_bias else "",
              "MAP head" if self.classifier == "map" else "", "quick GELU" if self.act == "quick_gelu" else "",
              "distillation token" if self.distilled else ""]
        return [o for o in on if o]


def resolve_layers(layers: int | Sequence[int] | None, depth: int) -> set[int]:
    """Block indices from `forward_intermediates`-style arguments: None for all, an int n for the last n, or a
    sequence of indices (negative counts from the end). An index outside [-depth, depth) is a ValueError."""
    if layers is None:
        return set(range(depth))
    if isinstance(layers, int):
        if not 0 <= layers <= depth:
            raise UsageError(f"asked for the last {layers} layers of a model of depth {depth}")
        return set(range(depth - layers, depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise UsageError(f"layer index {bad[0]} is out of range for a model of depth {depth} "
                         f"(valid: {-depth} to {depth - 1})")
    return {i % depth for i in layers}


def mpp_corruption(b: int, n: int, ratio: float, g: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which patches masked patch prediction corrupts, and how: (corrupted (B, N) bool: round(ratio * N) per
    image; how (B, N): 0 unchanged, 1 the mask embedding (80% of the corrupted), 2 another patch (10%))."""
    k = max(1, round(ratio * n))
    order = torch.rand(b, n, generator=g, device=device).argsort(1)  # a random permutation per image
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=device).scatter_(1, order[:, :k], True)
    u = torch.rand(b, n, generator=g, device=device)
    how = torch.where(u < 0.8, 1, torch.where(u < 0.9, 2, 0)) * corrupted
    return corrupted, how


def mpp_random_patches(b: int, n: int, g: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random other patch of the batch for every position: (image index, patch index), each (B, N)."""
    flat = torch.randint(0, b * n - 1, (b, n), generator=g, device=device)
    own = torch.arange(b * n, device=device).view(b, n)
    flat = flat + (flat >= own).long()  # never the patch itself
    return flat // n, flat % n


def mpp_targets(pixels: torch.Tensor, patch: tuple[int, int]) -> torch.Tensor:
    """The class of every patch's mean colour at 3 bits a channel: pixels (B, C, H, W) in [0, 1] -> (B, N) codes in
    [0, 8^C), the channels' 3-bit values read as base-8 digits (red most significant)."""
    b, c, h, w = pixels.shape
    ph, pw = patch
    mean = pixels.reshape(b, c, h // ph, ph, w // pw, pw).mean(dim=(3, 5))  # (B, C, gh, gw)
    bits = (mean * 8).floor().clamp(0, 7).long().flatten(2).transpose(1, 2)  # (B, N, C)
    weights = 8 ** torch.arange(c - 1, -1, -1, device=pixels.device)
    return (bits * weights).sum(-1)  # (B, N)


# torch.fx with dynamic_img_size: the patch grid is read from the input's shape when the traced module runs, so what
# depends on it (the position embedding resampled to it, the rotary angles, the relative bias's table) is one call
# each in the graph, run with the real grid (as `pad_same` in resnet.py), instead of Python branches on traced sizes.
def _pos_embed_at(pos_embed: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    return pos_embed(x, tuple(grid))


def _rope_at(rope: nn.Module, grid: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope(tuple(grid), device=like.device)


def _attention_at(attn: nn.Module, x: torch.Tensor, grid: tuple[int, int], rope, mask) -> torch.Tensor:
    return attn(x, grid=tuple(grid), rope=rope, mask=mask)


torch.fx.wrap("_pos_embed_at")
torch.fx.wrap("_rope_at")
torch.fx.wrap("_attention_at")


class Block(nn.Module):
    """One pre-norm encoder block (Eq. 2-3): x + MSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, c: ViTConfig, drop_path: float) -> None:
        super().__init__()
        rel = RelativePositionBias(c.grid_size, c.num_heads, c.num_prefix_tokens) if c.pos_embed == "relative" else None
        d = c.embed_dim
        self.norm1 = LayerNorm(d, eps=c.norm_eps)
        self.attn = Attention(d, c.num_heads, qkv_bias=c.qkv_bias, attn_drop=c.attn_drop_rate, proj_drop=c.drop_rate,
                              rel_pos=rel, qk_norm=c.qk_norm, inner_norm=c.attn_norm, norm_eps=c.norm_eps,
                              rope_prefix=c.num_prefix_tokens, k_bias=c.k_bias)
        self.ls1 = LayerScale(d, c.init_values) if c.init_values is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = LayerNorm(d, eps=c.norm_eps)
        if c.mlp_layer == "swiglu":
            self.mlp = SwiGLU(d, c.mlp_dim, norm=c.mlp_norm, norm_eps=c.norm_eps, drop=c.drop_rate)
        else:
            self.mlp = Mlp(d, c.mlp_dim, act=c.act, drop=c.drop_rate)
        self.ls2 = LayerScale(d, c.init_values) if c.init_values is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                grid: tuple[int, int] | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None):
        """(B, T, D) -> (B, T, D); with `queries`, only the first `queries` tokens' outputs: (B, queries, D).
        `grid`: the input's patch grid when it is not the model's (dynamic_img_size: the relative bias);
        `rope`: the rotary embedding's (sin, cos) for that grid; `mask`: a packed batch's keys (B, 1, 1, T)."""
        if queries is not None:  # every token is normed for the keys and values; only the queries go on
            x = x[:, :queries] + self.drop_path1(self.ls1(self.attn(self.norm1(x), queries=queries, grid=grid, rope=rope,
                                                                    mask=mask)))
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if return_attention:
            y, attn = self.attn(self.norm1(x), return_attention=True, grid=grid, rope=rope, mask=mask)
            x = x + self.drop_path1(self.ls1(y))
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))), attn
        x = x + self.drop_path1(self.ls1(self._attend(self.norm1(x), grid, rope, mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def _attend(self, x: torch.Tensor, grid, rope, mask) -> torch.Tensor:
        if grid is not None and self.attn.rel_pos is not None and is_fx_tracing():  # the bias's table for the grid
            return _attention_at(self.attn, x, grid, rope, mask)
        return self.attn(x, grid=grid, rope=rope, mask=mask)


class PreLogits(nn.Module):
    """The pre-training head's hidden layer: Linear(D, R) + tanh (Sec. 3.1, App. B.1.1)."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.fc = Linear(dim, size)
        lecun_normal_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class VisionTransformer(TimmModelApi, nn.Module):
    """ViT, and with `hybrid_layers` set, the ResNet + ViT hybrid. Build it with `vitkit.create_model`.

    timm's model API (`TimmModelApi`, docs/timm.md): num_classes, pretrained_cfg, get_classifier, reset_classifier
    (num_classes, global_pool), set_input_size, no_weight_decay, group_matcher, embed_dim, num_prefix_tokens, ..."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = self.config = config
        backbone = None
        if c.hybrid_layers is not None:
            backbone = ResNetBackbone(
                c.hybrid_layers, width_factor=c.hybrid_width, in_chans=c.in_chans,
                ws_eps=c.hybrid_ws_eps, ws_eps_mode=c.hybrid_ws_eps_mode, gn_eps=c.hybrid_gn_eps,
            )
        self.patch_embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, c.embed_dim, backbone, bias=c.patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        self.dist_token = nn.Parameter(torch.randn(1, 1, c.embed_dim) * 0.02) if c.distilled else None
        self.reg_token = nn.Parameter(torch.randn(1, c.reg_tokens, c.embed_dim) * 1e-6) if c.reg_tokens else None
        # the prefix tokens the position embedding covers: all of them (the paper) or none (no_embed_class)
        covered = 0 if c.no_embed_class else c.num_prefix_tokens
        self.pos_embed = POS_EMBEDS[c.pos_embed](c.grid_size, c.embed_dim, covered)
        self.pos_embed.method, self.pos_embed.square = c.pos_resample, c.pos_resample_square
        self.rope = (RotaryEmbedding2d(c.embed_dim // c.num_heads, c.grid_size, c.rope_ref_grid, c.rope_temperature)
                     if c.rope else None)
        self.pos_drop = nn.Dropout(c.drop_rate)
        self.norm_pre = LayerNorm(c.embed_dim, eps=c.norm_eps) if c.pre_norm else nn.Identity()
        dpr = [c.drop_path_rate * i / max(c.depth - 1, 1) for i in range(c.depth)]  # stochastic depth, linear over depth
        self.blocks = nn.ModuleList(Block(c, dpr[i]) for i in range(c.depth))
        self.norm = nn.Identity() if c.fc_norm else LayerNorm(c.embed_dim, eps=c.norm_eps)
        self.fc_norm = LayerNorm(c.embed_dim, eps=c.norm_eps) if c.fc_norm else nn.Identity()
        self.attn_pool = (AttentionPool(c.embed_dim, c.num_heads, c.mlp_dim, act=c.act, norm_eps=c.norm_eps)
                          if c.classifier == "map" else None)
        self.pre_logits = PreLogits(c.embed_dim, c.representation_size) if c.representation_size else nn.Identity()
        self.head_drop = nn.Dropout(c.drop_rate)
        self.num_features = c.representation_size or c.embed_dim
        self.head = self._new_head(c.num_classes)
        self.head_dist = self._new_head(c.num_classes) if c.distilled else None
        self.distilled_training = False  # set by the trainer: in training, return both heads' logits
        if c.mpp:
            self.mask_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim))
            self.mpp_head = Linear(c.embed_dim, 8 ** c.in_chans)
        # Two speed switches, per instance (timm decides `fused_attn` per instance in the same way):
        # - lowp_stream: under autocast the tokens between blocks stay fp32 (the position embedding promotes
        #   them), so every norm, residual add and GELU runs in fp32 with a cast in front of every Linear. True
        #   keeps the stream in the autocast dtype, as pure-bf16 training does (1.2x faster training on a CPU at
        #   small widths, 1.1-1.2x for B/16 on an H100; benchmarks/NOTES.md sections 8 and 11); weights,
        #   gradients and the optimizer stay fp32. The trainer sets it from `run.lowp_stream`.
        # - last_block_cls_only: with the class token as the classifier the head reads one token, so `forward`
        #   runs the last block's queries, output projection and MLP on the class token alone (keys and values
        #   still from every token): the same logits and gradients, ~6.5% fewer FLOPs for a 12-layer model.
        #   `forward` falls back to the full last block whenever something could see the difference: a forward
        #   hook or pre-hook on the last block or any module inside it, or torch.fx tracing (feature extraction).
        self.lowp_stream = False
        self.last_block_cls_only = True
        self.patch_embed.dynamic = c.dynamic_img_size
        # Activation checkpointing (`set_grad_checkpointing`): each block's activations are recomputed in the
        # backward instead of kept, trading ~a third more compute for memory that no longer grows with depth.
        self.grad_checkpointing = False

    def _new_head(self, num_classes: int) -> nn.Module:
        if not num_classes:
            return nn.Identity()
        head = Linear(self.num_features, num_classes)
        nn.init.zeros_(head.weight)  # the official head is zero-initialised
        nn.init.zeros_(head.bias)
        return head

    # ---- the forward pass, split as features / pooling / head -------------------------------------

    def grid_for(self, x: torch.Tensor) -> tuple[int, int] | None:
        """The patch grid of an input batch when the model takes any size (dynamic_img_size), else None."""
        return self.patch_embed.grid_for(x) if self.config.dynamic_img_size else None

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Image (B, C, H, W) -> the input sequence of the encoder (B, T, D), position added."""
        grid = self.grid_for(x)
        return self._add_tokens(self.patch_embed(x), grid)  # (B, N, D) -> (B, T, D)

    def _add_tokens(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """Patch tokens (B, N, D) -> (B, p + N, D): the class (distillation, register) tokens prepended, position
        added (to the patches alone with no_embed_class), then the pre-norm where there is one (CLIP)."""
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.config.no_embed_class:
            x = self._add_pos(x, grid)  # (B, N, D)
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # (B, p + N, D)
        if not self.config.no_embed_class:
            x = self._add_pos(x, grid)
        x = self.norm_pre(self.pos_drop(x))
        if self.lowp_stream and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def _add_pos(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        if grid is not None and is_fx_tracing():  # one traced call, resampling to the grid the input has
            return _pos_embed_at(self.pos_embed, x, grid)
        return self.pos_embed(x, grid)

    def rope_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary embedding's (sin, cos) for an image batch's patch grid, or None for a model without one."""
        if self.rope is None:
            return None
        if is_fx_tracing():  # the angles for the grid the input has, one traced call (none of them cached here)
            sincos = _rope_at(self.rope, self.patch_embed.grid_for(x), x)
            return sincos[0], sincos[1]
        return self.rope(self.patch_embed.grid_for(x), device=x.device)

    def _run(self, blk: Block, x: torch.Tensor, **kw) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, **kw)
        return blk(x, **kw)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """All tokens after the final norm: (B, C, H, W) -> (B, T, D)."""
        grid, rope = self.grid_for(x), self.rope_for(x)
        x = self.embed(x)
        for blk in self.blocks:
            x = self._run(blk, x, grid=grid, rope=rope)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D): the class token, the mean of the patch tokens, or their attention pooling."""
        if self.config.classifier == "token":
            return x[:, 0]
        if self.attn_pool is not None:
            return self.attn_pool(x[:, self.config.num_prefix_tokens :])
        return self.fc_norm(x[:, self.config.num_prefix_tokens :].mean(dim=1))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, T, D) -> logits (B, K); with `pre_logits`, the head's input (B, R or D).

        A distilled model (DeiT) has two: the class token's head and the distillation token's. Its logits are their
        mean, or both, as a pair, in training with `distilled_training` (the trainer's distillation loss)."""
        if self.head_dist is not None:
            cls, dist = x[:, 0], x[:, 1]
            if pre_logits:
                return (cls + dist) / 2
            logits, logits_dist = self.head(self.head_drop(cls)), self.head_dist(self.head_drop(dist))
            if self.training and self.distilled_training:
                return logits, logits_dist
            return (logits + logits_dist) / 2
        x = self.pre_logits(self.pool(x))
        if pre_logits:
            return x
        return self.head(self.head_drop(x))

    def _cls_only_last_block(self) -> bool:
        """Whether `forward` may run the last block on the class token alone (see `last_block_cls_only`)."""
        if not (self.last_block_cls_only and self.config.classifier == "token" and len(self.blocks)):
            return False
        if is_fx_tracing():
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.blocks[-1].modules())

    def forward(self, x, mpp_pixels: torch.Tensor | None = None, mpp_generator: torch.Generator | None = None):
        """Image (B, C, H, W) -> logits (B, num_classes), or pooled features if num_classes == 0.
        Images of different sizes (a list of (C, H, W), sides multiples of the patch size), a `PackedBatch` or the
        dict of timm's NaFlex collator: one packed forward, `forward_packed`.
        With `mpp_pixels` (the images in [0, 1]): masked patch prediction, `forward_mpp` (through forward, so that
        DDP and FSDP2 see the call)."""
        if isinstance(x, (list, tuple, dict, PackedBatch)):
            return self.forward_packed(as_packed(x, self.config.patch_size))
        if mpp_pixels is not None and not is_fx_tracing():  # fx traces the classifier; mpp through forward_mpp
            return self.forward_mpp(x, mpp_pixels, mpp_generator)
        if not self._cls_only_last_block():
            return self.forward_head(self.forward_features(x))
        grid, rope = self.grid_for(x), self.rope_for(x)
        x = self.embed(x)
        for blk in self.blocks[:-1]:
            x = self._run(blk, x, grid=grid, rope=rope)
        # the prefix tokens, all the head reads: (B, 1, D), (B, 2, D) with DeiT's distillation token, (B, 1 + R, D)
        # with R registers
        x = self._run(self.blocks[-1], x, queries=self.config.num_prefix_tokens, grid=grid, rope=rope)
        return self.forward_head(self.norm(x))

    def forward_intermediates(
        self, x: torch.Tensor, layers: int | Sequence[int] | None = None, *, attention: bool = True,
        patch_grid: bool = False, norm: bool = False,
    ) -> dict:
        """Run the model and keep, for the layers asked for, their output tokens and attention weights.

        Args:
            x: images (B, C, H, W), or a packed batch of mixed sizes (a list of images, a PackedBatch): then
                "valid" (B, L) is returned too, and each row's attention covers its own tokens only.
            layers: block indices (negative counts from the end), an int n for the last n blocks,
                or None for all. Only these blocks compute attention explicitly; every other block
                keeps the fused kernel.
            attention: also return the softmax attention weights of those layers.
            patch_grid: also return those layers' patch tokens as a feature map (B, D, gh, gw) (dense features:
                segmentation, depth, correspondence heads read these) and their prefix tokens (B, p, D).
            norm: apply the final norm to the kept tokens (as DINOv2's and timm's dense features do).

        Returns:
            a dict with "tokens" {layer: (B, T, D)} (block outputs, before the final norm unless `norm`),
            "attention" {layer: (B, H, T, T)} (if asked), "patch_grid" {layer: (B, D, gh, gw)} and "prefix"
            {layer: (B, p, D)} (if asked), "features" (B, T, D) after the final norm, and "logits".
        """
        wanted = resolve_layers(layers, len(self.blocks))
        tokens, attn = {}, {}
        packed = isinstance(x, (list, tuple, dict, PackedBatch))
        if packed:  # images of different sizes: the attention over each row's own tokens (padding keys get 0)
            if patch_grid:
                raise UsageError("patch_grid needs one grid per batch; a packed batch has one per image (use its "
                                 "coords to place the tokens)")
            batch = as_packed(x, self.config.patch_size)
            h, mask, rope = self.embed_packed(batch)
            grid = None
        else:
            grid, rope, mask = self.grid_for(x), self.rope_for(x), None
            h = self.embed(x)
        for i, blk in enumerate(self.blocks):
            if i in wanted and attention:
                h, attn[i] = blk(h, return_attention=True, grid=grid, rope=rope, mask=mask)
            else:
                h = blk(h, grid=grid, rope=rope, mask=mask)
            if i in wanted:
                tokens[i] = self.norm(h) if norm else h
        feats = self.norm(h)
        if packed:
            out = {"tokens": tokens, "features": feats, "logits": self.forward_head_packed(feats, batch.valid),
                   "valid": batch.valid}
            if attention:
                out["attention"] = attn
            return out
        out = {"tokens": tokens, "features": feats, "logits": self.forward_head(feats)}
        if attention:
            out["attention"] = attn
        if patch_grid:
            gh, gw = self.patch_embed.grid_for(x)
            p = self.config.num_prefix_tokens
            out["prefix"] = {i: t[:, :p] for i, t in tokens.items()}
            out["patch_grid"] = {i: t[:, p:].transpose(1, 2).reshape(t.shape[0], t.shape[2], gh, gw)  # (B, N, D) -> (B, D, gh, gw)
                                 for i, t in tokens.items()}
        return out

    # ---- packed batches: images of different sizes and aspect ratios in one forward (NaViT, NaFlex) -----------

    def _check_packable(self) -> None:
        c = self.config
        if c.hybrid_layers is not None:
            raise UsageError("a hybrid's ResNet reads whole images: packed batches of patches are for plain ViTs "
                             "(run a hybrid on one size per batch, or one image at a time)")
        if c.pos_embed == "relative":
            raise UsageError("packed batches need an absolute position embedding, not the relative bias")

    def embed_packed(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """A packed batch -> (the encoder's input (B, p + L, D), the attention mask (B, 1, 1, p + L), the rotary
        embedding's (sin, cos) per token or None). Each image's patches get the position grid resampled to that
        image's grid (`config.pos_resample`, per token: `packing.resample_for_coords`)."""
        self._check_packable()
        c, p = self.config, self.config.num_prefix_tokens
        x = self.patch_embed.embed_patches(batch.patches)  # (B, L, D)
        sizes = grid_sizes(batch.coords, batch.valid)  # (B, 2): every image's grid
        pe = self.pos_embed.for_coords(batch.coords, sizes, c.pos_resample, c.pos_resample_square)  # (B, L, D)
        if pe is not None:
            x = x + pe.to(x.dtype)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if prefix:
            pre = torch.cat(prefix, dim=1)  # (B, p, D)
            pos = None if c.no_embed_class else self.pos_embed.prefix_embed()
            x = torch.cat([pre if pos is None else pre + pos, x], dim=1)  # (B, p + L, D)
        x = self.norm_pre(self.pos_drop(x))
        if self.lowp_stream and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        rope = self.rope.for_coords(batch.coords, sizes) if self.rope is not None else None
        return x, key_mask(batch.valid, p), rope

    def forward_features_packed(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed batch (or a list of images) -> (all tokens after the final norm (B, p + L, D), valid (B, L))."""
        batch = as_packed(x, self.config.patch_size)
        h, mask, rope = self.embed_packed(batch)
        for blk in self.blocks:
            h = self._run(blk, h, rope=rope, mask=mask)
        return self.norm(h), batch.valid

    def pool_packed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`pool` per image of a packed batch: the class token, the mean of the image's own patches, or the
        attention pooling over them."""
        p = self.config.num_prefix_tokens
        if self.config.classifier == "token":
            return x[:, 0]
        if self.attn_pool is not None:
            return self.attn_pool(x[:, p:], valid=valid)
        return self.fc_norm(masked_mean(x[:, p:], valid))

    def forward_head_packed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`forward_head` for a packed batch: tokens (B, p + L, D), valid (B, L) -> logits (B, K)."""
        if self.config.classifier == "token":  # the class token (and DeiT's distillation token): no padding to skip
            return self.forward_head(x)
        return self.head(self.head_drop(self.pre_logits(self.pool_packed(x, valid))))

    def forward_packed(self, x) -> torch.Tensor:
        """Images of different sizes in one forward: a PackedBatch (or a list of (C, H, W) images, or timm's NaFlex
        dict) -> logits (B, num_classes), one row per image, each as the image alone would give."""
        batch = as_packed(x, self.config.patch_size)
        if not self._cls_only_last_block():
            return self.forward_head_packed(*self.forward_features_packed(batch))
        h, mask, rope = self.embed_packed(batch)
        for blk in self.blocks[:-1]:
            h = self._run(blk, h, rope=rope, mask=mask)
        h = self._run(self.blocks[-1], h, queries=self.config.num_prefix_tokens, rope=rope, mask=mask)
        return self.forward_head(self.norm(h))

    # ---- changing the model after construction --------------------------------------------------

    def set_dynamic_img_size(self, enable: bool = True) -> None:
        """Accept any H x W divisible by the patch size (see ViTConfig.dynamic_img_size)."""
        self.config.dynamic_img_size = self.patch_embed.dynamic = enable

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward instead of storing them (training memory)."""
        self.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None,
                         class_names: list[str] | None = None) -> None:
        """A new zero-initialised head, as for fine-tuning (Sec. 3.2), in timm's order: `global_pool` ('token',
        'avg', 'map'; None keeps it) changes the pooling as timm's does (`_set_global_pool`); class names by keyword."""
        num_classes = check_num_classes(num_classes)
        names = check_class_names(num_classes, class_names, global_pool)
        if global_pool is not None:
            self._set_global_pool(global_pool)
        self.config.num_classes, self.config.class_names = num_classes, names
        w = self.patch_embed.proj.weight
        self.head = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)
        if self.head_dist is not None:
            self.head_dist = self._new_head(num_classes).to(device=w.device, dtype=w.dtype)

    def _set_global_pool(self, global_pool: str) -> None:
        """Pool as timm's `global_pool` names it, the norms where they are (timm's reset_classifier): 'avg' the mean
        of the patch tokens, 'token' the class token (a model with one, whose norm comes before the pooling), 'map'
        only where the model has its attention pooling (timm cannot add one either); leaving 'map' drops it."""
        c = self.config
        new = vit_classifier(global_pool)
        if new == c.classifier:
            return
        if new == "map":
            raise UsageError("global_pool='map': this model has no attention pooling, and it cannot be added after "
                             "construction (in timm neither): create the model with global_pool='map'")
        if c.distilled:
            raise UsageError("a distilled model (DeiT) pools its class and distillation tokens: "
                             "global_pool='token' only")
        if new == "token" and not c.class_token:
            raise UsageError("global_pool='token' needs a class token; this model has none (class_token=False)")
        if new == "token" and c.fc_norm:
            raise UsageError("global_pool='token': this model normalises after pooling (fc_norm, timm's default for "
                             "'avg'), which vitkit applies to the mean alone; create the model with "
                             "global_pool='token'")
        dataclasses.replace(c, classifier=new)  # the config's own checks, before anything changes
        c.classifier = new
        self.attn_pool = None

    # ---- timm's names (timm_api.TimmModelApi has the ones every family shares) -----------------------------------

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class token, DeiT's distillation token, the registers."""
        return self.config.num_prefix_tokens

    @property
    def has_class_token(self) -> bool:
        return bool(self.config.class_token)

    @property
    def global_pool(self) -> str:
        """timm's name of the pooling: 'token', 'avg' or 'map' (vitkit's classifier 'token', 'gap', 'map')."""
        return VIT_POOL_NAMES[self.config.classifier]

    @property
    def dynamic_img_size(self) -> bool:
        return self.config.dynamic_img_size

    def _fixed_input_size(self) -> bool:
        return not self.config.dynamic_img_size

    def _classifier_names(self) -> str | tuple[str, ...]:
        return ("head", "head_dist") if self.head_dist is not None else "head"

    @property
    def _first_conv(self) -> str:
        return "patch_embed.proj" if self.config.hybrid_layers is None else "patch_embed.backbone.stem.conv"

    def set_input_size(self, img_size: int | tuple[int, int] | None = None,
                       patch_size: int | tuple[int, int] | None = None) -> None:
        """timm's name: `set_img_size(img_size)` (the position embedding resampled by the checkpoint's own method);
        a patch size other than the model's is refused (timm resamples the kernel; vitkit does not)."""
        self._check_patch_size(patch_size)
        if img_size is not None:
            self.set_img_size(img_size)

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups for layer-wise LR decay (`timm_api.layer_groups`): the embeddings (patch
        embedding, a hybrid's ResNet, the tokens, the position embedding, the pre-norm) first, then one group per
        block, the final norm with the last block, the pooling and head last (no pattern). `coarse` changes nothing
        (as in timm's ViT)."""
        return dict(stem=r"^(?:cls_token|reg_token|dist_token|mask_token|pos_embed|patch_embed|norm_pre)",
                    blocks=[(r"^blocks\.(\d+)\.", None), (r"^norm\.", (99999,))])

    # ---- masked patch prediction (Sec. 4.6, App. B.1.2) --------------------------------------------

    def forward_mpp(self, x: torch.Tensor, pixels: torch.Tensor, g: torch.Generator | None = None,
                    ratio: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked patch prediction: corrupt `ratio` of every image's patch embeddings (80% of them become the
        learnable mask embedding, 10% another patch's embedding from the batch, 10% stay), and predict each
        corrupted patch's 3-bit mean colour (a class of 8^C) from its output token.

        Args:
            x: the model's input (B, C, H, W), normalised. pixels: the same images in [0, 1], for the targets.
        Returns: (logits (M, 8^C), targets (M,)) for the M corrupted patches of the batch."""
        if not self.config.mpp:
            raise UsageError("this model has no masked-patch-prediction head: create it with mpp=True")
        tokens = self.patch_embed(x)  # (B, N, D)
        corrupted, how = mpp_corruption(tokens.shape[0], tokens.shape[1], ratio, g, tokens.device)
        b_idx, n_idx = mpp_random_patches(tokens.shape[0], tokens.shape[1], g, tokens.device)
        swapped = tokens[b_idx, n_idx]  # (B, N, D): a random patch of the batch for every position
        tokens = torch.where((how == 1)[..., None], self.mask_token.to(tokens.dtype), tokens)
        tokens = torch.where((how == 2)[..., None], swapped, tokens)
        h = self._add_tokens(tokens, None)
        rope = self.rope_for(x)
        for blk in self.blocks:
            h = self._run(blk, h, rope=rope)
        out = self.norm(h)[:, self.config.num_prefix_tokens:]  # (B, N, D)
        return self.mpp_head(out[corrupted]), mpp_targets(pixels, self.config.patch_size)[corrupted]

    def add_mpp(self) -> None:
        """Add a fresh masked-patch-prediction head (pre-training a loaded checkpoint further)."""
        if not self.config.mpp:
            self.config.mpp = True
            device = self.patch_embed.proj.weight.device
            self.mask_token = nn.Parameter(torch.zeros(1, 1, self.config.embed_dim, device=device))
            self.mpp_head = Linear(self.config.embed_dim, 8 ** self.config.in_chans, device=device)

    def drop_mpp(self) -> None:
        """Remove the masked-patch-prediction head (after pre-training, for fine-tuning)."""
        if self.config.mpp:
            del self.mask_token, self.mpp_head
            self.config.mpp = False

    def set_img_size(self, img_size: int | tuple[int, int], method: str | None = None) -> None:
        """Change the input resolution, keeping the patch size; the position embedding is resampled in 2-D.

        Args:
            method: how the position grid is resampled (`layers.pos_embed.RESAMPLE_METHODS`); default: the
                checkpoint's own (`config.pos_resample`: "bilinear" for the official code, "bicubic" for timm,
                "bicubic_noaa" for most transformers classes), as recorded when it was loaded.
        """
        c = self.config
        method = method or c.pos_resample
        new = to_2tuple(img_size)
        for s, p in zip(new, c.patch_size):
            if s % p:
                raise UsageError(f"img_size {new} is not divisible by patch_size {c.patch_size}")
        c.img_size = new
        self.patch_embed.img_size = new
        self.patch_embed.grid_size = c.grid_size
        self.patch_embed.num_patches = c.grid_size[0] * c.grid_size[1]
        self.pos_embed.resample(c.grid_size, method)
        if self.rope is not None:
            self.rope.resample(c.grid_size)
        for blk in self.blocks:
            if blk.attn.rel_pos is not None:
                blk.attn.rel_pos.resample(c.grid_size, method)
