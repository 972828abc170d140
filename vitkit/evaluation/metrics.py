"""Top-1/top-5 and per-class accuracy, the confusion matrix (as a PNG) and a JSON report."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..cache import atomic_write
from ..errors import UsageError
from ..machine.precision import autocast
from ..data.datasets import load_batches, eval_index_batches
from ..data.naflex import hflip_packed
from ..models.layers.packing import PackedBatch


@dataclass
class EvalResult:
    acc1: float
    acc5: float
    loss: float
    n: int
    skipped: int
    per_class: list[float]
    confusion: np.ndarray  # (K, K): rows true class, columns predicted
    classes: list[str]

    def to_dict(self) -> dict:
        return {"acc1": self.acc1, "acc5": self.acc5, "loss": self.loss, "n": self.n, "skipped": self.skipped,
                "per_class": {c: a for c, a in zip(self.classes, self.per_class)}, "confusion": self.confusion.tolist()}


TTA_MODES = ("none", "flip", "flip-shift", "flip-shift2")


PACKED_TTA_MODES = ("none", "flip")  # images at their own sizes: no shifted views


def check_tta(mode: str, what: str = "test-time augmentation", packed: bool = False) -> str:
    """`mode` if it is one of TTA_MODES (of PACKED_TTA_MODES for packed batches: `packed`), else a UsageError (a
    ValueError) naming `what` (e.g. the config key)."""
    if mode not in TTA_MODES:
        raise UsageError(f"unknown {what} {mode!r}; choose one of {', '.join(TTA_MODES)}")
    if packed and mode not in PACKED_TTA_MODES:
        raise UsageError(f"{what} {mode!r} of packed batches (native aspect ratios): "
                         f"{' or '.join(repr(m) for m in PACKED_TTA_MODES)} only")
    return mode


def tta_views(x: torch.Tensor, mode: str = "none") -> list[torch.Tensor]:
    """The test-time-augmentation views of a model-ready batch x (B, C, H, W).

    "none": x. "flip": x and its horizontal mirror (for models trained with flips).
    "flip-shift": those two, each also moved by one pixel down, up, right and left (edges replicated): 10 views.
    "flip-shift2": those ten, and the two moved by two pixels each way: 18 views, for models trained on crops of
        images padded by two or more pixels (benchmarks/NOTES.md section 50: +0.14 and +0.22 over "flip-shift" on
        Fashion-MNIST's held-out split). The edges are replicated, where the training crops pad with zeros: the same
        on black borders such as Fashion-MNIST's, not on photographs.
    """
    if check_tta(mode) == "none":
        return [x]
    views = [x, x.flip(-1)]
    if mode in ("flip-shift", "flip-shift2"):
        h, w = x.shape[-2:]
        p = 2 if mode == "flip-shift2" else 1
        padded = F.pad(x, (p, p, p, p), mode="replicate")  # (B, C, H + 2p, W + 2p)
        for d in range(1, p + 1):
            # window corners: the content moves down, up, right, left by d pixels
            for dy, dx in ((p - d, p), (p + d, p), (p, p - d), (p, p + d)):
                moved = padded[..., dy:dy + h, dx:dx + w]  # (B, C, H, W)
                views += [moved, moved.flip(-1)]
    return views


def check_tta_margin(margin: float | None, mode: str, what: str = "the TTA margin") -> float | None:
    """`margin` if None or in [0, 1] with a mode of more than two views ("flip-shift", "flip-shift2"), else a
    UsageError naming `what`."""
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0.0 <= margin <= 1.0:
        raise UsageError(f"{what} must be a number in [0, 1] (a difference of two probabilities), got {margin!r}")
    if mode not in ("flip-shift", "flip-shift2"):
        raise UsageError(f"{what} chooses which images get the shifted views: with TTA flip-shift or flip-shift2, "
                         f"not {mode!r}")
    return float(margin)


def _mean_log_probs(logp: torch.Tensor) -> torch.Tensor:
    """(V, B, K) log-probabilities -> the log of their mean probabilities (B, K)."""
    return logp.logsumexp(0) - math.log(logp.shape[0])


def tta_log_probs(model: nn.Module, x: torch.Tensor, mode: str = "none", margin: float | None = None,
                  lockstep: bool = False) -> torch.Tensor:
    """log of the class probabilities (B, K) averaged over the views of `tta_views`, in float32.

    margin: a cascade (flip-shift and flip-shift2): every image is first seen with its mirror image; where the two
        views' mean probabilities put the first class ahead of the second by `margin` or more, that mean is the
        answer, and only the other images are seen in all the views (None: every image in every view; 1 is not
        quite that, as a pair whose probabilities saturate to one class keeps its answer). On Fashion-MNIST's
        held-out split, 0.75 with flip-shift2 sent 15-19% of the images on and gave the same predictions as every
        view for all of them (six runs; benchmarks/NOTES.md section 62), at under a third of the 18 views' cost. How
        many go on depends on how confident the model is: label smoothing 0.2 sent 27%. The confident
        images' loss and top-5 are their two views'. lockstep: every call runs the same forwards (FSDP2's ranks):
        the second stage runs on one image where no image goes on.
    """
    if isinstance(x, PackedBatch):  # images at their own sizes: the identity and, for "flip", the mirror images
        check_tta(mode, packed=True)
        views = [x] if mode == "none" else [x, hflip_packed(x, model.config.patch_size)]
    else:
        views = tta_views(x, mode)
    if check_tta_margin(margin, mode) is None:  # packed batches have no shifted views: refused with a margin
        return _mean_log_probs(torch.stack([model(v).float().log_softmax(-1) for v in views]))  # (V, B, K) -> (B, K)
    first = torch.stack([model(v).float().log_softmax(-1) for v in views[:2]])  # (2, B, K): the image, its mirror
    logp = _mean_log_probs(first)  # (B, K)
    top2 = logp.exp().topk(min(2, logp.shape[-1]), -1).values  # (B, 2)
    gap = top2[:, 0] - top2[:, 1] if top2.shape[-1] == 2 else torch.ones_like(top2[:, 0])
    unsure = (gap < margin).nonzero().squeeze(1)  # (U,)
    run = unsure if len(unsure) or not lockstep else torch.zeros(1, dtype=torch.long, device=x.device)
    if len(run):
        rest = torch.stack([model(v).float().log_softmax(-1) for v in tta_views(x[run], mode)[2:]])  # (V - 2, U, K)
        if len(unsure):
            logp[unsure] = _mean_log_probs(torch.cat([first[:, unsure], rest]))  # (V, U, K) -> (U, K)
    return logp


@torch.no_grad()
def evaluate(model: nn.Module, data, transform, *, batch_size: int = 256, device: str | torch.device = "cpu",
             precision: str = "fp32", num_workers: int = 0, tta: str = "none", tta_margin: float | None = None, dist=None,
             lockstep: bool = False) -> EvalResult:
    """Accuracy of `model` on `data` (an in-memory or file dataset); `transform` maps uint8 batches to model inputs.

    tta: test-time augmentation (`tta_views`): the prediction is the mean of the views' probabilities.
    tta_margin: a cascade over those views (`tta_log_probs`): an image whose mirror pair's mean probabilities put
        the first class ahead of the second by this margin or more is not seen in the other views.
    dist: a `vitkit.training.distributed.Dist`: each rank evaluates its own contiguous part and the counts are summed, so
        every sample counts exactly once; every rank gets the whole result. lockstep: every rank runs the same
        number of forward passes (a model sharded with FSDP2).
    """
    check_tta(tta)  # before any work
    check_tta_margin(tta_margin, tta)
    was_training = model.training
    model.eval()
    k = len(data.classes)
    conf = torch.zeros(k, k, dtype=torch.float64)
    top5 = loss_sum = n = skipped = 0.0
    dev = torch.device(device)
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    plan = eval_index_batches(len(data), batch_size, rank, world, lockstep)
    for (x, y, s), (_, counts) in zip(load_batches(data, [b for b, _ in plan], num_workers, dev), plan):
        if len(y) == 0:
            skipped += s if counts else 0
            continue
        with autocast(precision, dev):
            # log-probabilities: top-k and the loss as from logits
            logits = tta_log_probs(model, transform(x), tta, tta_margin, lockstep)
        if not counts:
            continue
        skipped += s
        loss_sum += F.nll_loss(logits.double(), y, reduction="sum").item()
        pred = logits.argmax(1)
        conf += torch.bincount((y * k + pred).cpu(), minlength=k * k).view(k, k).double()
        top5 += (logits.topk(min(5, k), 1).indices == y[:, None]).any(1).sum().item()
        n += len(y)
    if dist is not None and dist.enabled:
        totals = dist.sum([top5, loss_sum, n, skipped, *conf.flatten().tolist()])
        top5, loss_sum, n, skipped = totals[:4]
        conf = torch.tensor(totals[4:], dtype=torch.float64).view(k, k)
    model.train(was_training)
    if n == 0:
        raise UsageError("no image of the evaluation set could be read")
    conf = conf.round().long()
    n, skipped = int(round(n)), int(round(skipped))
    per_class = (conf.diag().float() / conf.sum(1).clamp(min=1).float()).tolist()
    return EvalResult(conf.diag().sum().item() / n, top5 / n, loss_sum / n, n, skipped, per_class, conf.numpy(), list(data.classes))


def save_confusion_png(result: EvalResult, path: str | Path, title: str = "") -> Path:
    """The confusion matrix, row-normalised, with counts, as a PNG (at most 40 x 40 inches: class names shown up to
    100 classes). Drawn on its own Agg canvas: pyplot's backend, a notebook's included, is left as it is."""
    # matplotlib: its import costs start-up time, and only figures need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # matplotlib: its import costs start-up time, and only figures need it

    k = len(result.classes)
    norm = result.confusion / np.maximum(result.confusion.sum(1, keepdims=True), 1)
    size = min(max(4.0, 0.55 * k + 2), 40.0)
    fig = Figure(figsize=(size + 1, size))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    if k <= 100:
        ax.set_xticks(range(k), result.classes, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(k), result.classes, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if k <= 30:
        for i in range(k):
            for j in range(k):
                if result.confusion[i, j]:
                    ax.text(j, i, str(result.confusion[i, j]), ha="center", va="center", fontsize=6,
                            color="white" if norm[i, j] > 0.5 else "black")
    ax.set_title(title or f"top-1 {result.acc1:.2%}, top-5 {result.acc5:.2%} (n = {result.n})")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format=path.suffix[1:] or "png"))
    return path


def write_report(result: EvalResult, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    atomic_write(path, lambda p: p.write_text(json.dumps({**result.to_dict(), **(extra or {})}, indent=1)))
    return path
