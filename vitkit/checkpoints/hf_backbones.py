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

import re

import torch

from .hf_vision import _vision_config
from .io import CheckpointError, fuse

FAMILIES = {"dinov3_vit": "dinov3", "aimv2_vision_model": "aimv2", "aimv2": "aimv2"}
_OTHER_TOWER = ("text_model.", "text_projection.", "logit_scale")


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


_DINOV3_BLOCK = {"norm1": "norm1", "norm2": "norm2", "attention.o_proj": "attn.proj", "mlp.down_proj": "mlp.fc2",
                 "layer_scale1": "ls1", "layer_scale2": "ls2"}
_AIMV2_BLOCK = {"rms_norm1": "norm1", "rms_norm2": "norm2", "attention.out_proj": "attn.proj",
                "ffn.gate_proj": "mlp.fc1_g", "ffn.up_proj": "mlp.fc1_x", "ffn.down_proj": "mlp.fc2"}


def to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    fam = family(w, hf_config)
    if fam is None:
        raise CheckpointError("not a DINOv3 or AIMv2 vision tower (transformers names)")
    c = _vision_config(hf_config)
    gated = c.get("use_gated_mlp", "layer.0.mlp.gate_proj.weight" in w)
    sd, qkv, unused = {}, {}, []
    for k, v in w.items():
        if k.startswith(_OTHER_TOWER) or k.endswith("position_ids"):
            unused.append(k)
            continue
        if k == "visual_projection.weight" and fam == "aimv2":  # Aimv2Model's joint embedding: vitkit's head
            sd["head.weight"], sd["head.bias"] = v, torch.zeros(v.shape[0], dtype=v.dtype)
            continue
        key = k.removeprefix("vision_model.")
        if m := re.match(r"(?:encoder\.layers|layer)\.(\d+)\.(.+)\.(weight|bias|lambda1)$", key):
            i, mod, leaf = m.groups()
            if mod in ("attention.q_proj", "attention.k_proj", "attention.v_proj"):
                qkv[(int(i), leaf, mod[-6])] = v
            elif fam == "dinov3" and mod == "mlp.up_proj":  # the value half of the gated MLP, or the first Linear
                sd[f"blocks.{i}.mlp.{'fc1_x' if gated else 'fc1'}.{leaf}"] = v
            elif fam == "dinov3" and mod == "mlp.gate_proj":
                sd[f"blocks.{i}.mlp.fc1_g.{leaf}"] = v
            elif mod in (_DINOV3_BLOCK if fam == "dinov3" else _AIMV2_BLOCK):
                ours = (_DINOV3_BLOCK if fam == "dinov3" else _AIMV2_BLOCK)[mod]
                sd[f"blocks.{i}.{ours}.{'gamma' if leaf == 'lambda1' else leaf}"] = v
            else:
                raise CheckpointError(f"unexpected Hugging Face {fam} key {k!r}")
        elif key in ("embeddings.mask_token",):
            unused.append(k)
        elif key == "embeddings.cls_token":
            sd["cls_token"] = v
        elif key == "embeddings.register_tokens":
            sd["reg_token"] = v
        elif m := re.match(r"embeddings\.(?:patch_embeddings|patch_embed)\.(weight|bias)$", key):
            sd[f"patch_embed.proj.{m.group(1)}"] = v
        elif key == "embeddings.rms_norm.weight":
            sd["patch_embed.norm.weight"] = v
        elif key == "embeddings.position_embedding.weight":
            sd["pos_embed.weight"] = v[None]  # nn.Embedding (N, D) -> (1, N, D)
        elif m := re.match(r"(norm|rms_norm)\.(weight|bias)$", key):
            sd[f"norm.{m.group(2)}"] = v
        elif key == "head.cls_token":  # AIMv2's pooling: the learned query is used as it is
            sd["attn_pool.latent"] = v
            sd["attn_pool.q.weight"] = torch.eye(v.shape[-1], dtype=v.dtype)
            sd["attn_pool.q.bias"] = torch.zeros(v.shape[-1], dtype=v.dtype)
        elif m := re.match(r"head\.(k_proj|v_proj|output_proj)\.(weight|bias)$", key):
            ours = "proj" if m.group(1) == "output_proj" else m.group(1)
            sd[f"attn_pool.{ours}.{m.group(2)}"] = v
        else:
            raise CheckpointError(f"unexpected Hugging Face {fam} key {k!r}")
    for i, leaf in sorted({(i, leaf) for i, leaf, _ in qkv}):
        got = {n: qkv.get((i, leaf, n)) for n in "qkv"}
        if leaf == "bias" and got["k"] is None and fam == "dinov3":  # DINOv3: no key bias (vitkit's k_bias=False)
            sd[f"blocks.{i}.attn.q_bias"], sd[f"blocks.{i}.attn.v_bias"] = got["q"], got["v"]
            continue
        if any(t is None for t in got.values()):
            raise CheckpointError(f"layer {i}: the query, key and value projections differ in having a {leaf}")
        sd[f"blocks.{i}.attn.qkv.{leaf}"] = fuse({f"layer.{i}.attention.{n}_proj.{leaf}": got[n] for n in "qkv"})
    if "attn_pool.k_proj.weight" in sd:  # k and v -> one kv Linear; absent biases are zero
        d = sd["attn_pool.k_proj.weight"].shape[0]
        kw, vw = sd.pop("attn_pool.k_proj.weight"), sd.pop("attn_pool.v_proj.weight")
        kb, vb = sd.pop("attn_pool.k_proj.bias", torch.zeros(d)), sd.pop("attn_pool.v_proj.bias", torch.zeros(d))
        sd["attn_pool.kv.weight"] = fuse({"k_proj.weight": kw, "v_proj.weight": vw})
        sd["attn_pool.kv.bias"] = fuse({"k_proj.bias": kb, "v_proj.bias": vb})
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
    d, out = c.embed_dim, {}
    for i in range(c.depth):
        b = f"blocks.{i}."
        q, k, v = sd[b + "attn.qkv.weight"].chunk(3)
        p = f"layer.{i}." if fam == "dinov3" else f"encoder.layers.{i}."
        out[p + "attention.q_proj.weight"], out[p + "attention.k_proj.weight"], out[p + "attention.v_proj.weight"] = q, k, v
        if b + "attn.q_bias" in sd:
            out[p + "attention.q_proj.bias"], out[p + "attention.v_proj.bias"] = sd[b + "attn.q_bias"], sd[b + "attn.v_bias"]
        elif b + "attn.qkv.bias" in sd:
            qb, _, vb = sd[b + "attn.qkv.bias"].chunk(3)
            out[p + "attention.q_proj.bias"], out[p + "attention.v_proj.bias"] = qb, vb
            if fam == "aimv2":
                out[p + "attention.k_proj.bias"] = sd[b + "attn.qkv.bias"].chunk(3)[1]
        names = dict(_DINOV3_BLOCK if fam == "dinov3" else _AIMV2_BLOCK)
        if fam == "dinov3":
            names.update({"mlp.up_proj": "mlp.fc1_x", "mlp.gate_proj": "mlp.fc1_g"} if c.mlp_layer == "swiglu"
                         else {"mlp.up_proj": "mlp.fc1"})
        for theirs, ours in names.items():
            for leaf in ("weight", "bias", "gamma"):
                if b + f"{ours}.{leaf}" in sd:
                    out[p + f"{theirs}.{'lambda1' if leaf == 'gamma' else leaf}"] = sd[b + f"{ours}.{leaf}"]
    if fam == "dinov3":
        out.update({"embeddings.cls_token": sd["cls_token"], "embeddings.mask_token": torch.zeros(1, 1, d),
                    "embeddings.patch_embeddings.weight": sd["patch_embed.proj.weight"],
                    "embeddings.patch_embeddings.bias": sd["patch_embed.proj.bias"],
                    "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]})
        if c.reg_tokens:
            out["embeddings.register_tokens"] = sd["reg_token"]
        gated = c.mlp_layer == "swiglu"
        cfg = {"model_type": "dinov3_vit", "architectures": ["DINOv3ViTModel"], "hidden_size": d,
               "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
               "image_size": c.img_size[0], "patch_size": c.patch_size[0], "num_channels": c.in_chans,
               "layer_norm_eps": float(c.norm_eps), "rope_theta": float(c.rope_temperature), "num_register_tokens": c.reg_tokens,
               "layerscale_value": float(c.init_values or 1.0), "query_bias": c.qkv_bias, "key_bias": False,
               "value_bias": c.qkv_bias, "proj_bias": True, "mlp_bias": True, "use_gated_mlp": gated,
               "hidden_act": "silu" if gated else "gelu"}
        if c.init_values is None:
            for i in range(c.depth):
                out[f"layer.{i}.layer_scale1.lambda1"] = out[f"layer.{i}.layer_scale2.lambda1"] = torch.ones(d)
        return out, cfg
    out.update({"embeddings.patch_embed.weight": sd["patch_embed.proj.weight"],
                "embeddings.patch_embed.bias": sd["patch_embed.proj.bias"],
                "embeddings.rms_norm.weight": sd["patch_embed.norm.weight"],
                "embeddings.position_embedding.weight": sd["pos_embed.weight"][0], "rms_norm.weight": sd["norm.weight"]})
    if c.classifier == "map":
        eye = torch.eye(d, dtype=sd["attn_pool.q.weight"].dtype)
        if not (torch.equal(sd["attn_pool.q.weight"], eye) and not sd["attn_pool.q.bias"].any()):
            raise CheckpointError("AIMv2's pooling uses its query as it is: this model's query projection is not the "
                                  "identity")
        kw, vw = sd["attn_pool.kv.weight"].chunk(2)
        kb, vb = sd["attn_pool.kv.bias"].chunk(2)
        if not c.qkv_bias and (kb.any() or vb.any()):
            raise CheckpointError("AIMv2's pooling has no key and value biases (qkv_bias=False): these are not zero")
        out.update({"head.cls_token": sd["attn_pool.latent"], "head.k_proj.weight": kw, "head.v_proj.weight": vw,
                    "head.output_proj.weight": sd["attn_pool.proj.weight"], "head.output_proj.bias": sd["attn_pool.proj.bias"]})
        if c.qkv_bias:
            out["head.k_proj.bias"], out["head.v_proj.bias"] = kb, vb
    cfg = {"model_type": "aimv2_vision_model", "architectures": ["Aimv2VisionModel"], "hidden_size": d,
           "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
           "image_size": c.img_size[0], "patch_size": c.patch_size[0], "num_channels": c.in_chans,
           "rms_norm_eps": float(c.norm_eps), "qkv_bias": c.qkv_bias, "mlp_bias": c.proj_bias, "hidden_act": "silu",
           "use_head": c.classifier == "map", "is_native": False}
    return out, cfg
