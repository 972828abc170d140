"""Dynamic data pruning as InfoBatch does it (Qin et al., ICLR 2024, "InfoBatch: Lossless Training Speed Up by
Unbiased Dynamic Data Pruning", arXiv 2303.04947): `data.prune=R`.

Every training image keeps the training loss of its latest forward pass: its score. Each pass over the data leaves
out a random fraction R of the images scored below the mean score (the well-learned ones), and scales the loss of the
well-learned images it keeps by (well-learned) / (well-learned kept), about 1 / (1 - R): the pass's expected gradient
is the whole set's. Images not yet scored (all of them, in the first pass) are kept at weight 1. A pass that starts
in the last (1 - data.prune_anneal) of the run's steps keeps every image at weight 1 (InfoBatch's annealing: the
final steps see the data unweighted).

A pass is thus shorter than an epoch, while the run still counts steps, and epochs as the images it has seen over
the training set's size: pruning makes no step cheaper; the steps of a fixed length or time budget visit the images
still being learned more often. The stream runs from pass to pass without a break (a batch may hold the end of one
and the start of the next), each pass in its own order, drawn from (seed, pass).

Exact resume: the scores, the pass in hand (its order and weights), its number and the position in it travel in the
step's checkpoint. Several processes: every rank draws the same global batches and takes its contiguous slice (as
`vitkit.data.datasets.iterate_batches`), and a batch's losses are summed over the ranks each micro-step, so every rank
holds the same scores and draws the same passes (checked at each pass).
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from ..data.augment import alternate_flip, flip_coins

UNSCORED = float("inf")  # never below the mean: kept until its first loss


def plan_pass(scores: torch.Tensor, ratio: float, full: bool, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, weight) of one pass: the kept images' indices in a random order and each one's loss weight.

    The well-learned are the scored images below the mean of the scored ones; round(ratio * their number) of them,
    drawn at random, are left out, and the rest of them weigh (well-learned) / (kept). `full`: every image, weight 1.
    """
    n = len(scores)
    weight = torch.ones(n)
    keep = torch.ones(n, dtype=torch.bool)
    scored = torch.isfinite(scores)
    if not full and ratio > 0 and bool(scored.any()):
        # the mean summed exactly: a float32 sum's rounding moves with the thread count, and ranks must agree
        mean = math.fsum(scores[scored].tolist()) / int(scored.sum())
        well = (scores < mean).nonzero().squeeze(1)  # unscored (inf) images are never below
        drop = min(round(ratio * len(well)), len(well) - 1)  # one at least is kept: a weight of at most len(well)
        if drop > 0:
            keep[well[torch.randperm(len(well), generator=g)[:drop]]] = False
            weight[well] = len(well) / (len(well) - drop)
    kept = keep.nonzero().squeeze(1)
    order = kept[torch.randperm(len(kept), generator=g)]
    return order, weight[order]


