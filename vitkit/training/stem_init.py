"""`model.stem_init`: a convolutional stem's first conv set from the training images before the first step.

"pca": the conv's filters become the leading principal components of the image patches it reads (as the model reads
them: at its size, normalised), each beside its negative, so that the ReLU (or GELU) after the norm passes both signs
of every component. It is the first layer of airbench (Jordan 2024, "94% on CIFAR-10 in 3.29 Seconds on a Single
GPU", arXiv 2404.00498, Sec. 3.2, after tysam-code's hlb-cifar10), where it was the largest single gain, and the basis
the ViT paper's own patch embeddings learn (Fig. 7, left: "RGB embedding filters (first 28 principal components)").
Airbench divides each component by the square root of its variance (whitening) and drops the norm after the conv;
here the norm stays. It normalises what the conv gives (BatchNorm each channel; the hybrid's GroupNorm(32) each
group of channels: at the stem's width 64 each component with its negative, at wider stems several components
together), so a filter's length does not change the forward pass: each component takes the length of the random
filter it replaces, which keeps the step sizes the optimizer sees. The covariance is about the patches' mean; a
weight-standardised conv (the hybrid's `StdConv2d`) subtracts each filter's mean, so each patch's own mean is taken
out first and the components are those it can hold (orthogonal to a constant patch); a plain conv (`ConvStem`'s)
keeps them. Components along which the patches do not vary (images upsampled to the model's size vary along fewer)
are not used: the filters past twice the usable components keep their random initialisation.

"pca-frozen": the same, and the conv's weight never trains (no gradient), as airbench keeps its first layer.

The patches: up to 4,096 training images (a draw from the run's seed), in each about 200,000 / (images) of the
positions the conv visits without padding (a second draw; all of them where there are fewer), their first and second
moments summed in float64 image by image, so memory stays at a few images' patches whatever the images' size. Every
rank holds rank 0's filters (summed over the ranks with the others' zero: exact), so FSDP2, which does not broadcast
a model, starts every shard alike. A resumed run computes them again and then loads its checkpoint over them. Only a
training set held in memory (fashion-mnist, cifar10, cifar100, digits, .npz arrays) is sampled; image folders, file
lists and shards are refused, as packed batches (`data.max_patches`) are: every rank says so before any work.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError

log = logging.getLogger(__name__)

STEM_INITS = ("random", "pca", "pca-frozen")
MAX_IMAGES = 4096
MAX_PATCHES = 200_000
CHUNK_ELEMENTS = 1 << 22  # an unfolded chunk of images: ~16 MB of float32 patches


def check_stem_init_config(cfg) -> None:
    """What model.stem_init needs of the config alone, said before the data loads: a known value, random weights to
    set (no checkpoint), every weight of the model training, images at the model's size."""
    m = cfg.model
    if m.stem_init not in STEM_INITS:
        raise UsageError(f"model.stem_init={m.stem_init!r}: one of {', '.join(STEM_INITS)}")
    if m.stem_init == "random":
        return
    if m.checkpoint:
        raise UsageError(f"model.stem_init={m.stem_init} sets a randomly initialised stem from the data; "
                         f"model.checkpoint brings a trained one: set model.stem_init=random to fine-tune it")
    if m.linear_probe or m.lora:
        raise UsageError(f"model.stem_init={m.stem_init} initialises a stem that trains from scratch; model.linear_probe "
                         f"and model.lora keep the backbone frozen: set model.stem_init=random")
    if cfg.data.max_patches:
        raise UsageError(f"model.stem_init={m.stem_init} samples patches from images at the model's size; "
                         f"data.max_patches packs them at their own: set model.stem_init=random")


