"""schedule.time_budget: the arithmetic of the length that fits, the clock, and runs that fix their length. No test
depends on how fast this machine is: the runs below keep time on a virtual clock that moves 0.1 s a training step
(and not at all for anything else)."""
import functools
import json
import math
import os
import random
import subprocess
import sys
import time

import pytest

import vitkit.training.trainer as trainer_mod
from vitkit import cli
from vitkit.errors import UsageError
from vitkit.training import budget as budgeting
from vitkit.training import checkpoint, train
from vitkit.training.budget import (RESERVE, RESERVE_S, START_ENV, budgeted_total, evaluations_from, run_start,
                                    saved_state)

from test_training import tiny_cfg

STEP_S, EVAL_S = 0.1, 0.5  # the virtual clock's seconds per training step and per evaluation


def test_evaluations_from_a_step():
    assert evaluations_from(0, 100, 0) == 1  # no periodic ones: the last step's
    assert evaluations_from(0, 100, 10) == 10  # steps 10, 20, ..., 100 (the last is one of them); never step 0
    assert evaluations_from(1, 95, 10) == 10  # steps 10, ..., 90 and 95
    assert evaluations_from(40, 95, 10) == 7  # 40 (not run yet when the length is fixed at it), ..., 90 and 95
    assert evaluations_from(46, 92, 23) == 3  # 46, 69, 92
    assert evaluations_from(95, 95, 10) == 1 and evaluations_from(96, 95, 10) == 0


def test_budgeted_total_is_the_longest_run_that_fits():
    assert 100 * (1 - RESERVE) - RESERVE_S == pytest.approx(97)  # what a 100 s budget spends
    # 10 s spent at step 10, 1 s a step, one 5 s evaluation at the end: 10 + (T - 10) + 5 <= 97 -> T = 92
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5) == 92
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=50, eval_steps=0, eval_s=5) == 50
    assert budgeted_total(budget_s=100, spent_s=120, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5) == 10
    # the test set's evaluation after the held-out split's (final_s) comes off the steps
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5,
                          final_s=20) == 72
    # every 10 steps a 2 s evaluation: T + 2 * evaluations(T) <= 97 -> T = 80 (80 + 2 * 8 = 96)
    assert budgeted_total(budget_s=100, spent_s=0, step=0, step_s=1.0, max_total=1000, eval_steps=10, eval_s=2) == 80
    # fixed at step 20, where an evaluation is due: it counts (60 steps and 7 evaluations of 5 s: 95 <= 97)
    assert budgeted_total(budget_s=100, spent_s=0, step=20, step_s=1.0, max_total=1000, eval_steps=10, eval_s=5) == 80
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="step_s"):
            budgeted_total(budget_s=100, spent_s=0, step=0, step_s=bad, max_total=10, eval_steps=0, eval_s=0)
    rng = random.Random(0)
    for _ in range(300):  # against the plain search over every length
        kw = dict(budget_s=rng.uniform(1, 500), spent_s=rng.uniform(0, 200), step=rng.randrange(0, 50),
                  step_s=rng.uniform(0.05, 3), eval_steps=rng.choice([0, 1, 7, 25]), eval_s=rng.uniform(0, 20),
                  final_s=rng.choice([0.0, rng.uniform(0, 30)]))
        kw["max_total"] = kw["step"] + rng.randrange(0, 400)
        left = kw["budget_s"] * (1 - RESERVE) - RESERVE_S - kw["spent_s"] - kw["final_s"]
        fits = [t for t in range(kw["step"], kw["max_total"] + 1)
                if (t - kw["step"]) * kw["step_s"] + evaluations_from(kw["step"], t, kw["eval_steps"]) * kw["eval_s"] <= left]
        assert budgeted_total(**kw) == (max(fits) if fits else kw["step"]), kw


def test_a_checkpoint_says_what_an_earlier_part_fixed_and_spent():
    meta = {"total": 57, "spent": 4.0, "budget": 8.0, "max_total": 92, "elapsed": 3.0}
    assert saved_state(meta, 8.0, 92) == (57, 4.0)
    assert saved_state(meta, 9.0, 92) == (None, 4.0)  # another budget: its length is not this run's
    assert saved_state(meta, 8.0, 100) == (None, 4.0)  # another most steps (schedule.epochs)
    assert saved_state({"elapsed": 3.0}, 8.0, 92) == (None, 3.0)  # a run without a budget clock: its training time
    for total in (True, -1, 5.0, "57", None):
        assert saved_state({**meta, "total": total}, 8.0, 92)[0] is None, total
    for spent in (math.nan, math.inf, -4.0, True, "4"):
        assert saved_state({**meta, "spent": spent}, 8.0, 92)[1] == 3.0, spent  # the training time instead
    assert saved_state({"spent": math.nan}, 8.0, 92) == (None, 0.0)


