"""The fast float32 CPU GEMM (`vitkit.machine.gemm`, `vitkit.machine.fast_linear`): chosen by measurement, packed weights
for inference and training, the same logits and gradients as the plain path, clean fallbacks."""
import copy
import json
import platform

import pytest
import torch

import vitkit
from vitkit.models.layers import Linear
from vitkit.machine import fast_linear, gemm
from vitkit.machine.fast_linear import pack_linears
from vitkit.machine.fast_linear import FastGemm, packing_available
from vitkit.models.layers.std_conv import StdConv2d
from vitkit.models.stats import count_flops

from conftest import tiny_kwargs


def _model(name: str = "vit_ti16") -> torch.nn.Module:
    torch.manual_seed(0)
    kw = tiny_kwargs(name) if name != "vit_ti16" else dict(num_classes=10, img_size=32)
    m = vitkit.create_model(name, **kw).eval()
    torch.nn.init.normal_(m.head.weight, std=0.1)  # the zero-initialised head would hide every difference
    with torch.no_grad():  # so would zero-initialised residual norms (a ResNet block's last GroupNorm): the layers
        for k, p in m.named_parameters():  # before them would get their first gradient, near zero and all rounding,
            if k.endswith("weight") and p.dim() == 1 and not p.any():  # only after a step
                p.normal_(1.0, 0.1)
    return m


def _packed_layers(m: torch.nn.Module) -> list:
    return [x for x in m.modules() if isinstance(x, FastGemm) and x._packed is not None]


PATHS = [p for p in gemm.PATHS if gemm.available(p)]
_real_measure = gemm.measure


def test_packing_is_available_on_x86():
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert packing_available() and gemm.available("onednn-packed")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["vit_ti16", "r26_vit_s32", "bit_r50x1"])
def test_fast_path_logits_and_gradients_equal_the_plain_path(name, path, monkeypatch):
    """Every path a machine may choose, forced in turn, on ViT, a hybrid (its 1x1 patch embedding a packed matmul
    too) and BiT: inference logits, training logits and every parameter's gradient equal the plain path's to fp32
    rounding, through two optimizer steps (the packed weights follow the updates)."""
    monkeypatch.setattr(gemm, "FORCE", path)
    plain = _model(name)
    fast = copy.deepcopy(plain)
    n = pack_linears(fast, training=True)
    assert n == len([m for m in fast.modules() if isinstance(m, FastGemm)]) and n >= 1
    size = plain.config.img_size
    x = torch.randn(3, 3, *size)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast(x[:1]), plain(x[:1]), rtol=1e-5, atol=1e-5)  # another row count
    if path != "mkl":
        assert _packed_layers(fast)
    if name != "bit_r50x1":
        assert fast.patch_embed._packed is not None or path == "mkl"
    fast.train(), plain.train()
    standardised = {f"{n}.weight" for n, mod in plain.named_modules() if isinstance(mod, StdConv2d)}
    # fused: the trainer's default on CPUs; its kernel writes the weights without moving their version counter
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, fused=True) for m in (plain, fast)]
    for step in range(2):
        outs = []
        for m, opt in zip((plain, fast), opts):
            opt.zero_grad()
            torch.manual_seed(step)  # the same dropout / drop-path draws
            y = m(x)
            (y.logsumexp(-1).sum() + (y ** 2).mean()).backward()
            outs.append(y)
        tol = 1e-5 if step == 0 else 1e-4  # after a step, the weights differ by the rounding of the gradients
        torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
        grads = {k: p.grad for k, p in plain.named_parameters() if p.grad is not None}
        fgrads = {k: p.grad for k, p in fast.named_parameters() if p.grad is not None}
        assert grads.keys() == fgrads.keys() and grads
        # relative to the gradient's norm; a ResNet's (BiT's standardised convs, a hybrid's backbone) against the
        # whole gradient's: WS's backward subtracts nearly equal terms, and a hybrid's stem gets a small gradient
        # through the backbone, so upstream rounding reaches 0.3% of its own (1 thread; 1.1e-4 of the whole
        # gradient's norm). A wrong gradient is off by O(its norm); the rounding elsewhere: 1e-6 to 7e-6 (Zen 5)
        total = torch.cat([g.flatten() for g in grads.values()]).norm()
        for k in grads:
            if k in standardised or k.startswith("patch_embed.backbone."):
                assert (fgrads[k] - grads[k]).norm() / total < 1e-3, k
            else:
                err = ((fgrads[k] - grads[k]).norm() / grads[k].norm().clamp_min(1e-12)).item()
                assert err < 1e-4, (k, err)
        for opt in opts:
            opt.step()
    fast.eval(), plain.eval()
    with torch.inference_mode():  # the weights moved: the packed copies are rebuilt from them
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-4)
    if path != "mkl":
        layer = next(m for m in fast.modules() if isinstance(m, Linear) and m._packed is not None)
        assert layer._packed[4] == layer.weight._version


