"""The model registry swept at tiny sizes, every option, parameter counts, the forward API and errors."""
import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vitkit
from vitkit.models import get_entry
from vitkit.models.stats import model_stats

from conftest import tiny_kwargs

ALL = vitkit.list_models()


def test_registry_has_every_model_of_the_issue():
    want = {"vit_ti16", "vit_s16", "vit_s32", "vit_b8", "vit_b16", "vit_b32", "vit_l16", "vit_l32", "vit_h14",
            "r50_vit_b16", "r26_vit_s32", "bit_r50x1", "bit_r101x1", "bit_r50x3"}
    assert want <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_sweep_forward_backward(name):
    model = vitkit.create_model(name, **tiny_kwargs(name))
    # zero-initialised weights (the head, the hybrid's last GroupNorm per block) block gradients by design
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("weight") and not p.any():
                p.normal_(std=0.02)
    model.train()
    size = model.config.img_size
    x = torch.randn(2, model.config.in_chans, *size)
    y = model(x)
    assert y.shape == (2, 5)
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no gradient for {missing}"
    zero = [n for n, p in model.named_parameters() if p.grad.abs().sum() == 0]
    assert not zero, f"all-zero gradient for {zero}"


@pytest.mark.parametrize("name,paper,expected_m", [("vit_b16", "ViT-B/16", 86), ("vit_l16", "ViT-L/16", 307), ("vit_h14", "ViT-H/14", 632)])
def test_table1_param_counts_within_1_percent(name, paper, expected_m):
    stats = model_stats(get_entry(name), num_classes=1000)
    assert stats["paper_name"] == paper
    assert abs(stats["params_m"] - expected_m) / expected_m < 0.01, stats


def test_flops_of_vit_b16_and_tokens():
    stats = model_stats(get_entry("vit_b16"))
    assert stats["tokens"] == 197
    # 2 * MACs; the commonly quoted 17.6 GMACs for ViT-B/16 at 224.
    assert 34.5 < stats["gflops"] < 35.5


def test_flops_count_the_cpu_fused_attention():
    # a real CPU forward runs the fused attention kernel, which torch's counter does not know by itself:
    # the count must equal the meta-device count (where attention runs as explicit matmuls), T^2 term included
    from vitkit.models.stats import count_flops

    model = vitkit.create_model("vit_ti16", img_size=64, num_classes=0)
    with torch.device("meta"):
        meta = vitkit.create_model("vit_ti16", img_size=64, num_classes=0)
    cpu = count_flops(model, (64, 64))
    assert cpu == count_flops(meta, (64, 64))
    # and exactly the attention's two matmuls (q k^T and attn v: 2 x 2 T^2 D per layer) above torch's bare count
    from torch.utils.flop_counter import FlopCounterMode

    model.last_block_cls_only = False  # count_flops counts the full last block: so must the bare counter
    with FlopCounterMode(display=False) as bare, torch.no_grad():
        model(torch.empty(1, 3, 64, 64))
    T, D, L = 17, 192, 12
    assert cpu - bare.get_total_flops() == L * 4 * T * T * D


def test_paper_names_are_aliases():
    assert get_entry("ViT-B/16").name == "vit_b16"
    assert get_entry("R50+ViT-B/16").name == "r50_vit_b16"
    assert get_entry("vit-l/32").name == "vit_l32"
    with pytest.raises(ValueError, match="unknown model"):
        get_entry("vit_z99")


def test_overrides_by_keyword():
    m = vitkit.create_model("vit_b16", img_size=(32, 48), patch_size=8, in_chans=1, num_classes=10, num_heads=6,
                            classifier="gap", pos_embed="sincos_2d", representation_size=64, drop_rate=0.1,
                            drop_path_rate=0.2, depth=2)
    c = m.config
    assert c.img_size == (32, 48) and c.grid_size == (4, 6) and c.in_chans == 1 and c.num_heads == 6
    assert m.cls_token is None and m(torch.randn(2, 1, 32, 48)).shape == (2, 10)
    assert m.blocks[-1].drop_path1.p == pytest.approx(0.2) and m.blocks[0].drop_path1.p == 0
    with pytest.raises(ValueError, match="unknown option"):
        vitkit.create_model("vit_b16", heads=3)


OPTIONS = [dict(classifier=c, pos_embed=p, representation_size=r)
           for c in ("token", "gap") for p in ("learned_1d", "learned_2d", "sincos_2d", "none", "relative") for r in (None, 16)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_option_builds_and_trains_one_step(opts):
    model = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64,
                                num_classes=4, drop_rate=0.1, drop_path_rate=0.1, **opts)
    x, t = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):  # the zero-initialised head passes no gradient down on the first step
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "head.weight" in changed and "patch_embed.proj.weight" in changed
    if opts["pos_embed"] == "relative":
        assert "blocks.0.attn.rel_pos.table" in changed


def test_num_classes_zero_returns_pooled_features():
    m = vitkit.create_model("vit_s16", img_size=32, depth=1, num_classes=0).eval()
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 384)
    m = vitkit.create_model("vit_s16", img_size=32, depth=1, num_classes=0, representation_size=100).eval()
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 100)


def test_gap_pools_normed_tokens_and_token_takes_class_token():
    m = vitkit.create_model("vit_ti16", img_size=32, depth=1, classifier="gap", num_classes=0).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = m.forward_features(x)
    assert feats.shape == (2, 4, 192)  # no class token
    torch.testing.assert_close(m(x), feats.mean(1))
    m = vitkit.create_model("vit_ti16", img_size=32, depth=1, num_classes=0).eval()
    feats = m.forward_features(x)
    assert feats.shape == (2, 5, 192)
    torch.testing.assert_close(m(x), feats[:, 0])


def _attention_model(pos_embed: str, depth: int):
    """A tiny ViT whose head and relative-position tables are non-zero, so that every path shows in the output."""
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=depth, num_classes=10, pos_embed=pos_embed)
    torch.nn.init.normal_(m.head.weight, std=0.02)
    for blk in m.blocks:
        if blk.attn.rel_pos is not None:
            torch.nn.init.normal_(blk.attn.rel_pos.table)
    return m


@pytest.mark.parametrize("pos_embed", ["learned_1d", "relative"])
def test_fused_and_explicit_attention_agree(pos_embed):
    m = _attention_model(pos_embed, depth=3).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        fused = m(x)
        out = m.forward_intermediates(x)
        feats = m.forward_features(x)
    assert (fused - out["logits"]).abs().max() < 1e-5
    assert (feats - out["features"]).abs().max() < 1e-5
    assert set(out["attention"]) == {0, 1, 2}
    a = out["attention"][1]
    assert a.shape == (3, 3, 17, 17)
    torch.testing.assert_close(a.sum(-1), torch.ones(3, 3, 17))


