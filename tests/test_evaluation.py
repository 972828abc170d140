"""Evaluation: test-time augmentation views and their averaging, in `evaluate`, `predict` and the trainer."""
import math

import pytest
import torch
from torch import nn

from vitkit.data.datasets import InMemoryDataset
from vitkit.evaluation import evaluate, tta_log_probs, tta_views


def test_tta_views_mirror_and_move_the_image():
    x = torch.zeros(1, 1, 5, 5)
    x[0, 0, 1, 3] = 1.0  # one bright pixel at row 1, column 3
    assert len(tta_views(x, "none")) == 1 and tta_views(x, "none")[0] is x
    plain, mirror = tta_views(x, "flip")
    assert torch.equal(plain, x) and mirror[0, 0, 1, 1] == 1.0 and mirror.sum() == 1.0
    views = tta_views(x, "flip-shift")
    assert len(views) == 10 and all(v.shape == x.shape for v in views)
    where = [tuple(v[0, 0].nonzero()[0].tolist()) for v in views[2::2]]  # the unmirrored moved views
    assert where == [(2, 3), (0, 3), (1, 4), (1, 2)]  # down, up, right, left by one pixel
    assert all(torch.equal(m, v.flip(-1)) for v, m in zip(views[2::2], views[3::2]))
    # flip-shift2: flip-shift's ten views, then the image moved by two pixels each way and their mirrors
    x7 = torch.zeros(1, 1, 7, 7)
    x7[0, 0, 3, 4] = 1.0
    two = tta_views(x7, "flip-shift2")
    assert len(two) == 18
    noise = torch.rand(2, 3, 7, 7)  # edges that are not zero: the one-pixel views replicate them as flip-shift does
    assert all(torch.equal(a, b) for a, b in zip(tta_views(noise, "flip-shift2"), tta_views(noise, "flip-shift")))
    where = [tuple(v[0, 0].nonzero()[0].tolist()) for v in two[10::2]]
    assert where == [(5, 4), (1, 4), (3, 6), (3, 2)]  # down, up, right, left by two pixels
    assert all(torch.equal(m, v.flip(-1)) for v, m in zip(two[10::2], two[11::2]))
    ramp = tta_views(torch.arange(1.0, 6.0).expand(1, 1, 5, 5), "flip-shift2")  # edges replicated, not zeros
    assert ramp[14][0, 0, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 3.0]  # moved right by two
    assert ramp[16][0, 0, 0].tolist() == [3.0, 4.0, 5.0, 5.0, 5.0]  # moved left by two
    with pytest.raises(ValueError, match="unknown test-time augmentation 'rot90'"):
        tta_views(x, "rot90")


class LeftVsRight(nn.Module):
    """Logits (left-half mean, right-half mean) * 10: a model that is not mirror-invariant at all."""

    def forward(self, x):
        w = x.shape[-1] // 2
        return 10 * torch.stack([x[..., :w].mean((1, 2, 3)), x[..., w:].mean((1, 2, 3))], 1)


def test_flip_tta_averages_the_probabilities_of_image_and_mirror():
    images = torch.zeros(8, 1, 4, 4, dtype=torch.uint8)
    images[..., :2] = 255  # bright left half: class 0
    data = InMemoryDataset(images, torch.zeros(8, dtype=torch.long), ["left", "right"])
    model, to_float = LeftVsRight(), (lambda x: x.float() / 255)
    plain = evaluate(model, data, to_float)
    assert plain.acc1 == 1.0 and plain.loss == pytest.approx(math.log1p(math.exp(-10)), rel=1e-3)
    # the mirror puts the same confidence on the other class: the mean of the two is exactly one half each
    flipped = evaluate(model, data, to_float, tta="flip")
    assert flipped.loss == pytest.approx(math.log(2), abs=1e-6)
    logp = tta_log_probs(model, to_float(images[:2]), "flip")
    assert torch.allclose(logp.exp(), torch.full((2, 2), 0.5))
    # a top-vs-bottom model on a bright top row: the views moved up and down change its answer, the mirror does not
    top_vs_bottom = lambda x: LeftVsRight()(x.transpose(-1, -2))  # noqa: E731
    row = torch.zeros(1, 1, 4, 4)
    row[..., 0, :] = 1.0
    views = tta_views(row, "flip-shift")
    manual = torch.stack([top_vs_bottom(v).softmax(-1) for v in views]).mean(0)
    got = tta_log_probs(top_vs_bottom, row, "flip-shift").exp()
    assert torch.allclose(got, manual, atol=1e-6)
    assert not torch.allclose(got, tta_log_probs(top_vs_bottom, row, "flip").exp(), atol=1e-3)  # 10 views, not 2


