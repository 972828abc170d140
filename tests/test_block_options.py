"""Block options: residual post-norm (`res_post_norm`), grouped-query attention (`num_kv_heads`,
`kv_full_blocks`) and LayerScale on the attention branch alone (`attn_only_layer_scale`, Sapiens2), against timm's
own outputs (tests/fixtures/block_options, made by make_block_options.py) and
against plain multi-head attention with each key/value head copied to its group."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError
from vitkit.models.lora import apply_lora
from vitkit.models.registry import build_model
from vitkit.models.vit_config import ViTConfig
from vitkit.checkpoints.io import read_safetensors

FIXTURES = Path(__file__).parent / "fixtures" / "block_options"

# vitkit's config of each fixture's timm model (the README there names timm's arguments)
CONFIGS = {
    "timm_post_norm": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_dim=96, num_classes=5,
                           k_bias=False, res_post_norm=True),
    "timm_gqa": dict(img_size=(16, 12), patch_size=4, embed_dim=32, depth=3, num_heads=4, mlp_dim=128, num_classes=5,
                     num_kv_heads=2, kv_full_blocks=1, qk_norm=True, norm="rmsnorm", reg_tokens=2, init_values=0.5,
                     pos_embed="none", rope="dinov3", rope_temperature=100.0, rope_half=True),
}


def timm_eva_to_vitkit(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm Eva's names -> vitkit's, for these fixtures: separate q/k/v projections fused into qkv (rows q, k, v),
    gamma_1/gamma_2 -> ls1/ls2.gamma, pos_embed -> pos_embed.weight; every other name is the same."""
    out, parts = {}, {}
    for k, v in sd.items():
        m = re.fullmatch(r"(blocks\.\d+\.attn\.)([qkv])_proj\.(weight|bias)", k)
        if m:
            parts.setdefault((m[1], m[3]), {})[m[2]] = v
            continue
        out["pos_embed.weight" if k == "pos_embed" else re.sub(r"\.gamma_([12])$", r".ls\1.gamma", k)] = v
    for (prefix, kind), qkv in parts.items():
        out[f"{prefix}qkv.{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_timm(name):
    folder = FIXTURES / name
    sd, _ = read_safetensors(folder / "model.safetensors")
    model = build_model(ViTConfig(**CONFIGS[name])).eval()
    model.load_state_dict(timm_eva_to_vitkit(sd), strict=True)
    x = torch.from_numpy(np.load(folder / "input.npy"))
    with torch.no_grad():
        feats, logits = model.forward_features(x), model(x)
    assert (feats - torch.from_numpy(np.load(folder / "features.npy"))).abs().max() <= 1e-4
    assert (logits - torch.from_numpy(np.load(folder / "logits.npy"))).abs().max() <= 1e-4
    # the fixture's timm model has what the config says: grouped key/value heads in the middle block only
    if name == "timm_gqa":
        assert json.loads((folder / "config.json").read_text())["model_args"]["num_kv_heads"] == [4, 2, 4]
        assert [b.attn.num_kv_heads for b in model.blocks] == [4, 2, 4]


def _gqa_and_mha(**kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A GQA model (6 query heads, 2 key/value heads of width 8), and a plain one whose key/value heads are the GQA
    model's, each copied to the 3 query heads of its group (head h reads key/value head h // 3)."""
    base = dict(img_size=24, patch_size=8, embed_dim=48, depth=2, num_heads=6, mlp_dim=64, num_classes=3,
                qk_norm=True, rope="eva", **kw)
    torch.manual_seed(0)
    gqa = build_model(ViTConfig(**base, num_kv_heads=2)).eval()
    mha = build_model(ViTConfig(**base)).eval()
    with torch.no_grad():
        gqa.head.weight.normal_()  # a head that is not zero, so that the logits say something

    def per_query_head(t: torch.Tensor) -> torch.Tensor:  # (2 * 8, ...) -> (6 * 8, ...)
        return t.unflatten(0, (2, 8)).repeat_interleave(3, dim=0).flatten(0, 1)

    sd = {}
    for k, v in gqa.state_dict().items():
        if k.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
            q, k_rows, v_rows = v.split([48, 16, 16])
            v = torch.cat([q, per_query_head(k_rows), per_query_head(v_rows)])
        elif k.endswith(".attn.v_bias"):
            v = per_query_head(v)
        sd[k] = v
    mha.load_state_dict(sd)
    return gqa, mha


@pytest.mark.parametrize("kw", [{}, dict(k_bias=False)], ids=["qkv_bias", "q_v_bias"])
def test_gqa_is_mha_with_shared_heads(kw):
    gqa, mha = _gqa_and_mha(**kw)
    assert tuple(gqa.blocks[0].attn.qkv.weight.shape) == (48 + 2 * 16, 48)
    x = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-5)  # the class-token-only last block
        a, b = gqa.forward_intermediates(x, attention=True), mha.forward_intermediates(x, attention=True)
        torch.testing.assert_close(a["features"], b["features"], rtol=0, atol=1e-5)
        torch.testing.assert_close(a["attention"][1], b["attention"][1], rtol=0, atol=1e-5)  # the explicit path
        imgs = [x[0], x[1, :, :16, :]]
        torch.testing.assert_close(gqa(imgs), mha(imgs), rtol=0, atol=1e-5)  # a packed batch


def test_gqa_blocks_and_config():
    c = ViTConfig(embed_dim=64, depth=6, num_heads=8, num_kv_heads=2, kv_full_blocks=2)
    assert [c.kv_heads(i) for i in range(6)] == [None, None, 2, 2, None, None]
    assert ViTConfig(num_kv_heads=12).num_kv_heads is None  # as many as the query heads: plain attention
    assert ViTConfig(kv_full_blocks=3).kv_full_blocks == 0  # nothing grouped: nothing to keep full
    with pytest.raises(UsageError, match="num_kv_heads 5 does not divide num_heads 12"):
        ViTConfig(num_kv_heads=5)
    with pytest.raises(UsageError, match="rope='mixed'"):
        ViTConfig(num_kv_heads=4, rope="mixed")
    with pytest.raises(UsageError, match="kv_full_blocks"):
        ViTConfig(num_kv_heads=4, kv_full_blocks=-1)
    gqa, _ = _gqa_and_mha()
    with pytest.raises(UsageError, match="grouped-query"):
        apply_lora(gqa, 4, targets=("q", "v"))
    assert apply_lora(gqa, 4, targets=("qkv",))  # the fused projection whole: any row layout


def test_post_norm_block_order():
    """x + norm1(attn(x)): the norm on the branch's output (its weight scales the attention's output), not its
    input."""
    c = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=32, num_classes=0)
    torch.manual_seed(0)
    m = build_model(ViTConfig(**c, res_post_norm=True)).eval()
    blk, x = m.blocks[0], torch.randn(2, 5, 32)
    with torch.no_grad():
        blk.norm1.weight.mul_(3)
        h = x + blk.norm1(blk.attn(x))
        torch.testing.assert_close(blk(x), h + blk.norm2(blk.mlp(h)), rtol=0, atol=0)