def _loss_and_grads(m, x, impl, bf16):
    m.zero_grad(set_to_none=True)
    m.set_attention_impl(impl)  # this model's attention layers only
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = m(x).float().logsumexp(-1).mean()
        loss.backward()
    finally:
        m.set_attention_impl("auto")
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pos_embed", ["learned_1d", "relative"])
def test_training_attention_paths_give_the_same_gradients(pos_embed):
    # the CPU bf16 training path swaps the fused kernel for matmul + softmax: same loss and gradients
    torch.manual_seed(0)
    m = _attention_model(pos_embed, depth=2).train()
    x = torch.randn(4, 3, 32, 32)
    l_f, g_f = _loss_and_grads(m, x, "sdpa", False)
    l_e, g_e = _loss_and_grads(m, x, "explicit", False)
    assert g_f.keys() == g_e.keys() and len(g_f) > 10
    torch.testing.assert_close(l_f, l_e, rtol=1e-5, atol=1e-5)
    for n in g_f:
        torch.testing.assert_close(g_f[n], g_e[n], rtol=1e-4, atol=1e-5, msg=n)
    # bf16 autocast: "auto" takes the explicit path here; it must match the fused kernel to bf16 precision
    l_fb, g_fb = _loss_and_grads(m, x, "sdpa", True)
    l_ab, g_ab = _loss_and_grads(m, x, "auto", True)
    assert abs(l_fb - l_ab) < 2e-2 and abs(l_ab - l_f) < 5e-2
    for n in g_fb:
        scale = g_f[n].abs().max().clamp_min(1e-3)
        assert (g_fb[n] - g_ab[n]).abs().max() / scale < 0.1, n


@pytest.mark.parametrize("pos_embed,impl", [("learned_1d", "sdpa"), ("relative", "sdpa"), ("relative", "explicit"), ("hybrid", "sdpa")])
def test_last_block_runs_on_the_class_token_alone(pos_embed, impl):
    # the head reads the class token only, so forward() runs the last block's queries, projection and MLP
    # on it alone: the same logits and gradients as the full block, and (B, 1, D) into that MLP
    from vitkit.models.stats import count_flops

    torch.manual_seed(0)
    if pos_embed == "hybrid":
        m = vitkit.create_model("r26_vit_s32", img_size=32, patch_size=4, hybrid_layers=(1,), hybrid_width=0.5, depth=2,
                                embed_dim=64, num_heads=4, mlp_dim=128, num_classes=10)
        torch.nn.init.normal_(m.head.weight, std=0.02)
    else:
        m = _attention_model(pos_embed, depth=2)
    x = torch.randn(3, 3, 32, 32)
    seen = []
    fc1 = m.blocks[-1].mlp.fc1  # wrapped, not hooked: a hook turns the class-token path off (next test)
    fc1.forward = lambda inp, _f=fc1.forward: (seen.append(tuple(inp.shape)), _f(inp))[1]
    m.set_attention_impl(impl)
    try:
        m.eval()
        with torch.no_grad():
            short = m(x)
            m.last_block_cls_only = False
            full = m(x)
        T = m.config.num_tokens
        assert seen == [(3, 1, m.config.embed_dim), (3, T, m.config.embed_dim)]
        torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-5)
        assert full.abs().max() > 1e-2
        m.train()
        grads = []
        for cls_only in (True, False):
            m.last_block_cls_only = cls_only
            m.zero_grad(set_to_none=True)
            m(x).logsumexp(-1).mean().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
        for n, g in grads[1].items():  # to fp32 rounding, relative to each gradient's largest entry
            assert (grads[0][n] - g).abs().max() <= 1e-5 * g.abs().max().clamp_min(1e-3), n
    finally:
        m.set_attention_impl("auto")
    # the FLOP count is the model's, every token through every block, whichever way forward runs
    full_copy = copy.deepcopy(m)
    m.last_block_cls_only = True
    assert count_flops(m, (32, 32)) == count_flops(full_copy, (32, 32))


def test_hooks_and_fx_see_the_full_last_block():
    """A forward hook on the last block (or inside it) and torch.fx tracing see every token, as without the
    class-token shortcut; the logits are the same either way."""
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=4).eval()
    torch.nn.init.normal_(m.head.weight, std=0.1)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
        for module in (m.blocks[-1], m.blocks[-1].mlp, m.blocks[-1].attn.proj):
            shapes = []
            h = module.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(out.shape)))
            torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
            h.remove()
            assert shapes == [(2, m.config.num_tokens, m.config.embed_dim)], (module, shapes)
        pre = []
        h = m.blocks[-1].register_forward_pre_hook(lambda mod, inp: pre.append(tuple(inp[0].shape)))
        m(x)
        h.remove()
        assert pre == [(2, m.config.num_tokens, m.config.embed_dim)]
        gm = torch.fx.symbolic_trace(m)
        torch.testing.assert_close(gm(x), ref, rtol=1e-5, atol=1e-5)
        # the last MLP's first Linear, as traced: its output holds every token
        fc1 = next(n for n in gm.graph.nodes if n.op == "call_function" and any(
            getattr(a, "target", None) == "blocks.1.mlp.fc1.weight" for a in n.args))
        outputs = {}
        interp = torch.fx.Interpreter(gm)
        run_node = interp.run_node
        interp.run_node = lambda n: outputs.setdefault(n.name, run_node(n))
        interp.run(x)
        assert outputs[fc1.name].shape == (2, m.config.num_tokens, m.config.mlp_dim)


@pytest.mark.parametrize("name,kw", [
    ("vit_ti16", dict(img_size=32, patch_size=8, depth=2)),
    ("r26_vit_s32", dict(img_size=64, hybrid_layers=(1, 1, 1), hybrid_width=0.5, depth=1, embed_dim=48, num_heads=3, mlp_dim=96)),
    ("r_vit_ti16", dict(img_size=64, depth=1)),  # the stem alone: 'SAME' conv and max-pool
    ("bit_r50x1", dict(img_size=64)),
])
def test_every_family_traces_with_torch_fx(name, kw):
    """torch.fx symbolic tracing (feature extraction, graph rewrites) of every family, with gradients on: the traced
    module computes the model's logits. 'SAME' padding is one traced call (its size is read when it runs)."""
    m = vitkit.create_model(name, num_classes=5, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():  # no zero-initialised head: the logits must depend on every layer
            if not p.any():
                p.normal_(std=0.1)
    gm = torch.fx.symbolic_trace(m)
    x = torch.randn(2, 3, *m.config.img_size)
    torch.testing.assert_close(gm(x), m(x), rtol=1e-5, atol=1e-5)
    if name.startswith("r"):
        assert any(n.op == "call_function" and n.target.__name__ == "pad_same" for n in gm.graph.nodes)


def test_gap_models_run_every_block_on_every_token():
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, classifier="gap", num_classes=10).eval()
    seen = []
    m.blocks[-1].mlp.fc1.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    with torch.no_grad():
        m(torch.randn(2, 3, 32, 32))
    assert m.last_block_cls_only and seen == [m.config.num_tokens]


