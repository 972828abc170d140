"""MKL-packed Linear weights for float32 CPU inference (`vitkit.models.layers.linear`)."""
import copy
import platform

import torch

import vitkit
from vitkit.models.layers import Linear, pack_linears
from vitkit.models.layers.linear import packing_available
from vitkit.stats import count_flops


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", num_classes=10, img_size=32).eval()
    torch.nn.init.normal_(m.head.weight)  # the zero-initialised head would hide every difference
    return m


def _packed_layers(m: torch.nn.Module) -> list[Linear]:
    return [x for x in m.modules() if isinstance(x, Linear) and x._packed is not None]


def test_packing_is_available_on_x86():
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert packing_available()


def test_packed_inference_matches_and_falls_back():
    m, x = _model(), torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        plain = m(x)
    n = pack_linears(m)
    if not packing_available():
        assert n == 0
        return
    assert n == 4 * m.config.depth  # qkv, proj, fc1, fc2 per block
    keys = set(m.state_dict())
    with torch.inference_mode():
        packed = m(x)
    assert len(_packed_layers(m)) == n
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert set(m.state_dict()) == keys  # the packed copy is not state
    with torch.inference_mode():  # another row count (batch 1) runs from the same packed weights
        torch.testing.assert_close(m(x[:1]), plain[:1], rtol=1e-5, atol=1e-5)

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

    # gradients, autocast and FLOP counting
    m.train()
    pack_linears(m)
    loss = m(x).logsumexp(-1).sum()
    loss.backward()
    assert m.blocks[0].attn.qkv.weight.grad is not None and not _packed_layers(m)
    m.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16 and not _packed_layers(m)
    unpacked = count_flops(fresh, (32, 32))
    assert count_flops(m, (32, 32)) == unpacked and _packed_layers(m)
