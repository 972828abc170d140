"""`aug.hflip_alternate`: airbench's derandomised horizontal flip (Jordan 2024, arXiv 2404.00498, Sec. 3.6). Each
training image shows one side on even passes over the data and the other on odd ones, from a coin of its own on the
first. Checked against that statement on images whose side can be read off their pixels, in epochs and in
data.prune's passes, for one process and for two ranks' slices; the augmentation leaves those images as the stream
gave them and keeps its other draws; runs resume exactly; what it cannot serve is refused before any work."""
import json

import pytest
import torch
from safetensors.torch import load_file

from vitkit.data.augment import AugConfig, BatchAugment
from vitkit.data.datasets import InMemoryDataset, iterate_batches
from vitkit.errors import UsageError
from vitkit.training import train
from vitkit.training.prune import Pruner

from test_training import _write_png_folder, tiny_cfg

N = 40


def _sided(n: int = N) -> InMemoryDataset:
    """n images of 1 x 2 x 3 whose side reads off their pixels: the left column holds the index, the right 255."""
    x = torch.zeros(n, 1, 2, 3, dtype=torch.uint8)
    x[:, 0, 0, 0], x[:, 0, 0, 2] = torch.arange(n, dtype=torch.uint8), 255
    return InMemoryDataset(x, torch.arange(n) % 10, [str(i) for i in range(10)], "sided")


def _read(x: torch.Tensor) -> list[tuple[int, bool]]:
    """(image index, mirrored) of each image of a batch of `_sided` images."""
    mirrored = x[:, 0, 0, 0] == 255
    return list(zip(torch.where(mirrored, x[:, 0, 0, 2], x[:, 0, 0, 0]).tolist(), mirrored.tolist()))


def test_each_image_shows_one_side_on_even_epochs_and_the_other_on_odd_ones():
    data = _sided()
    sides: dict[int, list[bool]] = {}
    for epoch in range(4):
        for x, _, _ in iterate_batches(data, 8, seed=5, epoch=epoch, hflip_alternate=True):
            for i, m in _read(x):
                sides.setdefault(i, []).append(m)
    assert sorted(sides) == list(range(N))
    assert all(s == [s[0], not s[0], s[0], not s[0]] for s in sides.values()), sides
    first = sum(s[0] for s in sides.values())
    assert 10 <= first <= 30  # a coin per image: about half start mirrored
    # another seed, other coins; and the same seed, the same ones
    other = {i: m for x, _, _ in iterate_batches(data, 8, seed=6, epoch=0, hflip_alternate=True) for i, m in _read(x)}
    assert other != {i: s[0] for i, s in sides.items()}
    # two ranks' slices of each global batch are one process's batch, sides included
    for epoch in range(2):
        one = [_read(x) for x, _, _ in iterate_batches(data, 8, seed=5, epoch=epoch, hflip_alternate=True)]
        ranks = [[_read(x) for x, _, _ in iterate_batches(data, 8, seed=5, epoch=epoch, hflip_alternate=True,
                                                          rank=r, world=2)] for r in (0, 1)]
        assert one == [a + b for a, b in zip(*ranks)]
    # without it the stream leaves the images as they are (the augmentation flips them at random)
    plain = [m for x, _, _ in iterate_batches(data, 8, seed=5, epoch=1) for _, m in _read(x)]
    assert not any(plain)


def test_data_prunes_passes_alternate_the_sides_as_epochs_do():
    """Under data.prune the passes stand for the epochs: an image drawn in pass p shows its coin's side when p is
    even and the other when odd, also in a batch that spans two passes."""
    data = _sided()
    p = Pruner(data, 12, 0.5, 1.0, 3, 1, lambda: 1000, "cpu", hflip_alternate=True)
    stream = p.batches()
    g = torch.Generator().manual_seed(0)
    seen: dict[int, dict[int, bool]] = {}  # image -> {pass: mirrored}
    spans = 0
    for _ in range(20):
        x, y, _ = next(stream)
        passes = [p.pass_index - (len(p.segments) - 1 - k) for k, (_, idx) in enumerate(p.segments) for _ in idx]
        spans += len(p.segments) > 1
        for (i, m), q in zip(_read(x), passes):
            seen.setdefault(i, {})[q] = m
        p.weigh(torch.rand(len(y), generator=g))
    assert spans and p.pass_index >= 4 and any(len(v) < p.pass_index for v in seen.values())  # some were left out
    coins = {i: v[0] for i, v in seen.items()}  # the first pass draws every image
    assert len(coins) == N and 5 <= sum(coins.values()) <= 35
    assert all(m == (coins[i] != (q % 2 == 1)) for i, v in seen.items() for q, m in v.items())
    # two ranks' slices of each global batch are one process's batch, sides included (the losses summed over ranks)
    one = Pruner(data, 12, 0.5, 1.0, 3, 1, lambda: 1000, "cpu", hflip_alternate=True)
    ranks = [Pruner(data, 12, 0.5, 1.0, 3, 1, lambda: 1000, "cpu", rank=r, world=2, hflip_alternate=True) for r in (0, 1)]
    streams = [one.batches()] + [q.batches() for q in ranks]
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        (x, y, _), (x0, _, _), (x1, _, _) = (next(s) for s in streams)
        assert _read(x) == _read(x0) + _read(x1)
        losses = torch.rand(len(y), generator=g)
        one.weigh(losses)
        for r, q in enumerate(ranks):
            q.weigh(losses[r * 6:(r + 1) * 6], lambda _, full=losses.tolist(): full)
    assert one.pass_index >= 2


