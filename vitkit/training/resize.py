"""Progressive resizing (`schedule.resize_from`): the first part of a run trains on the images made smaller, the rest at
the model's size, so that the early steps, whose coarse features do not need every pixel, cost less and the run fits
more of them (FFCV's ResNet recipes, Leclerc et al. 2023; fast.ai's DAWNBench runs). A ViT takes the smaller grid of
patches with its position embedding resampled to it (`dynamic_img_size`).

The size rises linearly with the step from `resize_from` pixels (the image's height; the width keeps the image's
aspect ratio) to the model's size at `resize_until` of the way from the run's first step to its last (the last is
always at the model's size), the height held at a multiple of the model's patch height and the width at one of its
patch width (a hybrid's patch is its whole stride, the ResNet's included), never below `resize_from`. It is a function
of (step, the run's length) alone: every rank trains at the same size, and a resumed run continues where it was. A
smaller step costs about its pixels' share of a whole one (a step at 20 x 20 of 28 x 28 takes 0.50x in fp32 and 0.58x
in bf16 for fashion-mnist-fast's hybrid on a 2-core Zen 4, benchmarks/NOTES.md section 59); a time budget
(`vitkit.training.budget`) counts steps by that share, and each size's first step (its compile under run.compile) as
spent time, not as the rate.

Each batch is resized after its augmentation (bilinear with antialiasing: the whole image, smaller, not a crop of it).
Evaluation is at the model's size, and the saved model keeps the fixed size it was built with (`as_built`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError


def full_size(model: nn.Module) -> tuple[int, int]:
    """The model's training size (H, W)."""
    h, w = model.config.img_size if isinstance(model.config.img_size, (tuple, list)) else (model.config.img_size,) * 2
    return int(h), int(w)


def stride(model: nn.Module) -> tuple[int, int]:
    """The pixels a token covers along each side (H, W): a size's multiples (the patch size; a hybrid's is its whole
    stride)."""
    p = model.config.patch_size
    ph, pw = (p[0], p[1]) if isinstance(p, (tuple, list)) else (p, p)
    return int(ph), int(pw)