def test_packed_inference_matches_and_falls_back():
    m, x = _model(), torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        plain = m(x)
    n = pack_linears(m)
    if not packing_available():
        assert n == 0
        return
    assert n == 4 * m.config.depth + 2  # qkv, proj, fc1, fc2 per block; the head; the patch embedding
    keys = set(m.state_dict())
    with torch.inference_mode():
        packed = m(x)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert set(m.state_dict()) == keys  # the packed copy is not state

    # a weight changed after packing: the stale copy is not used
    with torch.no_grad():
        m.blocks[0].mlp.fc1.weight.mul_(2)
    with torch.inference_mode():
        changed = m(x)
    assert (changed - plain).abs().max() > 1e-3
    fresh = copy.deepcopy(m)  # copies drop the opaque packed tensor and stay packable
    assert not _packed_layers(fresh)
    pack_linears(fresh, enable=False)
    with torch.inference_mode():
        torch.testing.assert_close(fresh(x), changed, rtol=1e-5, atol=1e-5)
    assert not _packed_layers(fresh)

    # without training=True gradients take the plain path; autocast too; FLOPs are counted the same
    m.train()
    pack_linears(m)
    m(x).logsumexp(-1).sum().backward()
    assert m.blocks[0].attn.qkv.weight.grad is not None and not _packed_layers(m)
    m.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16 and not _packed_layers(m)
    unpacked = count_flops(fresh, (32, 32))
    assert count_flops(m, (32, 32)) == unpacked and _packed_layers(m)


def test_the_choice_is_measured_cached_and_falls_back(tmp_path, monkeypatch):
    """choose() measures the paths this build has, keeps the fastest on disk per CPU and torch version, and when an
    op is missing or fails it is no candidate: plain MKL (F.linear) always is."""
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "FORCE", None)
    monkeypatch.setattr(gemm, "_CHOICES", {})
    monkeypatch.setattr(gemm, "_RATES", {})
    monkeypatch.setattr(gemm, "_LOADED", False)
    rates = gemm.measure(64, 96, 50, seconds=0.01)
    assert set(rates) == set(PATHS) and all(r > 0 for r in rates.values())
    path = gemm.choose(64, 96, 50)
    assert path in PATHS
    (saved,) = json.loads(next((tmp_path / "gemm").glob("*.json")).read_text())
    assert saved["shape"][:4] == ["linear", 64, 96, 64] and saved["path"] == path and set(saved["gflops"]) == set(PATHS)
    wrates = gemm.measure(64, 96, 50, seconds=0.01, kind="wgrad")  # dW = dY^T X: torch.mm or oneDNN on the views
    assert set(wrates) == {p for p in gemm.WGRAD_PATHS if gemm.wgrad_available(p)} and "mkl" in wrates
    assert "64 x 96 @ 64 rows" in next(iter(gemm.choices()))
    # a fresh process reads the file instead of measuring again
    monkeypatch.setattr(gemm, "_CHOICES", {})
    monkeypatch.setattr(gemm, "_LOADED", False)
    monkeypatch.setattr(gemm, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert gemm.choose(64, 96, 50) == path

    # the packed ops missing from this build: nothing to choose but plain MKL, and the model still runs
    monkeypatch.setattr(gemm, "_CHOICES", {})
    monkeypatch.setattr(gemm, "measure", _real_measure)
    monkeypatch.setattr(gemm, "available", lambda p: p == "mkl")
    assert gemm.choose(64, 96, 50) == "mkl" and not packing_available()
    m, x = _model(), torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        ref = m(x)
    assert pack_linears(m, training=True) == 0
    with torch.inference_mode():
        torch.testing.assert_close(m(x), ref)
    assert not _packed_layers(m)


def test_training_chooses_its_paths_with_the_repacking_counted(tmp_path, monkeypatch):
    """A training step repacks W and W^T after every update, so its forward and input gradient are chosen by
    `measure`'s kinds "train" and "train-t" (the packing, and W^T's copy, in every timed call), not by the inference
    rates: where packing does not pay (plain MKL as fast, as on Intel CPUs) the layer trains on F.linear, with no
    packed copy or W^T made, while inference keeps its packed path; the gradients are the plain path's."""
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "FORCE", None)
    monkeypatch.setattr(gemm, "_CHOICES", {})
    monkeypatch.setattr(gemm, "_RATES", {})
    monkeypatch.setattr(gemm, "_LOADED", False)
    if not gemm.available("onednn-packed"):
        pytest.skip("no packed path in this build")
    for kind in ("train", "train-t"):  # every path a candidate, each with its packing timed
        assert set(gemm.measure(64, 96, 50, seconds=0.01, kind=kind)) == set(PATHS)
    asked = []

    def rates(k, n, rows, kind="linear", **_):  # packed fastest alone, plain MKL fastest with the repacking
        asked.append(kind)
        if kind == "wgrad":
            return {"mkl": 2.0, "onednn": 1.0}
        return {"mkl": 1.0, "onednn-packed": 2.0} if kind == "linear" else {"mkl": 2.0, "onednn-packed": 1.0}

    monkeypatch.setattr(gemm, "measure", rates)
    plain = _model()
    m = copy.deepcopy(plain)
    pack_linears(m, training=True)
    m.train(), plain.train()
    x = torch.randn(2, 3, 32, 32)
    m(x).logsumexp(-1).sum().backward()
    plain(x).logsumexp(-1).sum().backward()
    assert {"train", "train-t", "wgrad"} <= set(asked) and "linear" not in asked
    layers = _packed_layers(m)
    assert layers and all(p._packed[0] == "mkl" and p._packed[7] == "mkl" and p._packed[1] is None
                          and p._packed[2] is None for p in layers)  # no pack, no copy of W^T
    for (k, p), q in zip(m.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=k)
    torch.optim.SGD(m.parameters(), lr=0.1, fused=True).step()
    m.eval()
    with torch.inference_mode():  # an evaluation after the step: the path measured without the repacking
        m(x)
    assert "linear" in asked and m.blocks[0].mlp.fc1._packed[0] == "onednn-packed"