class Pruner:
    """The training images as an endless stream of global micro-batches, pass after pruned pass.

    Args:
        data: the training set (in memory: `batch(idx, device)`).
        batch_size: the global micro-batch.
        ratio: the fraction of the well-learned images each pass leaves out (data.prune), in [0, 1).
        anneal: passes that start at or past this fraction of the run's steps keep every image (data.prune_anneal).
        seed: the run's seed; a pass's draws come from (seed, pass).
        accumulate: micro-batches per step (the step a pass starts at decides its annealing).
        total: the run's length in steps, as it stands (a time budget refits it).
        hflip_alternate: each image mirrored where its coin of `seed` differs from the parity of the pass that draws
            it (`vitkit.data.augment.alternate_flip`, for `aug.hflip_alternate`): the passes stand for epochs.
    """

    def __init__(self, data, batch_size: int, ratio: float, anneal: float, seed: int, accumulate: int,
                 total: Callable[[], int], device, rank: int = 0, world: int = 1, check_same=None,
                 hflip_alternate: bool = False) -> None:
        self.data, self.batch_size, self.ratio, self.anneal, self.seed = data, batch_size, ratio, anneal, seed
        self.accumulate, self.total, self.device, self.rank, self.world = accumulate, total, device, rank, world
        self.check_same = check_same  # Dist.check_same: every rank must draw the same pass
        n = len(data)
        self.scores = torch.full((n,), UNSCORED)
        self.order = torch.empty(0, dtype=torch.long)
        self.weight = torch.empty(0)
        self.pass_index = -1  # the pass in hand; -1: none drawn yet
        self.pos = 0  # images of the pass in hand already drawn
        self.drawn = 0  # micro-batches drawn since the run's first step
        self.segments: list[tuple[int, torch.Tensor]] = []  # the batch in hand: (offset, indices) per pass it spans
        self.batch_weight = torch.ones(0)  # this rank's slice of the batch in hand
        self.plain_loss = 0.0  # the unweighted mean loss of this rank's slice of the batch in hand (the log's)
        self.events: list[dict] = []  # one record per pass drawn, for metrics.jsonl
        self.coins = flip_coins(n, seed) if hflip_alternate else None

    # -- the stream ----------------------------------------------------------------------------------------------
    def _next_pass(self) -> None:
        step = self.drawn // self.accumulate
        total = self.total()
        full = step >= self.anneal * total
        self.pass_index += 1
        g = torch.Generator().manual_seed(self.seed * 1_000_039 + self.pass_index)
        self.order, self.weight = plan_pass(self.scores, self.ratio, full, g)
        self.pos = 0
        n, kept = len(self.scores), len(self.order)
        if self.check_same is not None:
            self.check_same("pass of data.prune", [self.pass_index, kept, int(self.order[:64].sum())])
        # logged at the step that first trains on it (steps are counted from 1): a run resumed from the checkpoint
        # before that step draws it again and logs it once
        self.events.append({"split": "prune", "step": step + 1, "pass": self.pass_index, "kept": kept, "pruned": n - kept,
                            "annealed": full, "max_weight": float(self.weight.max()) if kept else 1.0})

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """(uint8 images on the device, labels, 0) of this rank's slice of each global micro-batch, without end."""
        per = self.batch_size // self.world
        mine = slice(self.rank * per, (self.rank + 1) * per)
        while True:
            self.segments, weights, passes, need = [], [], [], self.batch_size
            while need:
                if self.pos >= len(self.order):
                    self._next_pass()
                take = min(need, len(self.order) - self.pos)
                self.segments.append((self.batch_size - need, self.order[self.pos:self.pos + take]))
                weights.append(self.weight[self.pos:self.pos + take])
                passes.append(torch.full((take,), self.pass_index))
                self.pos += take
                need -= take
            self.drawn += 1
            idx = torch.cat([s for _, s in self.segments])
            self.batch_weight = torch.cat(weights)[mine]
            x, y = self.data.batch(idx[mine], self.device)
            if self.coins is not None:
                x = alternate_flip(x, self.coins[idx[mine]], torch.cat(passes)[mine])
            yield x, y, 0

    def weigh(self, losses: torch.Tensor, sum_ranks: Callable[[list[float]], list[float]] | None = None) -> torch.Tensor:
        """The loss of this rank's slice of the batch in hand, from its per-image losses: their weighted mean. The
        losses (every rank's, summed over the ranks by `sum_ranks`) become the images' scores."""
        w = self.batch_weight.to(losses.device, losses.dtype)
        got = losses.detach().float().cpu()
        self.plain_loss = float(got.mean())
        if self.world > 1:
            full = torch.zeros(self.batch_size)
            per = self.batch_size // self.world
            full[self.rank * per:(self.rank + 1) * per] = got
            got = torch.tensor(sum_ranks(full.tolist()), dtype=torch.float32)
        for offset, idx in self.segments:  # in order: an image at the end of one pass and the start of the next keeps its last loss
            self.scores[idx] = got[offset:offset + len(idx)]
        return (losses * w).mean()

    def pop_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Fixed-size tensors for the step's checkpoint (a pass's order and weights padded to the set's size)."""
        n = len(self.scores)
        order = torch.full((n,), -1, dtype=torch.long)
        weight = torch.zeros(n)
        order[:len(self.order)], weight[:len(self.weight)] = self.order, self.weight
        return {"scores": self.scores.clone(), "order": order, "weight": weight}

    def state_meta(self) -> dict:
        return {"pass": self.pass_index, "pos": self.pos, "length": len(self.order), "images": len(self.scores)}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict, step: int) -> None:
        """The state a checkpoint saved at step `step` (checked: a wrong or foreign one raises ValueError)."""
        n = len(self.scores)
        fields = {k: meta.get(k) for k in ("pass", "pos", "length", "images")}
        if not all(type(v) is int for v in fields.values()):
            raise ValueError(f"data.prune's saved pass is not four whole numbers: {fields}")
        index, pos, length = fields["pass"], fields["pos"], fields["length"]
        if fields["images"] != n or not (0 <= pos <= length <= n) or not -1 <= index <= (step + 1) * self.accumulate * self.batch_size:
            raise ValueError(f"data.prune's saved pass does not fit {n} training images at step {step}: {fields}")
        for k in ("scores", "order", "weight"):
            if tuple(tensors[k].shape) != (n,):
                raise ValueError(f"data.prune's saved {k} holds {tuple(tensors[k].shape)} values, not ({n},)")
        order, weight, scores = tensors["order"][:length].long(), tensors["weight"][:length].float(), tensors["scores"].float()
        if length and (int(order.min()) < 0 or int(order.max()) >= n or not bool(torch.isfinite(weight).all())
                       or float(weight.min()) < 1.0 or float(weight.max()) > n):
            raise ValueError("data.prune's saved pass holds indices or weights out of range")
        if bool(torch.isnan(scores).any()) or float(scores.min()) < 0:
            raise ValueError("data.prune's saved scores are not losses (NaN or negative)")
        self.scores, self.order, self.weight = scores.clone(), order.clone(), weight.clone()
        self.pos, self.pass_index = pos, index
