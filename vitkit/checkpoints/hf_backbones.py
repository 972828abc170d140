"""Hugging Face transformers' 2025 vision backbones <-> vitkit names: DINOv3 (`DINOv3ViTModel`, and the weights of
`DINOv3ViTBackbone`) and AIMv2 (`Aimv2VisionModel`).

- DINOv3: `embeddings.{cls_token, register_tokens, patch_embeddings}`, then `layer.N.{norm1, attention.{q,k,v,o}_proj,
  layer_scale1.lambda1, norm2, mlp.{up,down}_proj | mlp.{gate,up,down}_proj, layer_scale2.lambda1}` and `norm`. The
  rotary embedding (a buffer) is DINOv3's: vitkit's rope="dinov3" with the config's `rope_theta`. `pooler_output` is
  the class token after the norm (vitkit's classifier "token" with no head).
- AIMv2: `embeddings.{patch_embed, rms_norm, position_embedding}`, `encoder.layers.N.{rms_norm1, attention.{q,k,v,
  out}_proj, rms_norm2, ffn.{gate,up,down}_proj}`, `rms_norm`; with `use_head`, an attention pooling whose query is
  the learned `head.cls_token` itself (no query projection, no MLP): vitkit's attention pooling with an identity query
  projection and `pool_mlp_dim=0`. The native-resolution variant's sin-cos positions (`is_native`) are refused. The
  two-tower `Aimv2Model`'s `visual_projection` (no bias) is vitkit's head, its bias zero: `model(x)` is transformers'
  `get_image_features`, before the two-tower model divides it by its norm; the text tower is left unused.
"""
from __future__ import annotations

import torch

from .hf_vision import OTHER_TOWER_RULES, _vision_config
from .io import CheckpointError
from .layouts import QKV_INCOMPLETE, Layout, Rule, read, write

FAMILIES = {"dinov3_vit": "dinov3", "aimv2_vision_model": "aimv2", "aimv2": "aimv2"}


def family(keys, hf_config: dict | None = None) -> str | None:
    """'dinov3' or 'aimv2' for such a checkpoint (by its config's model_type, else by its keys), else None."""
    if hf_config and hf_config.get("model_type") in FAMILIES:
        return FAMILIES[hf_config["model_type"]]
    keys = {k.removeprefix("vision_model.") for k in keys}
    if "embeddings.patch_embeddings.weight" in keys and "layer.0.layer_scale1.lambda1" in keys:
        return "dinov3"
    if "embeddings.rms_norm.weight" in keys and "encoder.layers.0.ffn.gate_proj.weight" in keys:
        return "aimv2"
    return None


