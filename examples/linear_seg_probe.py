"""A linear segmentation probe on vitkit's dense features (DINOv3's linear segmentation evaluation, arXiv 2508.10104:
BatchNorm + a 1x1 conv on the frozen features of four layers, logits upsampled bilinearly, per-pixel cross-entropy).

The data is made offline from real images: Fashion-MNIST items pasted at random places on a black 56x56 canvas, the
mask being each pixel's item class (1..10) or background (0); training canvases from the training split, held-out
canvases from the test split. The backbone is a small ViT (patch 4, 8 blocks, no position embedding) trained for a
few seconds to classify single 28x28 items, then run frozen on the 56x56 canvases (dynamic_img_size); the same probe
on the randomly initialised ViT is the baseline, and each probe reads either DINOv3's four levels or the last alone.

    .venv/bin/python examples/linear_seg_probe.py            # < 2 minutes on 2 CPU cores
    .venv/bin/python examples/linear_seg_probe.py --smoke    # < 20 s: fewer canvases and steps
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import vitkit
from vitkit.data.datasets import load_fashion_mnist

CANVAS, ITEMS, CLASSES = 56, 2, 11  # canvas side, items per canvas, background + 10 Fashion-MNIST classes


def canvases(images: torch.Tensor, labels: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n canvases (n, 1, 56, 56) in [0, 1] and their masks (n, 56, 56): ITEMS items pasted at random places (a later
    item covers an earlier one where it is not background, pixel > 0.05)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, 1, CANVAS, CANVAS)
    y = torch.zeros(n, CANVAS, CANVAS, dtype=torch.long)
    pick = torch.randint(len(labels), (n, ITEMS), generator=g)
    at = torch.randint(CANVAS - 28 + 1, (n, ITEMS, 2), generator=g)
    for i in range(n):
        for k in range(ITEMS):
            item = images[pick[i, k], 0].float() / 255  # (28, 28)
            r, c = at[i, k].tolist()
            fg = item > 0.05
            x[i, 0, r:r + 28, c:c + 28][fg] = item[fg]
            y[i, r:r + 28, c:c + 28][fg] = labels[pick[i, k]] + 1
    return x, y


def backbone(seed: int) -> nn.Module:
    """A small ViT for 28x28 items that takes any size. No position embedding: trained on 28x28 items and run on
    56x56 canvases, a learned one would be resampled from 7x7 to 14x14, and an item in a corner would read as an item
    squeezed into a quarter of the image (in our runs that cost the probe ~0.02 mIoU)."""
    torch.manual_seed(seed)
    return vitkit.create_model("vit_ti16", img_size=28, patch_size=4, in_chans=1, embed_dim=64, depth=8, num_heads=2,
                               mlp_dim=128, num_classes=10, classifier="gap", pos_embed="none", dynamic_img_size=True)


def pretrain(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int, batch: int = 128) -> None:
    """Classify single 28x28 items for `steps` AdamW steps (one cycle: warm-up, then cosine decay)."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(labels), (batch,), generator=g)
        x, y = (images[idx].float() / 255 - 0.5) / 0.5, labels[idx]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    return (model((images.float() / 255 - 0.5) / 0.5).argmax(1) == labels).float().mean().item()


def features(model: nn.Module, x: torch.Tensor, batch: int = 128) -> torch.Tensor:
    """The four DINOv3 levels of each canvas, concatenated: (n, 4 D, 14, 14), stored in bf16."""
    dense = vitkit.DenseBackbone(model, frozen=True)  # blocks [1, 3, 5, 7], stride 4, after the final norm
    out = []
    for i in range(0, len(x), batch):
        levels = dense((x[i:i + batch] - 0.5) / 0.5)  # {"stage1".."stage4": (B, D, 14, 14)}
        out.append(torch.cat(list(levels.values()), dim=1).bfloat16())
    return torch.cat(out)


class LinearProbe(nn.Module):
    """DINOv3's `LinearHead`: BatchNorm over the concatenated levels, then a 1x1 conv to the classes."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, classes, 1)

    def forward(self, f: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        logits = self.conv(self.bn(f))  # (B, 4D, 14, 14) -> (B, K, 14, 14)
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)  # -> (B, K, 56, 56)


def train_probe(f: torch.Tensor, y: torch.Tensor, epochs: int, batch: int = 100) -> LinearProbe:
    torch.manual_seed(0)
    probe = LinearProbe(f.shape[1], CLASSES)
    opt = torch.optim.AdamW(probe.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * ((len(y) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(2)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(batch):
            loss = F.cross_entropy(probe(f[idx].float(), y.shape[-2:]), y[idx])  # per pixel
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return probe.eval()


@torch.no_grad()
def scores(probe: LinearProbe, f: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """On held-out canvases: (mean IoU over the 11 classes, the IoU of foreground against background whatever the
    item's class, pixel accuracy)."""
    conf = torch.zeros(CLASSES, CLASSES, dtype=torch.long)  # (true, predicted)
    for i in range(0, len(y), 256):
        pred = probe(f[i:i + 256].float(), y.shape[-2:]).argmax(1)
        pairs = y[i:i + 256].flatten() * CLASSES + pred.flatten()
        conf += torch.bincount(pairs, minlength=CLASSES**2).view(CLASSES, CLASSES)
    tp = conf.diag().float()
    union = conf.sum(0) + conf.sum(1) - conf.diag()
    present = union > 0
    fg = conf[1:, 1:].sum() / (conf.sum() - conf[0, 0])  # foreground pixels predicted as some item, over the union
    return (tp[present] / union[present]).mean().item(), fg.item(), (tp.sum() / conf.sum()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a quick run: fewer canvases and steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="the backbone's training steps (batch 128)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train, n_test, steps, epochs = (200, 100, 30, 10) if args.smoke else (1000, 300, 300, 20)
    steps = steps if args.steps is None else args.steps
    t0 = time.perf_counter()
    train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
    x_tr, y_tr = canvases(train.images, train.labels, n_train, seed=args.seed)
    x_te, y_te = canvases(test.images, test.labels, n_test, seed=args.seed + 1)

    trained = backbone(args.seed)
    pretrain(trained, train.images, train.labels, steps)
    acc = accuracy(trained, test.images[:2000], test.labels[:2000])
    print(f"backbone: ViT patch 4, D 64, 8 blocks, {steps} steps of 128 single items: top-1 {acc:.3f} on 2000 test "
          f"items ({time.perf_counter() - t0:.1f} s)")
    dense = vitkit.DenseBackbone(trained)
    print(f"levels: blocks {dense.layers} (DINOv3's four evenly spaced), strides {list(dense.strides.values())}, "
          f"{dense.out_channels} channels each, after the final norm")
    rows = []
    for name, model in (("trained", trained), ("random init", backbone(args.seed).eval())):
        f_tr, f_te = features(model, x_tr), features(model, x_te)
        d = f_tr.shape[1] // 4
        for probe_on, sl in (("4 levels", slice(None)), ("last level", slice(3 * d, None))):
            probe = train_probe(f_tr[:, sl], y_tr, epochs)
            rows.append((name, probe_on, *scores(probe, f_te[:, sl], y_te)))
    print(f"\nheld-out canvases: {n_test} ({CANVAS}x{CANVAS}, {ITEMS} test-split items each), {CLASSES} classes")
    print(f"{'backbone':<12} {'probe on':<11} {'mIoU':>6} {'fg IoU':>6} {'pixel acc':>9}")
    for name, probe_on, m, fg, pa in rows:
        print(f"{name:<12} {probe_on:<11} {m:6.3f} {fg:6.3f} {pa:9.3f}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
