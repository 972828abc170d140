"""A run fitted to a wall-clock budget (`schedule.time_budget`): the longest schedule that ends, evaluations
included, within the seconds given, on the machine the run finds itself on.

The run times its own steps (from its 16th on: the first compile and warm the caches) and fixes its length in
optimizer steps (at most `schedule.epochs`) as soon as 8 steps are timed, again at the warmup's end (the learning
rate before it does not depend on the length), then every ~5% of the budget (32 steps at least) from the steps since
the last fit, so that a machine that slows down (another job, a VM's neighbours) shortens the rest of the run rather
than overrunning it. A length fixed again moves the learning rate of a linear or cosine decay by as much as the
length changed (a few percent, where the machine's speed holds).

The clock starts where the command started: the `vitkit` command writes its start into VITKIT_RUN_START (wall
clock, seconds since the epoch), which `vitkit train --nproc N`'s processes inherit; a run started from Python
without it counts from its `train()` call.

`budgeted_total` is the arithmetic; `Budget` keeps the clock and the measurements for the training loop.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from .. import env

EVAL_VIEW_COST = 1 / 3  # an evaluated view costs about a third of a trained image (the forward alone, no backward)
# a TTA cascade (run.tta_margin) sees every image in two views and a share of them in the others: that share, before an
# evaluation has measured it (fashion-mnist-fast at 0.75: 18-19% of the held-out images; above it the first evaluation
# may overrun its estimate, by at most (1 - share) of the other views)
CASCADE_SHARE = 1 / 3
MIN_MEASURED_STEPS = 8  # a length is fixed only from at least this many timed steps
FIRST_TIMED_STEP = 16  # a process's first steps compile and warm the caches: not timed
FIT_EVERY = 0.05  # of the budget: how often the length is fixed again (in steps, at the step time measured)
MIN_FIT_EVERY = 32  # steps
RESERVE, RESERVE_S = 0.01, 2.0  # kept back for what is not counted (the final weights and report, the clock's noise)
START_ENV = "VITKIT_RUN_START"


def clock() -> float:
    """The budget's clock (seconds, monotonic)."""
    return time.perf_counter()


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so that a budget counts the whole command, its
    interpreter's start-up included; 0.0 where the system does not say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces and ')'
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return 0.0
    return age if 0.0 <= age < 1e7 else 0.0


def command_started(process_entry: bool) -> str:
    """VITKIT_RUN_START's value for a command starting now: the wall-clock time this process started where the
    command is the process (`vitkit ...`, `python -m vitkit ...`), else now (`vitkit.cli.main([...])` called in a
    long-lived process)."""
    return repr(time.time() - (process_age() if process_entry else 0.0))


def run_start(called_at: float) -> float:
    """When the run's command started, on `clock()`'s clock: VITKIT_RUN_START (written by the `vitkit` command,
    inherited by the processes it launches) where it holds a wall-clock time from the last 30 days, not in the
    future; else `called_at` (the `train()` call of a run started from Python)."""
    started = env.get(START_ENV)
    if started is None:
        return called_at
    age = time.time() - started
    return clock() - age if 0.0 <= age <= 30 * 86400 else called_at


def evaluations_from(first: int, total: int, eval_steps: int) -> int:
    """How many evaluations a run ending at `total` evaluates at steps `first` to `total`: every `eval_steps` (0:
    none; never at step 0) and at the last step."""
    if total < max(first, 1):
        return 0
    periodic = total // eval_steps - max(first - 1, 0) // eval_steps if eval_steps > 0 else 0
    return periodic + (0 if eval_steps > 0 and total % eval_steps == 0 else 1)


def weighed(cost: Callable[[int, int, int], float] | None, start: int, end: int, total: int) -> float:
    """Steps `start` to `end - 1` of a `total`-step run in whole steps: `cost(start, end, total)` (progressive
    resizing's smaller steps), or one each without a cost."""
    return end - start if cost is None else cost(start, end, total)


