"""Hugging Face transformers' later vision towers <-> vitkit names: DINOv2 (`Dinov2Model`, `Dinov2WithRegistersModel`),
SigLIP (`SiglipVisionModel`, the vision half of `SiglipModel`) and CLIP (`CLIPVisionModel`, the vision half of
`CLIPModel`).

What differs from vitkit's names, besides the separate query/key/value Linears:
- DINOv2: LayerScale is `layer_scale{1,2}.lambda1`; SwiGLU packs gate and value in `mlp.weights_in`; with registers,
  the position embedding covers the class token and the registers are inserted after it is added (vitkit folds the
  class token's position into the token: `no_embed_class`, exactly the same function).
- SigLIP: no class token; the position embedding is an `nn.Embedding` (N, D); the MAP head is `head.probe` and an
  `nn.MultiheadAttention` whose `in_proj` stacks the query, key and value projections.
- CLIP: the class token is a vector `class_embedding` (D,); `pre_layrnorm` (sic) before the blocks; the patch
  embedding has no bias; `post_layernorm` normalises the pooled class token (vitkit normalises every token, then
  takes the class token: the same pooled output).
- CLIP's `visual_projection` (`CLIPVisionModelWithProjection`, `CLIPModel`), a Linear without bias from the pooled
  class token to the joint embedding, is vitkit's head (its bias zero, as timm holds CLIP's projection): `model(x)` is
  transformers' `image_embeds`, before the two-tower model divides it by its norm.
The text towers of the two-tower checkpoints, their text projection and logit scale are left unused (they do not
change the image tower's output).
"""
from __future__ import annotations

import torch

from .io import CheckpointError
from .layouts import QKV_INCOMPLETE, Layout, Rule, read, write

FAMILIES = {"dinov2": "dinov2", "dinov2_with_registers": "dinov2", "siglip_vision_model": "siglip", "siglip": "siglip",
            "clip_vision_model": "clip", "clip": "clip", "siglip2_vision_model": "siglip2", "siglip2": "siglip2",
            # CLIP's layout under other names: MetaCLIP 2, AltCLIP, Chinese-CLIP, CLIPSeg (their text towers differ)
            "metaclip_2_vision_model": "clip", "metaclip_2": "clip", "altclip_vision_model": "clip", "altclip": "clip",
            "chinese_clip_vision_model": "clip", "chinese_clip": "clip", "clipseg_vision_model": "clip",
            "clipseg": "clip"}
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "quick_gelu": "quick_gelu"}


def pos_resample(hf_config: dict | None) -> str:
    """How transformers resamples this class's position grid at another size (`interpolate_pos_encoding`): plain
    bicubic, corners not aligned, for ViT, DeiT, DINOv2, SigLIP and CLIP; antialiased for DINOv2 with registers;
    SigLIP 2's NaFlex tower: antialiased bilinear."""
    model_type = (hf_config or {}).get("model_type")
    return {"dinov2_with_registers": "bicubic", "siglip2": "bilinear_aa",
            "siglip2_vision_model": "bilinear_aa"}.get(model_type, "bicubic_noaa")


def family(keys, hf_config: dict | None = None) -> str | None:
    """'dinov2', 'siglip' or 'clip' for such a checkpoint (by its config's model_type, else by its keys), else None."""
    if hf_config and hf_config.get("model_type") in FAMILIES:
        return FAMILIES[hf_config["model_type"]]
    keys = {k.removeprefix("dinov2.").removeprefix("vision_model."): (keys[k] if isinstance(keys, dict) else None)
            for k in keys}
    if "encoder.layer.0.layer_scale1.lambda1" in keys:
        return "dinov2"
    # (transformers 5.24 writes AltCLIPModel's vision blocks as `encoder.layer.N`, and reads them back)
    if "embeddings.patch_embedding.weight" in keys and ({"encoder.layers.0.self_attn.q_proj.weight",
                                                          "encoder.layer.0.self_attn.q_proj.weight"} & set(keys)):
        if "embeddings.class_embedding" in keys:
            return "clip"
        w = keys.get("embeddings.patch_embedding.weight") if isinstance(keys, dict) else None
        return "siglip2" if w is not None and w.ndim == 2 else "siglip"
    return None


