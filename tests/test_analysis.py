"""Known answers for the paper's analyses: rollout, attention distance, position similarity, filter PCA, figures."""
import itertools
import math

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.analysis import (
    attention_rollout,
    filter_principal_components,
    grad_rollout,
    iter_attention,
    layer_head_maps,
    mean_attention_distance,
    mean_attention_distance_from,
    patch_distances,
    position_similarity,
    rollout,
)
from vitkit.models.layers.pos_embed import sincos_2d

from conftest import FIXTURES


def test_self_attention_only_gives_identity_rollout_and_zero_distance():
    b, h, t = 2, 3, 17
    eye = torch.eye(t).expand(b, h, t, t)
    torch.testing.assert_close(rollout([eye, eye, eye]), torch.eye(t).expand(b, t, t))
    d = mean_attention_distance_from(eye, patch_distances((4, 4), (8, 8)), num_prefix_tokens=1)
    assert d.abs().max() == 0


def test_uniform_attention_gives_the_analytic_mean_distance():
    gh, gw, p = 3, 4, 16
    pts = [(r * p, c * p) for r in range(gh) for c in range(gw)]
    analytic = np.mean([math.dist(a, b) for a, b in itertools.product(pts, pts)])
    n = gh * gw
    uniform = torch.full((1, 2, n + 1, n + 1), 1.0 / (n + 1))  # class token + patches
    d = mean_attention_distance_from(uniform, patch_distances((gh, gw), (p, p)), num_prefix_tokens=1)
    assert d.shape == (1, 2)
    assert abs(d[0, 0].item() - analytic) < 1e-9


def test_rollout_of_uniform_attention_is_uniform_and_rows_sum_to_one():
    t = 10
    u = torch.full((1, 2, t, t), 1 / t)
    r = rollout([u] * 4)
    torch.testing.assert_close(r.sum(-1), torch.ones(1, t))
    # (U + I)/2 rolled out k times -> I/2^k + (1 - 1/2^k) U
    torch.testing.assert_close(r[0], torch.eye(t) / 16 + (1 - 1 / 16) * torch.full((t, t), 1 / t))


def test_discarding_keeps_the_class_column_and_the_rows_normalised():
    a = torch.rand(1, 2, 9, 9).softmax(-1)
    r = rollout([a, a], discard_ratio=0.5)
    torch.testing.assert_close(r.sum(-1), torch.ones(1, 9))
    assert (rollout([a], discard_ratio=0.5)[0, 1:, 0] > 0).all()


def test_sincos_similarity_peaks_along_its_own_row_and_column():
    grid = (6, 6)
    sim = position_similarity(sincos_2d(grid, 64), grid)
    for r, c in itertools.product(range(6), range(6)):
        assert sim[r, c, r, c] == pytest.approx(1.0, abs=1e-5)
        for d in range(1, 6):
            for rr in range(6):
                if rr != r and 0 <= c + d < 6:
                    assert sim[r, c, r, c + d] > sim[r, c, rr, c + d]  # same row beats another row, same column offset
            for cc in range(6):
                if cc != c and 0 <= r + d < 6:
                    assert sim[r, c, r + d, c] > sim[r, c, r + d, cc]


def test_pca_recovers_planted_components():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3 * 8 * 8, 3, generator=g, dtype=torch.float64))
    planted = q.t()  # (3, 192), orthonormal
    coef = torch.randn(500, 3, generator=g, dtype=torch.float64) * torch.tensor([10.0, 5.0, 2.0], dtype=torch.float64)
    bank = coef @ planted + 0.01 * torch.randn(500, 192, generator=g, dtype=torch.float64)
    comps, ratio = filter_principal_components(bank.float().reshape(500, 3, 8, 8), k=3)
    for i in range(3):
        cos = torch.dot(comps[i].flatten().double(), planted[i]).abs()
        assert cos > 0.999
    assert ratio[0] > ratio[1] > ratio[2] and ratio.sum() > 0.99


def test_attention_from_a_loaded_model_matches_its_fused_path():
    m = vitkit.load(FIXTURES / "jax_vit_token/model.npz")
    x = torch.from_numpy(np.load(FIXTURES / "jax_vit_token/input.npy"))
    layers = dict(iter_attention(m, x))
    assert set(layers) == {0, 1} and layers[0].shape == (2, 3, 17, 17)
    torch.testing.assert_close(layers[1].sum(-1), torch.ones(2, 3, 17))
    only_last = dict(iter_attention(m, x, layers=[-1]))
    torch.testing.assert_close(only_last[1], layers[1])
    roll = attention_rollout(m, x)
    assert roll.shape == (2, 4, 4) and roll.amax() == pytest.approx(1.0)
    g, idx = grad_rollout(m, x)
    assert g.shape == (2, 4, 4) and torch.equal(idx, m(x).argmax(-1))
    heads = layer_head_maps(m, x, layers=[0])
    assert heads[0].shape == (2, 3, 4, 4)
    d = mean_attention_distance(m, [x])
    assert d.shape == (2, 3) and (d > 0).all() and (d < 32 * math.sqrt(2)).all()


def test_gap_and_hybrid_models_work_too():
    gap = vitkit.load(FIXTURES / "jax_vit_gap/model.npz")
    x = torch.from_numpy(np.load(FIXTURES / "jax_vit_gap/input.npy"))
    assert attention_rollout(gap, x).shape == (2, 4, 4)
    hyb = vitkit.create_model("r26_vit_s32", img_size=64, depth=2, hybrid_layers=(1, 1, 1, 1), hybrid_width=0.5, num_classes=3)
    assert attention_rollout(hyb, torch.randn(1, 3, 64, 64)).shape == (1, 2, 2)
    with pytest.raises(ValueError, match="no attention"):
        attention_rollout(vitkit.create_model("bit_r50x1", layers=(1, 1, 1, 1)), torch.randn(1, 3, 64, 64))


def test_explain_and_inspect_commands_write_every_png(tmp_path):
    from vitkit.cli import main

    ckpt = FIXTURES / "timm_vit_tiny/model.safetensors"
    img = tmp_path / "photo.png"
    import skimage.data

    Image.fromarray(skimage.data.chelsea()).save(img)
    assert main(["explain", str(img), "--checkpoint", str(ckpt), "--out", str(tmp_path / "ex"), "--discard-ratio", "0.5"]) == 0
    for name in ("photo_rollout.png", "photo_heads.png"):
        w, h = Image.open(tmp_path / "ex" / name).size
        assert w > 300 and h > 150
    z = np.load(tmp_path / "ex" / "photo.npz")
    assert z["rollout"].shape == (4, 4) and z["layer_head"].shape == (2, 3, 4, 4) and z["grad_rollout"].shape == (4, 4)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray((np.random.default_rng(i).random((40, 50, 3)) * 255).astype(np.uint8)).save(folder / f"{i}.png")
    (folder / "corrupt.png").write_bytes(b"not an image")
    assert main(["inspect", "--checkpoint", str(ckpt), "--data", str(folder), "--out", str(tmp_path / "in"), "--components", "12"]) == 0
    for name in ("filters.png", "pos_similarity.png", "attention_distance.png"):
        w, h = Image.open(tmp_path / "in" / name).size
        assert w > 250 and h > 200, name
    z = np.load(tmp_path / "in" / "inspect.npz")
    assert z["filter_components"].shape == (12, 3, 16, 16) and z["position_similarity"].shape == (4, 4, 4, 4)
    assert z["mean_attention_distance"].shape == (2, 3)
