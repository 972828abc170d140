"""A run fitted to a wall-clock budget (`schedule.time_budget`): the longest schedule that ends, evaluations
included, within the seconds given, on the machine the run finds itself on.

The run measures its own step time and fixes its length in optimizer steps (at most `schedule.epochs`): first at
the end of the warmup (the learning rate before it does not depend on the length), then again at every epoch's end
from the step time measured so far, so that a machine that slows down (another job, a VM's neighbours) shortens the
rest of the run rather than overrunning it. A length fixed again moves the learning rate of a linear or cosine decay
by as much as the length changed (a few percent, where the machine's speed holds).

`budgeted_total` is the arithmetic; `Budget` keeps the clock and the measurements for the training loop.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

EVAL_VIEW_COST = 1 / 3  # an evaluated view costs about a third of a trained image (the forward alone, no backward)
MIN_MEASURED_STEPS = 8  # a length is fixed only from at least this many timed steps
RESERVE = 0.01  # of the budget, kept back for what is not counted: the final weights and report, the clock's noise


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so that a budget counts the whole command, its start-up
    included; 0.0 where the system does not say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return 0.0
    return age if 0.0 <= age < 1e7 else 0.0


def evaluations_after(step: int, total: int, eval_steps: int) -> int:
    """How many evaluations a run evaluates after `step` if it ends at `total`: every `eval_steps` (0: none) and at
    the last step."""
    if total <= step:
        return 0
    periodic = total // eval_steps - step // eval_steps if eval_steps > 0 else 0
    return periodic + (0 if eval_steps > 0 and total % eval_steps == 0 else 1)


def budgeted_total(*, budget_s: float, spent_s: float, step: int, step_s: float, max_total: int, eval_steps: int,
                   eval_s: float, final_s: float = 0.0) -> int:
    """The most optimizer steps (at least `step`, at most `max_total`) whose run ends within `budget_s`.

    spent_s: seconds the run has taken so far; step: the steps done; step_s: seconds a step takes; eval_s: seconds
    one evaluation takes, every `eval_steps` steps (0: none) and at the last; final_s: seconds of what comes once
    after the last step (the test set's evaluation after a held-out split's)."""
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    left = budget_s * (1 - RESERVE) - spent_s - final_s

    def fits(total: int) -> bool:
        return (total - step) * step_s + evaluations_after(step, total, eval_steps) * eval_s <= left

    lo, hi = step, max(step, max_total)  # fits(lo) may be false: the budget is spent; the run then ends at `step`
    while lo < hi:  # the largest total that fits: its cost grows with the total
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass
class Budget:
    """The clock and the step-time measurements of a run with `schedule.time_budget`.

    seconds: the budget; spent_before: what earlier parts of the run (before a resume) took; eval_views: the images
    times views of one evaluation (the EMA's and the held-out split's test evaluation counted by the caller);
    images_per_step: trained images per optimizer step (a rank's)."""

    seconds: float
    spent_before: float
    eval_views: int
    images_per_step: int
    started: float = 0.0  # perf_counter() at this process's start, estimated from its age
    mark: tuple[int, float] | None = None  # (step, clock) where the current measurement began
    paused: float = 0.0  # seconds of evaluation inside the measurement, not step time
    fits: int = 0  # how many times the length was fixed

    def __post_init__(self) -> None:
        self.started = time.perf_counter() - process_age()

    def spent(self) -> float:
        """Seconds the whole run has taken: earlier parts and this process since its start."""
        return self.spent_before + time.perf_counter() - self.started

    def begin(self, step: int) -> None:
        """Start timing steps at `step` (after the first steps, which compile and warm the caches)."""
        self.mark, self.paused = (step, time.perf_counter()), 0.0

    def step_time(self, step: int) -> float | None:
        """Seconds per step since `begin`, evaluations excluded; None before enough steps."""
        if self.mark is None or step - self.mark[0] < MIN_MEASURED_STEPS:
            return None
        return max(time.perf_counter() - self.mark[1] - self.paused, 1e-9) / (step - self.mark[0])

    def eval_time(self, step_s: float) -> float:
        """The estimated seconds of one evaluation: its views at a third of a trained image's cost."""
        return self.eval_views * EVAL_VIEW_COST * step_s / max(self.images_per_step, 1)
