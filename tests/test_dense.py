"""Multi-scale dense features (models/dense.py): DINOv3's layers, ViTDet's simple feature pyramid, Swin's stages,
the `DenseBackbone` module; shapes and strides at patch 16 and 14 and a non-square size, equality with
`forward_intermediates`, the documented layer choice, gradients, and the errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError
from vitkit.models.dense import LayerNorm2d


def _vit(patch: int = 16, depth: int = 12, dim: int = 16, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitkit.create_model("vit_ti16", img_size=patch * 4, patch_size=patch, embed_dim=dim, depth=depth,
                               num_heads=2, mlp_dim=2 * dim, num_classes=0, dynamic_img_size=True, **kw).eval()


# (patch, image size): square and non-square
SIZES = [(16, (64, 64)), (16, (64, 96)), (14, (56, 84))]


@pytest.mark.parametrize("patch,size", SIZES)
def test_native_levels_shapes_and_strides(patch, size):
    m = _vit(patch, reg_tokens=2)  # a class token and two registers: all dropped
    x = torch.randn(2, 3, *size)
    out = vitkit.dense_features(m, x)
    gh, gw = size[0] // patch, size[1] // patch
    assert list(out) == ["stage1", "stage2", "stage3", "stage4"]
    assert all(v.shape == (2, 16, gh, gw) for v in out.values())
    assert list(vitkit.dense_strides(m).values()) == [patch] * 4


@pytest.mark.parametrize("patch,size", SIZES)
def test_resized_levels_shapes_and_strides(patch, size):
    m = _vit(patch)
    strides = (4, 8, 16, 32) if patch == 16 else (3.5, 7, 14, 28)  # 4x, 2x, 1x, 0.5x the patch grid
    out = vitkit.dense_features(m, torch.randn(1, 3, *size), strides=strides)
    gh, gw = size[0] // patch, size[1] // patch
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(4 * gh, 4 * gw), (2 * gh, 2 * gw), (gh, gw),
                                                           (gh // 2, gw // 2)]
    assert list(vitkit.dense_strides(m, strides=strides).values()) == list(strides)
    # patch 14 at the usual pixel strides: floor(H / s) x floor(W / s)
    out = vitkit.dense_features(m, torch.randn(1, 3, *size), strides=(4, 8, 16, 32))
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(size[0] // s, size[1] // s) for s in (4, 8, 16, 32)]
    b = vitkit.DenseBackbone(m, strides=strides)
    assert list(b.strides.values()) == list(strides) and b.size_divisibility == 2 * patch


def test_resizing_is_bilinear():
    """Up: bilinear (align_corners=False), as ViT-Adapter and DINOv3's adapter; down by 2 on an even grid: then the
    mean of each 2x2 block."""
    m = _vit(16)
    x = torch.randn(1, 3, 64, 96)
    native = vitkit.dense_features(m, x)
    out = vitkit.dense_features(m, x, strides=(4, 8, 16, 32))
    up = torch.nn.functional.interpolate(native["stage1"], scale_factor=4, mode="bilinear", align_corners=False)
    torch.testing.assert_close(out["stage1"], up)
    assert torch.equal(out["stage3"], native["stage3"])
    torch.testing.assert_close(out["stage4"], torch.nn.functional.avg_pool2d(native["stage4"], 2))


def test_levels_equal_forward_intermediates_exactly():
    m = _vit(16, reg_tokens=4, init_values=0.1)
    x = torch.randn(2, 3, 48, 80)
    for norm in (True, False):
        ref = m.forward_intermediates(x, [2, 5, 8, 11], attention=False, patch_grid=True, norm=norm)["patch_grid"]
        out = vitkit.dense_features(m, x, norm=norm)
        for (name, got), i in zip(out.items(), [2, 5, 8, 11]):
            assert torch.equal(got, ref[i]), (name, i, norm)
    normed = vitkit.dense_features(m, x, layers=[-1])["stage1"]
    tokens = m.forward_features(x)[:, m.num_prefix_tokens:]  # the final norm's output, prefix dropped
    assert torch.equal(normed, tokens.transpose(1, 2).reshape(2, 16, 3, 5))


def test_documented_layer_choice():
    assert vitkit.dense_layer_indices(12) == [2, 5, 8, 11]
    assert vitkit.dense_layer_indices(24) == [4, 11, 17, 23]  # DINOv3's paper indices for ViT-L
    assert vitkit.dense_layer_indices(40) == [9, 19, 29, 39]
    assert vitkit.dense_layer_indices(32) == [7, 15, 23, 31]
    assert vitkit.dense_layer_indices(10) == [3, 5, 7, 9]  # every (depth // 4)-th, ending at the last
    assert vitkit.dense_layer_indices(12, 3) == [3, 7, 11]
    for depth, expected in ((12, [2, 5, 8, 11]), (24, [4, 11, 17, 23])):
        m = _vit(16, depth=depth, dim=8)
        assert vitkit.DenseBackbone(m).layers == expected
        x = torch.randn(1, 3, 32, 32)
        ref = m.forward_intermediates(x, expected, attention=False, patch_grid=True, norm=True)["patch_grid"]
        assert all(torch.equal(a, ref[i]) for a, i in zip(vitkit.dense_features(m, x).values(), expected))
    assert vitkit.DenseBackbone(_vit(16, depth=12, dim=8), layers=[-4, -3, -2, -1]).layers == [8, 9, 10, 11]


def test_equal_to_transformers_dinov3_backbone():
    """transformers' `DINOv3ViTBackbone` (out_indices [1, 2] of a 2-block model: stage i is block i - 1, after the
    final norm, prefix tokens dropped), from the fixture its own code made (tests/fixtures/backbones), at 64x64 and
    48x80: `dense_features(layers=2)` gives the same maps."""
    d = Path(__file__).resolve().parent / "fixtures" / "backbones" / "hf_dinov3_backbone"
    m = vitkit.load(d)
    b = vitkit.DenseBackbone(m, layers=2)
    assert b.layers == [0, 1]
    for suffix in ("", "_wide"):
        x = torch.from_numpy(np.load(d / f"input{suffix}.npy"))
        with torch.no_grad():
            out = b(x)
        for j, got in enumerate(out.values()):
            expected = np.load(d / f"feature_maps_{j}{suffix}.npy")
            assert tuple(got.shape) == expected.shape
            assert np.abs(got.numpy() - expected).max() <= 1e-4


def test_bad_layers_and_arguments_are_errors():
    m = _vit(16)
    x = torch.randn(1, 3, 32, 32)
    for layers in ([12], [-13], [0, 12], 0, 13, [], [1, -11], "last", [1.5]):
        with pytest.raises(UsageError):
            vitkit.dense_features(m, x, layers=layers)
    with pytest.raises(ValueError, match="out of range"):
        vitkit.DenseBackbone(m, layers=[3, 99])
    with pytest.raises(UsageError, match="one stride"):
        vitkit.dense_features(m, x, strides=(4, 8))
    with pytest.raises(UsageError, match="positive"):
        vitkit.dense_features(m, x, strides=(4, 8, 0, 32))
    with pytest.raises(UsageError, match="one map"):
        vitkit.DenseBackbone(m, layers=[5, 11], simple_fpn=True)
    with pytest.raises(UsageError):
        vitkit.DenseBackbone(m, simple_fpn=True, strides=(8,))
    with pytest.raises(UsageError, match="scale_factors"):
        vitkit.SimpleFeaturePyramid(16, scale_factors=(8.0, 1.0))
    with pytest.raises(UsageError, match="one size"):
        vitkit.dense_features(m, [torch.randn(3, 32, 32), torch.randn(3, 48, 32)])
    bit = vitkit.create_model("bit_r50x1", num_classes=0)
    with pytest.raises(UsageError, match="ViT"):
        vitkit.dense_features(bit, x)


@pytest.mark.parametrize("patch,size", SIZES)
def test_simple_feature_pyramid_shapes_and_strides(patch, size):
    m = _vit(patch, reg_tokens=1)
    b = vitkit.DenseBackbone(m, simple_fpn=True, out_channels=24, top_block=True)
    out = b(torch.randn(2, 3, *size))
    gh, gw = size[0] // patch, size[1] // patch
    assert list(out) == ["p2", "p3", "p4", "p5", "p6"]
    assert [tuple(v.shape) for v in out.values()] == [
        (2, 24, 4 * gh, 4 * gw), (2, 24, 2 * gh, 2 * gw), (2, 24, gh, gw), (2, 24, gh // 2, gw // 2),
        (2, 24, (gh // 2 + 1) // 2, (gw // 2 + 1) // 2)]
    expected = [patch / 4, patch / 2, patch, 2 * patch, 4 * patch]
    assert list(b.strides.values()) == expected and b.out_channels == 24 and b.layers == [11]
    assert b.size_divisibility == (64 if patch == 16 else 56)
    sfp = vitkit.SimpleFeaturePyramid(16, scale_factors=(2.0, 1.0, 0.5), patch_stride=patch)
    assert list(sfp.strides) == ["p3", "p4", "p5"]


def test_layernorm2d_is_detectron2s():
    ln = LayerNorm2d(6)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x = torch.randn(2, 6, 3, 5)
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    ref = ln.weight[:, None, None] * (x - u) / torch.sqrt(s + 1e-6) + ln.bias[:, None, None]
    torch.testing.assert_close(ln(x), ref, rtol=1e-5, atol=1e-5)


def test_simple_feature_pyramid_trains_and_gradients_reach_the_vit():
    m = _vit(16, depth=2)
    b = vitkit.DenseBackbone(m, simple_fpn=True, out_channels=8).train()
    assert all(p.requires_grad for p in b.parameters())  # nothing frozen by default
    x = torch.randn(2, 3, 32, 48)
    sum(v.square().mean() for v in b(x).values()).backward()
    missing = [n for n, p in b.named_parameters() if p.grad is None and "head" not in n]
    assert not missing, missing
    # a few steps fit the pyramid to a target: it learns (on the ViT's map, computed once)
    last = vitkit.dense_features(m, x, layers=[-1])["stage1"].detach()
    target = {k: torch.randn_like(v) for k, v in b.fpn(last).items()}
    opt = torch.optim.Adam(b.fpn.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = sum(torch.nn.functional.mse_loss(v, target[k]) for k, v in b.fpn(last).items())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_frozen_backbone_trains_only_the_pyramid():
    m = vitkit.create_model("vit_ti16", img_size=32, embed_dim=16, depth=2, num_heads=2, mlp_dim=32, num_classes=0,
                            drop_path_rate=0.5)
    b = vitkit.DenseBackbone(m, simple_fpn=True, out_channels=8, frozen=True).train()
    assert b.training and b.fpn.training and not m.training  # no stochastic depth in the frozen ViT
    assert not any(p.requires_grad for p in m.parameters())
    x = torch.randn(2, 3, 32, 32)
    out = b(x)
    sum(v.sum() for v in out.values()).backward()
    assert all(p.grad is not None for p in b.fpn.parameters())
    assert all(p.grad is None for p in m.parameters())
    with torch.no_grad():
        again = b(x)
    assert all(torch.equal(out[k], again[k]) for k in out)


def test_backbone_under_no_grad_and_in_train_mode():
    m = _vit(16, depth=4)
    b = vitkit.DenseBackbone(m, strides=(4, 8, 16, 32))
    x = torch.randn(1, 3, 64, 32)
    with torch.no_grad():
        ev = b.eval()(x)
    assert all(v.grad_fn is None for v in ev.values())
    tr = b.train()(x)
    assert m.training and all(v.requires_grad for v in tr.values())
    assert all(torch.allclose(ev[k], tr[k]) for k in ev)  # no dropout in this model: the same maps
    assert b.out_channels == 16 and list(b.channels.values()) == [16] * 4 and b.layers == [0, 1, 2, 3]


def test_swin_returns_its_stages():
    s = vitkit.create_model("swin_t", img_size=32, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                            window_size=2, num_classes=0).eval()
    x = torch.randn(2, 3, 32, 32)
    out = vitkit.dense_features(s, x)
    assert [tuple(v.shape) for v in out.values()] == [(2, 16, 8, 8), (2, 32, 4, 4), (2, 64, 2, 2), (2, 128, 1, 1)]
    assert list(vitkit.dense_strides(s).values()) == [4, 8, 16, 32]
    assert torch.equal(out["stage4"], s.forward_features(x).permute(0, 3, 1, 2))  # the final norm on the last
    b = vitkit.DenseBackbone(s, layers=[1, 3])
    assert list(b(x)) == ["stage2", "stage4"] and b.out_channels == [32, 128] and b.layers == [1, 3]