def test_auto_attention_picks_explicit_only_for_cpu_bf16(monkeypatch):
    from vitkit.models.layers import attention
    from vitkit.models.layers.attention import Attention

    a = Attention(64, 4)
    q = torch.zeros(2, 4, 50, 16, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(attention, "_CPU_BF16_NATIVE", False)  # emulated bf16 matmuls (AVX2): always the fused kernel
    assert not a._explicit_is_faster(q, 50)
    with torch.no_grad():
        assert not a._explicit_is_faster(q * 1, 50)
    monkeypatch.setattr(attention, "_CPU_BF16_NATIVE", True)
    assert a._explicit_is_faster(q, 50)
    assert not a._explicit_is_faster(q, 1025)  # long sequences: the fused kernel wins again
    assert not a._explicit_is_faster(q.detach().float().requires_grad_(), 50)  # fp32: fused
    with torch.no_grad():  # inference (q computed without grad): explicit only on a CPU without AMX
        monkeypatch.setattr(attention, "_CPU_HAS_AMX", True)
        assert not a._explicit_is_faster(q * 1, 50)
        monkeypatch.setattr(attention, "_CPU_HAS_AMX", False)
        assert a._explicit_is_faster(q * 1, 50)
        assert not a._explicit_is_faster(q * 1, 1025)
        assert not a._explicit_is_faster(q.float() * 1, 50)


def test_low_precision_token_stream():
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=5)
    torch.nn.init.normal_(m.head.weight, std=0.02)
    x = torch.randn(4, 3, 32, 32)
    seen = []
    m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = m(x)
    m.lowp_stream = True
    assert torch.equal(m(x), ref)  # without autocast it changes nothing
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(x)
        low.float().sum().backward()
    assert seen == [torch.float32, torch.float32, torch.float32, torch.bfloat16]
    assert (low.float() - ref).abs().max() < 0.1 and (amp.float() - ref).abs().max() < 0.1
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


def test_layernorm_keeps_a_low_precision_stream_in_its_dtype():
    """fp32 in: exactly nn.LayerNorm. bf16 in under autocast: bf16 out (CPU autocast's own behaviour; on CUDA, whose
    autocast would write fp32, vitkit's branch), close to the fp32 result, gradients to the fp32 weights."""
    from vitkit.models.layers import LayerNorm

    torch.manual_seed(0)
    ln, ref = LayerNorm(64, eps=1e-6), torch.nn.LayerNorm(64, eps=1e-6)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    ref.load_state_dict(ln.state_dict())
    x = torch.randn(3, 5, 64)
    assert torch.equal(ln(x), ref(x))
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        ln, ref = ln.to(dev), ref.to(dev)
        ln.zero_grad()
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = ln(x.to(dev, torch.bfloat16))
            assert ln(x.to(dev)).dtype == torch.float32  # an fp32 stream stays fp32
        assert y.dtype == torch.bfloat16
        assert (y.float() - ref(x.to(dev))).abs().max() < 0.1
        y.float().square().sum().backward()
        assert ln.weight.grad.dtype == torch.float32 and ln.weight.grad.abs().sum() > 0


def test_forward_intermediates_only_the_layers_asked():
    m = vitkit.create_model("vit_ti16", img_size=32, depth=4, num_classes=3).eval()
    calls = []
    for i, blk in enumerate(m.blocks):
        orig = blk.attn.forward
        blk.attn.forward = lambda x, return_attention=False, _o=orig, _i=i, **kw: (calls.append((_i, return_attention)), _o(x, return_attention, **kw))[1]
    out = m.forward_intermediates(torch.randn(1, 3, 32, 32), layers=[-1, 1])
    assert set(out["tokens"]) == {1, 3} and set(out["attention"]) == {1, 3}
    assert calls == [(0, False), (1, True), (2, False), (3, True)]
    assert set(m.forward_intermediates(torch.randn(1, 3, 32, 32), layers=2, attention=False)["tokens"]) == {2, 3}