def _vision_config(hf_config: dict | None) -> dict:
    c = dict(hf_config or {})
    return c.get("vision_config") or c  # a two-tower config.json nests the vision tower's


# ---- the layout tables (`layouts`): transformers' names <-> vitkit's, read forwards by to_vitkit, backwards by
# from_vitkit ------------------------------------------------------------------------------------------------------
# the text tower of a two-tower checkpoint, and position ids (buffers): not the image tower's output
OTHER_TOWER_RULES = (
    Rule("text_model.{*}", None, top=True), Rule("text_projection.{*}", None, top=True),
    Rule("logit_scale{*}", None, top=True), Rule("logit_bias{*}", None, top=True),
    Rule("{*}position_ids", None, top=True),
)
_D = "encoder.layer.{i}."
DINOV2_RULES = (
    # Dinov2ForImageClassification reads [class token, mean patch token] concatenated, which no vitkit head does:
    # kept under its own name, so strict loading refuses it and strict=False reports it skipped
    Rule("classifier.{*}", "dinov2_classifier.{*}", top=True),
    *OTHER_TOWER_RULES,
    Rule("embeddings.mask_token", None, default=("zeros", (1, "D"))),
    Rule("embeddings.cls_token", "cls_token"),
    Rule("embeddings.register_tokens", "reg_token"),
    Rule("embeddings.position_embeddings", "pos_embed.weight"),
    Rule("embeddings.patch_embeddings.projection.{w}", "patch_embed.proj.{w}"),
    Rule("layernorm.{w}", "norm.{w}"),
    Rule(_D + "norm1.{w}", "blocks.{i}.norm1.{w}"),
    Rule(tuple(_D + f"attention.attention.{n}.{{w}}" for n in ("query", "key", "value")), "blocks.{i}.attn.qkv.{w}"),
    Rule(_D + "attention.output.dense.{w}", "blocks.{i}.attn.proj.{w}"),
    Rule(_D + "layer_scale1.lambda1", "blocks.{i}.ls1.gamma", default=("ones", ("D",))),
    Rule(_D + "norm2.{w}", "blocks.{i}.norm2.{w}"),
    Rule(_D + "mlp.fc1.{w}", "blocks.{i}.mlp.fc1.{w}", when="!swiglu"),
    Rule(_D + "mlp.fc2.{w}", "blocks.{i}.mlp.fc2.{w}", when="!swiglu"),
    # SwiGLU packs the gate's rows and the value's in one Linear, gate first
    Rule(_D + "mlp.weights_in.{w}", ("blocks.{i}.mlp.fc1_g.{w}", "blocks.{i}.mlp.fc1_x.{w}"), when="swiglu"),
    Rule(_D + "mlp.weights_out.{w}", "blocks.{i}.mlp.fc2.{w}", when="swiglu"),
    Rule(_D + "layer_scale2.lambda1", "blocks.{i}.ls2.gamma", default=("ones", ("D",))),
)
_C = "encoder.layers.{i}."
CLIP_BLOCK_RULES = (
    Rule(_C + "layer_norm1.{w}", "blocks.{i}.norm1.{w}"),
    Rule(tuple(_C + f"self_attn.{n}_proj.{{w}}" for n in "qkv"), "blocks.{i}.attn.qkv.{w}"),
    Rule(_C + "self_attn.out_proj.{w}", "blocks.{i}.attn.proj.{w}"),
    Rule(_C + "layer_norm2.{w}", "blocks.{i}.norm2.{w}"),
    Rule(_C + "mlp.fc1.{w}", "blocks.{i}.mlp.fc1.{w}"),
    Rule(_C + "mlp.fc2.{w}", "blocks.{i}.mlp.fc2.{w}"),
)
# SiglipForImageClassification and CLIPForImageClassification (flag "classifier") classify the mean of the tower's
# tokens, not its pooled output: SigLIP's after `post_layernorm` (vitkit's "gap"), CLIP's patch tokens before it
# (vitkit's "gap" with no final norm). What the logits do not read is left unused: SigLIP's attention pooling, CLIP's
# `post_layernorm`.
SIGLIP_RULES = (
    Rule("classifier.{*}", "head.{*}", top=True, when="classifier"),
    *OTHER_TOWER_RULES,
    Rule("head.{*}", None, when="classifier"),
    Rule("embeddings.mask_token", None),
    Rule("embeddings.patch_embedding.{w}", "patch_embed.proj.{w}"),
    Rule("embeddings.position_embedding.weight", "pos_embed.weight", transform="embedding"),
    *CLIP_BLOCK_RULES,
    Rule("post_layernorm.{w}", "norm.{w}"),
    # the MAP head: a learned query (`probe`) and an nn.MultiheadAttention whose in_proj stacks q, k, v
    Rule("head.probe", "attn_pool.latent"),
    Rule("head.attention.in_proj_{w}", ("attn_pool.q.{w}", "attn_pool.kv.{w}"), sizes=(1, 2)),
    Rule("head.attention.out_proj.{w}", "attn_pool.proj.{w}"),
    Rule("head.layernorm.{w}", "attn_pool.norm.{w}"),
    Rule("head.mlp.fc1.{w}", "attn_pool.mlp.fc1.{w}"),
    Rule("head.mlp.fc2.{w}", "attn_pool.mlp.fc2.{w}"),
)
SIGLIP2_RULES = (
    Rule("classifier.{*}", top=True, refuse="transformers' siglip2 image classifier ({key!r}) is not one vitkit reads "
                                             "yet: load the vision tower alone"),
    Rule("embeddings.patch_embedding.weight", "patch_embed.proj.weight", transform="linear_patches"),
    *SIGLIP_RULES,
)
CLIP_RULES = (
    Rule("classifier.{*}", "head.{*}", top=True, when="classifier"),
    *OTHER_TOWER_RULES,
    # the joint embedding (CLIPVisionModelWithProjection, CLIPModel): vitkit's head, its bias zero
    Rule("visual_projection.weight", "head.weight", top=True, when="!classifier"),
    Rule(None, "head.bias", fill="zeros_rows", like="head.weight",
         why="CLIP's visual_projection has no bias: this model's head bias is not zero"),
    Rule("visual_projection.bias", "head.bias", top=True, when="!classifier", export=False),
    Rule("post_layernorm.{*}", None, when="classifier"),
    Rule("embeddings.mask_token", None),
    Rule("embeddings.class_embedding", "cls_token", transform="class_vector"),
    Rule("embeddings.patch_embedding.{w}", "patch_embed.proj.{w}"),
    Rule("embeddings.position_embedding.weight", "pos_embed.weight", transform="embedding"),
    Rule("pre_layrnorm.{w}", "norm_pre.{w}"),  # (sic)
    *CLIP_BLOCK_RULES,
    Rule("post_layernorm.{w}", "norm.{w}"),
)
_PREFIXES = ("vision_model.", "dinov2.")  # CLIPModel/SiglipModel's vision half; Dinov2ForImageClassification
# (transformers 5.24 writes AltCLIPModel's vision blocks as `encoder.layer.N`, and reads them back)
_ALIASES = (("encoder.layer.", "encoder.layers."),)
LAYOUTS = {
    "dinov2": Layout("dinov2", DINOV2_RULES, prefixes=_PREFIXES, incomplete=QKV_INCOMPLETE),
    "siglip": Layout("siglip", SIGLIP_RULES, prefixes=_PREFIXES, aliases=_ALIASES, incomplete=QKV_INCOMPLETE),
    "siglip2": Layout("siglip2", SIGLIP2_RULES, prefixes=_PREFIXES, aliases=_ALIASES, incomplete=QKV_INCOMPLETE),
    "clip": Layout("clip", CLIP_RULES, prefixes=_PREFIXES, aliases=_ALIASES, incomplete=QKV_INCOMPLETE),
}


