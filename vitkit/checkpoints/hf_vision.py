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

import re

import torch

from .io import CheckpointError, fuse

FAMILIES = {"dinov2": "dinov2", "dinov2_with_registers": "dinov2", "siglip_vision_model": "siglip", "siglip": "siglip",
            "clip_vision_model": "clip", "clip": "clip", "siglip2_vision_model": "siglip2", "siglip2": "siglip2",
            # CLIP's layout under other names: MetaCLIP 2, AltCLIP, Chinese-CLIP, CLIPSeg (their text towers differ)
            "metaclip_2_vision_model": "clip", "metaclip_2": "clip", "altclip_vision_model": "clip", "altclip": "clip",
            "chinese_clip_vision_model": "clip", "chinese_clip": "clip", "clipseg_vision_model": "clip",
            "clipseg": "clip"}
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "quick_gelu": "quick_gelu"}
_TOWER_PREFIXES = ("vision_model.", "dinov2.", "")  # CLIPModel/SiglipModel's vision half; Dinov2ForImageClassification
_OTHER_TOWER = ("text_model.", "text_projection.", "logit_scale", "logit_bias")


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


_BLOCK = {"norm1": "norm1", "norm2": "norm2", "layer_norm1": "norm1", "layer_norm2": "norm2",
          "attention.output.dense": "attn.proj", "self_attn.out_proj": "attn.proj",
          "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "mlp.weights_out": "mlp.fc2"}
_QKV = {"attention.attention.query": "q", "attention.attention.key": "k", "attention.attention.value": "v",
        "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v"}


def to_vitkit(w: dict[str, torch.Tensor], hf_config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    fam = family(w, hf_config)
    if fam is None:
        raise CheckpointError("not a DINOv2, SigLIP or CLIP vision tower (transformers names)")
    sd, qkv, unused = {}, {}, []
    # SiglipForImageClassification and CLIPForImageClassification classify the mean of the tower's tokens, not its
    # pooled output: SigLIP's after `post_layernorm` (vitkit's "gap"), CLIP's patch tokens before it (vitkit's "gap"
    # with no final norm). What the logits do not read is left unused: SigLIP's attention pooling, CLIP's
    # `post_layernorm`.
    classifier = fam in ("siglip", "clip") and "classifier.weight" in w
    not_read = ("head.", "vision_model.head.") if fam == "siglip" else ("post_layernorm.", "vision_model.post_layernorm.")
    for k, v in w.items():
        if classifier and k.startswith(not_read):
            unused.append(k)
            continue
        if fam == "dinov2" and k.startswith("classifier."):
            # Dinov2ForImageClassification reads [class token, mean patch token] concatenated, which no vitkit head
            # does: kept under its own name, so strict loading refuses it and strict=False reports it skipped
            sd["dinov2_classifier." + k[len("classifier."):]] = v
            continue
        if k.startswith("classifier."):
            if fam not in ("siglip", "clip"):
                raise CheckpointError(f"transformers' {fam} image classifier ({k!r}) is not one vitkit reads yet: "
                                      f"load the vision tower alone")
            sd["head." + k[len("classifier."):]] = v  # the mean of the tokens, classified
            continue
        if k.startswith(_OTHER_TOWER) or k.endswith("position_ids"):
            unused.append(k)
            continue
        if k.startswith("visual_projection."):
            if fam != "clip" or k not in ("visual_projection.weight", "visual_projection.bias"):
                raise CheckpointError(f"unexpected Hugging Face {fam} key {k!r}")
            sd["head." + k[len("visual_projection."):]] = v  # the joint embedding: vitkit's head
            continue
        key = next((k[len(p):] for p in _TOWER_PREFIXES if k.startswith(p)), k)
        if m := re.match(r"encoder\.layers?\.(\d+)\.(.+)\.(weight|bias|lambda1)$", key):
            i, mod, leaf = m.groups()
            if mod in _QKV:
                qkv[(int(i), leaf, _QKV[mod])] = v
            elif mod in ("layer_scale1", "layer_scale2"):
                sd[f"blocks.{i}.ls{mod[-1]}.gamma"] = v
            elif mod == "mlp.weights_in":  # packed SwiGLU, gate rows first
                sd[f"blocks.{i}.mlp.fc1_g.{leaf}"], sd[f"blocks.{i}.mlp.fc1_x.{leaf}"] = v.chunk(2)
            elif mod in _BLOCK:
                sd[f"blocks.{i}.{_BLOCK[mod]}.{leaf}"] = v
            else:
                raise CheckpointError(f"unexpected Hugging Face {fam} key {k!r}")
        elif key == "embeddings.mask_token":
            unused.append(k)
        elif key == "embeddings.cls_token":
            sd["cls_token"] = v
        elif key == "embeddings.class_embedding":
            sd["cls_token"] = v.reshape(1, 1, -1)  # (D,) -> (1, 1, D)
        elif key == "embeddings.register_tokens":
            sd["reg_token"] = v
        elif key == "embeddings.position_embeddings":
            sd["pos_embed.weight"] = v
        elif key == "embeddings.position_embedding.weight":
            sd["pos_embed.weight"] = v[None]  # nn.Embedding (T, D) -> (1, T, D)
        elif key == "embeddings.patch_embedding.weight" and v.ndim == 2:  # SigLIP 2: a Linear over (ph, pw, C) patches
            c = _vision_config(hf_config).get("num_channels", 3)
            p = round((v.shape[1] / c) ** 0.5)
            sd["patch_embed.proj.weight"] = v.reshape(v.shape[0], p, p, c).permute(0, 3, 1, 2)  # -> (D, C, ph, pw)
        elif m := re.match(r"embeddings\.patch_embeddings?(?:\.projection)?\.(weight|bias)$", key):
            sd[f"patch_embed.proj.{m.group(1)}"] = v
        elif m := re.match(r"(layernorm|post_layernorm|pre_layrnorm)\.(weight|bias)$", key):
            sd[{"layernorm": "norm", "post_layernorm": "norm", "pre_layrnorm": "norm_pre"}[m.group(1)] + "." + m.group(2)] = v
        elif key == "head.probe":
            sd["attn_pool.latent"] = v
        elif m := re.match(r"head\.attention\.in_proj_(weight|bias)$", key):
            q, kv = v.split([v.shape[0] // 3, 2 * v.shape[0] // 3])  # rows: query, key, value
            sd[f"attn_pool.q.{m.group(1)}"], sd[f"attn_pool.kv.{m.group(1)}"] = q, kv
        elif m := re.match(r"head\.(attention\.out_proj|layernorm|mlp\.fc1|mlp\.fc2)\.(weight|bias)$", key):
            ours = {"attention.out_proj": "proj", "layernorm": "norm", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}[m.group(1)]
            sd[f"attn_pool.{ours}.{m.group(2)}"] = v
        else:
            raise CheckpointError(f"unexpected Hugging Face {fam} key {k!r}")
    for i, leaf in sorted({(i, leaf) for i, leaf, _ in qkv}):
        sd[f"blocks.{i}.attn.qkv.{leaf}"] = fuse({f"layers.{i}.{n}_proj.{leaf}": qkv[(i, leaf, n)] for n in "qkv"})
    if "head.weight" in sd and "head.bias" not in sd:  # CLIP's projection has no bias: vitkit's head, bias zero
        sd["head.bias"] = torch.zeros(sd["head.weight"].shape[0], dtype=sd["head.weight"].dtype)
    if fam == "dinov2" and "reg_token" in sd:  # registers go in after the position embedding: fold the class token's
        pe = sd.pop("pos_embed.weight")
        sd["cls_token"], sd["pos_embed.weight"] = sd["cls_token"] + pe[:, :1], pe[:, 1:]
    c = _vision_config(hf_config)
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
    if fails:
        raise CheckpointError(f"a Hugging Face {fam} vision tower cannot hold this model: " + "; ".join(fails))
    d, out = c.embed_dim, {}
    for i in range(c.depth):
        b = f"blocks.{i}."
        q, k, v = sd[b + "attn.qkv.weight"].chunk(3)
        if b + "attn.qkv.bias" in sd:
            qb, kb, vb = sd[b + "attn.qkv.bias"].chunk(3)
        else:  # k_bias=False: the key's bias is zero
            qb, vb = sd[b + "attn.q_bias"], sd[b + "attn.v_bias"]
            kb = torch.zeros_like(qb)
        if fam == "dinov2":
            p = f"encoder.layer.{i}."
            names = {"norm1": "norm1", "norm2": "norm2", "attn.proj": "attention.output.dense"}
            for n, t, tb in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
                out[p + f"attention.attention.{n}.weight"], out[p + f"attention.attention.{n}.bias"] = t, tb
            for j in (1, 2):
                out[p + f"layer_scale{j}.lambda1"] = sd.get(b + f"ls{j}.gamma", torch.ones(d))
            if c.mlp_layer == "swiglu":
                for leaf in ("weight", "bias"):
                    out[p + f"mlp.weights_in.{leaf}"] = torch.cat([sd[b + f"mlp.fc1_g.{leaf}"], sd[b + f"mlp.fc1_x.{leaf}"]])
                    out[p + f"mlp.weights_out.{leaf}"] = sd[b + f"mlp.fc2.{leaf}"]
            else:
                names.update({"mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"})
        else:
            p = f"encoder.layers.{i}."
            names = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
                     "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
            for n, t, tb in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
                out[p + f"self_attn.{n}_proj.weight"], out[p + f"self_attn.{n}_proj.bias"] = t, tb
        for ours, theirs in names.items():
            for leaf in ("weight", "bias"):
                out[p + f"{theirs}.{leaf}"] = sd[b + f"{ours}.{leaf}"]
    pe = sd["pos_embed.weight"]
    if fam == "dinov2":
        cls = sd["cls_token"]
        if c.no_embed_class and not c.reg_tokens:
            raise CheckpointError("transformers' Dinov2Model adds a position to the class token; this model "
                                  "(no_embed_class without registers, DeiT-III style) exports to timm instead")
        if c.no_embed_class:  # transformers adds a position to the class token: give it none (zeros)
            pe = torch.cat([torch.zeros_like(cls), pe], dim=1)
        out.update({"embeddings.cls_token": cls, "embeddings.position_embeddings": pe,
                    "embeddings.mask_token": torch.zeros(1, d),
                    "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
                    "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
                    "layernorm.weight": sd["norm.weight"], "layernorm.bias": sd["norm.bias"]})
        if c.reg_tokens:
            out["embeddings.register_tokens"] = sd["reg_token"]
    else:
        e = "embeddings."
        out[e + "patch_embedding.weight"] = sd["patch_embed.proj.weight"]
        if fam == "siglip":
            out[e + "patch_embedding.bias"] = sd["patch_embed.proj.bias"]
            out[e + "position_embedding.weight"] = pe[0]
            h = "head."
            out[h + "probe"] = sd["attn_pool.latent"]
            for leaf in ("weight", "bias"):
                out[h + f"attention.in_proj_{leaf}"] = torch.cat([sd[f"attn_pool.q.{leaf}"], sd[f"attn_pool.kv.{leaf}"]])
                for ours, theirs in (("proj", "attention.out_proj"), ("norm", "layernorm"), ("mlp.fc1", "mlp.fc1"),
                                     ("mlp.fc2", "mlp.fc2")):
                    out[h + f"{theirs}.{leaf}"] = sd[f"attn_pool.{ours}.{leaf}"]
        else:
            out[e + "class_embedding"] = sd["cls_token"].reshape(-1)
            out[e + "position_embedding.weight"] = pe[0]
            out["pre_layrnorm.weight"], out["pre_layrnorm.bias"] = sd["norm_pre.weight"], sd["norm_pre.bias"]
        out["post_layernorm.weight"], out["post_layernorm.bias"] = sd["norm.weight"], sd["norm.bias"]
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
