"""vitkit.resolve_data_config / vitkit.create_transform: timm's `timm.data.resolve_data_config` and
`timm.data.create_transform` for evaluation, against timm's own dicts (timm 1.0.31, `resolve_data_config(model=
timm.create_model(name))`) and its transform's output tensors (tests/fixtures/timm_eval_transform)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import vitkit
from vitkit.errors import UsageError
from vitkit.models.layers.patch_embed import to_2tuple

from conftest import FIXTURES_HERE

EVAL = FIXTURES_HERE / "timm_eval_transform"
IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
HALF = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
TIMM = {  # timm.data.resolve_data_config(model=timm.create_model(name)), timm 1.0.31
    "vit_tiny_patch16_224": dict(input_size=(3, 224, 224), interpolation="bicubic", **HALF, crop_pct=0.9),
    "deit_tiny_patch16_224": dict(input_size=(3, 224, 224), interpolation="bicubic", **IMAGENET, crop_pct=0.9),
    "vit_small_patch16_384": dict(input_size=(3, 384, 384), interpolation="bicubic", **HALF, crop_pct=1.0),
    "vit_base_patch16_clip_224.openai": dict(
        input_size=(3, 224, 224), interpolation="bicubic", mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711), crop_pct=0.9),
}


@pytest.mark.parametrize("name", list(TIMM))
def test_resolve_data_config_is_timms(name):
    m = vitkit.create_model(name, depth=1)
    got = vitkit.resolve_data_config(m)
    assert got == {**TIMM[name], "crop_mode": "center"}
    assert vitkit.resolve_data_config({}, model=m) == got == vitkit.resolve_data_config(pretrained_cfg=m.pretrained_cfg)


def test_resolve_data_config_of_a_checkpoint_reads_its_config_and_takes_timms_overrides(tmp_path):
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=3, crop_pct=0.95,
                            interpolation="bicubic", mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))
    path = vitkit.save(m, tmp_path / "m.safetensors")
    got = vitkit.resolve_data_config(path)
    assert got == dict(input_size=(3, 32, 32), interpolation="bicubic", mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3),
                       crop_pct=0.95, crop_mode="center") == vitkit.resolve_data_config(str(path))
    over = vitkit.resolve_data_config({"img_size": 48, "crop_pct": None, "interpolation": "bilinear"}, model=path)
    assert over["input_size"] == (3, 48, 48) and over["crop_pct"] == 0.95 and over["interpolation"] == "bilinear"
    with pytest.raises(UsageError, match="give a model"):
        vitkit.resolve_data_config()


def _cases():
    return list(enumerate(json.loads((EVAL / "cases.json").read_text())))


@pytest.mark.parametrize("i,case", _cases(), ids=lambda v: str(v) if isinstance(v, int) else None)
def test_create_transform_gives_timms_tensors(i, case):
    """timm's create_transform(**data_config) on three PNGs (tall, wide, smaller than the crop): the same floats."""
    expected = np.load(EVAL / "expected.npz")
    cfg = dict(input_size=(3, *to_2tuple(case["img_size"])), interpolation=case["interpolation"],
               mean=tuple(case["mean"]), std=tuple(case["std"]), crop_pct=case["crop_pct"], crop_mode="center")
    transform = vitkit.create_transform(**cfg)
    for name in ("tall", "wide", "small"):
        with Image.open(EVAL / f"{name}.png") as img:
            got = transform(img)
            grey = transform(img.convert("L"))  # converted to RGB as timm's datasets do
        want = expected[f"{i}/{name}"]
        assert got.shape == want.shape and np.array_equal(got.numpy(), want), name
        assert grey.shape == want.shape


def test_create_transform_takes_a_models_data_config_and_refuses_what_it_cannot_do():
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=3)
    t = vitkit.create_transform(**vitkit.resolve_data_config(m))
    x = t(Image.new("RGB", (50, 40), (255, 0, 0)))
    assert x.shape == (3, 32, 32) and float(x[0].min()) == pytest.approx(1.0)
    assert m(x[None]).shape == (1, 3)
    assert vitkit.create_transform(40, hflip=0.5)(Image.new("RGB", (50, 40))).shape == (3, 40, 40)  # timm's train-only
    for kw, match in [(dict(is_training=True), "training"), (dict(crop_mode="squash"), "center"),
                      (dict(interpolation="lanczos"), "interpolation"), (dict(use_prefetcher=True), "default"),
                      (dict(bogus=1), "unknown")]:
        with pytest.raises(UsageError, match=match):
            vitkit.create_transform(32, **kw)
