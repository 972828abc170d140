"""`model.stem_init=pca`: a convolutional stem's first conv set to the training patches' principal components, each
beside its negative (airbench's first layer). The components against scikit-learn's PCA, a run's stem against the
patches of its own training images, the frozen variant kept, an exact resume, two processes as one, refusals."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.decomposition import PCA

import vitkit
from vitkit.data.datasets import InMemoryDataset
from vitkit.data.splits import prepare, training_data
from vitkit.errors import UsageError
from vitkit.training import train
from vitkit.training.stem_init import MAX_IMAGES, components, patch_moments, principal_filters

from test_distributed import _max_diff, _train as _train_procs
from test_training import _write_png_folder, tiny_cfg

HYBRID = {"hybrid_layers": [1], "patch_size": 4}  # a ResNet stem (7x7/2 StdConv2d, GroupNorm) and one bottleneck
STEM = "patch_embed.backbone.stem.conv.weight"


def _aligned(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """|cosine| of each of our directions with the same-rank component of theirs (1: the same up to sign)."""
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    return np.abs((ours * theirs).sum(1))


def test_the_filters_are_scikit_learns_principal_components_each_beside_its_negative():
    rng = np.random.default_rng(0)
    # correlated 49-dim patches, each with an offset of its own (what a weight-standardised conv cannot see)
    x = rng.normal(size=(6000, 49)) @ rng.normal(size=(49, 49)) + rng.normal(size=(6000, 1)) * 3 + 0.7
    for standardised, usable in ((False, 49), (True, 48)):
        seen = x - x.mean(1, keepdims=True) if standardised else x
        pca = PCA().fit(seen)
        for out_chans in (64, 120):  # 32 components; all the usable ones (the rest of the filters stay random)
            pairs, share = principal_filters(torch.from_numpy(x), out_chans, standardised)
            k = min(out_chans // 2, usable)
            assert pairs.shape == (2 * k, 49)
            p = pairs.numpy()
            np.testing.assert_array_equal(p[1::2], -p[0::2])
            np.testing.assert_allclose(_aligned(p[0::2], pca.components_[:k]), 1.0, atol=1e-6)
            np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-9)
            assert share == pytest.approx(pca.explained_variance_ratio_[:k].sum(), rel=1e-9)
            if standardised:  # zero-mean filters: a standardised kernel holds them as they are
                assert np.abs(p.sum(1)).max() < 1e-9
    # a fixed sign: each component's entry of largest magnitude is positive
    p = principal_filters(torch.from_numpy(x), 64, False)[0].numpy()[0::2]
    assert (p[np.arange(len(p)), np.abs(p).argmax(1)] > 0).all()
    # patches that never vary give no component (the stem keeps its random start), not an error
    pairs, share = components(torch.zeros(49, 49, dtype=torch.float64), 64)
    assert pairs.shape == (0, 49) and share == 0.0


def test_patches_are_drawn_from_4096_images_and_200000_positions_by_the_runs_seed_alone():
    """5,000 random 28-px images, a 7x7/2 conv (121 positions each): 4,096 images, 49 positions in each (200,704
    patches, summed chunk by chunk); the same seed draws the same patches, another seed others; the run's global
    random stream is untouched."""
    g = torch.Generator().manual_seed(0)
    ds = InMemoryDataset(torch.randint(0, 256, (5000, 1, 28, 28), dtype=torch.uint8, generator=g),
                         torch.zeros(5000, dtype=torch.long), ["a"])
    conv = torch.nn.Conv2d(1, 64, 7, 2)
    state = torch.get_rng_state()
    a, n = patch_moments(ds, lambda x: x.float() / 255, conv, True, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert n == MAX_IMAGES == 4096 and a.n == 4096 * 49
    b, _ = patch_moments(ds, lambda x: x.float() / 255, conv, True, seed=0)
    c, _ = patch_moments(ds, lambda x: x.float() / 255, conv, True, seed=1)
    assert torch.equal(a.outer, b.outer) and not torch.equal(a.outer, c.outer)
    every = InMemoryDataset(ds.images[:3000], ds.labels[:3000], ["a"])  # every image: the seed draws positions alone
    d0, n = patch_moments(every, lambda x: x.float() / 255, conv, True, seed=0)
    d1, _ = patch_moments(every, lambda x: x.float() / 255, conv, True, seed=1)
    assert n == 3000 and d0.n == 3000 * 67  # ceil(200,000 / 3,000) of 121 positions
    assert not torch.allclose(d0.outer, d1.outer, rtol=1e-6)  # other positions (not the sums of another order)
    small = InMemoryDataset(ds.images[:100], ds.labels[:100], ["a"])  # 12,100 positions in all: every one
    m, n = patch_moments(small, lambda x: x.float() / 255, conv, False, seed=0)
    p = torch.nn.functional.unfold(small.images.float() / 255, 7, stride=2).transpose(1, 2).reshape(-1, 49).double()
    assert n == 100 and m.n == 12_100
    torch.testing.assert_close(m.outer, p.T @ p, rtol=1e-10, atol=1e-9)  # summed in chunks: another order
    torch.testing.assert_close(m.sum, p.sum(0), rtol=1e-10, atol=1e-9)


def _digit_patches(cfg, model_config) -> np.ndarray:
    """Every 7x7 window at stride 2 (no padding) of the run's training images as the model reads them (its size,
    normalisation), cut by numpy, each window's own mean taken out (what the standardised stem can see)."""
    spec = training_data(cfg.data)
    data = prepare(model_config, train=spec.train)
    x = data.transform(data.train)(spec.train.images).double().numpy()  # (N, 1, 16, 16)
    win = np.lib.stride_tricks.sliding_window_view(x, (7, 7), axis=(2, 3))[:, :, ::2, ::2]  # (N, 1, 5, 5, 7, 7)
    p = win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 49)
    return p - p.mean(1, keepdims=True)