def test_out_of_range_layers_are_errors():
    """layers=[5] of a 3-layer model used to return layer 2 (5 % 3): every index must name a layer."""
    from vitkit.analysis import layer_head_maps, mean_attention_distance

    m = vitkit.create_model("vit_ti16", img_size=32, depth=3, num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    for bad in ([5], [3], [-4], 4):
        with pytest.raises(ValueError, match="out of range|last 4 layers"):
            m.forward_intermediates(x, layers=bad)
    with pytest.raises(ValueError, match="out of range"):
        layer_head_maps(m, x, layers=[3])
    assert set(m.forward_intermediates(x, layers=[-3, 2])["tokens"]) == {0, 2}
    assert mean_attention_distance(m, [x]).shape == (3, 3)


def test_rectangular_images_and_grayscale():
    m = vitkit.create_model("vit_s32", img_size=(64, 96), in_chans=1, depth=1, num_classes=2)
    assert m.config.num_tokens == 1 + 2 * 3
    assert m(torch.randn(1, 1, 64, 96)).shape == (1, 2)


@pytest.mark.parametrize("name", ["vit_s16", "r26_vit_s32", "bit_r50x1"])
def test_bad_input_shape_is_a_clear_value_error(name):
    m = vitkit.create_model(name, **tiny_kwargs(name))
    c = m.config
    with pytest.raises(ValueError, match=r"expected input of shape.*got \(1, 4, "):
        m(torch.randn(1, 4, *c.img_size))
    if c.arch == "vit":
        h, w = c.img_size
        with pytest.raises(ValueError, match=rf"expected input of shape \(B, 3, {h}, {w}\).*got \(1, 3, {h + 8}, {w}\)"):
            m(torch.randn(1, 3, h + 8, w))


def test_config_errors():
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        vitkit.create_model("vit_b16", img_size=100)
    with pytest.raises(ValueError, match="classifier"):
        vitkit.create_model("vit_b16", classifier="max")
    with pytest.raises(ValueError, match="pos_embed"):
        vitkit.create_model("vit_b16", pos_embed="rope")
    hyb = dict(img_size=28, in_chans=1, patch_size=4, hybrid_layers=(4,))  # the Fashion-MNIST preset's backbone
    assert vitkit.create_model("r26_vit_s32", hybrid_width=1.5, **hyb).config.hybrid_width == 1.5
    with pytest.raises(ValueError, match="hybrid_width 1.25: must be a multiple of 0.5"):
        vitkit.create_model("r26_vit_s32", hybrid_width=1.25, **hyb)
    with pytest.raises(ValueError, match=r"not a multiple of its ResNet's stride 8 \(2 stage"):
        vitkit.create_model("r26_vit_s32", **{**hyb, "hybrid_layers": (2, 2)})
    with pytest.raises(ValueError, match="at least one block"):
        vitkit.create_model("r26_vit_s32", **{**hyb, "hybrid_layers": (2, 0)})


def test_hybrid_without_the_stem_pool_keeps_twice_the_resolution(tmp_path, capsys):
    """hybrid_stem_pool=False: the first stage at half the image's size (14x14 for 28 px), the stride halved; a vitkit
    file keeps the option; timm and the official format, whose hybrids pool, refuse it."""
    from vitkit.errors import CheckpointError
    from vitkit.models.resnet import backbone_stride

    assert backbone_stride((1, 2)) == 8 and backbone_stride((1, 2), stem_pool=False) == 4
    kw = dict(img_size=28, in_chans=1, patch_size=4, hybrid_layers=(1, 2), hybrid_width=0.5, embed_dim=48, depth=1,
              num_heads=3, mlp_dim=96, num_classes=10)
    m = vitkit.create_model("r26_vit_s32", hybrid_stem_pool=False, **kw).eval()
    backbone, x = m.patch_embed.backbone, torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        first = backbone.stages[0](F.relu(backbone.stem.norm(backbone.stem.conv(x))))
        assert first.shape == (2, 32 * 4, 14, 14) and backbone(x).shape == (2, 32 * 8, 7, 7)
        assert m.forward_features(x).shape == (2, 1 + 49, 48)
    with pytest.raises(ValueError, match=r"not a multiple of its ResNet's stride 8"):
        vitkit.create_model("r26_vit_s32", **kw)  # with the pool, two stages reach 28 / 8
    with pytest.raises(ValueError, match="set hybrid_layers too"):
        vitkit.create_model("vit_ti16", img_size=28, in_chans=1, patch_size=4, hybrid_stem_pool=False)
    back = vitkit.load(vitkit.export(m, tmp_path / "m.safetensors", to="vitkit"))
    assert back.config.hybrid_stem_pool is False
    from vitkit import cli  # `vitkit info` names the option where it is off, and only there
    assert cli.main(["info", str(tmp_path / "m.safetensors")]) == 0
    assert "hybrid_stem_pool: False" in capsys.readouterr().out
    pooled = vitkit.create_model("r26_vit_s32", **{**kw, "hybrid_layers": (4,)})
    assert cli.main(["info", str(vitkit.export(pooled, tmp_path / "pooled.safetensors", to="vitkit"))]) == 0
    assert "hybrid_stem_pool" not in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)
    for to in ("timm", "npz"):
        with pytest.raises(CheckpointError, match="max-pool"):
            vitkit.export(m, tmp_path / to, to=to)
    # a bare state dict does not say whether the stem pools (it has no weights): told, it is read as this model
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(CheckpointError, match="True or False"):
        vitkit.load(tmp_path / "bare.safetensors", hybrid_stem_pool="False", num_heads=3)
    bare = vitkit.load(tmp_path / "bare.safetensors", hybrid_stem_pool=False, num_heads=3)
    assert (bare.config.patch_size, bare.config.img_size) == ((4, 4), (28, 28))
    with torch.no_grad():
        torch.testing.assert_close(bare(x), m(x), rtol=0, atol=0)


def test_hybrid_with_batchnorm(tmp_path, capsys):
    """hybrid_norm="batch": every norm of the hybrid's ResNet is a BatchNorm (batch statistics in training, running
    ones in eval); a vitkit file, and a bare one (its running statistics name the kind), keep it; timm and the official
    format refuse it; damaged statistics are refused by name; a frozen backbone keeps its statistics."""
    from safetensors.torch import load_file
    from vitkit.errors import CheckpointError

    kw = dict(img_size=28, in_chans=1, patch_size=4, hybrid_layers=(2,), hybrid_width=0.5, embed_dim=48, depth=1,
              num_heads=3, mlp_dim=96, num_classes=10)
    torch.manual_seed(0)
    m = vitkit.create_model("r26_vit_s32", hybrid_norm="batch", **kw)
    norms = [mod for n, mod in m.patch_embed.backbone.named_modules() if n.endswith("norm") or ".norm" in n]
    assert len(norms) == 1 + 2 * 3 + 1 and all(isinstance(n, torch.nn.BatchNorm2d) for n in norms)
    assert not any(isinstance(mod, torch.nn.GroupNorm) for mod in m.modules())
    x = torch.randn(6, 1, 28, 28) * 2 + 1
    with torch.no_grad():
        m.train()  # (features: the head starts at zero)
        a, b = m.forward_features(x[:3]), m.forward_features(torch.cat([x[:1], x[3:]]))
        assert not torch.allclose(a[0], b[0], atol=1e-3)  # training: sample 0 normalised with its batch's statistics
        assert float(m.patch_embed.backbone.stem.norm.running_mean.abs().sum()) > 0
        m.eval()
        a, b = m.forward_features(x[:3]), m.forward_features(torch.cat([x[:1], x[3:]]))
        torch.testing.assert_close(a[0], b[0])  # eval: the running statistics, the same for any batch
    with pytest.raises(ValueError, match="hybrid_norm must be one of"):
        vitkit.create_model("r26_vit_s32", hybrid_norm="layer", **kw)
    with pytest.raises(ValueError, match="set hybrid_layers too"):
        vitkit.create_model("vit_ti16", img_size=28, in_chans=1, patch_size=4, hybrid_norm="batch")
    f = vitkit.export(m, tmp_path / "m.safetensors", to="vitkit")
    back = vitkit.load(f).eval()
    assert back.config.hybrid_norm == "batch"
    from vitkit import cli
    assert cli.main(["info", str(f)]) == 0
    assert "hybrid_norm: batch" in capsys.readouterr().out
    for to in ("timm", "npz"):
        with pytest.raises(CheckpointError, match="hybrid_norm=.batch."):
            vitkit.export(m, tmp_path / to, to=to)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(sd, str(tmp_path / "bare.safetensors"))
    bare = vitkit.load(tmp_path / "bare.safetensors", num_heads=3).eval()
    assert bare.config.hybrid_norm == "batch"
    # vitkit's numerics, not timm's (no timm hybrid has BatchNorm: running statistics make the file vitkit's)
    assert (bare.config.hybrid_ws_eps, bare.config.hybrid_ws_eps_mode) == (m.config.hybrid_ws_eps, "std")
    m.eval()
    with torch.no_grad():  # the features (the zero-initialised head's logits are 0 for any weights)
        torch.testing.assert_close(back.forward_features(x), m.forward_features(x), rtol=0, atol=0)
        torch.testing.assert_close(bare.forward_features(x), m.forward_features(x), rtol=0, atol=0)
    # damaged statistics, in each kind of position, refused by name: also where the cast to the buffer's float32
    # would make them so (a float64 1e300 is inf) or where they are not floating point at all
    for key, value, dtype in (("stem.norm.running_var", -1.0, torch.float32),
                              ("stages.0.blocks.1.norm2.running_mean", float("nan"), torch.float32),
                              ("stages.0.blocks.0.downsample.norm.running_var", float("inf"), torch.float32),
                              ("stem.norm.running_mean", -1e300, torch.float64),
                              ("stages.0.blocks.0.norm3.running_var", -1, torch.int64)):
        key = "patch_embed.backbone." + key
        for path in (f, tmp_path / "bare.safetensors"):
            bad = load_file(str(path))
            bad[key] = bad[key].clone().to(dtype)
            bad[key][3] = value
            save_file(bad, str(tmp_path / "bad.safetensors"), metadata=safe_open_metadata(path))
            with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
                vitkit.load(tmp_path / "bad.safetensors", num_heads=3)
    # a GroupNorm model told to read a BatchNorm file (a preset's overrides over a checkpoint) says which to set
    with pytest.raises(CheckpointError, match="BatchNorm in the checkpoint and GroupNorm in the model: set "
                                              "hybrid_norm=batch"):
        vitkit.load(f, hybrid_norm="group")
    with pytest.raises(ValueError, match="whole number of channels"):
        vitkit.create_model("r26_vit_s32", hybrid_norm="batch", **{**kw, "hybrid_width": 0.3})
    assert "BatchNorm in the ResNet" in m.config.options()
    for p in m.patch_embed.backbone.parameters():  # a frozen backbone (a linear probe, LoRA): its statistics stay
        p.requires_grad_(False)
    m.train()
    assert not m.patch_embed.backbone.training and m.blocks.training
    before = m.patch_embed.backbone.stem.norm.running_mean.clone()
    m(x)
    torch.testing.assert_close(m.patch_embed.backbone.stem.norm.running_mean, before, rtol=0, atol=0)


