"""k-nearest-neighbour classification on frozen features: the evaluation of self-supervised backbones (DINO, Caron
et al. 2021, Sec. 4.1; DINOv2): the pooled features are L2-normalised, every test image's k most cosine-similar
training images vote for their class with weight exp(similarity / T), and the class with the largest total wins
(T = 0.07, k = 10 and 20 as DINO reports). `temperature=None` gives every neighbour one vote.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .fewshot import split_features


@dataclass
class KnnResult:
    ks: list[int]
    accuracy: dict[int, float]
    temperature: float | None
    train_images: int
    test_images: int

    def to_dict(self) -> dict:
        return {"ks": self.ks, "accuracy": self.accuracy, "temperature": self.temperature,
                "train_images": self.train_images, "test_images": self.test_images}

    def __str__(self) -> str:
        return "  ".join(f"{k}-NN {100 * self.accuracy[k]:.2f}%" for k in self.ks)


def knn_predict(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, ks=(10, 20),
                temperature: float | None = 0.07, chunk: int = 1024) -> dict[int, torch.Tensor]:
    """{k: (M,) predicted classes} for the test features (M, D) from the training features (N, D) and labels (N,)."""
    if len(train_x) < max(ks):
        raise UsageError(f"k={max(ks)} neighbours asked for, but there are {len(train_x)} training images")
    num_classes = int(train_y.max()) + 1
    train = F.normalize(train_x.float(), dim=1)
    out: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for start in range(0, len(test_x), chunk):
        sim = F.normalize(test_x[start:start + chunk].float(), dim=1) @ train.T  # (m, N) cosine similarities
        top_sim, top_idx = sim.topk(max(ks), dim=1)  # (m, K), most similar first
        weight = torch.ones_like(top_sim) if temperature is None else (top_sim / temperature).exp()
        labels = train_y[top_idx]  # (m, K)
        for k in ks:
            votes = torch.zeros(len(sim), num_classes).scatter_add_(1, labels[:, :k], weight[:, :k])  # (m, C)
            out[k].append(votes.argmax(1))
    return {k: torch.cat(v) for k, v in out.items()}


def knn_from_features(train_x, train_y, test_x, test_y, ks=(10, 20), temperature: float | None = 0.07) -> KnnResult:
    pred = knn_predict(train_x, train_y, test_x, ks, temperature)
    acc = {k: (pred[k] == test_y).double().mean().item() for k in ks}
    return KnnResult(list(ks), acc, temperature, len(train_x), len(test_x))


def knn(model: nn.Module, train_data, test_data, *, ks=(10, 20), temperature: float | None = 0.07,
        replicate_to: int | None = None, device="cpu", batch_size: int = 500, precision: str = "fp32") -> KnnResult:
    """k-NN accuracy of a frozen model's pooled features (the head's input) on a dataset: its train split is the
    memory bank, its test split is scored. Each split gets the model's own evaluation preprocessing."""
    tx, ty, vx, vy = split_features(model, train_data, test_data, replicate_to, device, batch_size, precision)
    return knn_from_features(tx, ty, vx, vy, ks, temperature)