def test_a_run_starts_from_its_training_patches_components_and_pca_frozen_keeps_them(tmp_path):
    """The stem of a run on digits (16 px: 1,500 images, 37,500 windows, every one sampled) spans the windows'
    leading principal components by scikit-learn, in +- pairs; frozen, it ends training as it began; "pca" trains it;
    every other weight starts as a random-stem run's (the components come from a generator of their own)."""
    runs = {}
    for mode in ("pca-frozen", "pca", "random"):
        out = tmp_path / mode
        train(tiny_cfg(out, **{"model.stem_init": mode, "schedule.epochs": 1, "model.overrides": HYBRID}), max_steps=0)
        runs[mode, 0] = load_file(out / "final.safetensors")
        if mode != "random":
            train(tiny_cfg(out, **{"model.stem_init": mode, "schedule.epochs": 1, "model.overrides": HYBRID}))
            runs[mode, 1] = load_file(out / "final.safetensors")
    model = vitkit.load(tmp_path / "pca-frozen" / "final.safetensors")
    patches = _digit_patches(tiny_cfg(tmp_path / "x"), model.config)
    assert len(patches) == 37_500
    pca = PCA().fit(patches)
    varies = int((pca.explained_variance_ratio_ > 1e-9).sum())
    assert varies == 24  # 8-px digits upsampled to 16: their windows vary along 24 directions of 49
    start = runs["pca-frozen", 0][STEM].double().flatten(1).numpy()  # (64, 49)
    d = start[:48] / np.linalg.norm(start[:48], axis=1, keepdims=True)
    np.testing.assert_allclose(d[1::2], -d[0::2], atol=1e-6)
    comps = pca.components_
    np.testing.assert_allclose(_aligned(d[0::2][:8], comps[:8]), 1.0, atol=1e-4)  # the leading, well-separated ones
    proj = d[0::2] @ comps[:24].T  # all 24 within the span of the 24
    np.testing.assert_allclose(np.linalg.norm(proj, axis=1), 1.0, atol=1e-4)
    rand = runs["random", 0]
    assert torch.equal(runs["pca-frozen", 0][STEM][48:], rand[STEM][48:])  # the other 16 filters: their random start
    # each component took the length of the random filter it replaced
    torch.testing.assert_close(runs["pca-frozen", 0][STEM].flatten(1).norm(dim=1), rand[STEM].flatten(1).norm(dim=1))
    assert not torch.equal(runs["pca-frozen", 0][STEM][:48], rand[STEM][:48])
    for k in rand:  # nothing else moved: the run's random stream is untouched
        if k != STEM:
            assert torch.equal(runs["pca-frozen", 0][k], rand[k]), k
    assert torch.equal(runs["pca", 0][STEM], runs["pca-frozen", 0][STEM])
    assert torch.equal(runs["pca-frozen", 1][STEM], runs["pca-frozen", 0][STEM])  # frozen: kept
    assert not torch.equal(runs["pca-frozen", 1]["head.weight"], runs["pca-frozen", 0]["head.weight"])  # it trained
    assert (runs["pca", 1][STEM] - runs["pca", 0][STEM]).abs().max() > 1e-4  # not frozen: the stem trained