def safe_open_metadata(path) -> dict[str, str] | None:
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_official_initialisation():
    m = vitkit.create_model("vit_b16", depth=2)
    assert torch.count_nonzero(m.cls_token) == 0
    assert torch.count_nonzero(m.head.weight) == 0 and torch.count_nonzero(m.head.bias) == 0
    assert 0.015 < m.pos_embed.weight.std().item() < 0.025
    w = m.blocks[0].mlp.fc1.weight  # xavier uniform: bound sqrt(6 / (fan_in + fan_out))
    assert w.abs().max() <= (6 / (768 + 3072)) ** 0.5
    assert m.blocks[0].mlp.fc1.bias.abs().max() < 1e-4


def test_set_img_size_resamples_the_position_embedding():
    m = vitkit.create_model("vit_ti16", img_size=32, depth=1, num_classes=3)
    m.set_img_size(48)
    assert m.pos_embed.weight.shape == (1, 1 + 9, 192)
    assert m(torch.randn(1, 3, 48, 48)).shape == (1, 3)


def test_a_distilled_models_eval_logits_are_the_mean_of_its_two_heads():
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=4, distilled=True)
    torch.nn.init.normal_(m.head.weight)
    torch.nn.init.normal_(m.head_dist.weight)
    x = torch.randn(3, 3, 32, 32)
    m.eval()
    with torch.no_grad():
        feats = m.forward_features(x)
        both = (m.head(feats[:, 0]) + m.head_dist(feats[:, 1])) / 2
        torch.testing.assert_close(m(x), both, rtol=1e-5, atol=1e-5)  # through the two-token last-block shortcut too
    m.train()
    m.distilled_training = True
    cls, dist = m(x)
    assert cls.shape == dist.shape == (3, 4) and not torch.allclose(cls, dist)


def test_masked_patch_prediction_targets_and_corruption_rates():
    from vitkit.models.mpp import mpp_corruption, mpp_random_patches, mpp_targets

    # a constant-colour image: every patch's target is that colour's 3-bit code (r, g, b) -> r * 64 + g * 8 + b
    rgb = torch.tensor([0.30, 0.99, 0.05])  # 3-bit: 2, 7, 0
    img = rgb.view(1, 3, 1, 1).expand(1, 3, 32, 32)
    assert mpp_targets(img, (8, 8)).tolist() == [[2 * 64 + 7 * 8 + 0] * 16]
    half = img.clone()
    half[..., :8, :8] = 1.0  # the first patch white: code 7 * 64 + 7 * 8 + 7 = 511
    assert mpp_targets(half, (8, 8))[0, 0] == 511
    assert mpp_targets(torch.zeros(1, 1, 16, 16), (4, 4)).max() == 0 and mpp_targets(torch.ones(1, 1, 16, 16), (4, 4)).min() == 7
    g = torch.Generator().manual_seed(0)
    corrupted, how = mpp_corruption(512, 196, 0.5, g, "cpu")
    assert (corrupted.sum(1) == 98).all()  # exactly half of every image's patches
    n = corrupted.sum().item()
    for code, share in ((1, 0.8), (2, 0.1), (0, 0.1)):
        got = ((how == code) & corrupted).sum().item() / n
        assert abs(got - share) < 4 * (share * (1 - share) / n) ** 0.5, (code, got)  # within 4 sigma of sampling
    assert not ((how > 0) & ~corrupted).any()
    b, p = mpp_random_patches(4, 9, g, "cpu")
    assert not ((b == torch.arange(4)[:, None]) & (p == torch.arange(9))).any()  # never the patch itself
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=0, mpp=True)
    logits, targets = m.forward_mpp((img - 0.5) / 0.5, img, g)
    assert logits.shape == (8, 512) and (targets == 2 * 64 + 7 * 8).all()


# ---- timm's model API (docs/timm.md) ---------------------------------------------------------------------------

def _tiny(name: str, **extra):
    m = vitkit.create_model(name, **{**tiny_kwargs(name), **extra}).eval()
    with torch.no_grad():  # no zero-initialised layer: outputs depend on every layer
        for p in m.parameters():
            if not p.any():
                p.normal_(std=0.1)
    return m


_HEAD_NAMES = ("head.", "head_dist.", "fc_norm.", "attn_pool.", "pre_logits.", "mpp_head.")


