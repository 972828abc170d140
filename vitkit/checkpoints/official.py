"""The official Google vision_transformer .npz format (ViT and R50+ViT hybrids) <-> vitkit names.

Kernels are stored as flax lays them out: conv HWIO, Dense (in, out), attention query/key/value
(D, heads, head_dim) with biases (heads, head_dim), attention out (heads, head_dim, D).
Published checkpoints use pre-Linen module numbering (LayerNorm_0/2, MultiHeadDotProductAttention_1,
MlpBlock_3); files from newer Linen code use LayerNorm_0/1, MultiHeadDotProductAttention_0, MlpBlock_0.
"""
from __future__ import annotations

import re

import torch

from .io import CheckpointError

PRE_LINEN = {"ln1": "LayerNorm_0", "attn": "MultiHeadDotProductAttention_1", "ln2": "LayerNorm_2", "mlp": "MlpBlock_3"}
LINEN = {"ln1": "LayerNorm_0", "attn": "MultiHeadDotProductAttention_0", "ln2": "LayerNorm_1", "mlp": "MlpBlock_0"}


def is_official(keys) -> bool:
    return any(k.endswith("embedding/kernel") for k in keys)


def _conv(k: torch.Tensor) -> torch.Tensor:
    return k.permute(3, 2, 0, 1).contiguous()  # HWIO -> OIHW


def _norm_param(t: torch.Tensor) -> torch.Tensor:
    """A GroupNorm scale or bias: the published hybrid files store them with the legacy shape (1, 1, 1, C)."""
    return t.reshape(-1) if t.ndim == 4 and t.shape[:3] == (1, 1, 1) else t