def test_the_augmentation_leaves_the_sides_to_the_stream_and_keeps_its_other_draws():
    x = torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8)
    y = torch.arange(64) % 10
    want = (x.float() / 255 - 0.5) / 0.5

    def augment(alternate: bool, erasing: float) -> tuple[torch.Tensor, torch.Generator]:
        aug = AugConfig(crop="none", hflip=True, hflip_alternate=alternate, random_erasing=erasing)
        g = torch.Generator().manual_seed(0)
        return BatchAugment(aug, (8, 8), (0.5,), (0.5,), 10)(x, y, g)[0], g

    a, _ = augment(False, 0.0)
    b, _ = augment(True, 0.0)
    assert torch.equal(b, want)  # no image mirrored
    same = (a == want).flatten(1).all(1)
    assert 10 < int(same.sum()) < 54 and bool((same | (a == want.flip(-1)).flatten(1).all(1)).all())
    # the coins are drawn either way: what follows them (random erasing here) draws the same
    (ea, ga), (eb, gb) = augment(False, 0.5), augment(True, 0.5)
    assert torch.equal(ga.get_state(), gb.get_state())
    assert torch.equal(ea[same], eb[same]) and not torch.equal(ea[~same], eb[~same])


def test_a_run_with_alternating_flips_resumes_exactly_with_and_without_pruning(tmp_path):
    from vitkit.training import checkpoint

    for name, extra in (("epochs", {}), ("passes", {"data.prune": 0.5})):
        cfg = {"aug.hflip": True, "aug.hflip_alternate": True, "schedule.epochs": 2, "run.ckpt_every": 10, **extra}
        whole = train(tiny_cfg(tmp_path / name, **cfg))
        cut = tmp_path / f"{name}-cut"
        train(tiny_cfg(cut, **cfg), max_steps=30)  # inside the second epoch, and inside a pass
        if extra:
            saved = json.loads((checkpoint.latest(cut) / "meta.json").read_text())["prune"]
            assert saved["pass"] >= 1 and 0 < saved["pos"] < saved["length"], saved
        resumed = train(tiny_cfg(cut, **cfg))
        assert resumed["step"] == whole["step"] == 46 and whole["acc1"] > 0.3, whole  # chance: 0.1
        a, b = load_file(tmp_path / name / "final.safetensors"), load_file(cut / "final.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
    # random flips, the same run otherwise (the augmentation's draws are the same): other sides, other weights
    random = train(tiny_cfg(tmp_path / "random", **{"aug.hflip": True, "schedule.epochs": 2}))
    a, c = load_file(tmp_path / "epochs" / "final.safetensors"), load_file(tmp_path / "random" / "final.safetensors")
    assert random["step"] == 46 and not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("extra, match", [
    ({"aug.hflip": False}, "aug.hflip=true"),
    ({"data.dataset": "FOLDER", "data.batch_size": 8, "data.num_workers": 0,
      "model.overrides": {"img_size": 16, "in_chans": 3}}, "held in memory"),
])
def test_what_alternating_flips_cannot_serve_is_refused_before_any_work(tmp_path, extra, match):
    if extra.get("data.dataset") == "FOLDER":
        _write_png_folder(tmp_path / "imgs")
        extra = {**extra, "data.dataset": str(tmp_path / "imgs")}
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=match):
        train(tiny_cfg(out, **{"aug.hflip": True, "aug.hflip_alternate": True, "run.tta": "none", **extra}))
    assert not (out / "checkpoints").exists()