def test_the_cli_offers_every_tta_mode():
    import typing

    from vitkit import cli
    from vitkit.evaluation import TTA_MODES

    for command in (cli.evaluate, cli.predict):
        assert typing.get_args(typing.get_type_hints(command)["tta"]) == TTA_MODES, command.__name__


def test_trainer_rejects_a_bad_tta_before_training(tmp_path):
    from vitkit.training import apply_overrides, get_preset, train

    cfg = get_preset("fashion-mnist", smoke=True)
    apply_overrides(cfg, {"run.tta": "mirror", "run.out_dir": str(tmp_path / "run"), "data.dataset": "digits"})
    with pytest.raises(ValueError, match="unknown run.tta 'mirror'"):
        train(cfg)
    apply_overrides(cfg, {"run.tta": "flip", "aug.hflip": False})  # mirrored views for a model trained without flips
    with pytest.raises(ValueError, match="set aug.hflip=true or run.tta=none"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


class CountingTopVsBottom(nn.Module):
    """Logits (top-half mean, bottom-half mean) * scale: mirror-invariant, moved by the shifted views; it keeps the
    batch size of every call."""

    def __init__(self, scale: float = 4.0):
        super().__init__()
        self.scale, self.calls = scale, []

    def forward(self, x):
        self.calls.append(len(x))
        h = x.shape[-2] // 2
        return self.scale * torch.stack([x[..., :h, :].mean((1, 2, 3)), x[..., h:, :].mean((1, 2, 3))], 1)


def _rows(brightness):
    """Images (B, 1, 6, 6) with a bright row at row 2 of each (just above the middle): the moved views change how far
    above it lies, so every view answers differently; `brightness` sets each image's confidence."""
    x = torch.zeros(len(brightness), 1, 6, 6)
    x[:, 0, 2, :] = torch.tensor(brightness)[:, None]
    return x


@pytest.mark.parametrize("mode", ["flip-shift", "flip-shift2"])
def test_a_tta_cascade_sends_on_only_the_images_its_mirror_pair_leaves_unsure(mode):
    x = _rows([0.05, 3.0, 0.1, 6.0, 0.02])  # faint rows: unsure; bright rows: sure
    model = CountingTopVsBottom()
    everything = tta_log_probs(model, x, mode)  # every image in every view
    pair = tta_log_probs(model, x, "flip")
    top2 = pair.exp().topk(2, -1).values
    gap = top2[:, 0] - top2[:, 1]
    margin = 0.5
    unsure = gap < margin
    assert unsure.tolist() == [True, False, True, False, True]  # the test's images span both sides of the margin
    model.calls.clear()
    got = tta_log_probs(model, x, mode, margin=margin)
    views = len(tta_views(x, mode))
    assert model.calls == [5, 5] + [3] * (views - 2)  # the pair for all, the other views for the three unsure only
    assert torch.equal(got[~unsure], pair[~unsure])  # the sure ones: their pair's mean, exactly
    assert torch.allclose(got[unsure], everything[unsure], atol=1e-6)  # the unsure ones: every view's mean
    assert not torch.allclose(everything[unsure], pair[unsure], atol=1e-3)  # and the other views did move them
    # margin 0: the pair answers for every image; margin 1: every image in every view
    model.calls.clear()
    assert torch.equal(tta_log_probs(model, x, mode, margin=0.0), pair) and model.calls == [5, 5]
    assert torch.allclose(tta_log_probs(model, x, mode, margin=1.0), everything, atol=1e-6)
    # no image unsure: no second stage, unless every call must run the same forwards (FSDP2's ranks): then one image
    sure = _rows([3.0, 6.0])
    model.calls.clear()
    assert torch.equal(tta_log_probs(model, sure, mode, margin=margin), tta_log_probs(model, sure, "flip"))
    assert model.calls == [2, 2, 2, 2]
    model.calls.clear()
    assert torch.equal(tta_log_probs(model, sure, mode, margin=margin, lockstep=True),
                       tta_log_probs(model, sure, "flip"))
    assert model.calls == [2, 2] + [1] * (views - 2) + [2, 2]


class Lopsided(nn.Module):
    """Logits (mean + left-half mean - right-half mean, 0) * 8: an image and its mirror image answer differently."""

    def forward(self, x):
        w = x.shape[-1] // 2
        d = x.mean((1, 2, 3)) + x[..., :w].mean((1, 2, 3)) - x[..., w:].mean((1, 2, 3))
        return 8 * torch.stack([d, torch.zeros_like(d)], 1)


def test_the_cascade_decides_on_the_mirror_pairs_mean_and_keeps_it_for_the_sure_images():
    """A model that is not mirror-invariant: the pair's mean differs from either view's, the first view alone would be
    sure where the pair is not, and an image exactly `margin` apart stays with its pair ("by the margin or more")."""
    x = torch.zeros(3, 1, 4, 4)
    x[0, ..., :2] = 1.0  # bright on the left: the image is sure of class 0, its mirror of class 1; the pair unsure
    x[1, ..., :1] = 1.0
    x[1, ..., 3:] = 0.2  # a little of both: the pair leans to class 0 by a gap that sets the margin
    # image 2 dark: both classes at one half in every view
    model = Lopsided()
    pair = tta_log_probs(model, x, "flip")
    first = model(x).float().log_softmax(-1)
    assert not torch.allclose(pair, first, atol=1e-3)  # the mirror view counts
    gap = (pair.exp()[:, 0] - pair.exp()[:, 1]).abs()
    margin = float(gap[1])
    assert gap[0] < margin and (first.exp()[0, 0] - first.exp()[0, 1]) > margin  # unsure as a pair, sure alone
    model = CountingTopVsBottom()  # logits from the lopsided model, batch sizes counted
    lopsided = Lopsided()

    def counted(v):
        model.calls.append(len(v))
        return lopsided(v)
    got = tta_log_probs(counted, x, "flip-shift2", margin=margin)
    assert model.calls == [3, 3] + [2] * 16  # images 0 and 2 go on; image 1, exactly the margin apart, does not
    assert torch.equal(got[1], pair[1])  # the pair's mean, not the first view twice
    assert torch.allclose(got[[0, 2]], tta_log_probs(lopsided, x, "flip-shift2")[[0, 2]], atol=1e-6)


def test_evaluate_with_a_cascade_counts_every_image_once():
    rows = (torch.rand(40) * 4).tolist()  # confidences spread across the margin
    images = (_rows(rows) * 255 / 4).round().to(torch.uint8)
    data = InMemoryDataset(images, torch.zeros(40, dtype=torch.long), ["top", "bottom"])
    to_float = lambda x: x.float() / 255 * 4  # noqa: E731
    full = evaluate(CountingTopVsBottom(), data, to_float, batch_size=16, tta="flip-shift2")
    model = CountingTopVsBottom()
    cascade = evaluate(model, data, to_float, batch_size=16, tta="flip-shift2", tta_margin=0.3)
    flip = evaluate(CountingTopVsBottom(), data, to_float, batch_size=16, tta="flip")
    # the unsure images' every view, the rest's pair: a loss between the two
    assert cascade.n == 40 and min(full.loss, flip.loss) < cascade.loss < max(full.loss, flip.loss)
    assert sum(model.calls) < 18 * 40 / 2  # under half of every view's forwards
    model.calls.clear()
    with pytest.raises(ValueError, match="with TTA flip-shift or flip-shift2, not 'flip'"):
        evaluate(model, data, to_float, tta="flip", tta_margin=0.5)
    assert model.calls == []  # before any forward
    # lockstep (FSDP2's ranks): every batch runs the second stage, on one image where none of it is unsure
    sure = InMemoryDataset((_rows([4.0] * 8) * 255 / 4).round().to(torch.uint8), torch.zeros(8, dtype=torch.long),
                           ["top", "bottom"])
    evaluate(model, sure, to_float, batch_size=4, tta="flip-shift2", tta_margin=0.3)
    assert model.calls == [4, 4] * 2
    model.calls.clear()
    evaluate(model, sure, to_float, batch_size=4, tta="flip-shift2", tta_margin=0.3, lockstep=True)
    assert model.calls == ([4, 4] + [1] * 16) * 2


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5", float("nan")])
def test_a_tta_margin_outside_0_to_1_is_refused(bad):
    from vitkit.evaluation import check_tta_margin

    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\]"):
        check_tta_margin(bad, "flip-shift2", "run.tta_margin")
    assert check_tta_margin(None, "none") is None and check_tta_margin(1, "flip-shift") == 1.0