def to_vitkit(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(vitkit state dict, facts for the config, keys left unused)."""
    w = dict(w)
    for prefix in ("opt/target/", "params/"):
        if any(k.startswith(prefix) for k in w):
            w = {k.removeprefix(prefix): v for k, v in w.items()}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in w:
            raise CheckpointError(f"official .npz checkpoint lacks {key!r}")
        used.add(key)
        return w[key]

    sd: dict[str, torch.Tensor] = {}
    facts: dict = {"act": "gelu_tanh", "norm_eps": 1e-6}
    sd["patch_embed.proj.weight"] = _conv(take("embedding/kernel"))
    sd["patch_embed.proj.bias"] = take("embedding/bias")
    if "cls" in w:
        sd["cls_token"] = take("cls")
    sd["pos_embed.weight"] = take("Transformer/posembed_input/pos_embedding")
    depth = len({m.group(1) for k in w if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))})
    names = PRE_LINEN if any("/LayerNorm_2/" in k for k in w) else LINEN
    for i in range(depth):
        p = f"Transformer/encoderblock_{i}/"
        for ln, ours in (("ln1", "norm1"), ("ln2", "norm2")):
            sd[f"blocks.{i}.{ours}.weight"] = take(f"{p}{names[ln]}/scale")
            sd[f"blocks.{i}.{ours}.bias"] = take(f"{p}{names[ln]}/bias")
        a = f"{p}{names['attn']}/"
        q = take(a + "query/kernel")
        d, heads, hd = q.shape
        facts["num_heads"] = heads
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([take(a + f"{n}/kernel").reshape(d, d).t() for n in ("query", "key", "value")])
        if a + "query/bias" in w:
            sd[f"blocks.{i}.attn.qkv.bias"] = torch.cat([take(a + f"{n}/bias").reshape(d) for n in ("query", "key", "value")])
        sd[f"blocks.{i}.attn.proj.weight"] = take(a + "out/kernel").reshape(d, d).t()
        sd[f"blocks.{i}.attn.proj.bias"] = take(a + "out/bias")
        for j, fc in enumerate(("fc1", "fc2")):
            sd[f"blocks.{i}.mlp.{fc}.weight"] = take(f"{p}{names['mlp']}/Dense_{j}/kernel").t()
            sd[f"blocks.{i}.mlp.{fc}.bias"] = take(f"{p}{names['mlp']}/Dense_{j}/bias")
    sd["norm.weight"] = take("Transformer/encoder_norm/scale")
    sd["norm.bias"] = take("Transformer/encoder_norm/bias")
    if "pre_logits/kernel" in w:
        sd["pre_logits.fc.weight"] = take("pre_logits/kernel").t()
        sd["pre_logits.fc.bias"] = take("pre_logits/bias")
    if "head/kernel" in w:
        sd["head.weight"] = take("head/kernel").t()
        sd["head.bias"] = take("head/bias")
    # The hybrid's ResNet (no scope in published files; "ResNet/" in some Linen files).
    rw = {k.removeprefix("ResNet/"): k for k in w if k.removeprefix("ResNet/").startswith(("conv_root", "gn_root", "block"))}
    if rw:
        bb = "patch_embed.backbone."
        sd[bb + "stem.conv.weight"] = _conv(take(rw["conv_root/kernel"]))
        sd[bb + "stem.norm.weight"] = _norm_param(take(rw["gn_root/scale"]))
        sd[bb + "stem.norm.bias"] = _norm_param(take(rw["gn_root/bias"]))
        for short, key in rw.items():
            m = re.match(r"block(\d+)/unit(\d+)/(conv|gn)(\d|_proj)/(kernel|scale|bias)$", short)
            if not m:
                continue
            s, b, kind, n, leaf = int(m.group(1)) - 1, int(m.group(2)) - 1, m.group(3), m.group(4), m.group(5)
            base = f"{bb}stages.{s}.blocks.{b}."
            mod = ("downsample." + ("conv" if kind == "conv" else "norm")) if n == "_proj" else f"{'conv' if kind == 'conv' else 'norm'}{n}"
            sd[base + mod + (".weight" if leaf in ("kernel", "scale") else ".bias")] = _conv(take(key)) if leaf == "kernel" else _norm_param(take(key))
        facts.update(hybrid_ws_eps=1e-5, hybrid_ws_eps_mode="std", hybrid_gn_eps=1e-6)
    unused = sorted(set(w) - used)
    return sd, facts, unused


def from_vitkit(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """vitkit ViT state dict -> official .npz arrays with the published (pre-Linen) key names.

    What the format cannot hold (exact GELU, a class token beside 'gap', fc_norm, ...) is refused by
    `vitkit.export`, which reads the arrays back and compares the model they describe with this one."""
    if config.pos_embed != "learned_1d":
        raise CheckpointError(f"the official format holds a learned 1-D position embedding, not {config.pos_embed!r}")
    if config.distilled or config.mpp:
        raise CheckpointError("the official format has no distillation token or masked-patch head; export to vitkit or timm")
    cannot = [what for what, has in (
        (f"grouped-query attention (num_kv_heads={getattr(config, 'num_kv_heads', None)})",
         getattr(config, "num_kv_heads", None) not in (None, config.num_heads)),
        (f"a {getattr(config, 'mlp_layer', 'mlp')!r} MLP", getattr(config, "mlp_layer", "mlp") != "mlp"),
        (f"{getattr(config, 'norm', 'layernorm')!r} norms", getattr(config, "norm", "layernorm") != "layernorm"),
        ("bias-free layers (qkv_bias/k_bias/proj_bias/patch_bias False)",
         not all(getattr(config, b, True) for b in ("qkv_bias", "k_bias", "proj_bias", "patch_bias"))),
        ("a norm after the pooling (fc_norm) or no final norm: its encoder_norm is before the pooling",
         getattr(config, "fc_norm", False) or not getattr(config, "final_norm", True)),
        ("a hybrid stem without its max-pool (hybrid_stem_pool=False)",
         config.hybrid_layers is not None and not getattr(config, "hybrid_stem_pool", True)),
        ("a hybrid ResNet with BatchNorm (hybrid_norm='batch')",
         config.hybrid_layers is not None and getattr(config, "hybrid_norm", "group") != "group"),
    ) if has]
    if cannot:
        raise CheckpointError(f"the official format cannot hold {', '.join(cannot)}; export to vitkit or timm")
    out: dict[str, torch.Tensor] = {}
    d, heads = config.embed_dim, config.num_heads
    hd = d // heads

    def conv(t: torch.Tensor) -> torch.Tensor:
        return t.permute(2, 3, 1, 0)  # OIHW -> HWIO

    out["embedding/kernel"] = conv(sd["patch_embed.proj.weight"])
    out["embedding/bias"] = sd["patch_embed.proj.bias"]
    if "cls_token" in sd:
        out["cls"] = sd["cls_token"]
    out["Transformer/posembed_input/pos_embedding"] = sd["pos_embed.weight"]
    for i in range(config.depth):
        p, n = f"Transformer/encoderblock_{i}/", PRE_LINEN
        for ln, ours in (("ln1", "norm1"), ("ln2", "norm2")):
            out[f"{p}{n[ln]}/scale"] = sd[f"blocks.{i}.{ours}.weight"]
            out[f"{p}{n[ln]}/bias"] = sd[f"blocks.{i}.{ours}.bias"]
        a = f"{p}{n['attn']}/"
        qkv_w = sd[f"blocks.{i}.attn.qkv.weight"].chunk(3)
        qkv_b = sd[f"blocks.{i}.attn.qkv.bias"].chunk(3) if f"blocks.{i}.attn.qkv.bias" in sd else None
        for j, name in enumerate(("query", "key", "value")):
            out[a + f"{name}/kernel"] = qkv_w[j].t().reshape(d, heads, hd)
            if qkv_b is not None:
                out[a + f"{name}/bias"] = qkv_b[j].reshape(heads, hd)
        out[a + "out/kernel"] = sd[f"blocks.{i}.attn.proj.weight"].t().reshape(heads, hd, d)
        out[a + "out/bias"] = sd[f"blocks.{i}.attn.proj.bias"]
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{p}{n['mlp']}/Dense_{j}/kernel"] = sd[f"blocks.{i}.mlp.{fc}.weight"].t()
            out[f"{p}{n['mlp']}/Dense_{j}/bias"] = sd[f"blocks.{i}.mlp.{fc}.bias"]
    out["Transformer/encoder_norm/scale"] = sd["norm.weight"]
    out["Transformer/encoder_norm/bias"] = sd["norm.bias"]
    if "pre_logits.fc.weight" in sd:
        out["pre_logits/kernel"] = sd["pre_logits.fc.weight"].t()
        out["pre_logits/bias"] = sd["pre_logits.fc.bias"]
    if "head.weight" in sd:
        out["head/kernel"] = sd["head.weight"].t()
        out["head/bias"] = sd["head.bias"]
    bb = "patch_embed.backbone."
    for k, v in sd.items():
        if not k.startswith(bb):
            continue
        short = k[len(bb):]
        if short.startswith("stem."):
            name = {"stem.conv.weight": "conv_root/kernel", "stem.norm.weight": "gn_root/scale", "stem.norm.bias": "gn_root/bias"}[short]
        else:
            m = re.match(r"stages\.(\d+)\.blocks\.(\d+)\.(downsample\.)?(conv|norm)(\d?)\.(weight|bias)$", short)
            s, b, ds, kind, num, leaf = m.groups()
            mod = ("conv" if kind == "conv" else "gn") + ("_proj" if ds else num)
            leaf = "kernel" if kind == "conv" else ("scale" if leaf == "weight" else "bias")
            name = f"block{int(s) + 1}/unit{int(b) + 1}/{mod}/{leaf}"
        out[name] = conv(v) if name.endswith("kernel") else v
    return {k: v.detach().float().contiguous() for k, v in out.items()}
