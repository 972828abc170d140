"""Progressive resizing (`schedule.resize_from`, vitkit.training.resize): the sizes a run's steps train at, each
batch made smaller as Pillow resizes an image, a run that trains at those sizes and resumes exactly, a time budget
that counts the smaller steps at their cost, and what it cannot serve refused before any work."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitkit
import vitkit.training.trainer as trainer_mod
from vitkit.errors import UsageError
from vitkit.training import TrainingError, checkpoint, train
from vitkit.training.checkpoint import config_differences
from vitkit.training.config import TrainConfig
from vitkit.training import budget as budgeting
from vitkit.training.budget import START_ENV
from vitkit.training.resize import Resizer

from conftest import FIXTURES
from test_training import tiny_cfg

RESIZE = {"schedule.resize_from": 8, "schedule.resize_until": 0.75}  # digits at 16 px, patches of 4: 8, 12, then 16


def test_the_size_rises_with_the_step_from_resize_from_to_the_models_at_resize_until():
    r = Resizer((28, 28), 16, 0.75, 4)
    assert [r.height(s, 100) for s in range(0, 100, 5)] == [16] * 5 + [20] * 5 + [24] * 5 + [28] * 5
    assert r.height(74, 100) == 24 and r.height(75, 100) == 28 and r.size(99, 100) == (28, 28)
    assert r.cost(0, 100) == pytest.approx(16 * 16 / 28**2) and r.cost(80, 100) == 1.0
    wide = Resizer((28, 42), 16, 0.5, 4)  # the width keeps the aspect ratio, at the patch size's multiple
    assert [wide.size(s, 10) for s in range(6)] == [(16, 24), (16, 24), (20, 32), (24, 36), (24, 36), (28, 42)]
    tall_patch = Resizer((16, 24), 8, 0.75, (4, 8))  # patches of 4 x 8: heights by 4, widths by 8
    assert [tall_patch.size(s, 12) for s in range(12)] == [(8, 16)] * 5 + [(12, 16)] * 4 + [(16, 24)] * 3
    # the last step is always at the model's size: resize_until=1 included, and runs of a step or two
    for until in (1.0, 0.75, 1e-9):
        assert all(Resizer((28, 28), 16, until, 4).size(t - 1, t) == (28, 28) for t in (1, 2, 3, 10, 100, 10_000))
    for rz, totals in ((r, (1, 2, 3, 7, 100, 1013)), (wide, (1, 5, 64)), (Resizer((224, 224), 16, 1.0, 16), (9, 500)),
                       (Resizer((16, 16), 8, 0.3, 4), (92, 57))):
        for total in totals:
            heights = [rz.height(s, total) for s in range(total)]
            assert heights == sorted(heights) and set(heights) <= set(rz.heights)
            assert heights[0] == (rz.start if rz.until * (total - 1) > 0 else rz.full[0])  # one step: the model's
            assert all(h % rz.step_px == 0 or h == rz.full[0] for h in heights)
            assert all(h == rz.full[0] for s, h in enumerate(heights) if s >= rz.until * (total - 1))
            assert heights[-1] == rz.full[0]
            for start in range(0, total + 3, max(1, total // 6)):  # the cost of steps start..end-1: step by step
                for end in range(start, total + 5, max(1, total // 4)):
                    each = sum(rz.cost(s, total) if s < total else 1.0 for s in range(start, end))
                    assert rz.costs(start, end, total) == pytest.approx(each, abs=1e-9), (total, start, end)
    # the sizes still to come that this process has not trained at (each a compile a budget counts ahead)
    r = Resizer((28, 28), 16, 0.75, 4)
    assert r.sizes_to_come(0, 100) == 3
    r.seen |= {(16, 16), (20, 20)}
    assert r.sizes_to_come(30, 100) == 2 and r.sizes_to_come(60, 100) == 1 and r.sizes_to_come(99, 100) == 0
    # a longer run never costs less (what the budget's search relies on)
    r = Resizer((28, 28), 16, 0.75, 4)
    assert all(r.costs(0, t + 1, t + 1) > r.costs(0, t, t) for t in range(1, 400))


def test_a_batch_is_the_whole_image_made_smaller_as_pillow_makes_it():
    rng = np.random.default_rng(0)
    img = rng.random((3, 28, 28)).astype(np.float32)
    x = torch.from_numpy(img)[None].repeat(2, 1, 1, 1) * 2 - 1  # a normalised batch: affine in the pixels
    r = Resizer((28, 28), 16, 0.75, 4)
    small = r(x, 0, 100)
    assert small.shape == (2, 3, 16, 16) and r(x, 99, 100) is x  # the model's size: the batch as it is
    for c in range(3):  # Pillow's bilinear filter, widened to the reduction (its antialiasing), channel by channel
        ref = np.asarray(Image.fromarray(img[c], mode="F").resize((16, 16), Image.Resampling.BILINEAR))
        np.testing.assert_allclose(small[0, c].numpy(), ref * 2 - 1, atol=1e-5)


def _sizes_seen(monkeypatch):
    """The input sizes the model's patch embedding receives, per training step and in evaluation."""
    seen = {"train": {}, "eval": set()}
    real = trainer_mod.train_step

    def step(run, batches, i, g):
        if not getattr(run.model, "_sizes_hook", None):
            def hook(module, args):
                if module.training:
                    seen["train"].setdefault(seen["step"], set()).add(tuple(args[0].shape[-2:]))
                else:
                    seen["eval"].add(tuple(args[0].shape[-2:]))
            run.model._sizes_hook = run.model.patch_embed.register_forward_pre_hook(hook)
        seen["step"] = i
        return real(run, batches, i, g)
    monkeypatch.setattr(trainer_mod, "train_step", step)
    return seen