# ---- the layout tables (`layouts`): transformers' names <-> vitkit's, read forwards by to_vitkit, backwards by
# from_vitkit ------------------------------------------------------------------------------------------------------
_L = "layer.{i}."
DINOV3_RULES = (
    *OTHER_TOWER_RULES,
    Rule("embeddings.mask_token", None, default=("zeros", (1, 1, "D"))),
    Rule("embeddings.cls_token", "cls_token"),
    Rule("embeddings.register_tokens", "reg_token"),
    Rule("embeddings.patch_embeddings.{w}", "patch_embed.proj.{w}"),
    Rule(_L + "norm1.{w}", "blocks.{i}.norm1.{w}"),
    Rule(tuple(_L + f"attention.{n}_proj.weight" for n in "qkv"), "blocks.{i}.attn.qkv.weight"),
    # no key bias (key_bias=False): the query's and value's biases are vitkit's q_bias, v_bias (k_bias=False)
    Rule(tuple(_L + f"attention.{n}_proj.bias" for n in "qkv"), "blocks.{i}.attn.qkv.bias",
         partial=("blocks.{i}.attn.q_bias", None, "blocks.{i}.attn.v_bias")),
    Rule(_L + "attention.o_proj.{w}", "blocks.{i}.attn.proj.{w}"),
    Rule(_L + "layer_scale1.lambda1", "blocks.{i}.ls1.gamma", default=("ones", ("D",))),
    Rule(_L + "norm2.{w}", "blocks.{i}.norm2.{w}"),
    # use_gated_mlp (flag "gated"): SiLU(gate) * up; else up is the MLP's first Linear
    Rule(_L + "mlp.gate_proj.{w}", "blocks.{i}.mlp.fc1_g.{w}"),
    Rule(_L + "mlp.up_proj.{w}", "blocks.{i}.mlp.fc1_x.{w}", when="gated"),
    Rule(_L + "mlp.up_proj.{w}", "blocks.{i}.mlp.fc1.{w}", when="!gated"),
    Rule(_L + "mlp.down_proj.{w}", "blocks.{i}.mlp.fc2.{w}"),
    Rule(_L + "layer_scale2.lambda1", "blocks.{i}.ls2.gamma", default=("ones", ("D",))),
    Rule("norm.{w}", "norm.{w}"),
)
_A = "encoder.layers.{i}."
_IDENTITY_QUERY = "AIMv2's pooling uses its query as it is: this model's query projection is not the identity"
AIMV2_RULES = (
    *OTHER_TOWER_RULES,
    # Aimv2Model's joint embedding: vitkit's head, its bias zero
    Rule("visual_projection.weight", "head.weight", top=True),
    Rule(None, "head.bias", fill="zeros_rows", like="head.weight",
         why="AIMv2's visual_projection has no bias: this model's head bias is not zero"),
    Rule("embeddings.mask_token", None),
    Rule("embeddings.patch_embed.{w}", "patch_embed.proj.{w}"),
    Rule("embeddings.rms_norm.weight", "patch_embed.norm.weight"),
    Rule("embeddings.position_embedding.weight", "pos_embed.weight", transform="embedding"),
    Rule(_A + "rms_norm1.{w}", "blocks.{i}.norm1.{w}"),
    Rule(tuple(_A + f"attention.{n}_proj.{{w}}" for n in "qkv"), "blocks.{i}.attn.qkv.{w}"),
    Rule(_A + "attention.out_proj.{w}", "blocks.{i}.attn.proj.{w}"),
    Rule(_A + "rms_norm2.{w}", "blocks.{i}.norm2.{w}"),
    Rule(_A + "ffn.gate_proj.{w}", "blocks.{i}.mlp.fc1_g.{w}"),
    Rule(_A + "ffn.up_proj.{w}", "blocks.{i}.mlp.fc1_x.{w}"),
    Rule(_A + "ffn.down_proj.{w}", "blocks.{i}.mlp.fc2.{w}"),
    Rule("rms_norm.{w}", "norm.{w}"),
    # the attention pooling: the learned query is used as it is (an identity query projection), k and v in one Linear
    Rule("head.cls_token", "attn_pool.latent"),
    Rule(None, "attn_pool.q.weight", fill="eye_last", like="attn_pool.latent", why=_IDENTITY_QUERY),
    Rule(None, "attn_pool.q.bias", fill="zeros_last", like="attn_pool.latent", why=_IDENTITY_QUERY),
    Rule(("head.k_proj.weight", "head.v_proj.weight"), "attn_pool.kv.weight"),
    # the k and v biases with qkv_bias (flag "qkv_bias"), else none: zero
    Rule(("head.k_proj.bias", "head.v_proj.bias"), "attn_pool.kv.bias", when="qkv_bias"),
    Rule(None, "attn_pool.kv.bias", fill="zeros_rows", like="attn_pool.kv.weight", when="!qkv_bias",
         why="AIMv2's pooling has no key and value biases (qkv_bias=False): these are not zero"),
    Rule("head.output_proj.{w}", "attn_pool.proj.{w}"),
)
LAYOUTS = {"dinov3": Layout("dinov3", DINOV3_RULES, prefixes=("vision_model.",), incomplete=QKV_INCOMPLETE),
           "aimv2": Layout("aimv2", AIMV2_RULES, prefixes=("vision_model.",), incomplete=QKV_INCOMPLETE)}


def table(w, hf_config: dict | None = None) -> tuple[Layout, frozenset[str], dict]:
    """The layout table these tensors are read by, its variant flags ("gated": DINOv3's use_gated_mlp, from
    config.json or else the keys; "qkv_bias": AIMv2's pooling has k and v biases) and what its reshapes need
    (nothing)."""
    gated = _vision_config(hf_config).get("use_gated_mlp", "layer.0.mlp.gate_proj.weight" in w)
    variant = ({"gated"} if gated else set()) | ({"qkv_bias"} if any(k.endswith("head.k_proj.bias") for k in w)
                                                 else set())
    return LAYOUTS[family(w, hf_config)], frozenset(variant), {}


def to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """A transformers DINOv3 or AIMv2 model's tensors (and config.json) -> (vitkit state dict, facts, unused keys)."""
    fam = family(w, hf_config)
    if fam is None:
        raise CheckpointError("not a DINOv3 or AIMv2 vision tower (transformers names)")
    c = _vision_config(hf_config)
    layout, variant, ctx = table(w, hf_config)
    sd, unused = read(layout, w, variant, ctx)
    gated = "gated" in variant
    facts: dict = {} if "head.weight" in sd else {"num_classes": 0}
    if "num_attention_heads" in c:
        facts["num_heads"] = c["num_attention_heads"]
    if "image_size" in c:
        facts["img_size"] = c["image_size"]
    if fam == "dinov3":
        facts.setdefault("img_size", 224)  # DINOv3ViTConfig's default; any size runs (no position table)
        act = c.get("hidden_act", "silu" if gated else "gelu")  # (a bare file: the gated MLP is SiLU's)
        if act != ("silu" if gated else "gelu"):
            raise CheckpointError(f"DINOv3 with hidden_act {act!r} and use_gated_mlp={gated}: vitkit has GELU MLPs "
                                  f"and SiLU-gated ones")
        facts.update(rope="dinov3", rope_temperature=float(c.get("rope_theta", 100.0)), rope_half=True,
                     pos_embed="none", dynamic_img_size=True, norm_eps=c.get("layer_norm_eps", 1e-5),
                     classifier="token", k_bias=False, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                     interpolation="bicubic", crop_pct=1.0)
        if c.get("key_bias"):
            raise CheckpointError("DINOv3 with a key bias (key_bias=True): vitkit's DINOv3 has none")
    else:
        if c.get("is_native"):
            raise CheckpointError("AIMv2's native-resolution tower (is_native=True) adds sin-cos positions in MAE's "
                                  "[width | height] layout, which vitkit does not implement; the fixed-size towers "
                                  "load")
        if c.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"AIMv2 with hidden_act {c['hidden_act']!r}: vitkit's SwiGLU gates with SiLU")
        if bool(c.get("qkv_bias", False)) != bool(c.get("mlp_bias", False)):
            raise CheckpointError("AIMv2 with a bias on the attention but not the MLP (or the reverse): vitkit has "
                                  "one switch for the output projections (proj_bias)")
        facts.update(norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-5), patch_norm=True, class_token=False,
                     mlp_layer="swiglu", proj_bias=bool(c.get("mlp_bias", False)), act="gelu",
                     mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711),
                     interpolation="bicubic", crop_pct=1.0, pos_resample="bicubic_noaa")
        facts.update(classifier="map", pool_mlp_dim=0) if "attn_pool.latent" in sd else facts.update(classifier="gap")
    return sd, facts, unused