def check_stem_init(cfg, model: nn.Module, train) -> None:
    """What model.stem_init needs of the model and the training set, said on every rank before any work: a
    convolutional stem whose first conv is followed by a norm, and images held in memory."""
    if cfg.model.stem_init == "random":
        return
    stem_conv(model, cfg.model.stem_init)
    if getattr(train, "decodes", True) or not hasattr(train, "images"):
        raise UsageError(f"model.stem_init={cfg.model.stem_init} samples patches from a training set held in memory "
                         f"(fashion-mnist, cifar10, cifar100, digits, .npz arrays); image folders, file lists and "
                         f"shards are not sampled: set model.stem_init=random")


def stem_conv(model: nn.Module, mode: str = "pca") -> tuple[nn.Conv2d, bool]:
    """The first conv of `model`'s convolutional stem, and whether it is weight-standardised: the hybrid's ResNet
    stem (`StdConv2d`, then its norm) or a `ConvStem`'s first layer (conv, then BatchNorm). A UsageError otherwise."""
    from ..models.layers import StdConv2d
    from ..models.layers.conv_stem import ConvStem
    from ..models.resnet import ResNetBackbone

    backbone = getattr(getattr(model, "patch_embed", None), "backbone", None)
    if isinstance(backbone, ResNetBackbone):
        conv = backbone.stem.conv
    elif isinstance(backbone, ConvStem):
        conv = backbone[0].conv
    else:
        raise UsageError(f"model.stem_init={mode} sets the first conv of a ViT's convolutional stem, which a norm "
                         f"follows: the paper's hybrids (a ResNet stem, e.g. r26_vit_s32, r50_vit_b16) and ViTs with "
                         f"model.overrides.conv_stem. This model has no such stem (a plain ViT's patch embedding, "
                         f"Swin's, and BiT's stem, which a max-pool follows, are not set): set model.stem_init=random")
    return conv, isinstance(conv, StdConv2d)


class Moments:
    """The first and second moments of patches (rows of d values) summed in float64, chunk by chunk; standardised:
    each patch's own mean taken out as it is added."""

    def __init__(self, d: int, standardised: bool) -> None:
        self.n, self.standardised = 0, standardised
        self.sum = torch.zeros(d, dtype=torch.float64)
        self.outer = torch.zeros(d, d, dtype=torch.float64)

    def add(self, patches: torch.Tensor) -> None:
        x = patches.double()
        if self.standardised:
            x = x - x.mean(1, keepdim=True)
        self.n += len(x)
        self.sum += x.sum(0)
        self.outer += x.T @ x

    def covariance(self) -> torch.Tensor:
        """About the patches' mean (the norm after the conv subtracts what the filters give on average)."""
        mean = self.sum / max(self.n, 1)
        cov = self.outer / max(self.n, 1) - torch.outer(mean, mean)
        return (cov + cov.T) / 2