def test_a_run_trains_at_the_growing_sizes_saves_a_fixed_size_model_and_resumes_exactly(tmp_path, monkeypatch):
    """digits at 16 px, 4 epochs of 23 steps: steps 0-34 at 8 px, 35-68 at 12, the rest at 16 (0.75 of 92 = 69);
    evaluated at 16; stopped inside the 12-px steps it resumes to the same weights as the run never stopped."""
    seen = _sizes_seen(monkeypatch)
    whole = train(tiny_cfg(tmp_path / "whole", **RESIZE))
    # above chance (0.1); below the plain run's 0.81: a 2 x 2 grid of patches for 35 of 92 steps, each larger size a
    # new scale for the patch embedding of this tiny plain ViT (docs/training.md)
    assert whole["step"] == 92 and whole["acc1"] > 0.3, whole
    expect = {s: {(8, 8) if s < 35 else (12, 12) if s < 69 else (16, 16)} for s in range(92)}
    assert Resizer((16, 16), 8, 0.75, 4).first_at(12, 92) == 35
    assert seen["train"] == expect and seen["eval"] == {(16, 16)}
    logged = {r["step"]: tuple(r["size"]) for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl").read_text()
                                                        .splitlines()) if "size" in r}
    assert logged == {s + 1: next(iter(v)) for s, v in expect.items()}
    # the saved model is the one the run built: a fixed size (dynamic_img_size is the training's)
    assert vitkit.load(tmp_path / "whole" / "final.safetensors").config.dynamic_img_size is False
    cut = tmp_path / "cut"
    train(tiny_cfg(cut, **RESIZE), max_steps=40)
    ck = checkpoint.latest(cut)
    assert checkpoint.read_meta(ck)["model_config"]["dynamic_img_size"] is False
    with pytest.raises(TrainingError, match="resize_from"):  # another ramp is another run
        train(tiny_cfg(cut, **{**RESIZE, "schedule.resize_from": 12}))
    assert train(tiny_cfg(cut, **RESIZE))["step"] == 92
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(cut / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = train(tiny_cfg(tmp_path / "plain"))  # and without it, another run: every step at 16
    c = load_file(tmp_path / "plain" / "final.safetensors")
    assert plain["step"] == 92 and not all(torch.equal(a[k], c[k]) for k in a)


def _budgeted_runs(tmp_path, monkeypatch, slow_from: int = 10**9):
    """A plain and a resized run under 12 s on a virtual clock where a step takes 0.1 s (0.25 s from step
    `slow_from` on) times the share of the model's pixels the model was given (read off its input), and the first
    step at a new size 1 s more (a compile): (plain result, resized result, its metrics records, the size the model
    trained at by logged step, the steps' shares)."""
    now = [1000.0]
    monkeypatch.setattr(budgeting, "clock", lambda: now[0])
    monkeypatch.delenv(START_ENV, raising=False)
    shares, sizes = [], {}
    real = trainer_mod.train_step

    def step(run, batches, i, g):
        if not getattr(run.model, "_share_hook", None):
            def hook(module, args):
                if module.training:
                    shares.append(args[0].shape[-2] * args[0].shape[-1] / 16**2)
                    sizes[len(sizes) + 1] = tuple(args[0].shape[-2:])  # by the step the log numbers it
            run.model._share_hook = run.model.patch_embed.register_forward_pre_hook(hook)
        out = real(run, batches, i, g)
        now[0] += (0.1 if i < slow_from else 0.25) * shares[-1] \
            + (1.0 if len(shares) > 1 and shares[-1] != shares[-2] else 0.0)
        return out
    monkeypatch.setattr(trainer_mod, "train_step", step)
    plain = train(tiny_cfg(tmp_path / "plain", **{"schedule.time_budget": 12}))
    shares.clear(), sizes.clear()
    res = train(tiny_cfg(tmp_path / "resized", **{**RESIZE, "schedule.time_budget": 12, "schedule.epochs": 8}))
    records = [json.loads(x) for x in (tmp_path / "resized" / "metrics.jsonl").read_text().splitlines()]
    return plain, res, records, sizes, shares


def test_a_time_budget_counts_a_smaller_step_at_its_pixels_share(tmp_path, monkeypatch):
    """The budget measures a whole step's 0.1 s on the small steps too and leaves a new size's compile out of it
    (spent, not a rate), fits more steps into 12 s than a run without resizing does, and ends within the budget."""
    plain, res, records, sizes, shares = _budgeted_runs(tmp_path, monkeypatch)
    fits = [r for r in records if r.get("split") == "budget"]
    assert {r["step"]: tuple(r["size"]) for r in records if "size" in r} == sizes  # each step's as trained
    assert fits and all(f["step_s"] == pytest.approx(0.1) for f in fits), fits  # a whole step's, measured on 8 px
    assert plain["step"] < res["step"] <= 184 and res["budget_spent_s"] <= 12, (plain, res)
    assert len(fits) >= 3
    assert min(shares) == 0.25 and shares[-1] == 1.0


def test_a_machine_that_slows_down_shortens_a_resized_run_and_logs_each_steps_size(tmp_path, monkeypatch):
    """Steps 2.5x slower from step 40: the fits shorten the run, which moves the sizes of the steps after them; each
    step's logged size is the one it trained at (a step where a fit moved the length included), and the run ends
    within its budget at the model's size."""
    _, res, records, sizes, shares = _budgeted_runs(tmp_path, monkeypatch, slow_from=40)
    fits = [r for r in records if r.get("split") == "budget"]
    assert len(fits) >= 2 and fits[-1]["total"] < fits[0]["total"], fits
    assert {r["step"]: tuple(r["size"]) for r in records if "size" in r} == sizes
    assert res["budget_spent_s"] <= 12 and shares[-1] == 1.0


def test_a_non_square_patch_trains_at_its_own_multiples(tmp_path, monkeypatch):
    """Patches of 4 x 8 on 16 x 24 images: heights by 4, widths by 8, each a size the model takes."""
    seen = _sizes_seen(monkeypatch)
    res = train(tiny_cfg(tmp_path / "run", **{**RESIZE, "schedule.epochs": 1,
                                             "model.overrides": {"img_size": [16, 24], "patch_size": [4, 8]}}))
    assert res["step"] == 23
    trained = {next(iter(v)) for v in seen["train"].values()}
    assert trained == {(8, 16), (12, 16), (16, 24)} and seen["eval"] == {(16, 24)}


def test_resize_until_alone_is_not_another_run():
    """Without schedule.resize_from, schedule.resize_until changes no step: a run may resume with it changed."""
    a, b = TrainConfig().to_dict(), TrainConfig().to_dict()
    b["schedule"]["resize_until"] = 0.5
    assert config_differences(a, b) == []
    a["schedule"]["resize_from"] = b["schedule"]["resize_from"] = 16
    assert config_differences(a, b) == ["schedule.resize_until: 0.75 -> 0.5"]


@pytest.mark.parametrize("extra, match", [
    ({"schedule.resize_from": 6}, "multiple of the model's patch height 4"),
    ({"schedule.resize_from": 16}, "below its height 16"),
    ({"schedule.resize_from": 0}, "resize_from"),
    ({"schedule.resize_until": 0.0}, "resize_until"),
    ({"schedule.resize_until": 1.5}, "resize_until"),
    ({"model.overrides": {"distilled": True}}, "distillation"),
    ({"model.objective": "mpp", "model.overrides": {"classifier": "token"}}, "mpp"),
    ({"model.checkpoint": str(FIXTURES / "timm_resnetv2_bit/model.safetensors"), "model.overrides": {"img_size": 32},
      "schedule.resize_from": 16}, "not a CNN"),
])
def test_what_resizing_cannot_serve_is_refused_before_any_training(tmp_path, extra, match):
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=match):
        train(tiny_cfg(out, **{**RESIZE, **extra}))
    assert not (out / "checkpoints").exists()