def test_a_failing_path_is_no_candidate(monkeypatch):
    """An op that exists but raises (a build that refuses the shape) or computes something else is skipped."""
    real_run = gemm.run

    def broken(path, x, packed, w, b, rows):
        if path == "onednn-packed":
            raise RuntimeError("no kernel for this shape")
        if path == "mkl-packed":
            return real_run(path, x, packed, w, b, rows) + 1.0  # wrong answer
        return real_run(path, x, packed, w, b, rows)

    monkeypatch.setattr(gemm, "run", broken)
    assert set(gemm.measure(32, 48, 16, seconds=0.01)) == {"mkl"}


def test_bf16_inference_casts_and_packs_each_weight_once():
    """Under bf16 autocast a packed model's Linears use a bf16 copy of each weight made once (and remade when the
    weight changes), with autocast's own numbers: the same logits as autocast's F.linear to bf16 rounding."""
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=7).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    x = torch.randn(3, 3, 32, 32)

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float()

    pack_linears(m, enable=False)
    plain = run()
    pack_linears(m)
    packed = run()
    assert packed.dtype == plain.dtype and (packed - plain).abs().max() <= 2e-2 * plain.abs().max()
    cached = m.blocks[0].mlp.fc1._packed_bf16
    assert cached is not None and cached[1].dtype == torch.bfloat16
    run()
    assert m.blocks[0].mlp.fc1._packed_bf16 is cached  # not recast at the next call
    with torch.no_grad():
        m.head.weight.mul_(-1)  # an in-place change: the cast copy is remade
    torch.nn.init.zeros_(m.head.bias)
    assert (run() + packed).abs().max() <= 2e-2 * packed.abs().max()  # the head's sign flipped: so did the logits


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_inference_gelu_runs_inside_oneDNNs_gemm_with_the_unfused_numbers(act, monkeypatch):
    """On oneDNN's packed path (bf16 where oneDNN packs bf16; fp32 where it is the path chosen) the MLP's GELU is
    the GEMM's post-op: no separate GELU op runs, and the output is the unfused MLP's (fp32: to rounding; bf16: to
    bf16 rounding, computed from the fp32 accumulator). Elsewhere the GELU runs as its own op."""
    from torch.profiler import ProfilerActivity, profile

    from vitkit.machine import gemm
    from vitkit.models.layers.mlp import Mlp

    torch.manual_seed(0)
    mlp = Mlp(64, 256, act=act).eval()
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        ref = mlp(x)  # not packed: F.linear, GELU, F.linear

    def ops(fn) -> set[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return {e.key for e in prof.key_averages()}

    def bf16():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return mlp(x).float()

    pack_linears(mlp)
    y = bf16()
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert ("aten::gelu" in ops(bf16)) == (fast_linear._BF16_PACKS is False)  # fused where oneDNN packs bf16 weights
    monkeypatch.setattr(gemm, "FORCE", "onednn-packed")
    pack_linears(mlp)

    def fp32():
        with torch.no_grad():
            return mlp(x)

    assert torch.allclose(fp32(), ref, atol=1e-5, rtol=1e-5)
    assert "aten::gelu" not in ops(fp32) and "mkldnn::_linear_pointwise" in ops(fp32)
    x.requires_grad_(True)  # training: the plain op, which autograd differentiates
    assert "aten::gelu" in ops(lambda: mlp(x))