@pytest.mark.parametrize("name", ALL)
def test_timm_api_sweep(name):
    """Every registered model: num_classes, pretrained_cfg (as the timm folder export writes it), get_classifier,
    group_matcher's groups (every parameter in exactly one; embeddings first, one group a block, the head last),
    no_weight_decay (real parameter names, the ones vitkit's optimizer keeps out of decay), reset_classifier in timm's
    order."""
    from vitkit.checkpoints.timm import _pretrained_cfg
    from vitkit.models.timm_api import layer_groups

    m = _tiny(name)
    c = m.config
    assert m.num_classes == c.num_classes == 5 and m.get_classifier() is m.head
    cfg = m.pretrained_cfg
    assert cfg == m.default_cfg
    theirs = _pretrained_cfg(c)
    assert list(cfg["input_size"]) == theirs["input_size"] == [c.in_chans, *c.img_size]
    for k in ("interpolation", "crop_pct", "crop_mode", "num_classes"):
        assert cfg[k] == theirs[k], k
    assert list(cfg["mean"]) == theirs["mean"] and list(cfg["std"]) == theirs["std"]
    assert cfg["fixed_input_size"] == {"vit": not getattr(c, "dynamic_img_size", False), "resnetv2": False,
                                       "swin": True}[c.arch]
    m.get_submodule(cfg["first_conv"])  # vitkit's module names
    assert isinstance(m.get_submodule(cfg["first_conv"]), torch.nn.Conv2d)
    assert cfg["classifier"] == "head"
    names = [n for n, _ in m.named_parameters()]
    for coarse in (False, True):
        groups = layer_groups(m, coarse)
        flat = [n for g in groups.values() for n in g]
        assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
        first, last = groups[0], groups[max(groups)]
        assert all(n.startswith(("patch_embed.", "stem.", "cls_token", "pos_embed.", "reg_token", "norm_pre.", "rope."))
                   for n in first), first
        head = _HEAD_NAMES + (("norm.",) if coarse and c.arch != "vit" else ())  # timm's coarse stages: no norm pattern
        assert "head.weight" in last and all(n.startswith(head) for n in last), last
    if c.arch == "vit":
        assert len(layer_groups(m)) == c.depth + 2  # embeddings, a group per block (the final norm with the last), head
    nwd = m.no_weight_decay()
    assert nwd <= set(names)
    if c.arch == "vit":
        assert {"pos_embed.weight", "cls_token"} & nwd or c.pos_embed != "learned_1d" or not c.class_token
    # reset_classifier(num_classes, global_pool): timm's order; the pooling changes where the model can
    with pytest.raises(ValueError, match="global_pool='max'"):
        m.reset_classifier(5, "max")
    with pytest.raises(ValueError, match="class names by keyword"):
        m.reset_classifier(5, ["a"] * 5)
    assert m.config.num_classes == 5 and m.config.class_names is None  # nothing changed by the refusals
    m.reset_classifier(3, "avg", class_names=["a", "b", "c"])
    assert m.global_pool == "avg" and m.num_classes == 3 and m.config.class_names == ["a", "b", "c"]
    x = torch.randn(2, c.in_chans, *c.img_size)
    if c.arch == "vit":
        assert c.classifier == "gap" and m.attn_pool is None
        feats = m.forward_features(x)
        torch.testing.assert_close(m.forward_head(feats, pre_logits=True),
                                   m.pre_logits(m.fc_norm(feats[:, c.num_prefix_tokens:].mean(1))))
    assert m(x).shape == (2, 3)


def test_no_weight_decay_is_what_vitkits_optimizer_leaves_undecayed():
    from vitkit.training.optim import param_groups

    for name, kw in [("vit_ti16", {}), ("dinov2_s14_reg4", {}), ("siglip_b16", {}), ("bit_r50x1", {}),
                     ("vit_ti16", dict(pos_embed="relative")), ("vit_ti16", dict(distilled=True, mpp=True))]:
        m = _tiny(name, **kw)
        undecayed = {n for g in param_groups(m, 0.1) if g["weight_decay"] == 0 for n in g["names"]}
        by_shape = {n for n, p in m.named_parameters() if p.ndim <= 1 or n.endswith(".bias")}
        assert m.no_weight_decay() <= undecayed and undecayed - by_shape <= m.no_weight_decay(), (name, kw)


def test_swin_no_weight_decay_is_what_vitkits_optimizer_leaves_undecayed():
    from vitkit.training.optim import param_groups

    m = _tiny("swin_t")
    undecayed = {n for g in param_groups(m, 0.1) if g["weight_decay"] == 0 for n in g["names"]}
    assert m.no_weight_decay() and m.no_weight_decay() <= undecayed


@pytest.mark.parametrize("name", [n for n in ALL if get_entry(n).arch != "swin"] + ["swin_t"])
def test_fx_traces_after_set_dynamic_img_size_at_two_sizes(name):
    """torch.fx.symbolic_trace after set_dynamic_img_size(): the traced module reads the grid from its input, as the
    model does (the position embedding, the rotary angles and the relative bias's table for it: one traced call
    each). BiT takes any size as it is; Swin (laid out for one resolution) traces at its own size."""
    m = _tiny(name)
    if m.config.arch == "vit":
        m.set_dynamic_img_size()
        assert m.dynamic_img_size and not m.pretrained_cfg["fixed_input_size"]
    gm = torch.fx.symbolic_trace(m)
    h, w = m.config.img_size
    step = (32, 32) if m.config.arch == "resnetv2" else m.config.patch_size
    sizes = [(h, w)] if m.config.arch == "swin" else [(h, w), (h + step[0], w + 2 * step[1])]
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(2, m.config.in_chans, *size)
            torch.testing.assert_close(gm(x), m(x), rtol=1e-5, atol=1e-5)
    if getattr(m, "rope", None) is not None:  # tracing left no traced values in the angles' cache
        assert all(isinstance(k[0][0], int) for k in m.rope._cache)


@pytest.mark.parametrize("pos_embed", ["learned_2d", "sincos_2d", "relative", "none"])
def test_fx_dynamic_size_every_position_embedding(pos_embed):
    m = _tiny("vit_ti16", pos_embed=pos_embed, dynamic_img_size=True)
    gm = torch.fx.symbolic_trace(m)
    with torch.no_grad():
        for size in ((32, 32), (48, 64)):
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(gm(x), m(x), rtol=1e-5, atol=1e-5)