def budgeted_total(*, budget_s: float, spent_s: float, step: int, step_s: float, max_total: int, eval_steps: int,
                   eval_s: float, final_s: float = 0.0, cost: Callable[[int, int, int], float] | None = None) -> int:
    """The most optimizer steps (at least `step`, at most `max_total`) whose run ends within `budget_s`.

    spent_s: seconds the run has taken up to the end of step `step` (the evaluation due there, if any, not yet run:
    it is counted with the rest); step_s: seconds a step takes; eval_s: seconds one evaluation takes, every
    `eval_steps` steps (0: none) and at the last; final_s: seconds of what comes once after the last step (the test
    set's evaluation after a held-out split's); cost: what steps `start` to `end - 1` of a `total`-step run cost in
    steps of `step_s`, `cost(start, end, total)` (progressive resizing's smaller steps, `vitkit.training.resize`;
    None: end - start), not falling as `total` grows."""
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    left = budget_s * (1 - RESERVE) - RESERVE_S - spent_s - final_s

    def fits(total: int) -> bool:
        return weighed(cost, step, total, total) * step_s + evaluations_from(step, total, eval_steps) * eval_s <= left

    lo, hi = step, max(step, max_total)  # fits(lo) may be false: the budget is spent; the run then ends at `step`
    while lo < hi:  # the largest total that fits: its cost grows with the total
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def saved_state(meta: dict, budget_s: float, max_total: int) -> tuple[int | None, float]:
    """What a checkpoint says of an earlier part of a budgeted run: the length it fixed (None where it fixed none,
    or under another budget or maximum: that run's length is not this one's) and the seconds it took (its training
    time where it kept no budget clock). Values of the wrong type, negative or not finite count as absent."""
    def number(v) -> float | None:
        return float(v) if type(v) in (int, float) and math.isfinite(v) and v >= 0 else None

    spent = number(meta.get("spent"))
    spent = spent if spent is not None else (number(meta.get("elapsed")) or 0.0)
    total = meta.get("total")
    same = number(meta.get("budget")) == float(budget_s) and type(meta.get("max_total")) is int \
        and meta["max_total"] == max_total
    return (total if type(total) is int and total >= 0 and same else None), spent


@dataclass
class Budget:
    """The clock and the step-time measurements of a run with `schedule.time_budget`.

    seconds: the budget; started: when the run's command started, on `clock()`'s clock (`run_start`);
    spent_before: what earlier parts of the run (before a resume) took; eval_views: the images times views of one
    evaluation (the EMA's too); images_per_step: trained images per optimizer step (the global batch, all ranks);
    cost: what steps `start` to `end - 1` of a `total`-step run cost in whole steps, `cost(start, end, total)`
    (progressive resizing, `vitkit.training.resize.Resizer.costs`; None: each step one), so that a step time
    measured on smaller steps is a whole step's."""

    seconds: float
    started: float
    spent_before: float
    eval_views: int
    images_per_step: int
    mark: tuple[int, float] | None = None  # (step, clock) where the current measurement began
    paused: float = 0.0  # seconds of evaluation (and `exclude`d steps) inside the measurement, not step time
    excluded: float = 0.0  # whole steps' worth of `exclude`d steps inside the measurement
    new_size_s: float = 0.0  # seconds of the slowest `exclude`d step: a size's first (its compile), to come again
    eval_measured: float | None = None  # seconds the latest periodic evaluation took
    fits: int = 0  # how many times the length was fixed
    fit_every: int = MIN_FIT_EVERY  # steps between fits after the first: ~FIT_EVERY of the budget
    cost: Callable[[int, int, int], float] | None = None

    def due(self, step: int, warmup: int) -> bool:
        """Whether to fix the length at the end of step `step` (the same answer on every rank: it depends on steps
        alone): as soon as enough steps are timed, at the warmup's end, then every `fit_every` steps."""
        if self.mark is None or step - self.mark[0] < MIN_MEASURED_STEPS:
            return False
        return self.fits == 0 or step == warmup or step - self.mark[0] >= self.fit_every

    def spent(self) -> float:
        """Seconds the whole run has taken: earlier parts and this one since its command started."""
        return self.spent_before + clock() - self.started

    def begin(self, step: int) -> None:
        """Time steps from the end of step `step` on."""
        self.mark, self.paused, self.excluded = (step, clock()), 0.0, 0.0

    def step_time(self, step: int, total: int) -> float | None:
        """Seconds per step since `begin` (a whole step's, where `cost` counts smaller ones: `total` is the length
        those steps ran under), evaluations and `excluded` steps left out; None before enough steps."""
        if self.mark is None or step - self.mark[0] < MIN_MEASURED_STEPS:
            return None
        steps = weighed(self.cost, self.mark[0], step, total) - self.excluded
        if steps <= 0:
            return None
        return max(clock() - self.mark[1] - self.paused, 1e-9) / steps

    def exclude(self, seconds: float, steps: float) -> None:
        """A step that took `seconds` and counts `steps` whole ones is not the machine's rate (progressive resizing's
        first step at a new size compiles it): its seconds are spent, not measured, and what such a step costs is
        kept (`new_size_s`: the largest seen) for the sizes still to come."""
        self.new_size_s = max(self.new_size_s, seconds)
        if self.mark is not None:
            self.paused += seconds
            self.excluded += steps

    def evaluated(self, seconds: float) -> None:
        """A periodic evaluation took `seconds`: measured, and not step time."""
        self.paused += seconds
        self.eval_measured = seconds

    def eval_time(self, step_s: float) -> float:
        """The seconds of one evaluation: the latest one's, or before any its views at a third of a trained
        image's cost."""
        if self.eval_measured is not None:
            return self.eval_measured
        return self.eval_views * EVAL_VIEW_COST * step_s / max(self.images_per_step, 1)
