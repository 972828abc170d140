"""schedule.time_budget: the arithmetic of the length that fits, the clock, and a run that fixes its length (no test
depends on how fast this machine is: the budgets are spent before the first step, or never)."""
import json
import random
import subprocess
import sys

import pytest

from vitkit.training import checkpoint, train
from vitkit.training.budget import RESERVE, budgeted_total, evaluations_after

from test_training import tiny_cfg


def test_evaluations_after_a_step():
    assert evaluations_after(0, 100, 0) == 1  # no periodic ones: the last step's
    assert evaluations_after(0, 100, 10) == 10  # steps 10, 20, ..., 100 (the last is one of them)
    assert evaluations_after(0, 95, 10) == 10  # steps 10, ..., 90 and 95
    assert evaluations_after(35, 95, 10) == 7  # 40, ..., 90 and 95
    assert evaluations_after(95, 95, 10) == 0 and evaluations_after(96, 95, 10) == 0


def test_budgeted_total_is_the_longest_run_that_fits():
    left = 100 * (1 - RESERVE)  # 99 s of a 100 s budget
    # 10 s spent at step 10, 1 s a step, one 5 s evaluation at the end: 10 + (T - 10) + 5 <= 99 -> T = 94
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5) == 94
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=50, eval_steps=0, eval_s=5) == 50
    assert budgeted_total(budget_s=100, spent_s=120, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5) == 10
    # the test set's evaluation after the held-out split's (final_s) comes off the steps
    assert budgeted_total(budget_s=100, spent_s=10, step=10, step_s=1.0, max_total=1000, eval_steps=0, eval_s=5,
                          final_s=20) == 74
    # every 10 steps a 2 s evaluation: T + 2 * evaluations(T) <= 99 -> T = 81 (81 + 2 * 9 = 99)
    assert budgeted_total(budget_s=100, spent_s=0, step=0, step_s=1.0, max_total=1000, eval_steps=10, eval_s=2) == 81
    assert left == pytest.approx(99)
    with pytest.raises(ValueError, match="step_s"):
        budgeted_total(budget_s=100, spent_s=0, step=0, step_s=0.0, max_total=10, eval_steps=0, eval_s=0)
    rng = random.Random(0)
    for _ in range(300):  # against the plain search over every length
        kw = dict(budget_s=rng.uniform(1, 500), spent_s=rng.uniform(0, 200), step=rng.randrange(0, 50),
                  step_s=rng.uniform(0.05, 3), eval_steps=rng.choice([0, 1, 7, 25]), eval_s=rng.uniform(0, 20),
                  final_s=rng.choice([0.0, rng.uniform(0, 30)]))
        kw["max_total"] = kw["step"] + rng.randrange(0, 400)
        left = kw["budget_s"] * (1 - RESERVE) - kw["spent_s"] - kw["final_s"]
        fits = [t for t in range(kw["step"], kw["max_total"] + 1)
                if (t - kw["step"]) * kw["step_s"] + evaluations_after(kw["step"], t, kw["eval_steps"]) * kw["eval_s"] <= left]
        assert budgeted_total(**kw) == (max(fits) if fits else kw["step"]), kw


def test_the_clock_counts_the_process_from_its_start():
    code = "import time; time.sleep(0.5); from vitkit.training.budget import process_age; print(process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 120  # the sleep and the imports before the clock was read: counted


def _records(out, split):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in lines if r.get("split") == split]


def test_a_spent_budget_ends_the_run_where_it_first_fixes_its_length(tmp_path):
    """Inside this test process the budget of 1 s is spent before the first step: the run measures its steps, fixes
    its length at the first chance (step 32: after the warmup's 11 steps, and 16 timed ones) to the step it is at,
    evaluates there and ends. Resumed, it keeps that length (without it, the next fit would come an epoch later)."""
    out = tmp_path / "spent"
    res = train(tiny_cfg(out, **{"schedule.time_budget": 1, "run.ckpt_every": 4}))
    assert res["step"] == 32 and res["time_budget_s"] == 1 and res["budget_spent_s"] > 1
    fit = _records(out, "budget")
    assert [(r["step"], r["total"]) for r in fit] == [(32, 32)] and fit[0]["step_s"] > 0
    assert [r["step"] for r in _records(out, "test")] == [32]
    assert checkpoint.read_meta(checkpoint.latest(out))["total"] == 32
    assert train(tiny_cfg(out, **{"schedule.time_budget": 1, "run.ckpt_every": 4}))["step"] == 32


def test_an_ample_budget_trains_the_epochs(tmp_path):
    out = tmp_path / "ample"
    res = train(tiny_cfg(out, **{"schedule.time_budget": 1e6}))
    assert res["step"] == 4 * (1500 // 64)  # schedule.epochs=4 of digits' 1500 training images: the most it trains
    assert [(r["step"], r["total"]) for r in _records(out, "budget")] == [(32, 92)]  # the first fit is logged