def test_create_model_takes_timms_keywords():
    kw = dict(img_size=32, depth=2, embed_dim=48, num_heads=3)
    m = vitkit.create_model("vit_ti16", pretrained=False, global_pool="avg", **kw)
    # timm's 'avg': the mean of the patch tokens, normed after the pooling (fc_norm), the class token kept
    assert m.config.classifier == "gap" and m.config.fc_norm and m.has_class_token and m.global_pool == "avg"
    assert not vitkit.create_model("vit_ti16", global_pool="avg", fc_norm=False, **kw).config.fc_norm
    assert vitkit.create_model("vit_ti16", classifier="gap", **kw).cls_token is None  # vitkit's GAP: the paper's
    m = vitkit.create_model("vit_small_patch14_dinov2", global_pool="token", img_size=28, depth=1, mlp_ratio=2,
                            act_layer="gelu_tanh", pos_embed="learn", drop_rate=0.1, pos_drop_rate=0.1,
                            proj_drop_rate=0.1, exportable=True, scriptable=False, features_only=False, fc_norm=None,
                            weight_init="jax", class_token=True, reg_tokens=2, dynamic_img_size=True, in_chans=1,
                            num_classes=7, drop_path_rate=0.1)
    c = m.config
    assert (c.mlp_dim, c.act, c.pos_embed, c.drop_rate, c.reg_tokens, c.in_chans, m.num_classes) == \
        (768, "gelu_tanh", "learned_1d", 0.1, 2, 1, 7)
    assert m(torch.randn(1, 1, 42, 28)).shape == (1, 7)
    assert vitkit.create_model("siglip_b16", global_pool="map", **kw).attn_pool is not None
    assert vitkit.create_model("swin_t", global_pool="avg", window_size=(7, 7)).global_pool == "avg"
    for name, bad, match in [
        ("vit_ti16", dict(global_pool=""), "no vitkit equivalent"),
        ("vit_ti16", dict(global_pool="avgmax"), "avgmax"),
        ("vit_ti16", dict(features_only=True), "forward_intermediates"),
        ("vit_ti16", dict(scriptable=True), "TorchScript"),
        ("vit_ti16", dict(proj_drop_rate=0.2), "one dropout rate"),
        ("vit_ti16", dict(dynamic_img_pad=True), "padding"),
        ("vit_ti16", dict(global_pool="avg", classifier="gap"), "not both"),
        ("vit_ti16", dict(act_layer="relu"), "act="),
        ("vit_ti16", dict(embed_layer=object), "unknown option.*docs/timm.md"),
        ("bit_r50x1", dict(global_pool="max"), "BiT"),
        ("swin_t", dict(global_pool="token"), "Swin"),
        ("swin_t", dict(window_size=(7, 8)), "square windows"),
        ("siglip_b16", dict(global_pool="token"), "class_token"),
    ]:
        with pytest.raises(ValueError, match=match):
            vitkit.create_model(name, **bad)


def test_create_model_pretrained_and_checkpoint_path(tmp_path, monkeypatch):
    from vitkit.checkpoints import catalog

    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "cache"))
    kw = dict(img_size=32, depth=2, embed_dim=48, num_heads=3, mlp_dim=96, num_classes=4)
    src = _tiny("vit_ti16", **kw)
    path = vitkit.save(src, tmp_path / "ti.safetensors")
    entry = catalog.CatalogEntry("test-timm-api", {"ti.safetensors": path.as_uri()}, "vitkit")
    monkeypatch.setitem(catalog.CATALOG, "test-timm-api", entry)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        m = vitkit.create_model("test-timm-api", pretrained=True)
        torch.testing.assert_close(m(x), src(x))
        m = vitkit.create_model("test-timm-api", pretrained=True, global_pool="avg", num_classes=6)
        assert m.global_pool == "avg" and m.num_classes == 6 and m(x).shape == (2, 6)
        m = vitkit.create_model("vit_ti16", checkpoint_path=path, **kw)
        torch.testing.assert_close(m(x), src(x))
    with pytest.raises(ValueError, match="not the model its name builds: embed_dim 48"):
        vitkit.create_model("vit_s16", checkpoint_path=path)
    with pytest.raises(ValueError, match=r"no pretrained weights named 'vit_b16'.*ViT-B_16-i21k.*vitkit catalog"):
        vitkit.create_model("vit_b16", pretrained=True)
    with pytest.raises(ValueError, match="give one"):
        vitkit.create_model("vit_b16", pretrained=True, checkpoint_path=path)
    from vitkit.checkpoints.create import catalog_name

    tagged = "vit_base_patch16_224.augreg2_in21k_ft_in1k"
    assert catalog_name(tagged) == f"timm/{tagged}"
    assert catalog_name("swin_tiny_patch4_window7_224") == "timm/swin_tiny_patch4_window7_224.ms_in1k"  # the first tag


