"""`data.prune`: InfoBatch's dynamic data pruning (Qin et al., ICLR 2024). Its rule against the paper's statement
(who is left out, what the kept weigh, an unbiased pass), runs that prune and still train, an exact resume inside a
pass and across passes, two processes against one, and what it refuses."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vitkit.errors import CheckpointError, UsageError
from vitkit.training import train
from vitkit.training.prune import plan_pass

from test_distributed import _env, _max_diff, _train as _train_procs, REPO
from test_training import _write_png_folder, tiny_cfg

PRUNE = {"data.prune": 0.5, "schedule.epochs": 4, "run.ckpt_every": 10}


def _records(out, split="prune"):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if f'"split": "{split}"' in x]


def test_a_pass_leaves_out_a_share_of_the_images_below_the_mean_and_weighs_the_rest_up():
    """The paper's Eq. 1-3: well-learned = score below the mean; a random r of them pruned; the kept ones' loss
    scaled by 1 / (1 - r), here exactly (well-learned) / (kept of them); the rest untouched, unscored images kept."""
    scores = torch.tensor([0.1, 0.2, 0.3, 0.4, 2.0, 3.0, 0.15, 0.25, float("inf"), 5.0])
    mean = scores[torch.isfinite(scores)].mean()  # 11.4 / 9 = 1.27: six below it
    well = {i for i, s in enumerate(scores.tolist()) if s < mean}
    assert well == {0, 1, 2, 3, 6, 7}
    for seed in range(20):
        order, weight = plan_pass(scores, 0.5, False, torch.Generator().manual_seed(seed))
        kept = order.tolist()
        assert len(set(kept)) == len(kept)  # a permutation of the kept images
        assert {4, 5, 8, 9} <= set(kept)  # above the mean, or unscored: always kept
        assert len(set(kept) & well) == 3  # round(0.5 * 6) of the six left out
        for i, w in zip(kept, weight.tolist()):
            assert w == (2.0 if i in well else 1.0)
    order, weight = plan_pass(scores, 0.5, True, torch.Generator().manual_seed(0))  # annealed: all, unweighted
    assert sorted(order.tolist()) == list(range(10)) and bool((weight == 1).all())
    order, _ = plan_pass(torch.full((10,), float("inf")), 0.5, False, torch.Generator())  # nothing scored yet
    assert sorted(order.tolist()) == list(range(10))
    first = plan_pass(scores, 0.5, False, torch.Generator().manual_seed(3))[0]
    assert torch.equal(first, plan_pass(scores, 0.5, False, torch.Generator().manual_seed(3))[0])  # drawn, not random


def test_a_pruned_pass_is_unbiased():
    """Over many draws, the weighted sum of the kept images' losses averages the whole set's (InfoBatch's claim that
    the pruned pass's expected gradient is the full pass's; here for the loss, linear in each image's term)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(200, generator=g) ** 3
    sums = []
    for seed in range(3000):
        order, weight = plan_pass(scores, 0.7, False, torch.Generator().manual_seed(seed))
        assert len(order) < 200
        sums.append(float((scores[order] * weight).sum()))
    mean = sum(sums) / len(sums)
    assert abs(mean - float(scores.sum())) < 0.01 * float(scores.sum()), (mean, float(scores.sum()))
    assert min(sums) < float(scores.sum()) < max(sums)  # each pass is a random draw around it


def test_the_stream_weighs_each_images_loss_and_keeps_it_as_its_score():
    """The stream itself: a batch that spans two passes, the weighted mean it returns, the scores it keeps (an image
    in both parts of one batch keeps its later loss), and the pass annealed once the run's steps pass the share."""
    from vitkit.data.datasets import InMemoryDataset
    from vitkit.training.prune import Pruner

    n = 10
    data = InMemoryDataset(torch.zeros(n, 1, 2, 2, dtype=torch.uint8), torch.arange(n), [str(i) for i in range(n)])
    total = [100]
    p = Pruner(data, 4, 0.5, 0.5, 0, 1, lambda: total[0], "cpu")
    stream = p.batches()
    for _ in range(2):  # 8 of the first pass's 10 images
        _, y, skipped = next(stream)
        assert skipped == 0 and bool((p.batch_weight == 1).all())
        p.weigh(y.float() / 10)  # image i's loss: i / 10
    before = p.scores.clone()  # 8 scored (i / 10), 2 not yet
    _, y, _ = next(stream)  # the first pass's last 2 images, then 2 of the second pass's
    assert [len(i) for _, i in p.segments] == [2, 2] and p.pass_index == 1
    scored = torch.isfinite(before)
    well = set((before < before[scored].mean()).nonzero().squeeze(1).tolist())
    assert len(well) == 4 and not well & set((~scored).nonzero().squeeze(1).tolist())
    assert len(p.order) == n - 2 and well - set(p.order.tolist()) and len(well - set(p.order.tolist())) == 2
    losses = torch.arange(4, dtype=torch.float32) + 1.0
    want = (losses * p.batch_weight).mean()
    assert p.batch_weight.tolist()[2:] == [2.0 if i in well else 1.0 for i in y.tolist()[2:]]  # 4 / (4 - 2)
    assert torch.allclose(p.weigh(losses), want)
    for j, i in enumerate(y.tolist()):
        if i not in y.tolist()[j + 1:]:
            assert float(p.scores[i]) == float(losses[j])  # the later of two losses of one image
    total[0] = 2  # the run's length refitted (a time budget): the next pass starts past half of it
    while p.pass_index == 1:
        next(stream)
        p.weigh(torch.ones(4))
    assert len(p.order) == n and bool((p.weight == 1).all())
    assert [e["annealed"] for e in p.pop_events()] == [False, False, True] and p.pop_events() == []


def test_a_pruned_run_trains_on_fewer_images_a_pass_and_resumes_exactly(tmp_path):
    """A run with data.prune=0.5 (anneal 0.75): after the first pass each pass leaves images out, the last ones keep
    all; the steps are those of an unpruned run; stopped inside a pass, and again later, it resumes to the same
    weights as the run never stopped, its scores and pass in the checkpoint."""
    extra = {**PRUNE, "data.prune_anneal": 0.75, "data.batch_size": 32, "run.accumulate": 2}  # 2 micro-batches a step
    whole = train(tiny_cfg(tmp_path / "whole", **extra))
    plain = train(tiny_cfg(tmp_path / "plain", **{k: v for k, v in extra.items() if not k.startswith("data.prune")}))
    assert whole["step"] == plain["step"] == 92 and whole["acc1"] > 0.7, whole  # digits: 23 steps an epoch
    passes = _records(tmp_path / "whole")
    assert passes[0]["pass"] == 0 and passes[0]["pruned"] == 0 and passes[0]["step"] == 1
    pruned = [p for p in passes if not p["annealed"]][1:]
    assert pruned and all(0 < p["pruned"] < 1500 and p["max_weight"] > 1.5 for p in pruned), passes
    annealed = [p for p in passes if p["annealed"]]
    assert annealed and all(p["pruned"] == 0 and p["step"] >= 0.75 * 92 for p in annealed), passes
    assert len(passes) > 4  # shorter passes than epochs: more of them in the same steps
    # stopped at step 30 (inside the second pass), resumed to the step before a pass begins, and to the end
    cut = tmp_path / "cut"
    train(tiny_cfg(cut, **extra), max_steps=30)
    train(tiny_cfg(cut, **extra), max_steps=passes[2]["step"] - 1)
    resumed = train(tiny_cfg(cut, **extra))
    assert resumed["step"] == whole["step"]
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(cut / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [(p["pass"], p["kept"]) for p in _records(cut)] == [(p["pass"], p["kept"]) for p in passes]
    # and the plain run is another run: pruning changed what the steps saw
    c = load_file(tmp_path / "plain" / "final.safetensors")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_checkpoint_whose_pruning_state_is_damaged_is_refused(tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(out, **PRUNE), max_steps=30)
    from vitkit.training import checkpoint

    meta_file = checkpoint.latest(out) / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["prune"]["images"] == 1500 and 0 <= meta["prune"]["pos"] <= meta["prune"]["length"]
    meta["prune"]["length"] = 10**9
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="data.prune's state"):
        train(tiny_cfg(out, **PRUNE))
    # a step folder of a pruned run reads as any other (convert, eval): the weights alone
    res = subprocess.run([sys.executable, "-m", "vitkit", "convert", str(checkpoint.latest(out)),
                          str(tmp_path / "c.safetensors")], env=_env(), cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert load_file(tmp_path / "c.safetensors")["head.weight"].abs().max() > 0


def test_a_run_saved_without_pruning_and_resumed_with_it_counts_its_steps(tmp_path):
    """Resumed (--force) with data.prune from a checkpoint that has no scores: they start afresh at the checkpoint's
    step, and the passes are logged at, and annealed by, the run's own steps."""
    out = tmp_path / "run"
    plain = {k: v for k, v in PRUNE.items() if k != "data.prune"}
    train(tiny_cfg(out, **plain), max_steps=30)
    train(tiny_cfg(out, **PRUNE, **{"data.prune_anneal": 0.75}), force=True)
    passes = _records(out)
    assert passes[0]["step"] == 31 and passes[0]["pruned"] == 0  # the first pass scores every image
    assert [p["step"] >= 0.75 * 92 for p in passes] == [p["annealed"] for p in passes] and passes[-1]["annealed"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "split" not in x]
    assert steps == list(range(1, 93))


def test_a_saved_state_that_does_not_fit_is_refused():
    from vitkit.data.datasets import InMemoryDataset
    from vitkit.training.prune import Pruner

    n = 10
    data = InMemoryDataset(torch.zeros(n, 1, 2, 2, dtype=torch.uint8), torch.arange(n), [str(i) for i in range(n)])
    p = Pruner(data, 4, 0.5, 0.9, 0, 1, lambda: 100, "cpu")
    good_t = {"scores": torch.rand(n), "order": torch.arange(n), "weight": torch.ones(n)}
    good_m = {"pass": 1, "pos": 3, "length": n, "images": n}
    p.load(good_t, good_m, 5)
    assert p.pos == 3 and p.pass_index == 1 and torch.equal(p.order, torch.arange(n))
    bad = [({}, {"length": float("inf")}), ({}, {"pos": 1.7}), ({}, {"pass": True}), ({}, {"pass": 10**30}),
           ({}, {"images": 11}), ({}, {"pos": 11}), ({}, {"length": 11}),
           ({"order": torch.arange(n) + 1}, {}), ({"order": torch.arange(n) - 1}, {}),
           ({"weight": torch.full((n,), float("inf"))}, {}), ({"weight": torch.full((n,), 0.5)}, {}),
           ({"weight": torch.full((n,), 1e30)}, {}), ({"scores": torch.full((n,), float("nan"))}, {}),
           ({"scores": -torch.ones(n)}, {}), ({"scores": torch.ones(n + 1)}, {})]
    for t, m in bad:
        with pytest.raises(ValueError, match="data.prune"):
            p.load({**good_t, **t}, {**good_m, **m}, 5)


def test_two_processes_prune_as_one(tmp_path):
    """2 processes at 32 images each = 1 at 64: every rank scores the whole batch (its losses summed over the ranks),
    so they draw the same passes (checked each pass) and end with one process's weights."""
    sgd = ("optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0", "data.prune=0.5", "schedule.epochs=2",
           "data.prune_anneal=1")
    _train_procs(tmp_path / "one", *sgd)
    _train_procs(tmp_path / "ddp", *sgd, nproc=2, torchrun=True)
    assert _max_diff(tmp_path / "one" / "final.safetensors", tmp_path / "ddp" / "final.safetensors") <= 1e-5
    one, two = _records(tmp_path / "one"), _records(tmp_path / "ddp")
    assert len(one) >= 3 and one[1]["pruned"] > 0 and [p["kept"] for p in one] == [p["kept"] for p in two]


@pytest.mark.parametrize("extra, match", [
    ({"aug.mixup": 0.8}, "mixup"),
    ({"model.objective": "mpp", "model.overrides": {"classifier": "token"}}, "mpp"),
    ({"model.overrides": {"distilled": True}}, "distillation"),
])
def test_what_pruning_cannot_score_is_refused_before_any_work(tmp_path, extra, match):
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=match):
        train(tiny_cfg(out, **{**PRUNE, **extra}))
    assert not (out / "checkpoints").exists()


def test_an_image_folder_is_refused(tmp_path):
    root = tmp_path / "imgs"
    _write_png_folder(root)
    with pytest.raises(UsageError, match="held in memory"):
        train(tiny_cfg(tmp_path / "run", **{**PRUNE, "data.dataset": str(root), "data.batch_size": 8,
                                            "data.num_workers": 0, "model.overrides": {"img_size": 16, "in_chans": 3}}))
    for bad in (-0.1, 1.0):
        with pytest.raises(UsageError, match="data.prune"):
            train(tiny_cfg(tmp_path / "bad", **{"data.prune": bad}))