def components(cov: torch.Tensor, out_chans: int) -> tuple[torch.Tensor, float]:
    """Unit filters from a covariance (d, d): the leading min(out_chans // 2, usable) eigenvectors, each followed by
    its negative ([v1, -v1, v2, -v2, ...]), and the share of the variance they hold. Usable: the directions the
    patches vary along (an eigenvalue above 1e-9 of the total). Signs: each component's entry of largest magnitude
    positive (where eigenvalues repeat, the basis within their span is the LAPACK build's)."""
    d = cov.shape[0]
    values, vectors = torch.linalg.eigh(cov.double())  # ascending
    values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)  # descending
    total = float(values.sum())
    usable = int((values > 1e-9 * total).sum()) if total > 0 else 0
    k = min(out_chans // 2, usable)  # a direction the patches never vary along would feed its norm a constant
    v = vectors[:, :k].T  # (k, d)
    idx = v.abs().argmax(1)
    v = v * torch.sign(v[torch.arange(k), idx]).unsqueeze(1)
    pairs = torch.stack([v, -v], 1).reshape(2 * k, d)  # (2k, d): v1, -v1, v2, -v2, ...
    return pairs, float(values[:k].sum()) / total if total > 0 else 0.0


def principal_filters(patches: torch.Tensor, out_chans: int, standardised: bool) -> tuple[torch.Tensor, float]:
    """`components` of the covariance of `patches` (n, d); standardised: each patch's own mean taken out first (a
    weight-standardised conv cannot hold it)."""
    m = Moments(patches.shape[1], standardised)
    m.add(patches)
    return components(m.covariance(), out_chans)


def patch_moments(train, transform, conv: nn.Conv2d, standardised: bool, seed: int) -> tuple[Moments, int]:
    """The moments of the training images' patches as `conv` reads them (module docstring), and how many images
    they came from. `transform`: the model's evaluation transform of `train` (its size, channels, normalisation)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)  # the run's global random stream is untouched
    n = min(len(train), MAX_IMAGES)
    idx = torch.randperm(len(train), generator=g)[:n]
    per_image = math.ceil(MAX_PATCHES / n)
    kernel, stride = conv.kernel_size, conv.stride

    def patches(i: torch.Tensor) -> torch.Tensor:  # (b, C*kh*kw, L): resized, normalised, channels as the model reads
        return F.unfold(transform(train.batch(i, torch.device("cpu"))[0]).float(), kernel, stride=stride)

    first = patches(idx[:1])  # sizes the chunks: ~CHUNK_ELEMENTS of patches at a time
    moments = Moments(first.shape[1], standardised)
    for chunk in idx.split(max(1, min(256, CHUNK_ELEMENTS // max(first.numel(), 1)))):
        p = patches(chunk)
        b, d, positions = p.shape
        if positions > per_image:  # a draw of positions in each image
            keep = torch.rand(b, positions, generator=g).argsort(1)[:, :per_image]  # (b, m)
            p = p.gather(2, keep.unsqueeze(1).expand(b, d, per_image))
        moments.add(p.transpose(1, 2).reshape(-1, d))  # (b*m, C*kh*kw)
    return moments, n


def apply_stem_init(cfg, model: nn.Module, data, dist) -> None:
    """model.stem_init="pca" or "pca-frozen" on `model` (before any wrapping), from `data` (the run's `Splits`):
    the stem's first conv holds the training patches' principal components (module docstring); "pca-frozen" leaves
    its weight without a gradient. Every rank ends with rank 0's filters."""
    mode = cfg.model.stem_init
    if mode == "random":
        return
    conv, standardised = stem_conv(model, mode)
    w = conv.weight  # (O, C, kh, kw)
    out_chans = w.shape[0]
    if dist.main:
        moments, images = patch_moments(data.train, data.transform(data.train), conv, standardised, cfg.run.seed)
        pairs, share = components(moments.covariance(), out_chans)
        with torch.no_grad():
            new = w.detach().float().cpu().reshape(out_chans, -1).clone()
            norms = new[: len(pairs)].norm(dim=1, keepdim=True)  # the random filters' lengths, kept
            new[: len(pairs)] = pairs.float() * norms
        if len(pairs):
            log.info(f"model.stem_init={mode}: the stem's {w.shape[2]}x{w.shape[3]} conv set to the leading "
                     f"{len(pairs) // 2} principal components (each with its negative; {share:.1%} of the variance) "
                     f"of {moments.n:,} patches of {images:,} training images"
                     + (f"; its other {out_chans - len(pairs)} filters keep their random initialisation"
                        if len(pairs) < out_chans else ""))
        else:
            log.warning(f"model.stem_init={mode}: the training images' patches do not vary (every one alike): the "
                        f"stem keeps its random initialisation")
    else:
        new = torch.zeros(out_chans, w[0].numel())
    if dist.enabled:  # rank 0's filters on every rank: the others add zeros, exactly
        new = torch.tensor(dist.sum(new.flatten().double().tolist()), dtype=torch.float32).reshape(out_chans, -1)
    with torch.no_grad():
        w.copy_(new.reshape(w.shape).to(w.dtype))
    if mode == "pca-frozen":
        w.requires_grad_(False)
