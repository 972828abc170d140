"""`model.stem_init`: a convolutional stem's first conv set from the training images before the first step.

"pca": the conv's filters become the leading principal components of the image patches it reads (as the model reads
them: at its size, normalised), each beside its negative, so that the ReLU (or GELU) after the norm passes both signs
of every component. It is the first layer of airbench (Jordan 2024, "94% on CIFAR-10 in 3.29 Seconds on a Single
GPU", arXiv 2404.00498, Sec. 3.2, after tysam-code's hlb-cifar10), where it was the largest single gain, and the basis
the ViT paper's own patch embeddings learn (Fig. 7, left: "RGB embedding filters (first 28 principal components)").
Airbench divides each component by the square root of its variance (whitening) and drops the norm after the conv;
here the norm stays, and it gives each channel its own scale, so only the directions matter: each component takes the
length of the random filter it replaces, which keeps the step sizes the optimizer sees. A weight-standardised conv
(the hybrid's `StdConv2d`) subtracts each filter's mean, so each patch's own mean is taken out first and the
components are those it can hold (orthogonal to a constant patch); a plain conv (`ConvStem`'s) keeps them, centred
on the patches' mean. Filters beyond twice the components the patches vary along keep their random initialisation.

"pca-frozen": the same, and the conv's weight never trains (no gradient), as airbench keeps its first layer.

The patches: up to 4,096 training images (a draw from the run's seed), every position the conv visits without
padding, at most 200,000 of them (a second draw). Every rank holds rank 0's filters (summed over the ranks with the
others' zero: exact), so FSDP2, which does not broadcast a model, starts every shard alike. A resumed run computes
them again and then loads its checkpoint over them. Only a training set held in memory (fashion-mnist, cifar10,
cifar100, digits, .npz arrays) is sampled; image folders, file lists and shards are refused, as packed batches
(`data.max_patches`) are.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError

log = logging.getLogger(__name__)

STEM_INITS = ("random", "pca", "pca-frozen")
MAX_IMAGES = 4096
MAX_PATCHES = 200_000


def check_stem_init(cfg, model: nn.Module) -> None:
    """What model.stem_init needs, said before any work: a known value, a model with a convolutional stem whose first
    conv is followed by a norm, random weights to set (no checkpoint), and every weight of the model training."""
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
    stem_conv(model)


def stem_conv(model: nn.Module) -> tuple[nn.Conv2d, bool]:
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
        raise UsageError("model.stem_init=pca sets the first conv of a convolutional stem followed by a norm: the "
                         "paper's hybrids (a ResNet stem, e.g. r26_vit_s32, r50_vit_b16) and ViTs with "
                         "model.overrides.conv_stem; this model has none (set model.stem_init=random)")
    return conv, isinstance(conv, StdConv2d)


def principal_filters(patches: torch.Tensor, out_chans: int, standardised: bool) -> tuple[torch.Tensor, float]:
    """Unit filters from `patches` (n, d): the leading min(out_chans // 2, usable) principal components, each
    followed by its negative ([v1, -v1, v2, -v2, ...]), and the share of the patches' variance they hold. The
    covariance is about the patches' mean (the norm after the conv centres each channel); standardised: each patch's
    own mean taken out before (a weight-standardised conv cannot hold it). Usable: the components along which the
    patches vary (variance above 1e-9 of the total; at most d - 1 standardised, d else): images upsampled to the
    model's size vary along fewer. Signs: each component's entry of largest magnitude positive."""
    x = patches.double()
    if standardised:
        x = x - x.mean(1, keepdim=True)
    x = x - x.mean(0, keepdim=True)
    cov = x.T @ x / max(len(x), 1)  # (d, d)
    values, vectors = torch.linalg.eigh(cov)  # ascending
    values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)  # descending
    total = float(values.sum())
    usable = int((values > 1e-9 * total).sum()) if total > 0 else 0  # a direction the patches never vary along
    k = min(out_chans // 2, usable)  # would feed its norm a constant: those filters keep their random start
    v = vectors[:, :k].T  # (k, d)
    idx = v.abs().argmax(1)
    v = v * torch.sign(v[torch.arange(k), idx]).unsqueeze(1)  # a fixed sign: the same filters on any LAPACK
    pairs = torch.stack([v, -v], 1).reshape(2 * k, -1)  # (2k, d): v1, -v1, v2, -v2, ...
    return pairs, float(values[:k].sum()) / total if total > 0 else 0.0


def sample_patches(data, conv: nn.Conv2d, seed: int) -> tuple[torch.Tensor, int]:
    """Patches (n, C*k*k) of the training images as `conv` reads them, as float32, and how many images they came
    from. `data`: the run's `Splits` (the model's own evaluation transform: its size, channels and normalisation)."""
    train = data.train
    if getattr(train, "decodes", True) or not hasattr(train, "images"):
        raise UsageError("model.stem_init=pca samples patches from a training set held in memory (fashion-mnist, "
                         "cifar10, cifar100, digits, .npz arrays); image folders, file lists and shards are not "
                         "sampled: set model.stem_init=random")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    n = min(len(train), MAX_IMAGES)
    idx = torch.randperm(len(train), generator=g)[:n]
    transform = data.transform(train)
    kernel, stride = conv.kernel_size, conv.stride
    rows = []
    for chunk in idx.split(256):
        x, _ = train.batch(chunk, torch.device("cpu"))
        x = transform(x).float()  # (b, C, H, W): resized, normalised, channels replicated as the model reads them
        p = F.unfold(x, kernel, stride=stride)  # (b, C*kh*kw, L)
        rows.append(p.transpose(1, 2).reshape(-1, p.shape[1]))  # (b*L, C*kh*kw)
    patches = torch.cat(rows)
    if len(patches) > MAX_PATCHES:
        patches = patches[torch.randperm(len(patches), generator=g)[:MAX_PATCHES]]
    return patches, n


def apply_stem_init(cfg, model: nn.Module, data, dist) -> None:
    """model.stem_init="pca" or "pca-frozen" on `model` (before any wrapping), from `data` (the run's `Splits`):
    the stem's first conv holds the training patches' principal components (module docstring); "pca-frozen" leaves
    its weight without a gradient. Every rank ends with rank 0's filters."""
    mode = cfg.model.stem_init
    if mode == "random":
        return
    conv, standardised = stem_conv(model)
    w = conv.weight  # (O, C, kh, kw)
    out_chans = w.shape[0]
    if dist.main:
        patches, images = sample_patches(data, conv, cfg.run.seed)
        pairs, share = principal_filters(patches, out_chans, standardised)
        with torch.no_grad():
            new = w.detach().float().cpu().reshape(out_chans, -1).clone()
            norms = new[: len(pairs)].norm(dim=1, keepdim=True)  # the random filters' lengths, kept
            new[: len(pairs)] = pairs.float() * norms
        log.info(f"model.stem_init={mode}: the stem's {w.shape[2]}x{w.shape[3]} conv set to the leading {len(pairs) // 2} "
                 f"principal components (each with its negative; {share:.1%} of the variance) of {len(patches):,} "
                 f"patches of {images:,} training images"
                 + (f"; its other {out_chans - len(pairs)} filters keep their random initialisation"
                    if len(pairs) < out_chans else ""))
    else:
        new = torch.zeros(out_chans, w[0].numel())
    if dist.enabled:  # rank 0's filters on every rank: the others add zeros, exactly
        new = torch.tensor(dist.sum(new.flatten().double().tolist()), dtype=torch.float32).reshape(out_chans, -1)
    with torch.no_grad():
        w.copy_(new.reshape(w.shape).to(w.dtype))
    if mode == "pca-frozen":
        w.requires_grad_(False)