def test_the_clock_starts_with_the_command(monkeypatch):
    code = "import time; time.sleep(0.5); from vitkit.training.budget import process_age; print(process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 120  # the sleep and the imports before the clock was read: counted
    monkeypatch.delenv(START_ENV, raising=False)
    assert run_start(12.5) == 12.5  # started from Python: from the train() call
    monkeypatch.setenv(START_ENV, repr(time.time() - 100))
    assert budgeting.clock() - run_start(12.5) == pytest.approx(100, abs=5)  # the command's start, 100 s ago
    for bad_time in (time.time() + 3600, time.time() - 40 * 86400):  # in the future, or a stale leftover
        monkeypatch.setenv(START_ENV, repr(bad_time))
        assert run_start(12.5) == 12.5
    monkeypatch.setenv(START_ENV, "soon")
    with pytest.raises(UsageError, match=START_ENV):
        run_start(12.5)
    # `vitkit` as the process counts from the process's start; `cli.main([...])` inside a longer-lived one from the
    # call; either way the command puts back what it found
    assert float(budgeting.command_started(True)) == pytest.approx(time.time() - budgeting.process_age(), abs=2)
    monkeypatch.setenv(START_ENV, "123.0")
    seen, demo = {}, cli.COMMANDS["demo"]

    @functools.wraps(demo)  # the command's own arguments, as the parser reads them
    def spy(*args, **kwargs):
        seen["start"] = float(os.environ[START_ENV])
        return 0
    monkeypatch.setitem(cli.COMMANDS, "demo", spy)
    assert cli.main(["demo"]) == 0
    assert seen["start"] == pytest.approx(time.time(), abs=5)
    assert os.environ[START_ENV] == "123.0"


@pytest.fixture
def virtual_clock(monkeypatch):
    """The budget's clock moves STEP_S a training step (`now[1]` from step `now[2]` on), and EVAL_S an evaluation,
    from a start at 1000 s; no VITKIT_RUN_START (a run started from Python counts from its train() call)."""
    now = [1000.0, STEP_S, 10**9]
    monkeypatch.setattr(budgeting, "clock", lambda: now[0])
    real_step, real_eval = trainer_mod.train_step, trainer_mod.evaluate_and_keep_best

    def step(run, batches, i, g):
        out = real_step(run, batches, i, g)
        now[0] += STEP_S if i + 1 < now[2] else now[1]
        return out

    def evaluate(*args, **kwargs):
        out = real_eval(*args, **kwargs)
        now[0] += EVAL_S
        return out
    monkeypatch.setattr(trainer_mod, "train_step", step)
    monkeypatch.setattr(trainer_mod, "evaluate_and_keep_best", evaluate)
    monkeypatch.delenv(START_ENV, raising=False)
    return now


def _records(out, split=None):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in lines if r.get("split") == split]


def test_a_run_trains_what_fits_and_keeps_it_on_resume(tmp_path, virtual_clock):
    """8 s on digits (23 steps an epoch, at most 4 epochs: 92 steps; a warmup of 12): timed from step 16, the length
    is fixed at step 24 to 57 steps ((8 * 0.99 - 2 - 2.4 - 0.15 s for the final evaluation) / 0.1 s = 33 more) and
    confirmed at step 56. Stopped at step 40 (and evaluated there: 0.5 s) and resumed, the run keeps the 57 and
    counts the 4.5 s before the stop; resumed under another budget (forced), it fixes its own."""
    out = tmp_path / "run"
    cfg = {"schedule.time_budget": 8, "run.ckpt_every": 4}
    assert train(tiny_cfg(out, **cfg), max_steps=40)["step"] == 40
    assert [(r["step"], r["total"]) for r in _records(out, "budget")] == [(24, 57)]
    assert _records(out, "budget")[0]["step_s"] == pytest.approx(STEP_S)
    meta = checkpoint.read_meta(checkpoint.latest(out))
    assert (meta["step"], meta["total"], meta["budget"], meta["max_total"]) == (40, 57, 8.0, 92)
    assert meta["spent"] == pytest.approx(4.5)
    res = train(tiny_cfg(out, **cfg))
    assert res["step"] == 57 and res["budget_spent_s"] == pytest.approx(4.5 + 1.7 + EVAL_S)
    train_logs = [r for r in _records(out) if "loss" in r]
    assert train_logs[-1]["step"] == 57 and train_logs[-1]["lr"] < 0.05 * 3e-3  # the decay reached its end at 57
    assert [r["step"] for r in _records(out, "test")] == [40, 57]  # max_steps' last step evaluates too
    res = train(tiny_cfg(out, **{**cfg, "schedule.time_budget": 100}))  # a budget may change on resume
    assert res["step"] == 92  # fixed anew at step 57 + 16 + 8 = 81: all of schedule.epochs fits