def test_a_conv_stems_first_conv_takes_the_windows_components_without_taking_each_ones_mean_out(tmp_path):
    """A ViT with a conv stem (2x2/2 conv, BatchNorm, GELU, then a 1x1 layer; not weight-standardised): the first
    conv's 16 filters are the 4 components of every 2x2 window (centred on the windows' mean only), each with its
    negative, and 8 random."""
    stem = {"conv_stem": [16, 16], "conv_stem_kernels": [2, 1], "conv_stem_strides": [2, 1]}
    runs = {}
    for mode in ("pca", "random"):
        train(tiny_cfg(tmp_path / mode, **{"model.stem_init": mode, "model.overrides": stem}), max_steps=0)
        runs[mode] = load_file(tmp_path / mode / "final.safetensors")["patch_embed.backbone.0.conv.weight"]
    model = vitkit.load(tmp_path / "pca" / "final.safetensors")
    spec = training_data(tiny_cfg(tmp_path / "x").data)
    data = prepare(model.config, train=spec.train)
    x = data.transform(data.train)(spec.train.images).double().numpy()  # (N, 1, 16, 16)
    windows = x.reshape(len(x), 8, 2, 8, 2).transpose(0, 1, 3, 2, 4).reshape(-1, 4)  # every 2x2/2 window
    comps = PCA().fit(windows).components_  # 4 of them
    w = runs["pca"].double().flatten(1).numpy()  # (16, 4)
    d = w[:8] / np.linalg.norm(w[:8], axis=1, keepdims=True)
    np.testing.assert_allclose(d[1::2], -d[0::2], atol=1e-6)
    np.testing.assert_allclose(_aligned(d[0::2], comps), 1.0, atol=1e-5)
    assert torch.equal(runs["pca"][8:], runs["random"][8:])


def test_a_frozen_stem_before_groupnorm_trains_rgb_images(tmp_path):
    """Grey digits read as RGB: the stem's output is channels-last, and torch's CPU GroupNorm backward crashed on a
    channels-last input needing no gradient (a frozen stem before the trained norm); the backbone now hands it NCHW."""
    out = tmp_path / "rgb"
    res = train(tiny_cfg(out, **{"model.stem_init": "pca-frozen", "model.overrides": {**HYBRID, "in_chans": 3}}),
                max_steps=3)
    assert res["step"] == 3 and load_file(out / "final.safetensors")[STEM].shape == (64, 3, 7, 7)


def test_a_pca_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    kw = {"model.stem_init": "pca-frozen", "schedule.epochs": 2, "run.ckpt_every": 10, "model.overrides": HYBRID}
    train(tiny_cfg(tmp_path / "ref", **kw))
    train(tiny_cfg(tmp_path / "cut", **kw), max_steps=20)
    train(tiny_cfg(tmp_path / "cut", **kw))
    assert _max_diff(tmp_path / "ref" / "final.safetensors", tmp_path / "cut" / "final.safetensors") == 0


def test_two_processes_start_from_rank_0s_stem(tmp_path):
    """FSDP2 broadcasts nothing: each rank's shard of the stem is rank 0's filters, so 2 processes at 32 images each
    end at 1 process's weights at 64 (SGD; GroupNorm, per image)."""
    args = ("optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0", "model.stem_init=pca",
            "model.overrides.hybrid_layers=[1]", "--max-steps", "6")
    _train_procs(tmp_path / "one", *args)
    _train_procs(tmp_path / "fsdp", *args, "run.strategy=fsdp", nproc=2, torchrun=True)
    assert _max_diff(tmp_path / "one" / "final.safetensors", tmp_path / "fsdp" / "final.safetensors") <= 1e-5


@pytest.mark.parametrize("extra, match", [
    ({"model.stem_init": "whiten"}, "one of random, pca, pca-frozen"),
    ({"model.stem_init": True}, "one of random, pca, pca-frozen"),
    ({"model.stem_init": "pca"}, "convolutional stem"),  # a plain ViT: a patch embedding, no stem
    ({"model.stem_init": "pca", "model.overrides": HYBRID, "model.linear_probe": True}, "linear_probe"),
    ({"model.stem_init": "pca", "model.overrides": HYBRID, "model.lora": 4}, "lora"),
])
def test_what_pca_cannot_initialise_is_refused_before_any_work(tmp_path, extra, match):
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=match):
        train(tiny_cfg(out, **extra))
    assert not (out / "checkpoints").exists()


def test_a_checkpoint_and_an_image_folder_are_refused(tmp_path):
    train(tiny_cfg(tmp_path / "a", **{"schedule.epochs": 1, "model.overrides": HYBRID}), max_steps=2)
    with pytest.raises(UsageError, match="model.checkpoint brings a trained one"):
        train(tiny_cfg(tmp_path / "b", **{"model.stem_init": "pca",
                                          "model.checkpoint": str(tmp_path / "a" / "final.safetensors")}))
    root = tmp_path / "imgs"
    _write_png_folder(root)
    with pytest.raises(UsageError, match="held in memory"):
        train(tiny_cfg(tmp_path / "c", **{"model.stem_init": "pca", "data.dataset": str(root), "data.batch_size": 8,
                                          "data.num_workers": 0, "model.overrides": {**HYBRID, "in_chans": 3}}))
    assert not (tmp_path / "b" / "checkpoints").exists() and not (tmp_path / "c" / "checkpoints").exists()