def from_vitkit(sd: dict[str, torch.Tensor], c, fam: str) -> tuple[dict[str, torch.Tensor], dict]:
    """vitkit weights -> `DINOv3ViTModel` ('dinov3') or `Aimv2VisionModel` ('aimv2') and its config.json, or a
    CheckpointError naming what that class cannot hold."""
    fails = []
    if c.num_classes:
        fails.append(f"a classifier head ({c.num_classes} classes): model.reset_classifier(0) first, or export to timm")
    if c.img_size[0] != c.img_size[1] or c.patch_size[0] != c.patch_size[1]:
        fails.append("a non-square image or patch size")
    if fam == "dinov3":
        want = dict(rope="dinov3", rope_half=True, pos_embed="none", class_token=True, norm="layernorm",
                    patch_norm=False, proj_bias=True, final_norm=True, pre_norm=False, patch_bias=True, k_bias=False,
                    qk_norm=False, attn_norm=False, mlp_norm=False, classifier="token", act="gelu")
        if not c.qkv_bias:
            want.pop("k_bias")
    else:
        want = dict(rope=None, pos_embed="learned_1d", class_token=False, norm="rmsnorm", patch_norm=True,
                    mlp_layer="swiglu", final_norm=True, pre_norm=False, patch_bias=True, qk_norm=False,
                    attn_norm=False, mlp_norm=False, init_values=None, reg_tokens=0)
        if c.classifier == "map" and c.pool_mlp_dim != 0:
            fails.append("an attention pooling with an MLP (AIMv2's has none)")
        elif c.classifier not in ("map", "gap"):
            fails.append(f"classifier {c.classifier!r}")
        if c.qkv_bias != c.proj_bias:
            fails.append("a qkv bias without output biases, or the reverse (AIMv2 has one switch)")
    fails += [f"{k}={getattr(c, k)!r} (the {fam} tower has {v!r})" for k, v in want.items() if getattr(c, k) != v]
    if c.hybrid_layers is not None or c.distilled or c.mpp or c.representation_size:
        fails.append("a hybrid, a distillation token, an MPP head or a pre-logits layer")
    if fails:
        raise CheckpointError(f"a Hugging Face {fam} vision tower cannot hold this model: " + "; ".join(fails))
    d = c.embed_dim
    variant = {"gated"} if c.mlp_layer == "swiglu" else {"qkv_bias"} if fam == "aimv2" and c.qkv_bias else set()
    out, _ = write(LAYOUTS[fam], sd, variant, {"D": d, "depth": c.depth})
    if fam == "dinov3":
        gated = c.mlp_layer == "swiglu"
        cfg = {"model_type": "dinov3_vit", "architectures": ["DINOv3ViTModel"], "hidden_size": d,
               "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
               "image_size": c.img_size[0], "patch_size": c.patch_size[0], "num_channels": c.in_chans,
               "layer_norm_eps": float(c.norm_eps), "rope_theta": float(c.rope_temperature), "num_register_tokens": c.reg_tokens,
               "layerscale_value": float(c.init_values or 1.0), "query_bias": c.qkv_bias, "key_bias": False,
               "value_bias": c.qkv_bias, "proj_bias": True, "mlp_bias": True, "use_gated_mlp": gated,
               "hidden_act": "silu" if gated else "gelu"}
        return out, cfg
    cfg = {"model_type": "aimv2_vision_model", "architectures": ["Aimv2VisionModel"], "hidden_size": d,
           "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
           "image_size": c.img_size[0], "patch_size": c.patch_size[0], "num_channels": c.in_chans,
           "rms_norm_eps": float(c.norm_eps), "qkv_bias": c.qkv_bias, "mlp_bias": c.proj_bias, "hidden_act": "silu",
           "use_head": c.classifier == "map", "is_native": False}
    return out, cfg