def test_a_run_resumed_before_its_first_fit_times_its_own_steps(tmp_path, virtual_clock):
    """Stopped at step 20, before any length was fixed: the resumed process times its steps from its 16th (36) and
    fixes the length at 44: (8 * 0.99 - 2 - 4.4 s spent - 0.15) / 0.1 = 13 more steps."""
    out = tmp_path / "run"
    cfg = {"schedule.time_budget": 8, "run.ckpt_every": 4}
    train(tiny_cfg(out, **cfg), max_steps=20)
    meta = checkpoint.read_meta(checkpoint.latest(out))
    meta_spent = meta["spent"]
    assert "total" in meta and meta["total"] == 92 and _records(out, "budget") == []
    res = train(tiny_cfg(out, **cfg))
    fits = [(r["step"], r["total"]) for r in _records(out, "budget")]
    assert fits == [(44, 44 + int((8 * 0.99 - 2 - meta_spent - 2.4 - 0.155) / STEP_S))] and res["step"] == fits[0][1]


def test_a_machine_that_slows_down_shortens_the_rest(tmp_path, virtual_clock):
    """12 s, an evaluation every epoch (0.5 s each), and from step 40 on a step takes 0.3 s, not 0.1: the fits after
    the slowdown shorten the run, count the evaluations at what they took, and the run ends within its budget."""
    virtual_clock[1:] = [0.3, 40]
    out = tmp_path / "slow"
    res = train(tiny_cfg(out, **{"schedule.time_budget": 12, "run.eval_every": 1}))
    fits = _records(out, "budget")
    assert fits[0]["step"] == 24 and fits[0]["eval_s"] == pytest.approx(EVAL_S)  # step 23's evaluation, measured
    assert len(fits) >= 2 and fits[-1]["total"] < fits[0]["total"] and fits[-1]["step_s"] > 2 * STEP_S
    assert res["step"] == fits[-1]["total"] and res["budget_spent_s"] <= 12
    assert [r["step"] for r in _records(out, "test")][-1] == res["step"]


def test_a_spent_budget_ends_the_run_at_its_first_fit(tmp_path, virtual_clock):
    """1 s, spent by step 10: the run fixes its length at the first chance (step 24: 8 steps timed from step 16) to
    the step it is at, logs it, evaluates there and ends; resumed, it stays ended."""
    out = tmp_path / "spent"
    cfg = {"schedule.time_budget": 1, "run.ckpt_every": 4, "run.log_every": 5}
    res = train(tiny_cfg(out, **cfg))
    assert res["step"] == 24 and res["time_budget_s"] == 1 and res["budget_spent_s"] == pytest.approx(2.4 + EVAL_S)
    assert [(r["step"], r["total"]) for r in _records(out, "budget")] == [(24, 24)]
    assert [r["step"] for r in _records(out, "test")] == [24]
    assert [r["step"] for r in _records(out) if "loss" in r][-1] == 24  # the last step logged, off log_every's beat
    assert train(tiny_cfg(out, **cfg))["step"] == 24


def test_an_ample_budget_trains_the_epochs_and_counts_from_the_command(tmp_path, virtual_clock, monkeypatch):
    """1e6 s: all of schedule.epochs; the command started 5 s before the run (VITKIT_RUN_START): counted."""
    monkeypatch.setenv(START_ENV, repr(time.time() - 5))
    out = tmp_path / "ample"
    res = train(tiny_cfg(out, **{"schedule.time_budget": 1e6}))
    assert res["step"] == 4 * (1500 // 64)  # schedule.epochs=4 of digits' 1500 training images: the most it trains
    assert [(r["step"], r["total"]) for r in _records(out, "budget")] == [(24, 92)]  # the first fit is logged
    assert res["budget_spent_s"] == pytest.approx(5 + 92 * STEP_S + EVAL_S, abs=1)


def test_a_tta_cascade_is_budgeted_at_its_share_of_the_views(tmp_path, virtual_clock):
    """Before any evaluation has been measured, the final one is estimated from its views: 18 a held-out image for
    flip-shift2, and with a cascade (run.tta_margin) the mirror pair and CASCADE_SHARE of the other 16."""
    cfg = {"schedule.time_budget": 1, "run.tta": "flip-shift2", "aug.hflip": True}
    train(tiny_cfg(tmp_path / "all", **cfg))
    train(tiny_cfg(tmp_path / "cascade", **cfg, **{"run.tta_margin": 0.8}))
    train(tiny_cfg(tmp_path / "zero", **cfg, **{"run.tta_margin": 0.0}))  # 0 is a margin too
    every, cascade, zero = (_records(tmp_path / name, "budget")[0]["eval_s"] for name in ("all", "cascade", "zero"))
    assert every > 0 and cascade / every == pytest.approx((2 + 16 * budgeting.CASCADE_SHARE) / 18, rel=1e-3)
    assert zero == cascade