def table(w, hf_config: dict | None = None) -> tuple[Layout, frozenset[str], dict]:
    """The layout table these tensors are read by; its variant flags: "classifier" (an image classifier on the
    tower), "swiglu" (DINOv2's packed SwiGLU MLP); and what its reshapes need (SigLIP 2's channels)."""
    variant = ({"classifier"} if "classifier.weight" in w else set()) | (
        {"swiglu"} if any(".mlp.weights_in." in k for k in w) else set())
    return (LAYOUTS[family(w, hf_config)], frozenset(variant),
            {"in_chans": _vision_config(hf_config).get("num_channels", 3),
             "patch_size": _vision_config(hf_config).get("patch_size")})


def to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A transformers DINOv2, SigLIP or CLIP vision tower's tensors (and config.json) -> (vitkit state dict, facts,
    unused keys)."""
    fam = family(w, hf_config)
    if fam is None:
        raise CheckpointError("not a DINOv2, SigLIP or CLIP vision tower (transformers names)")
    c = _vision_config(hf_config)
    layout, variant, ctx = table(w, hf_config)
    sd, unused = read(layout, w, variant, ctx)
    classifier = fam in ("siglip", "clip") and "classifier" in variant
    if fam == "dinov2" and "reg_token" in sd:  # registers go in after the position embedding: fold the class token's
        pe = sd.pop("pos_embed.weight")
        sd["cls_token"], sd["pos_embed.weight"] = sd["cls_token"] + pe[:, :1], pe[:, 1:]
    facts: dict = {"norm_eps": c.get("layer_norm_eps", 1e-5 if fam == "clip" else 1e-6),
                   "act": {"clip": "quick_gelu", "siglip": "gelu_tanh", "siglip2": "gelu_tanh"}.get(fam, "gelu"),
                   "pos_resample": pos_resample(hf_config)}
    if fam == "siglip2":  # NaFlex: any size, the 16x16 (num_patches) grid resampled per image, antialiased bilinear
        facts.update(naflex=True, dynamic_img_size=True, pos_resample="bilinear_aa", no_embed_class=True)
        n = sd["pos_embed.weight"].shape[1]
        side = round(n ** 0.5)
        if side * side != n:
            raise CheckpointError(f"SigLIP 2 position embedding of {n} entries is not a square grid")
        facts["img_size"] = side * sd["patch_embed.proj.weight"].shape[-1]
    if "reg_token" in sd:
        facts["no_embed_class"] = True
    act = c.get("hidden_act")
    if act is not None:
        if act not in _ACT:
            raise CheckpointError(f"unsupported Hugging Face hidden_act {act!r}")
        facts["act"] = _ACT[act]
    if "num_attention_heads" in c:
        facts["num_heads"] = c["num_attention_heads"]
    if fam in ("siglip", "siglip2") and "attn_pool.latent" not in sd:
        facts["classifier"] = "gap"  # vision_use_head=False: no pooled output in transformers; vitkit averages
    if classifier:
        facts["classifier"] = "gap"
    if "image_size" in c and fam != "siglip2":
        facts["img_size"] = c["image_size"]
    return sd, facts, unused


def from_vitkit(sd: dict[str, torch.Tensor], c, fam: str) -> tuple[dict[str, torch.Tensor], dict]:
    """vitkit weights -> a transformers vision tower of family `fam` ('dinov2', 'siglip', 'clip') and its config.json,
    or a CheckpointError naming what that model class cannot hold."""
    fails = []
    if c.hybrid_layers is not None or c.distilled or c.mpp or c.representation_size or c.pos_embed != "learned_1d":
        fails.append("a hybrid, a distillation token, an MPP head, a pre-logits layer or a position embedding other "
                     "than learned 1-D")
    if c.qk_norm or c.attn_norm or c.mlp_norm or c.rope or not c.qkv_bias:
        fails.append("qk-norm, norms inside attention or the MLP, rotary embeddings or no qkv bias")
    want = {"dinov2": dict(classifier="token", class_token=True, pre_norm=False, patch_bias=True),
            "siglip": dict(classifier="map", class_token=False, pre_norm=False, patch_bias=True, init_values=None,
                           reg_tokens=0, mlp_layer="mlp"),
            "clip": dict(classifier="token", class_token=True, pre_norm=True, patch_bias=False, init_values=None,
                         reg_tokens=0, no_embed_class=False, mlp_layer="mlp")}[fam]
    fails += [f"{k}={getattr(c, k)!r} (the {fam} tower has {v!r})" for k, v in want.items() if getattr(c, k) != v]
    if c.num_classes:
        fails.append(f"a classifier head ({c.num_classes} classes): transformers' {fam} vision model has none "
                     f"(model.reset_classifier(0) first, or export to vitkit or timm)")
    if fam == "dinov2" and c.act != "gelu" and c.mlp_layer == "mlp":
        fails.append(f"act {c.act!r} (export keeps exact GELU only)")
    if not fails:  # the biases and the final norm every tower has (the table writes what the model holds)
        fails = [f"{k}=False (the {fam} tower has True)" for k in ("proj_bias", "final_norm") if not getattr(c, k)]
    if fails:
        raise CheckpointError(f"a Hugging Face {fam} vision tower cannot hold this model: " + "; ".join(fails))
    d, sd = c.embed_dim, dict(sd)
    if fam == "dinov2" and c.no_embed_class:
        if not c.reg_tokens:
            raise CheckpointError("transformers' Dinov2Model adds a position to the class token; this model "
                                  "(no_embed_class without registers, DeiT-III style) exports to timm instead")
        # transformers adds a position to the class token: give it none (zeros)
        sd["pos_embed.weight"] = torch.cat([torch.zeros_like(sd["cls_token"]), sd["pos_embed.weight"]], dim=1)
    out, _ = write(LAYOUTS[fam], sd, {"swiglu"} if c.mlp_layer == "swiglu" else (), {"D": d, "depth": c.depth})
    hf_act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}[c.act]
    size = c.img_size[0] if c.img_size[0] == c.img_size[1] else None
    if size is None or c.patch_size[0] != c.patch_size[1]:
        raise CheckpointError("transformers' vision towers take square images and patches")
    base = {"hidden_size": d, "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "image_size": size,
            "patch_size": c.patch_size[0], "num_channels": c.in_chans, "layer_norm_eps": c.norm_eps, "hidden_act": hf_act}
    if fam == "dinov2":
        # transformers' Dinov2Config holds an integer mlp_ratio; SwiGLU's width is derived from it
        if c.mlp_layer == "swiglu":
            ratio = next((r for r in range(1, 17) if (int(d * r) * 2 // 3 + 7) // 8 * 8 == c.mlp_dim), None)
        else:
            ratio = c.mlp_dim // d if c.mlp_dim % d == 0 else None
        if ratio is None:
            raise CheckpointError(f"transformers' Dinov2Config derives the MLP width from an integer mlp_ratio: "
                                  f"none gives {c.mlp_dim} at width {d}")
        model_type = "dinov2_with_registers" if c.reg_tokens else "dinov2"
        cfg = {**base, "model_type": model_type, "mlp_ratio": ratio, "qkv_bias": True,
               "architectures": ["Dinov2WithRegistersModel" if c.reg_tokens else "Dinov2Model"],
               "use_swiglu_ffn": c.mlp_layer == "swiglu", "layerscale_value": 1.0}
        if c.reg_tokens:
            cfg["num_register_tokens"] = c.reg_tokens
    else:
        cfg = {**base, "intermediate_size": c.mlp_dim, "model_type": f"{fam}_vision_model",
               "architectures": ["SiglipVisionModel" if fam == "siglip" else "CLIPVisionModel"]}
        if fam == "siglip":
            cfg["vision_use_head"] = True
    return out, cfg