class Resizer:
    """The training size of each step of a run of progressive resizing.

    full: the model's size (H, W); start: the first height (pixels, a multiple of the height's step, below H); until:
    the share of the run at which the size reaches `full` (its last step is always at `full`); step_px: the
    multiples of the height and of the width (an int: both)."""

    def __init__(self, full: tuple[int, int], start: int, until: float, step_px: int | tuple[int, int]) -> None:
        self.full, self.start, self.until = full, start, until
        self.step_px, self.step_w = step_px if isinstance(step_px, tuple) else (step_px, step_px)
        # the heights it trains at, smallest first; the full one last
        self.heights = list(range(start, full[0], self.step_px)) + [full[0]]
        self.built_dynamic = False  # the model's dynamic_img_size before the run set it (`as_built`)
        self.seen: set[tuple[int, int]] = set()  # the sizes this process has trained at (each compiled once)

    def _ramp(self, total: int) -> float:
        """The step from which a `total`-step run trains at the model's size: `until` of the way from its first
        step to its last, so that the last is always at the model's size."""
        return self.until * (total - 1)

    def height(self, step: int, total: int) -> int:
        """The height step `step` (0-based) of a `total`-step run trains at."""
        ramp = self._ramp(total)
        if step >= ramp:
            return self.full[0]
        h = self.start + (self.full[0] - self.start) * step / ramp
        return max(self.start, min(self.full[0], int(h // self.step_px) * self.step_px))

    def size(self, step: int, total: int) -> tuple[int, int]:
        """(H, W) of step `step`."""
        return self._size_of(self.height(step, total))

    def _size_of(self, h: int) -> tuple[int, int]:
        """(H, W) at height `h`: the width in the image's aspect ratio, at the size's multiple."""
        if h == self.full[0]:
            return self.full
        w = max(self.step_w, round(self.full[1] * h / self.full[0] / self.step_w) * self.step_w)
        return h, min(w, self.full[1])

    def cost(self, step: int, total: int) -> float:
        """What step `step` costs in whole steps at the model's size: its pixels' share."""
        h, w = self.size(step, total)
        return h * w / (self.full[0] * self.full[1])

    def first_at(self, height: int, total: int) -> int:
        """The first step of a `total`-step run that trains at `height` or more (sizes only rise with the step)."""
        if height <= self.start:
            return 0
        s = min(total, max(0, math.ceil((height - self.start) * self._ramp(total) / (self.full[0] - self.start))))
        while s > 0 and self.height(s - 1, total) >= height:  # the float arithmetic's last step, made exact
            s -= 1
        while s < total and self.height(s, total) < height:
            s += 1
        return s

    def sizes_to_come(self, step: int, total: int) -> int:
        """How many sizes the steps from `step` on train at that this process has not trained at yet (each a
        compile under run.compile): those above step `step`'s, the model's own last."""
        h = self.height(step, total)
        return sum(1 for hh in self.heights if hh > h and self._size_of(hh) not in self.seen)

    def costs(self, start: int, end: int, total: int) -> float:
        """What steps `start` to `end - 1` of a `total`-step run cost, in whole steps at the model's size (steps past
        `total`, a budget's candidate lengths, count whole)."""
        bounds = [self.first_at(h, total) for h in self.heights] + [max(total, end)]
        out = 0.0
        for h, lo, hi in zip(self.heights, bounds, bounds[1:]):  # steps lo to hi - 1 train at height h
            n = min(end, hi) - max(start, lo)
            if n > 0:
                hh, ww = self._size_of(h)
                out += n * hh * ww / (self.full[0] * self.full[1])
        return out

    def __call__(self, x: torch.Tensor, step: int, total: int) -> torch.Tensor:
        """A training batch (B, C, H, W) at step `step`'s size."""
        size = self.size(step, total)
        if tuple(x.shape[-2:]) == size:
            return x
        # (B, C, H, W) -> (B, C, h, w): the whole image, smaller
        return F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)


def resizer_for(cfg, model: nn.Module) -> Resizer | None:
    """The run's Resizer (None without schedule.resize_from), its settings checked against the model and the
    rest of the config: said before any work."""
    s = cfg.schedule
    if not (isinstance(s.resize_until, (int, float)) and not isinstance(s.resize_until, bool)
            and 0.0 < s.resize_until <= 1.0):
        raise UsageError(f"schedule.resize_until={s.resize_until!r}: the share of the run's steps at which the size "
                         "reaches the model's, in (0, 1]")
    if s.resize_from is None:
        return None
    c = model.config
    if getattr(c, "arch", "") != "vit" or not hasattr(model, "set_dynamic_img_size"):
        raise UsageError("schedule.resize_from trains a ViT (plain or hybrid) on smaller images, its position "
                         "embedding resampled to their grid: not a CNN (BiT) or Swin; unset schedule.resize_from")
    if cfg.data.max_patches:
        raise UsageError("schedule.resize_from resizes batches of one size; data.max_patches packs images of their "
                         "own sizes: unset one of them")
    if cfg.distill.teacher or getattr(c, "distilled", False) or cfg.model.objective != "classify":
        raise UsageError("schedule.resize_from trains classifiers without a teacher (no distillation, no "
                         "model.objective=mpp): unset schedule.resize_from")
    full, (ph, pw) = full_size(model), stride(model)
    start = s.resize_from
    if not (isinstance(start, int) and not isinstance(start, bool) and ph <= start < full[0] and start % ph == 0):
        raise UsageError(f"schedule.resize_from={start!r}: the first training height in pixels, a whole multiple of "
                         f"the model's patch height {ph} below its height {full[0]} (e.g. "
                         f"{max(ph, (full[0] * 2 // 3) // ph * ph)})")
    resizer = Resizer(full, start, float(s.resize_until), (ph, pw))
    resizer.built_dynamic = bool(c.dynamic_img_size)
    model.set_dynamic_img_size(True)  # any grid of patches; evaluation stays at the model's size
    return resizer


@contextlib.contextmanager
def as_built(resizer: Resizer | None, *modules: nn.Module | None):
    """The modules' configs as the run built them while they are saved: progressive resizing's `dynamic_img_size`
    is the training's, not the model's (a saved fixed-size model stays one)."""
    if resizer is None:
        yield
        return
    configs = [m.config for m in modules if m is not None and hasattr(m, "config")]
    for c in configs:
        c.dynamic_img_size = resizer.built_dynamic
    try:
        yield
    finally:
        for c in configs:
            c.dynamic_img_size = True
