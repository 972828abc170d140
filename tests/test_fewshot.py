"""Few-shot linear evaluation: the closed form, and known answers."""
import json

import numpy as np
import torch

import vitkit
from vitkit.evaluation.fewshot import BIAS_CONSTANT, fewshot, fewshot_from_features, ridge_fit


def test_the_closed_form_is_the_regularised_least_squares_solution():
    g = torch.Generator().manual_seed(0)
    for n, d in ((40, 8), (6, 30)):  # the primal and the dual form
        x, y = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)
        w, mean, std = ridge_fit(x, y, 4, l2=3.0)
        xw = torch.cat([(x - mean) / std, torch.full((n, 1), BIAS_CONSTANT, dtype=torch.float64)], 1)
        t = 2 * torch.nn.functional.one_hot(y, 4).double() - 1
        # min |xw w - t|^2 + l2 |w|^2  <=>  least squares on [xw; sqrt(l2) I] against [t; 0]
        a = torch.cat([xw, 3.0 ** 0.5 * torch.eye(d + 1, dtype=torch.float64)])
        b = torch.cat([t, torch.zeros(d + 1, 4, dtype=torch.float64)])
        ref = torch.linalg.lstsq(a, b).solution
        assert (w - ref).abs().max() < 1e-6


def test_linearly_separable_features_give_100_percent():
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(5, 16, generator=g) * 10
    ytr, yte = torch.arange(5).repeat(40), torch.arange(5).repeat(20)
    xtr = centres[ytr] + 0.1 * torch.randn(len(ytr), 16, generator=g)
    xte = centres[yte] + 0.1 * torch.randn(len(yte), 16, generator=g)
    r = fewshot_from_features(xtr, ytr, xte, yte, shots=(1, 5), draws=3)
    assert r.mean == {1: 1.0, 5: 1.0} and r.std == {1: 0.0, 5: 0.0}
    noise = fewshot_from_features(torch.randn(200, 16, generator=g), ytr, torch.randn(100, 16, generator=g), yte,
                                  shots=(5,), draws=3)
    assert noise.mean[5] < 0.5  # random features: about chance (0.2), the check can fail


def test_fewshot_of_a_model_on_a_dataset(capsys):
    from vitkit.cli import main
    from vitkit.data.datasets import load_dataset

    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=8, patch_size=4, in_chans=1, depth=1, embed_dim=32, num_heads=2,
                            mlp_dim=64, num_classes=0, mean=(0.5,), std=(0.5,))
    spec = load_dataset("digits")
    r = fewshot(m, spec.train, spec.test, shots=(1, 10), draws=2)
    assert 0.2 < r.mean[1] <= r.mean[10] + 0.05 and r.mean[10] > 0.5  # random features of digits are informative
    assert len(r.draws[10]) == 2 and r.std[10] == np.std(r.draws[10])
    vitkit.save(m, "/tmp/fewshot_m.safetensors")
    assert main(["fewshot", "/tmp/fewshot_m.safetensors", "--data", "digits", "--shots", "5", "--draws", "2", "--json-out"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["shots"] == [5] and set(res["mean"]) == {"5"} and 0 < res["mean"]["5"] <= 1


def test_reproduce_smoke_writes_a_table_and_a_plot(tmp_path, capsys, monkeypatch):
    """The studies' machinery end to end at smoke scale (`vitkit reproduce posemb --smoke`), on a quarter of the
    smoke's images (256 training, 250 test: one step per variant instead of four), which is not what is checked."""
    import dataclasses

    from PIL import Image

    from vitkit import reproduce
    from vitkit.cli import main

    of = reproduce.Scale.of
    monkeypatch.setattr(reproduce.Scale, "of", classmethod(
        lambda cls, smoke: dataclasses.replace(of(smoke), subset=256, test_subset=250) if smoke else of(smoke)))

    assert main(["reproduce", "posemb", "--seeds", "1", "--smoke", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "posemb-smoke.md").read_text()
    assert "| learned_2d |" in md and "Table 8" in md and "5-shot digits" in md
    res = json.loads((tmp_path / "posemb-smoke.json").read_text())
    assert len(res["rows"]) == 5 and all(0 < r["fine-tuned"] <= 1 for r in res["rows"])
    assert Image.open(tmp_path / "posemb-smoke.png").size[0] > 400
    (tmp_path / "posemb-smoke.png").unlink()
    assert main(["reproduce", "posemb", "--smoke", "--replot", "--out", str(tmp_path)]) == 0  # from the JSON, no training
    assert (tmp_path / "posemb-smoke.png").exists() and (tmp_path / "posemb-smoke.md").read_text() == md


def test_data_classes_selects_and_relabels():
    from vitkit.data.datasets import load_dataset

    train = load_dataset("digits").train
    sub = train.with_classes([7, 3])
    assert sub.classes == ["7", "3"] and set(sub.labels.tolist()) == {0, 1}
    assert len(sub) == int(((train.labels == 7) | (train.labels == 3)).sum())
    assert torch.equal(sub.images[sub.labels == 0], train.images[train.labels == 7])