def test_options_save_and_load(tmp_path):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=16, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_dim=32, num_classes=3,
                    num_kv_heads=1, kv_full_blocks=1, res_post_norm=True)
    m = build_model(cfg).eval()
    back = vitkit.load(vitkit.save(m, tmp_path / "m.safetensors")).eval()
    assert back.config == cfg
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), m(x))


SAPIENS2 = ["timm_sapiens2", "timm_sapiens2_wide"]


@pytest.mark.parametrize("name", SAPIENS2)
def test_sapiens2_as_registered_loads_from_timms_folder_and_builds_from_its_name(name):
    """Sapiens2's blocks as timm registers them (LayerScale on the attention branch alone, `attn_only_layer_scale`;
    a packed SwiGLU; grouped key/value heads in the middle blocks): timm's folder loads to its logits and features,
    and `vitkit.create_model(arch, **model_args)` is the same model (timm's parameter count, a strict load)."""
    folder = FIXTURES / name
    model = vitkit.load(folder)
    c = model.config
    assert c.attn_only_layer_scale and c.init_values is not None and c.mlp_layer == "swiglu" and c.num_kv_heads
    assert all(isinstance(b.ls2, torch.nn.Identity) and b.ls1.gamma.shape == (c.embed_dim,) for b in model.blocks)
    x = torch.from_numpy(np.load(folder / "input.npy"))
    with torch.no_grad():
        assert (model(x) - torch.from_numpy(np.load(folder / "logits.npy"))).abs().max() <= 1e-4
        assert (model.forward_features(x) - torch.from_numpy(np.load(folder / "features.npy"))).abs().max() <= 1e-4
    cfg = json.loads((folder / "config.json").read_text())
    built = vitkit.create_model(cfg["architecture"], **cfg["model_args"]).eval()
    built.load_state_dict(model.state_dict(), strict=True)
    sd, _ = read_safetensors(folder / "model.safetensors")
    assert sum(p.numel() for p in built.parameters()) == sum(v.numel() for v in sd.values())
    # the bare state dict named by its architecture, with the sizes that differ from it (as a timm user passes them
    # to create_model): LayerScale on one branch is in the names
    a = cfg["model_args"]
    kv = a["num_kv_heads"]
    bare = vitkit.load(folder / "model.safetensors", architecture=cfg["architecture"], num_heads=a["num_heads"],
                       img_size=tuple(np.load(folder / "input.npy").shape[2:]), reg_tokens=a["num_reg_tokens"],
                       num_kv_heads=min(kv), kv_full_blocks=kv.index(min(kv)))
    assert bare.config.attn_only_layer_scale
    with torch.no_grad():
        assert (bare(x) - torch.from_numpy(np.load(folder / "logits.npy"))).abs().max() <= 1e-4