def test_reset_classifier_pooling_changes_as_timms(tmp_path):
    # attention pooling -> mean: the probe dropped, the model saves and loads as what it now is
    m = _tiny("siglip_b16")
    m.reset_classifier(4, "avg")
    assert m.attn_pool is None and not any(k.startswith("attn_pool") for k in m.state_dict())
    x = torch.randn(2, 3, *m.config.img_size)
    back = vitkit.load(vitkit.save(m, tmp_path / "m.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x))
    with pytest.raises(ValueError, match="cannot be added"):
        m.reset_classifier(4, "map")
    with pytest.raises(ValueError, match="needs a class token"):
        m.reset_classifier(4, "token")
    e = _tiny("eva02_ti14")
    with pytest.raises(ValueError, match="normalises after pooling"):
        e.reset_classifier(4, "token")
    v = _tiny("vit_ti16")
    v.reset_classifier(4, "avg")
    v.reset_classifier(4, "token")
    assert v.global_pool == "token" and v.config.classifier == "token"
    assert v.get_classifier().weight.dtype == torch.float32
    with pytest.raises(ValueError, match="num_classes must be an int"):
        v.reset_classifier(-1)


def test_set_input_size():
    m = _tiny("vit_ti16", num_classes=3)
    m.set_input_size(img_size=48, patch_size=16)
    assert m.config.img_size == (48, 48) and m.pretrained_cfg["input_size"] == (3, 48, 48)
    assert m(torch.randn(1, 3, 48, 48)).shape == (1, 3)
    with pytest.raises(ValueError, match="keeps a model's patch size"):
        m.set_input_size(patch_size=8)
    s = _tiny("swin_t")  # img 32, patch 2, window 4: the window scales with the grid, as timm's set_input_size
    s.set_input_size(64)
    assert s.config.img_size == (64, 64) and s.config.window_size == 8
    assert s(torch.randn(1, 3, 64, 64)).shape == (1, 5)
    s.set_input_size(64, window_size=4)
    assert s.config.window_size == 4
    s.set_input_size(window_ratio=8)
    assert s.config.window_size == 4
    with pytest.raises(ValueError, match="square windows"):
        s.set_input_size((64, 128))


@pytest.mark.parametrize("name", ["vit_ti16", "swin_t", "bit_r50x1"])
def test_layer_decay_scales_follow_timm_s_groups(name):
    """vitkit's optimizer decays the LR by timm's layer groups: the embeddings get the smallest scale, the head 1,
    and within a family each later block a larger one (Swin's stages, BiT's stages too)."""
    from vitkit.models import layer_groups
    from vitkit.training.optim import param_groups

    m = _tiny(name)
    scale = {n: g["lr_scale"] for g in param_groups(m, 0.05, layer_decay=0.5) for n in g["names"]}
    groups = layer_groups(m)
    top = max(groups)
    for gid, names in groups.items():
        assert {scale[n] for n in names} == {0.5 ** (top - gid)}
    assert len(groups) > 3


def test_building_a_model_imports_no_compiler_and_initialises_as_before():
    """`build_model` sizes a model on the meta device (`build_on_meta`) before allocating it; there it skips the
    initialisation's fills, whose meta decompositions import torch._dynamo. In a fresh process: a plain ViT is built
    without importing it (models whose constructors compute on meta beyond fills, registers' or Swin's, still do);
    the shell's shapes are the model's; and the model is the one its constructor alone makes from the same seed
    (the shell draws nothing from the random stream)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys, torch, vitkit
from vitkit.models.registry import ARCHS, build_on_meta
m = vitkit.create_model("vit_ti16", num_classes=10)
dynamo = "torch._dynamo" in sys.modules
shell = build_on_meta(m.config)
sizes = lambda model: [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
same = sizes(m) == sizes(shell)
torch.manual_seed(3)
a = vitkit.create_model("vit_ti16", num_classes=10)
torch.manual_seed(3)
b = ARCHS[a.config.arch][1](a.config)
equal = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
print(dynamo, same, equal, round(a.pos_embed.weight.std().item(), 3))
"""
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dynamo, same, equal, pos_std = res.stdout.split()
    assert (dynamo, same, equal) == ("False", "True", "True") and abs(float(pos_std) - 0.02) < 0.002, res.stdout


def _one_per_family() -> list[str]:
    """A registered name per family: its architecture, name prefix and options (registers, RoPE, SwiGLU, ...)."""
    import re

    from vitkit.models import get_entry, list_models

    families = {}
    for n in list_models():
        e = get_entry(n)
        sizes = {"embed_dim", "depth", "num_heads", "mlp_dim", "patch_size", "img_size"}
        options = tuple(sorted(set(e.kwargs) - sizes))
        families.setdefault((e.arch, re.split("_", n)[0], options), n)
    return sorted(families.values())


def _meta_without_drop_path(config):
    """The config's model on meta, drop-path off: each block's rate prints in it, so that with it on no two blocks
    of a stochastic-depth model are alike, and the counts below would compare nothing."""
    import dataclasses

    from vitkit.models.registry import build_on_meta

    if any(f.name == "drop_path_rate" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, drop_path_rate=0.0)
    return build_on_meta(config), config


def _has_alike_blocks(model) -> bool:
    from vitkit.models.stats import _fingerprint

    return any(len({(repr(b), _fingerprint(b)) for b in seq}) < len(seq) for seq in model.modules()
               if isinstance(seq, (torch.nn.ModuleList, torch.nn.Sequential)))


@pytest.mark.parametrize("name", _one_per_family())
def test_flops_counted_with_alike_blocks_once_are_every_blocks(name):
    """`count_flops` on meta runs a block alike an earlier sibling (printed form, attributes, argument shapes) once
    and adds its FLOPs again: the same count as running every block, for each family, tiny and at its real size."""
    from vitkit.models.stats import count_flops

    entry = get_entry(name)
    kw = tiny_kwargs(name)
    if entry.arch == "resnetv2":
        kw.update(layers=(2, 3, 1, 1))
    elif entry.arch == "vit":
        kw.update(depth=3, **({"hybrid_layers": (2,)} if entry.kwargs.get("hybrid_layers") else {}))
    tiny = vitkit.create_model(name, **kw).config
    for config in (tiny, entry.default_config()):
        m, config = _meta_without_drop_path(config)
        assert _has_alike_blocks(m)  # there is something to count once
        flops = count_flops(m, config.img_size, config.in_chans)
        assert flops == count_flops(m, config.img_size, config.in_chans, alike_once=False) > 0


class _Stack(torch.nn.Module):
    """Alike blocks that the count must still tell apart: the same Linear at another token count, blocks holding
    alike blocks, and blocks differing only in a list attribute (how many times they run)."""

    class Twice(torch.nn.Module):
        def __init__(self, reps: list[int]) -> None:
            super().__init__()
            self.reps = reps
            self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

        def forward(self, x):
            for _ in range(self.reps[0]):
                x = self.inner(x)
            return x

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.nested = torch.nn.ModuleList([self.Twice([1]) for _ in range(3)])
        self.reps = torch.nn.ModuleList([self.Twice([1]), self.Twice([4])])

    def forward_features(self, x):  # (B, 1, 4, 8) -> (B, 4, 8)
        t = x[:, 0]
        t = self.lin[0](t) + self.lin[1](t[:, :2]).sum() + self.lin[2](t)  # 4 tokens, then 2, then 4
        for blk in [*self.nested, *self.reps]:
            t = blk(t)
        return t

    def forward_head(self, t):
        return t


def test_flops_of_alike_blocks_at_other_shapes_nested_or_with_other_attributes_are_each_counted():
    from vitkit.models.stats import count_flops

    with torch.device("meta"):
        m = _Stack()
    every = count_flops(m, (4, 8), in_chans=1, alike_once=False)
    assert every == 2 * 8 * 8 * (4 + 2 + 4 + 3 * 2 * 4 + 2 * 4 + 8 * 4)  # one multiply-add = 2 FLOPs
    assert count_flops(m, (4, 8), in_chans=1) == every


def test_flops_of_sams_windowed_and_global_blocks_are_told_apart():
    """SAM's image encoder: its windowed and global blocks print alike, and their attributes tell them apart."""
    from vitkit.models.registry import build_on_meta
    from vitkit.models.samvit import SamViTConfig
    from vitkit.models.stats import count_flops

    tiny = SamViTConfig(img_size=(128, 128), embed_dim=64, depth=4, num_heads=4, window_size=4,
                        global_attn_indexes=(1,), neck_chans=32)
    for config in (tiny, SamViTConfig()):
        m = build_on_meta(config)
        assert count_flops(m, config.img_size) == count_flops(m, config.img_size, alike_once=False)
