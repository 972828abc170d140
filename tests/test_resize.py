"""Progressive resizing (`schedule.resize_from`, vitkit.training.resize): the sizes a run's steps train at, each
batch made smaller as Pillow resizes an image, a run that trains at those sizes and resumes exactly, a time budget
that counts the smaller steps at their cost, and what it cannot serve refused before any work."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitkit.training.trainer as trainer_mod
from vitkit.errors import UsageError
from vitkit.training import train
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
    assert [wide.size(s, 10) for s in range(6)] == [(16, 24), (16, 24), (20, 32), (20, 32), (24, 36), (28, 42)]
    for rz, totals in ((r, (1, 2, 3, 7, 100, 1013)), (wide, (1, 5, 64)), (Resizer((224, 224), 16, 1.0, 16), (9, 500)),
                       (Resizer((16, 16), 8, 0.3, 4), (92, 57))):
        for total in totals:
            heights = [rz.height(s, total) for s in range(total)]
            assert heights == sorted(heights) and heights[0] == rz.start and set(heights) <= set(rz.heights)
            assert all(h % rz.step_px == 0 or h == rz.full[0] for h in heights)
            assert all(h == rz.full[0] for s, h in enumerate(heights) if s >= rz.until * total)
            for start in range(0, total + 3, max(1, total // 6)):  # the cost of steps start..end-1: step by step
                for end in range(start, total + 5, max(1, total // 4)):
                    each = sum(rz.cost(s, total) if s < total else 1.0 for s in range(start, end))
                    assert rz.costs(start, end, total) == pytest.approx(each, abs=1e-9), (total, start, end)
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


def test_a_run_trains_at_the_growing_sizes_and_resumes_exactly(tmp_path, monkeypatch):
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
    cut = tmp_path / "cut"
    train(tiny_cfg(cut, **RESIZE), max_steps=40)
    assert train(tiny_cfg(cut, **RESIZE))["step"] == 92
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(cut / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = train(tiny_cfg(tmp_path / "plain"))  # and without it, another run: every step at 16
    c = load_file(tmp_path / "plain" / "final.safetensors")
    assert plain["step"] == 92 and not all(torch.equal(a[k], c[k]) for k in a)


def test_a_time_budget_counts_a_smaller_step_at_its_pixels_share(tmp_path, monkeypatch):
    """On a virtual clock where a step takes 0.1 s times the share of the model's pixels the model was given (read
    off its input), and the first step at a new size 1 s more (a compile): the budget measures a whole step's 0.1 s
    on the small steps too and leaves the compiles out of it (spent, not a rate), fits more steps into 12 s than a
    run without resizing does, and ends within the budget."""
    now = [1000.0]
    monkeypatch.setattr(budgeting, "clock", lambda: now[0])
    monkeypatch.delenv(START_ENV, raising=False)
    shares = []
    real = trainer_mod.train_step

    def step(run, batches, i, g):
        if not getattr(run.model, "_share_hook", None):
            def hook(module, args):
                if module.training:
                    shares.append(args[0].shape[-2] * args[0].shape[-1] / 16**2)
            run.model._share_hook = run.model.patch_embed.register_forward_pre_hook(hook)
        out = real(run, batches, i, g)
        now[0] += 0.1 * shares[-1] + (1.0 if len(shares) > 1 and shares[-1] != shares[-2] else 0.0)
        return out
    monkeypatch.setattr(trainer_mod, "train_step", step)
    plain = train(tiny_cfg(tmp_path / "plain", **{"schedule.time_budget": 12}))
    shares.clear()
    res = train(tiny_cfg(tmp_path / "resized", **{**RESIZE, "schedule.time_budget": 12, "schedule.epochs": 8}))
    fits = [r for r in map(json.loads, (tmp_path / "resized" / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "budget"]
    assert fits and all(f["step_s"] == pytest.approx(0.1) for f in fits), fits  # a whole step's, measured on 8 px
    assert plain["step"] < res["step"] <= 184 and res["budget_spent_s"] <= 12, (plain, res)
    assert len(fits) >= 3
    assert min(shares) == 0.25 and shares[-1] == 1.0


@pytest.mark.parametrize("extra, match", [
    ({"schedule.resize_from": 6}, "multiple of the model's patch size 4"),
    ({"schedule.resize_from": 16}, "below its size 16"),
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
