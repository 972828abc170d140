"""`ViTConfig`: every field that defines a Vision Transformer (`vit.py`), checked when it is made and serialised into
every vitkit checkpoint.

The fields come in groups, declared once in `GROUPS`: the paper's model first (what Sec. 3.1 and Table 1 set), then
what the later ViTs add, a group each (position and rotary embeddings; extra tokens; pooling and head; norms;
attention and MLP variants) and last the facts the weights carry (preprocessing, class names, format). A family adds
its fields inside its group; the extensions default off, so the paper's model reads as the first group alone.

The class stays one flat dataclass, the groups a table beside it (checked when this module is imported: every field
in exactly one group, in the class's order), rather than nested dataclasses, because hundreds of lines read
`config.<field>`, `dataclasses.replace(config, rope=...)` sets fields by name, and every checkpoint earlier vitkit
versions wrote holds the flat dict: all of them keep working unchanged. `ViTConfig.groups()` and `describe()` show
the grouping, `to_dict(nested=True)` writes it (big_vision's `config.model.posemb` shape) and `from_dict` reads a
flat or a nested dict. Checkpoints are written flat, the fields newer than the previous vitkit only when set
(`to_dict`), so that it reads every checkpoint that does not use them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from .layers import LearnedPosEmbed1d, LearnedPosEmbed2d, NoPosEmbed, SinCosPosEmbed2d
from .layers.conv_stem import check_stem
from .layers.mlp import ACTIVATIONS
from .layers.norm import NORMS
from .layers.rope import ROPE_KINDS
from .layers.patch_embed import to_2tuple
from .layers.pos_embed import RESAMPLE_METHODS
from .resnet import HYBRID_NORMS, backbone_stride
from ..errors import UsageError
from ..safety import check_sizes, check_types

CLASSIFIERS = ("token", "gap", "map")
MLP_LAYERS = ("mlp", "swiglu")
ATTN_LAYERS = ("standard", "diff")
ROPES = (None, *ROPE_KINDS)
ROPE_INDEXING = ("ij", "xy")
# fields newer than the previous vitkit release, with their defaults: `to_dict` leaves them out when at the default
_LATER_FIELDS = {"res_post_norm": False, "num_kv_heads": None, "kv_full_blocks": 0, "rel_pos_dim": 128,
                 "rel_pos_shared": False, "attn_only_layer_scale": False,
                 "conv_stem": None, "conv_stem_kernels": (), "conv_stem_strides": (), "attn_layer": "standard",
                 "hybrid_stem_pool": True, "patch_drop_rate": 0.0, "hybrid_norm": "group"}
POS_EMBEDS = {
    "learned_1d": LearnedPosEmbed1d,
    "learned_2d": LearnedPosEmbed2d,
    "sincos_2d": SinCosPosEmbed2d,
    "none": NoPosEmbed,
    "relative": NoPosEmbed,  # the relative bias lives in every attention layer instead
    "relative_mlp": NoPosEmbed,  # so does the MLP that computes it (or in the model, shared by the blocks)
}

# The groups of `ViTConfig`'s fields, in the class's order: name -> (heading, fields). Checked at import
# (`_check_groups`); a new field goes into its family's group.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "paper": ("the paper's model (Sec. 3.1, Table 1)",
              ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_dim",
               "classifier", "representation_size", "drop_rate", "attn_drop_rate", "drop_path_rate", "qkv_bias", "act",
               "norm_eps", "hybrid_layers", "hybrid_width", "hybrid_ws_eps", "hybrid_ws_eps_mode", "hybrid_gn_eps")),
    "stem": ("the stem: the hybrid ResNet's max-pool and norm, or a convolutional stem (MobileCLIP's MCi)",
             ("hybrid_stem_pool", "hybrid_norm", "conv_stem", "conv_stem_kernels", "conv_stem_strides")),
    "position": ("position and rotary embeddings",
                 ("pos_embed", "no_embed_class", "pos_resample", "pos_resample_square", "dynamic_img_size", "rope",
                  "rope_ref_grid", "rope_temperature", "rope_indexing", "rope_offset", "rope_half", "rel_pos_dim",
                  "rel_pos_shared")),
    "tokens": ("extra tokens, and patch tokens dropped in training",
               ("class_token", "distilled", "reg_tokens", "patch_drop_rate")),
    "pooling": ("pooling and head", ("fc_norm", "pool_heads", "pool_mlp_dim", "pool_prefix", "mpp")),
    "norms": ("norms", ("norm", "pre_norm", "patch_norm", "final_norm", "qk_norm", "attn_norm", "mlp_norm",
                        "res_post_norm")),
    "variants": ("attention and MLP variants", ("k_bias", "proj_bias", "patch_bias", "mlp_layer", "init_values",
                                                "attn_only_layer_scale", "num_kv_heads", "kv_full_blocks",
                                                "attn_layer")),
    "facts": ("what the weights carry", ("mean", "std", "interpolation", "crop_pct", "class_names", "naflex", "arch")),
}


@dataclass
class ViTConfig:
    """Everything that defines a ViT, in groups (`GROUPS`; `describe()` prints a config that way). Serialised into
    every vitkit checkpoint.

    The paper's model (arXiv 2010.11929, Sec. 3.1, Table 1):
        img_size: input resolution, an int or (height, width); must be divisible by patch_size.
        patch_size: P; for hybrids the total stride (backbone stride x the embedding kernel).
        in_chans: input channels (1 for grayscale).
        num_classes: classes of the head; 0 makes `model(x)` return the pooled features.
        embed_dim, depth, num_heads, mlp_dim: D, L, heads and the MLP width (4D in the paper).
        classifier: "token" (the class token), "gap" (global average pooling of the patch tokens) or "map"
            (multihead attention pooling: a learned query attends over the patch tokens, then a residual MLP;
            SigLIP's head).
        representation_size: width of the pre-logits Linear + tanh (pre-training head); None: no layer.
        drop_rate, attn_drop_rate, drop_path_rate: dropout, attention dropout, stochastic depth
            (the latter linear over depth from 0 to the given rate).
        qkv_bias: bias on the query/key/value projections.
        act: "gelu" (exact), "gelu_tanh" (the official JAX code's and SigLIP's approximation) or "quick_gelu"
            (OpenAI CLIP's x * sigmoid(1.702 x)).
        norm_eps: LayerNorm epsilon (1e-6 official and timm, 1e-12 HF).
        hybrid_layers: blocks per ResNet stage for a hybrid (e.g. (3, 4, 9)); () the ResNet stem alone
            (AugReg's R+Ti/16); None: a plain ViT.
        hybrid_width: the ResNet width factor; hybrid_ws_eps/_mode, hybrid_gn_eps: its numerics.

    The stem:
        hybrid_stem_pool: the hybrid ResNet stem's 3x3/2 max-pool (the paper's); False halves the backbone's stride,
            for small images (a 28 px image then reaches the first stage at 14x14, not 7x7; not in timm or the
            official format).
        hybrid_norm: the hybrid ResNet's norms: "group", the paper's GroupNorm (32 groups, eps hybrid_gn_eps); "batch",
            BatchNorm2d (eps 1e-5, running statistics in eval mode; the convs stay weight-standardised; not in timm
            or the official format).
        conv_stem: a convolutional stem, the hybrid's other backbone kind (`layers/conv_stem.py`): the output
            channels of each conv + BatchNorm + exact GELU layer before the patch embedding, which is the stem's last
            conv (MobileCLIP's MCi: (192, 192), then the 768-wide 2x2/2 embedding); None: none. patch_size is then
            the total stride, as for a ResNet hybrid.
        conv_stem_kernels, conv_stem_strides: each layer's kernel and stride (MCi: kernels (4, 2), strides ()); the
            strides () are the kernels (patchify convs; strides equal to the kernels are stored so, so that a new
            conv_stem_kernels brings its strides along), `stem_strides` the strides in force. Padding
            (kernel - stride + 1) // 2 keeps H / stride exact.

    Position and rotary embeddings:
        pos_embed: "learned_1d" (the paper's) | "learned_2d" | "sincos_2d" | "none" | "relative" (App. D.4: a
            learned bias per head and relative offset in every block's attention, BEiT's) | "relative_mlp" (that bias
            computed by an MLP from the offsets' log-spaced coordinates, Swin V2's continuous bias: timm's
            ViT-RelPos, `layers.attention.RelativePositionMlp`; no table to resample at another grid).
        no_embed_class: the position embedding covers the patches only (DeiT-III, DINOv2 with registers, big_vision);
            False: it covers the prefix tokens too, as in the paper.
        pos_resample: how a packed batch (images of other sizes, `forward` on a list of images) resamples the
            learned position grid to each image's: "bilinear" (the official method), "bicubic" (timm's NaFlexVit),
            "bilinear_aa" (SigLIP 2), "bicubic_noaa" (transformers' DINOv2),
            "bilinear_noaa" (transformers' BEiT: its relative position table), "geometric" (timm's BEiT: its relative
            table's offsets spaced by a geometric progression; pos_embed="relative" only). pos_resample_square:
            resample to the square of the image's longer side and read the top-left part (timm's
            `pos_embed_ar_preserving`).
        dynamic_img_size: accept any H x W divisible by the patch size, the position embedding resampled to each
            input's grid on the fly (bilinear, as `vitkit.load(..., img_size=...)` does; cached per grid).
        rope: 2-D rotary embeddings of the patch tokens' queries and keys (`layers/rope.py`): "eva" (axial: EVA-02,
            ROPE-ViT-Axial, the Perception Encoder), "mixed" (ROPE-ViT's learned frequencies, per block and head) or
            "dinov3" (DINOv3's coordinates normalised to [-1, 1]); None: none. rope_ref_grid ("eva"): the grid whose
            coordinates the rotation uses at every resolution (EVA-02: (16, 16)); None: the grid itself.
            rope_temperature: the base of the frequencies (DINOv3's periods). rope_indexing: "ij" (the first half
            of the angles from the row) or "xy" (from the column: ROPE-ViT, PE). rope_offset: added to the patch
            indices (PE: 1). rope_half: the rotate-half channel layout (DINOv3) instead of adjacent pairs.
        rel_pos_dim, rel_pos_shared ("relative_mlp"): the MLP's hidden width; one MLP for all blocks (timm's
            vit_srelpos) instead of one each.

    Extra tokens, and patch tokens dropped in training:
        class_token: prepend a class token; None means "only when classifier == 'token'".
        distilled: DeiT's distillation token: a second prefix token with its own head, trained against a teacher's
            predictions; at inference the two heads' logits are averaged.
        reg_tokens: register tokens (Darcet et al. 2023, "Vision Transformers Need Registers"): learned tokens after
            the class token that the model may use as scratch space; no head reads them.
        patch_drop_rate: token dropping in training (FLIP; timm's patch_drop_rate): each image's blocks see a random
            max(1, int(N * (1 - rate))) of its N patch tokens and every prefix token; none dropped in evaluation
            or by `forward_intermediates`. Not with rotary or relative positions or in a NaFlex model, and not in
            training on packed batches or with masked patch prediction (each refused).

    Pooling and head:
        fc_norm: with "gap", normalise after pooling (timm's 'avg') instead of every token before it.
        pool_heads, pool_mlp_dim: the attention pooling's heads and MLP width ("map"), when not the blocks' (the
            Perception Encoder's: 8 heads; pool_mlp_dim 0: no MLP, AIMv2's). pool_prefix: the attention pooling
            reads the prefix tokens too (timm's Eva, the Perception Encoder), not the patches alone.
        mpp: the masked-patch-prediction head of Sec. 4.6 (a learnable mask embedding and a Linear to the 8^C
            colour codes of a patch's 3-bit mean colour), for self-supervised pre-training.

    Norms:
        norm: "layernorm" or "rmsnorm" (AIMv2), every norm of the model.
        pre_norm: a norm on the tokens before the first block (CLIP's `ln_pre`).
        patch_norm: a norm on the patch tokens before the position embedding (AIMv2).
        final_norm: the norm after the blocks (the Perception Encoder's language- and spatial-aligned towers have
            none).
        qk_norm: a norm on every head's queries and keys.
        attn_norm: a norm on the attention heads' output before the projection (EVA-02 CLIP's sub-LN).
        mlp_norm: a norm on the MLP's hidden units (EVA-02's `scale_mlp` in its SwiGLU; BEiT-3's sub-LN in the GELU MLP).
        res_post_norm: residual post-norm: each branch reads the un-normed tokens and its output is normed before
            the residual add, x + ls(norm1(attn(x))), x + ls(norm2(mlp(x))) (timm's Eva `use_post_norm`:
            EVA-02-CLIP-E "enormous"; Swin V2's res-post-norm); the norms keep their names (norm1, norm2).

    Attention and MLP variants:
        k_bias: False: no bias on the keys (EVA-02), the query and value biases then parameters of their own.
        proj_bias: biases on the attention's output projection and the MLP (AIMv2: none).
        patch_bias: a bias on the patch embedding (CLIP has none).
        mlp_layer: "mlp" (the paper's) or "swiglu" (fc2(SiLU(W_g x) * W_x x): EVA-02, DINOv2-g); with "swiglu",
            mlp_dim is the width of the gated hidden layer.
        init_values: LayerScale (CaiT, DeiT-III, DINOv2): a learned per-channel scale on both residual branches,
            initialised to this value; None: none. attn_only_layer_scale: on the attention branch alone (Sapiens2).
        num_kv_heads: grouped-query attention (Sapiens2): this many key/value heads, each shared by
            num_heads // num_kv_heads query heads (head h reads key/value head h // that); None: one per query
            head. The fused qkv's rows are q (D), k and v (num_kv_heads x head width each).
        kv_full_blocks: with num_kv_heads, the first and the last this many blocks keep one key/value head per query
            head (Sapiens2: 8); 0: every block is grouped.
        attn_layer: "standard" or "diff" (differential attention: each head the difference of two softmax maps,
            `layers/diff_attention.py`; timm's `vit_*_d*_reg1_gap_256`).

    What the weights carry:
        mean, std, interpolation, crop_pct: the preprocessing the weights expect.
        class_names: names of the head's classes, if known.
        naflex: the weights came from (or go to) a NaFlex model, timm's `NaFlexVit` or SigLIP 2's tower: a timm
            export writes a NaFlexVit (`embeds.*` names, a Linear patch embedding over (ph, pw, C) patches).
        arch: "vit" (the registry's and a checkpoint's architecture key).
    """

    # ---- the paper's model ----
    img_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (16, 16)
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    classifier: str = "token"
    representation_size: int | None = None
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    qkv_bias: bool = True
    act: str = "gelu"
    norm_eps: float = 1e-6
    hybrid_layers: tuple[int, ...] | None = None
    hybrid_width: float = 1.0
    hybrid_ws_eps: float = 1e-5
    hybrid_ws_eps_mode: str = "std"
    hybrid_gn_eps: float = 1e-6
    # ---- the stem ----
    hybrid_stem_pool: bool = True
    hybrid_norm: str = "group"
    conv_stem: tuple[int, ...] | None = None
    conv_stem_kernels: tuple[int, ...] = ()
    conv_stem_strides: tuple[int, ...] = ()
    # ---- position and rotary embeddings ----
    pos_embed: str = "learned_1d"
    no_embed_class: bool = False
    pos_resample: str = "bilinear"
    pos_resample_square: bool = False
    dynamic_img_size: bool = False
    rope: str | None = None
    rope_ref_grid: tuple[int, int] | None = None
    rope_temperature: float = 10000.0
    rope_indexing: str = "ij"
    rope_offset: float = 0.0
    rope_half: bool = False
    rel_pos_dim: int = 128
    rel_pos_shared: bool = False
    # ---- extra tokens ----
    class_token: bool | None = None
    distilled: bool = False
    reg_tokens: int = 0
    patch_drop_rate: float = 0.0
    # ---- pooling and head ----
    fc_norm: bool = False
    pool_heads: int | None = None
    pool_mlp_dim: int | None = None
    pool_prefix: bool = False
    mpp: bool = False
    # ---- norms ----
    norm: str = "layernorm"
    pre_norm: bool = False
    patch_norm: bool = False
    final_norm: bool = True
    qk_norm: bool = False
    attn_norm: bool = False
    mlp_norm: bool = False
    res_post_norm: bool = False
    # ---- attention and MLP variants ----
    k_bias: bool = True
    proj_bias: bool = True
    patch_bias: bool = True
    mlp_layer: str = "mlp"
    init_values: float | None = None
    attn_only_layer_scale: bool = False
    num_kv_heads: int | None = None
    kv_full_blocks: int = 0
    attn_layer: str = "standard"
    # ---- what the weights carry ----
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    interpolation: str = "bilinear"
    crop_pct: float = 0.875
    class_names: list[str] | None = field(default=None, repr=False)
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
        if not 0.0 <= self.patch_drop_rate < 1.0:
            raise UsageError(f"patch_drop_rate must be in [0, 1), got {self.patch_drop_rate}")
        if self.patch_drop_rate and (self.rope or self.pos_embed in ("relative", "relative_mlp") or self.naflex):
            raise UsageError("patch_drop_rate drops patch tokens before the blocks: not with rotary or relative "
                             "positions (they are computed for the whole grid) or a NaFlex model (packed batches)")
        if self.act not in ACTIVATIONS:
            raise UsageError(f"act must be one of {ACTIVATIONS}, got {self.act!r}")
        if self.mlp_layer not in MLP_LAYERS:
            raise UsageError(f"mlp_layer must be one of {MLP_LAYERS}, got {self.mlp_layer!r}")
        if self.pos_resample not in RESAMPLE_METHODS:
            raise UsageError(f"pos_resample must be one of {RESAMPLE_METHODS}, got {self.pos_resample!r}")
        if self.pos_resample == "geometric" and self.pos_embed != "relative":
            raise UsageError("pos_resample='geometric' resamples a relative position table (timm's BEiT); "
                             f"pos_embed={self.pos_embed!r} has none")
        if self.pos_embed != "relative_mlp" and (self.rel_pos_dim != 128 or self.rel_pos_shared):
            raise UsageError("rel_pos_dim and rel_pos_shared are the MLP relative bias's (pos_embed='relative_mlp'); "
                             f"pos_embed={self.pos_embed!r} has none")
        if self.rope not in ROPES:
            raise UsageError(f"rope must be one of {ROPES}, got {self.rope!r}")
        if self.rope and (self.embed_dim // self.num_heads) % 4:
            raise UsageError(f"rope needs a head width divisible by 4, got {self.embed_dim // self.num_heads}")
        if self.rope_indexing not in ROPE_INDEXING:
            raise UsageError(f"rope_indexing must be one of {ROPE_INDEXING}, got {self.rope_indexing!r}")
        if self.rope is None:  # the rotary settings mean nothing without a rotary embedding: their defaults
            self.rope_ref_grid, self.rope_indexing, self.rope_offset, self.rope_half = None, "ij", 0.0, False
        if self.rope == "mixed" and (self.rope_half or self.rope_offset or self.rope_ref_grid):
            raise UsageError("rope='mixed' (ROPE-ViT's learned frequencies) rotates adjacent channel pairs of the "
                             "plain patch indices: no rope_half, rope_offset or rope_ref_grid")
        if self.rope == "dinov3" and self.rope_ref_grid:
            raise UsageError("rope='dinov3' normalises the coordinates of every grid to [-1, 1]: no rope_ref_grid")
        if self.norm not in NORMS:
            raise UsageError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.fc_norm and not self.final_norm:
            raise UsageError("fc_norm replaces the final norm (it normalises after pooling): final_norm=False with it "
                             "means no norm at all; set fc_norm=False")
        if (self.pool_heads or self.pool_mlp_dim is not None or self.pool_prefix) and self.classifier != "map":
            raise UsageError("pool_heads, pool_mlp_dim and pool_prefix are the attention pooling's (classifier='map')")
        if self.pool_heads and self.embed_dim % self.pool_heads:
            raise UsageError(f"embed_dim {self.embed_dim} is not divisible by pool_heads {self.pool_heads}")
        if self.reg_tokens < 0:
            raise UsageError(f"reg_tokens must be >= 0, got {self.reg_tokens}")
        if self.reg_tokens and self.distilled:
            raise UsageError("register tokens beside DeiT's distillation token: no published model has both")
        if self.attn_layer not in ATTN_LAYERS:
            raise UsageError(f"attn_layer must be one of {ATTN_LAYERS}, got {self.attn_layer!r}")
        if self.attn_layer == "diff" and (self.rope or self.num_kv_heads or self.pos_embed in ("relative", "relative_mlp")
                                          or self.embed_dim % (2 * self.num_heads) or not self.k_bias):
            raise UsageError("attn_layer='diff' (differential attention) splits each head in two (embed_dim divisible "
                             "by 2 x num_heads) and has no rotary embedding, relative bias, grouped key/value heads or "
                             "separate query and value biases (k_bias=False)")
        if self.attn_only_layer_scale and self.init_values is None:
            raise UsageError("attn_only_layer_scale puts LayerScale on the attention branch alone: it needs init_values")
        if self.embed_dim % self.num_heads:
            raise UsageError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise UsageError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.num_kv_heads == self.num_heads:  # one key/value head per query head: plain multi-head attention
            self.num_kv_heads = None
        if self.num_kv_heads is not None and self.rope == "mixed":
            raise UsageError("num_kv_heads with rope='mixed': ROPE-ViT-Mixed's frequencies are per query head")
        if self.kv_full_blocks < 0:
            raise UsageError(f"kv_full_blocks must be >= 0, got {self.kv_full_blocks}")
        if self.num_kv_heads is not None and 2 * self.kv_full_blocks >= self.depth:  # every block full: no grouping
            self.num_kv_heads = None
        if self.num_kv_heads is None:  # which blocks are grouped means nothing without grouping
            self.kv_full_blocks = 0
        if self.hybrid_layers is not None:
            self.hybrid_layers = tuple(self.hybrid_layers)
            if any(n < 1 for n in self.hybrid_layers):
                raise UsageError(f"hybrid_layers {self.hybrid_layers}: every stage needs at least one block "
                                 f"(() is the ResNet stem alone)")
            if self.hybrid_norm not in HYBRID_NORMS:
                raise UsageError(f"hybrid_norm must be one of {HYBRID_NORMS}, got {self.hybrid_norm!r}")
            if self.hybrid_norm == "group" and (64 * self.hybrid_width) % 32:  # 32 groups; the narrowest is 64 * width
                raise UsageError(f"hybrid_width {self.hybrid_width}: must be a multiple of 0.5 (GroupNorm's 32 groups)")
            if (64 * self.hybrid_width) % 1:  # BatchNorm: any whole number of channels in the stem
                raise UsageError(f"hybrid_width {self.hybrid_width}: 64 x width must be a whole number of channels")
            stride = backbone_stride(self.hybrid_layers, self.hybrid_stem_pool)
            if any(p % stride for p in self.patch_size):
                raise UsageError(f"patch_size {self.patch_size} (the hybrid's total stride) is not a multiple of its "
                                 f"ResNet's stride {stride} ({len(self.hybrid_layers)} stage(s))")
        elif not self.hybrid_stem_pool or self.hybrid_norm != "group":
            raise UsageError(f"{'hybrid_stem_pool=False' if not self.hybrid_stem_pool else 'hybrid_norm'} describes a "
                             f"hybrid's ResNet: set hybrid_layers too")
        self._check_conv_stem()
        for s, p in zip(self.img_size, self.patch_size):
            if s % p:
                raise UsageError(f"img_size {self.img_size} is not divisible by patch_size {self.patch_size}")
        if self.class_names is not None and self.num_classes and len(self.class_names) != self.num_classes:
            raise UsageError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    def _check_conv_stem(self) -> None:
        """The conv stem's fields: one kernel and stride per layer, no ResNet beside it, a patch size its stride
        divides (defaults when there is none, so that a config without a stem reads as before)."""
        self.conv_stem_kernels, self.conv_stem_strides = tuple(self.conv_stem_kernels), tuple(self.conv_stem_strides)
        if self.conv_stem is None:
            if self.conv_stem_kernels or self.conv_stem_strides:
                raise UsageError("conv_stem_kernels and conv_stem_strides describe a conv stem: set conv_stem too")
            return
        self.conv_stem = tuple(self.conv_stem)
        if self.conv_stem_strides == self.conv_stem_kernels:
            self.conv_stem_strides = ()  # patchify convs: the strides are the kernels
        check_stem(self.conv_stem, self.conv_stem_kernels, self.stem_strides)
        if self.hybrid_layers is not None or self.mpp:
            raise UsageError("conv_stem is a hybrid backbone of its own: not with hybrid_layers (a ResNet) or mpp")
        stride = math.prod(self.stem_strides)
        if any(p % stride for p in self.patch_size):
            raise UsageError(f"patch_size {self.patch_size} (the total stride) is not a multiple of the conv stem's "
                             f"stride {stride}")

    @property
    def stem_strides(self) -> tuple[int, ...]:
        """Each conv stem layer's stride: conv_stem_strides, or the kernels where that is ()."""
        return self.conv_stem_strides or self.conv_stem_kernels

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

    def kv_heads(self, block: int) -> int | None:
        """The key/value heads of block `block` (grouped-query attention), or None for one per query head."""
        if self.num_kv_heads is None or not self.kv_full_blocks <= block < self.depth - self.kv_full_blocks:
            return None
        return self.num_kv_heads

    @classmethod
    def groups(cls) -> dict[str, tuple[str, ...]]:
        """{group: its fields}, in the class's order (`GROUPS`): "paper" first, then the extensions, "facts" last."""
        return {g: names for g, (_, names) in GROUPS.items()}

    def to_dict(self, nested: bool = False) -> dict:
        """The flat dict every vitkit checkpoint carries. The fields added after the flat format's 59 are written
        only when set, so that the previous vitkit reads every checkpoint that does not use them.
        nested: {group: {field: value}} (`GROUPS`), every field; `from_dict` reads it back."""
        d = asdict(self)
        if nested:
            return {g: {k: d[k] for k in names} for g, names in self.groups().items()}
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        """A config from `to_dict()`'s flat dict, its nested one ({group: {field: value}}) or a mix of the two;
        an unknown field or group, or a field given twice, is a UsageError naming it."""
        if not isinstance(d, dict):
            raise UsageError(f"a ViTConfig is read from a mapping, not a {type(d).__name__}")
        groups, flat = cls.groups(), {}
        for key, value in d.items():
            if key in groups and isinstance(value, dict):
                stray = sorted(set(value) - set(groups[key]))
                if stray:
                    raise UsageError(f"ViTConfig group {key!r} has no field(s) {stray} (its fields: {groups[key]})")
                items = value.items()
            else:
                items = [(key, value)]
            for name, v in items:
                if name in flat:
                    raise UsageError(f"ViTConfig field {name!r} is given twice")
                flat[name] = v
        unknown = sorted(set(flat) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"unknown ViTConfig field(s) {unknown}")
        return cls(**flat)

    def describe(self, every: bool = False) -> str:
        """The config as text, a heading per group: the paper's fields always, the other groups' fields where they
        differ from the default (every=True: all of them)."""
        default, lines = ViTConfig(), []
        for g, (title, names) in GROUPS.items():
            shown = [n for n in names if every or g == "paper" or getattr(self, n) != getattr(default, n)]
            if shown:
                lines.append(f"{title}:")
                for n in shown:
                    v = getattr(self, n)
                    lines.append(f"  {n}: {f'{len(v)} names' if n == 'class_names' and v else repr(v)}")
        return "\n".join(lines)

    def options(self) -> list[str]:
        """The later-ViT options this config turns on, in words (for a run's one-line model description)."""
        on = [f"LayerScale {self.init_values:g}{' (attention only)' if self.attn_only_layer_scale else ''}"
              if self.init_values is not None else "",
              f"{self.reg_tokens} registers" if self.reg_tokens else "",
              "position embedding over the patches only" if self.no_embed_class else "",
              "pre-norm" if self.pre_norm else "", "qk-norm" if self.qk_norm else "",
              "attention sub-norm" if self.attn_norm else "",
              ("SwiGLU with a norm" if self.mlp_norm else "SwiGLU") if self.mlp_layer == "swiglu" else
              "a norm inside the MLP" if self.mlp_norm else "",
              {"eva": "2-D RoPE", "mixed": "2-D RoPE, learned frequencies", "dinov3": "DINOv3 RoPE"}.get(self.rope, ""),
              "no key bias" if not self.k_bias else "", "RMSNorm" if self.norm == "rmsnorm" else "",
              "patch norm" if self.patch_norm else "", "no projection biases" if not self.proj_bias else "",
              "no final norm" if not self.final_norm else "",
              "MAP head" if self.classifier == "map" else "", "quick GELU" if self.act == "quick_gelu" else "",
              "distillation token" if self.distilled else "",
              "residual post-norm" if self.res_post_norm else "",
              "relative position bias" if self.pos_embed == "relative" else "",
              (f"relative position MLP{' shared by the blocks' if self.rel_pos_shared else ''}"
               if self.pos_embed == "relative_mlp" else ""),
              f"conv stem {self.conv_stem}" if self.conv_stem else "",
              "BatchNorm in the ResNet" if self.hybrid_layers is not None and self.hybrid_norm == "batch" else "",
              f"grouped-query attention ({self.num_kv_heads} key/value heads)" if self.num_kv_heads else "",
              "differential attention" if self.attn_layer == "diff" else ""]
        return [o for o in on if o]


def _check_groups() -> None:
    """`GROUPS` lists every field of `ViTConfig` once, in the class's order, and no group is named as a field."""
    declared = [n for _, names in GROUPS.values() for n in names]
    actual = [f.name for f in fields(ViTConfig)]
    if declared != actual or set(GROUPS) & set(actual):
        raise TypeError(f"vit_config.GROUPS does not list ViTConfig's fields in order: "
                        f"{sorted(set(declared) ^ set(actual)) or sorted(set(GROUPS) & set(actual)) or 'the order'}")


_check_groups()
