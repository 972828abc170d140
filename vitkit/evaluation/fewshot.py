"""Few-shot linear evaluation on frozen features, as the paper reports it (Sec. 4.1, "few-shot accuracies").

The paper's recipe (big_vision's fewshot evaluator): take the pooled representation of a frozen model; from the
k training images per class, whiten the features (the shot set's mean and standard deviation), append a constant
feature of 100 (a bias, almost unregularised), and solve a regularised least-squares regression to {-1, 1}
targets in closed form: W = (X^T X + l2 I)^-1 X^T Y (or X^T (X X^T + l2 I)^-1 Y when there are fewer images than
features). A test image's class is the argmax of its features times W. Each draw samples the k shots per class
anew; the regularisation is chosen per draw among `l2_grid` on held-out training images (never on the test set).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..data.datasets import load_batches, eval_index_batches
from ..data.splits import prepare
from ..machine.precision import autocast
from ..errors import UsageError

BIAS_CONSTANT = 100.0
L2_GRID = tuple(2.0 ** i for i in range(-10, 21, 2))


def ridge_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, mean, std) of the closed-form regularised least squares on whitened features with a bias column.

    x: (N, D) features, y: (N,) class indices. Float64 throughout."""
    x = x.double()
    mean, std = x.mean(0, keepdim=True), x.std(0, unbiased=False, keepdim=True) + 1e-5
    xw = torch.cat([(x - mean) / std, torch.full((len(x), 1), BIAS_CONSTANT, dtype=x.dtype, device=x.device)], 1)
    t = 2.0 * torch.nn.functional.one_hot(y.long(), num_classes).double() - 1.0  # {-1, 1}
    n, d = xw.shape
    if n >= d:
        w = torch.linalg.solve(xw.T @ xw + l2 * torch.eye(d, dtype=x.dtype, device=x.device), xw.T @ t)
    else:  # the dual form: an (N, N) system
        w = xw.T @ torch.linalg.solve(xw @ xw.T + l2 * torch.eye(n, dtype=x.dtype, device=x.device), t)
    return w, mean, std


def ridge_predict(x: torch.Tensor, fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    w, mean, std = fit
    x = x.double()
    xw = torch.cat([(x - mean) / std, torch.full((len(x), 1), BIAS_CONSTANT, dtype=x.dtype, device=x.device)], 1)
    return (xw @ w).argmax(1)


@dataclass
class FewShotResult:
    """Accuracy per number of shots: mean and standard deviation over draws, every draw's value and its l2."""

    shots: list[int]
    mean: dict[int, float]
    std: dict[int, float]
    draws: dict[int, list[float]] = field(default_factory=dict)
    l2: dict[int, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"shots": self.shots, "mean": self.mean, "std": self.std, "draws": self.draws, "l2": self.l2}

    def __str__(self) -> str:
        return "  ".join(f"{k}-shot {100 * self.mean[k]:.2f} ± {100 * self.std[k]:.2f}%" for k in self.shots)


def fewshot_from_features(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                          shots=(1, 5, 10, 25), draws: int = 5, seed: int = 0, val_per_class: int = 10,
                          l2_grid=L2_GRID) -> FewShotResult:
    """Few-shot accuracy from features already computed. Each draw takes `k` training images per class (and
    `val_per_class` other ones to choose the l2 by), fits, and scores the whole test set."""
    classes = torch.unique(train_y).tolist()
    num_classes = int(max(int(train_y.max()), int(test_y.max()))) + 1
    by_class = {c: torch.nonzero(train_y == c).flatten() for c in classes}
    need = max(shots) + val_per_class
    short = [c for c, idx in by_class.items() if len(idx) < need]
    if short:
        raise UsageError(f"classes {short} have fewer than {need} training images ({max(shots)} shots + {val_per_class} "
                         f"held out to choose the regularisation)")
    mean, std, per_draw, chosen = {}, {}, {}, {}
    for k in shots:
        accs, l2s = [], []
        for draw in range(draws):
            g = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * k + draw)
            pick, val = [], []
            for c in classes:
                perm = by_class[c][torch.randperm(len(by_class[c]), generator=g)]
                pick.append(perm[:k])
                val.append(perm[k:k + val_per_class])
            pick, val = torch.cat(pick), torch.cat(val)
            best = max(l2_grid, key=lambda l2: (
                (ridge_predict(train_x[val], ridge_fit(train_x[pick], train_y[pick], num_classes, l2)) == train_y[val])
                .double().mean().item(), -abs(math.log2(l2) - 10)))  # ties: the l2 nearest big_vision's default 2^10
            fit = ridge_fit(train_x[pick], train_y[pick], num_classes, best)
            accs.append((ridge_predict(test_x, fit) == test_y).double().mean().item())
            l2s.append(best)
        mean[k], std[k] = float(np.mean(accs)), float(np.std(accs))
        per_draw[k], chosen[k] = accs, l2s
    return FewShotResult(list(shots), mean, std, per_draw, chosen)


@torch.no_grad()
def features(model: nn.Module, data, transform, batch_size: int = 500, device="cpu", precision: str = "fp32"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled representation (the head's input: `forward_head(..., pre_logits=True)`) of every image of a
    dataset, and the labels; computed in `precision` (fp32 | bf16 | fp16 autocast), returned in float32."""
    was = model.training
    model.eval()
    xs, ys = [], []
    plan = [b for b, _ in eval_index_batches(len(data), batch_size)]
    for x, y, _ in load_batches(data, plan, 0, torch.device(device)):
        if len(y):
            with autocast(precision, device):
                xs.append(model.forward_head(model.forward_features(transform(x)), pre_logits=True).float().cpu())
            ys.append(y.cpu())
    model.train(was)
    return torch.cat(xs), torch.cat(ys)


def fewshot(model: nn.Module, train_data, test_data, *, shots=(1, 5, 10, 25), draws: int = 5, seed: int = 0,
            replicate_to: int | None = None, device="cpu", batch_size: int = 500, val_per_class: int = 10,
            precision: str = "fp32") -> FewShotResult:
    """Few-shot linear accuracy of a frozen model on a downstream dataset (its train split for the shots, its test
    split for the score), with the model's own evaluation preprocessing.

    Args:
        shots: images per class to fit on.
        draws: random draws of the shots; the result is their mean and standard deviation.
        replicate_to: repeat a grey channel this many times (grey data, an RGB model).
        precision: fp32 | bf16 | fp16 (autocast) for the features.
    """
    tx, ty, vx, vy = split_features(model, train_data, test_data, replicate_to, device, batch_size, precision)
    return fewshot_from_features(tx, ty, vx, vy, shots, draws, seed, val_per_class)


def split_features(model: nn.Module, train_data, test_data, replicate_to: int | None = None, device="cpu",
                   batch_size: int = 500, precision: str = "fp32") -> tuple[torch.Tensor, ...]:
    """(train features, train labels, test features, test labels), each split with the model's own evaluation
    preprocessing (files decoded at the model's size, in-memory arrays resized on the device: `vitkit.data.prepare`).
    replicate_to: None applies the grey-to-RGB rule (`vitkit.data.replicate_channels`); a number overrides it."""
    data = prepare(model.config, train=train_data, test=test_data)
    if replicate_to is not None:
        data.replicate_to = replicate_to
    tx, ty = features(model, data.train, data.transform(data.train), batch_size, device, precision)
    vx, vy = features(model, data.test, data.transform(data.test), batch_size, device, precision)
    return tx, ty, vx, vy