def test_the_trainer_and_the_cli_refuse_a_margin_without_shifted_views_before_any_work(tmp_path, capsys):
    from vitkit import cli
    from vitkit.training import apply_overrides, get_preset, train

    cfg = get_preset("fashion-mnist", smoke=True)
    apply_overrides(cfg, {"run.tta": "flip", "run.tta_margin": 0.8, "run.out_dir": str(tmp_path / "run"),
                          "data.dataset": "digits"})
    with pytest.raises(ValueError, match="run.tta_margin chooses which images get the shifted views"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    missing = tmp_path / "no-such.safetensors"
    assert cli.main(["eval", str(missing), "--tta", "flip-shift2", "--tta-margin", "2"]) == 2  # before the model loads
    assert "--tta-margin must be a number in [0, 1]" in capsys.readouterr().err


def test_the_trainer_evaluates_with_its_margin_reports_it_and_resumes_with_another(tmp_path):
    """A run stopped with one margin resumes with another (no --force); its test evaluation at margin 0 is the
    mirror pair's, as `vitkit eval --tta flip` finds on its final weights, not every view's; both reports say so."""
    import json

    from test_training import tiny_cfg

    from vitkit import cli
    from vitkit.training import train

    out = tmp_path / "run"
    cfg = {"run.tta": "flip-shift2", "aug.hflip": True, "schedule.epochs": 1}
    train(tiny_cfg(out, **cfg, **{"run.tta_margin": 0.5}), max_steps=5)
    res = train(tiny_cfg(out, **cfg, **{"run.tta_margin": 0.0}))
    assert res["step"] > 5
    trained = json.loads((out / "test_report.json").read_text())
    assert trained["tta"] == "flip-shift2" and trained["tta_margin"] == 0.0
    losses = {}
    for name, args in {"pair": ["--tta", "flip"], "every": ["--tta", "flip-shift2"],
                       "cascade": ["--tta", "flip-shift2", "--tta-margin", "0"]}.items():
        assert cli.main(["eval", str(out / "final.safetensors"), "--data", "digits", "--batch-size", "500",
                         "--precision", "fp32", "--out", str(tmp_path / name), *args]) == 0
        losses[name] = json.loads((tmp_path / name / "eval_report.json").read_text())
    assert losses["cascade"]["tta_margin"] == 0.0 and losses["pair"]["tta_margin"] is None
    assert trained["loss"] == pytest.approx(losses["pair"]["loss"], abs=1e-6)
    assert losses["cascade"]["loss"] == pytest.approx(losses["pair"]["loss"], abs=1e-6)
    assert abs(losses["every"]["loss"] - losses["pair"]["loss"]) > 1e-4