def test_attention_only_layer_scale_needs_a_layer_scale_and_saves():
    with pytest.raises(UsageError, match="attn_only_layer_scale .* needs init_values"):
        ViTConfig(attn_only_layer_scale=True)
    cfg = ViTConfig(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_dim=32, num_classes=3,
                    init_values=0.1, attn_only_layer_scale=True)
    m = build_model(cfg)
    assert [n for n, _ in m.named_parameters() if ".ls" in n] == ["blocks.0.ls1.gamma", "blocks.1.ls1.gamma"]
    assert "attn_only_layer_scale" not in ViTConfig().to_dict()  # written only where set (older vitkit reads the rest)
    with torch.device("meta"):
        assert sum(p.numel() for p in vitkit.create_model("vit_base_patch16_sapiens2").parameters()) == 113_993_472


def test_differential_attention_paths_agree_and_train():
    """Differential attention (attn_layer='diff'; timm's parity: the registry sweep's vit_dwee/vit_dlittle folders):
    the fused path, the explicit one (the maps forward_intermediates returns: the difference of two softmax maps, rows
    summing to 1 - lambda), the class-token-only last block and a packed batch give the same outputs; gradients reach
    the lambdas."""
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=3,
                    attn_layer="diff", qk_norm=True)
    m = build_model(cfg).eval()
    with torch.no_grad():
        m.head.weight.normal_()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = m(x)
        m.last_block_cls_only = False
        torch.testing.assert_close(m(x), out, rtol=0, atol=1e-5)
        inter = m.forward_intermediates(x, attention=True)
        attn = inter["attention"][1]  # (B, H, T, T)
        lam = m.blocks[1].attn.lambda_full()
        torch.testing.assert_close(attn.sum(-1), (1 - lam).expand_as(attn.sum(-1)), rtol=0, atol=1e-5)
        torch.testing.assert_close(m([x[0], x[1, :, :8, :]])[0], out[0], rtol=0, atol=1e-4)  # packed
    assert m.blocks[1].attn.lambda_init == pytest.approx(0.8 - 0.6 * np.exp(-0.3))
    m.train()
    torch.nn.functional.cross_entropy(m(x), torch.tensor([0, 2])).backward()
    assert m.blocks[0].attn.lambda_q1.grad.abs().sum() > 0
    with pytest.raises(UsageError, match="attn_layer='diff'"):
        ViTConfig(embed_dim=32, num_heads=2, attn_layer="diff", rope="eva")


def test_differential_attention_takes_lora_and_refuses_what_it_has_not():
    m = vitkit.create_model("vit_dwee_patch16_reg1_gap_256", depth=2, img_size=32)
    assert apply_lora(m, 2) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    with pytest.raises(UsageError, match="separate query and value biases"):
        ViTConfig(embed_dim=32, num_heads=2, attn_layer="diff", k_bias=False)
