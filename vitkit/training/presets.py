"""Training recipes as code. Each preset is a function returning a TrainConfig; `smoke=True` shrinks it to seconds."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..data.augment import AugConfig
from .config import (DataConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig, apply_overrides,
                     flatten_config, load_config_file)
from ..errors import UsageError
from ..models import get_entry

PRESETS: dict[str, Callable[[], TrainConfig]] = {}


def preset(fn: Callable[[], TrainConfig]) -> Callable[[], TrainConfig]:
    PRESETS[fn.__name__.replace("_", "-")] = fn
    return fn


@preset
def fashion_mnist() -> TrainConfig:
    """Fashion-MNIST from scratch on a 2-core CPU in 7-20 minutes: 92.12% in 437 s on a 2-core AMD EPYC with bf16
    instructions (Zen 5), and the README's figure for an AVX2-only CPU (fp32).

    The model is the paper's hybrid (Sec. 3.1) sized for 28x28 images: a ResNet stem and four bottlenecks turn
    the image into a 7x7 grid of 49 tokens for one ViT layer (D 192, 6 heads, MLP 384) with global average
    pooling; at small compute budgets hybrids beat plain ViTs (Fig. 5), and here a bottleneck at 7x7 costs less
    than a ViT layer. `run.precision=auto`: bf16 autocast with the token stream kept in bf16 (`run.lowp_stream`)
    where this machine runs it faster (AVX-512 BF16, AMX, GPUs), fp32 where it does not (AVX2-only CPUs); flips and random
    erasing, AdamW 2e-3, a short warmup and linear decay to zero, 10 epochs, evaluated with flip test-time
    augmentation (`run.tta`). How each choice was measured: benchmarks/NOTES.md, sections 6-10, 13 and 14.
    """
    return TrainConfig(
        preset="fashion-mnist",
        data=DataConfig(dataset="fashion-mnist", batch_size=256),
        aug=AugConfig(crop="none", hflip=True, label_smoothing=0.1, random_erasing=0.25),
        model=ModelConfig(name="r26_vit_s32", overrides=dict(hybrid_layers=(4,), hybrid_width=1.0, patch_size=4,
                                                             embed_dim=192, depth=1, num_heads=6, mlp_dim=384,
                                                             classifier="gap")),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, clip_grad=1.0),
        schedule=ScheduleConfig(epochs=10, warmup_epochs=0.5, decay="linear"),
        run=RunConfig(out_dir="runs/fashion-mnist", ckpt_every=200, precision="auto", lowp_stream=True, eval_every=5,
                      tta="flip"),
    )


@preset
def fashion_mnist_long() -> TrainConfig:
    """Fashion-MNIST from scratch in about 100 minutes on a 2-core CPU: the 15-minute preset's model and recipe
    for 72 epochs, with 2-pixel shifts, EMA weights, and test-time augmentation over flips and one-pixel shifts
    (10 views): 94.12% (`vitkit eval final.safetensors --tta flip-shift`) in 5979 s on a 2-core AMD EPYC
    (benchmarks/NOTES.md, sections 15 and 16)."""
    cfg = fashion_mnist()
    cfg.preset = "fashion-mnist-long"
    cfg.model.overrides.update(drop_path_rate=0.05)
    cfg.aug = AugConfig(crop="pad", pad=2, hflip=True, label_smoothing=0.1, random_erasing=0.25)
    cfg.schedule = ScheduleConfig(epochs=72, warmup_epochs=2, decay="linear")
    cfg.run.ema = 0.999
    cfg.run.eval_every = 24  # one evaluation of the weights and the EMA's over 10 views: ~2.5 minutes at batch 1000
    cfg.run.tta = "flip-shift"
    cfg.run.out_dir = "runs/fashion-mnist-long"
    return cfg


@preset
def fashion_mnist_fast() -> TrainConfig:
    """Fashion-MNIST in 30 minutes on any machine (issue 55): the long preset's hybrid with BatchNorm in its ResNet
    (`model.overrides.hybrid_norm=batch`) and its augmentation, trained with Muon (`optim.name=muon`: orthogonalised
    updates for the hidden matrices and conv kernels, AdamW for the rest) at batch 128 for as many epochs as fit 30
    minutes of the whole command (`schedule.time_budget=1800`, at most 40 epochs; the length is fixed from the step
    time the run measures, so a slower machine trains fewer), InfoBatch's pruned passes (`data.prune=0.5`: each pass
    leaves out half of the images whose last loss is below the mean, the rest of them weighed up), raw weights (no
    EMA: at this length it lags), one evaluation at the end over 18 views (flips, and shifts by one and two pixels:
    `run.tta=flip-shift2`) for the images their mirror pair leaves unsure (`run.tta_margin=0.75`: about a fifth;
    28-30 s instead of 102-119 s in fp32 on a Zen 4, NOTES 62). In fp32 on a CPU without bf16 (emulated: a 2-core
    Intel Xeon, CPU family 6, model 167, with oneDNN capped to Cascade Lake's ISA; compiled) it trains 15-17 epochs:
    93.87 +- 0.05% in 1764 +- 8 s (3 seeds; 93.45 +- 0.12% before `data.prune`). On the same CPU uncapped, where `run.precision=auto` takes bf16:
    94.14 +- 0.35% (seeds 0, 1 and 2: 94.00%, 93.88% and 94.54% in 25.4, 18.0 and 28.2 epochs, the VM's speed drifting
    between them) in 1765 +- 14 s; on a 2-core AMD EPYC Zen 4 (CPU family 25, bf16 without AMX) 20.5-20.9
    epochs: 93.98 +- 0.16% in 1770 +- 15 s, and in fp32 under the same caps 14.1-14.5 epochs: 93.70 +- 0.02% in
    1771 +- 9 s, with the cascade 14.6-15.1 epochs: 93.61 +- 0.08% in 1763 +- 4 s (the seeds before it ran every
    image in every view); before `data.prune` 94.09 +- 0.14% (24-27 epochs) and, on a slower day,
    93.80 +- 0.07% (19-22 epochs); under the AVX2 caps (eager, before `data.prune`) one seed trained 7.3 epochs: 92.25%. The
    choices, made on a held-out split of the training images: benchmarks/NOTES.md, sections 44 to 63; `python
    benchmarks/time_to_accuracy.py run --presets fashion-mnist-fast --seeds 0 1 2`."""
    cfg = fashion_mnist_long()
    cfg.preset = "fashion-mnist-fast"
    cfg.model.overrides.update(hybrid_norm="batch")  # BatchNorm in the ResNet: 1.2x GroupNorm's step (NOTES 51)
    cfg.data.batch_size = 128
    cfg.data.prune = 0.5  # InfoBatch's pruned passes: +0.55 held out at 15 epochs (NOTES 55)
    cfg.optim = OptimConfig(name="muon", lr=4e-3, weight_decay=0.05, clip_grad=1.0)
    cfg.schedule = ScheduleConfig(epochs=40, warmup_epochs=0.5, decay="linear", time_budget=1800)
    cfg.run.ema = None
    cfg.run.eval_every = 0
    cfg.run.tta = "flip-shift2"
    cfg.run.tta_margin = 0.75  # the shifted views for the images the mirror pair leaves unsure: ~1/3 the cost (NOTES 62)
    cfg.run.out_dir = "runs/fashion-mnist-fast"
    return cfg


@preset
def fashion_mnist_mpp() -> TrainConfig:
    """Masked patch prediction (Sec. 4.6) on Fashion-MNIST's images, no labels: a plain ViT on 4x4 patches (D 96,
    4 layers) predicts the 3-bit mean grey of each of the 50% corrupted patches, 4 epochs (about 2 minutes on a
    2-core CPU; `vitkit reproduce mpp`, docs/reproductions.md). Fine-tune from its result as from any checkpoint:
    `vitkit train fashion-mnist-mpp model.objective=classify model.checkpoint=runs/fashion-mnist-mpp/final.safetensors
    run.out_dir=runs/fashion-mnist-mpp-ft optim.lr=1e-3`."""
    return TrainConfig(
        preset="fashion-mnist-mpp",
        # eval batch 1000: each evaluation batch's corruption has its own seed, and docs/reproductions.md's patch
        # accuracies were measured on this task
        data=DataConfig(dataset="fashion-mnist", batch_size=256, eval_batch_size=1000),
        aug=AugConfig(crop="pad", pad=2, hflip=True, label_smoothing=0.1, random_erasing=0.0),
        model=ModelConfig(name="vit_ti16", objective="mpp",
                          overrides=dict(patch_size=4, embed_dim=96, depth=4, num_heads=4, mlp_dim=192,
                                         hybrid_layers=None, classifier="token")),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, clip_grad=1.0),
        schedule=ScheduleConfig(epochs=4, warmup_epochs=0.3, decay="linear"),
        run=RunConfig(out_dir="runs/fashion-mnist-mpp", precision="auto", eval_every=1000, tta="none"),
    )


@preset
def cifar10_scratch() -> TrainConfig:
    """CIFAR-10 from scratch: DeiT-style regularisation on a small ViT (patch 4)."""
    return TrainConfig(
        preset="cifar10-scratch",
        data=DataConfig(dataset="cifar10", batch_size=128),
        aug=AugConfig(crop="pad", pad=4, hflip=True, randaugment="2,9", mixup=0.8, cutmix=1.0, label_smoothing=0.1, random_erasing=0.25),
        model=ModelConfig(name="vit_s16", overrides=dict(patch_size=4, depth=6, classifier="gap", drop_path_rate=0.1)),
        optim=OptimConfig(name="adamw", lr=1e-3, weight_decay=0.05),
        schedule=ScheduleConfig(epochs=200, warmup_epochs=5),
        run=RunConfig(out_dir="runs/cifar10-scratch", ema=0.9998),
    )


@preset
def cifar10_finetune() -> TrainConfig:
    """The paper's fine-tuning recipe (App. B.1.1): SGD momentum, no weight decay, clip at 1, warmup + cosine,
    a new zero-initialised head, at a higher resolution than pre-training. Set model.checkpoint."""
    return TrainConfig(
        preset="cifar10-finetune",
        data=DataConfig(dataset="cifar10", batch_size=64),
        aug=AugConfig(crop="rrc", scale=(0.08, 1.0), hflip=True, label_smoothing=0.0),
        model=ModelConfig(name="vit_b16", checkpoint="ViT-B_16-i21k", overrides=dict(img_size=224)),
        optim=OptimConfig(name="sgd", lr=0.01, weight_decay=0.0, momentum=0.9, clip_grad=1.0),
        schedule=ScheduleConfig(epochs=10, warmup_epochs=0.5, decay="cosine"),
        run=RunConfig(out_dir="runs/cifar10-finetune", precision="auto"),
    )


@preset
def fashion_mnist_naflex() -> TrainConfig:
    """Native aspect ratios (NaFlex): a plain ViT trained and evaluated on Fashion-MNIST cut to random aspect ratios
    (1/3 to 3, `fashion-mnist-crops`), every image resized keeping its aspect ratio to at most 49 patches of 4x4
    pixels and each batch packed into one forward of mixed sizes (`data.max_patches`); augmented with crops of the
    image's own aspect ratio and flips. Against the same recipe on the images squashed to 28x28:
    `python benchmarks/naflex.py accuracy` (3 seeds; benchmarks/README.md)."""
    return TrainConfig(
        preset="fashion-mnist-naflex",
        data=DataConfig(dataset="fashion-mnist-crops", batch_size=128, max_patches=49),
        aug=AugConfig(crop="rrc", scale=(0.5, 1.0), ratio=(1.0, 1.0), hflip=True, label_smoothing=0.1),
        model=ModelConfig(name="vit_ti16", overrides=dict(patch_size=4, img_size=28, in_chans=1, embed_dim=96, depth=4,
                                                          num_heads=4, mlp_dim=192, classifier="gap")),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, clip_grad=1.0),
        schedule=ScheduleConfig(epochs=4, warmup_epochs=0.3, decay="linear"),
        run=RunConfig(out_dir="runs/fashion-mnist-naflex", ckpt_every=200, precision="auto", eval_every=0),
    )


SMOKE_MODEL = dict(embed_dim=32, depth=2, num_heads=2, mlp_dim=64)  # a smoke run's transformer
# a smoke run's Swin: four stages of two blocks on 32 px (maps 16, 8, 4, 2: shifted windows in the first two)
SMOKE_SWIN = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, patch_size=2, img_size=32)


def get_preset(name: str | None, smoke: bool = False) -> TrainConfig:
    """A preset by name (None: no preset, TrainConfig's plain defaults); smoke: a few hundred images, a couple of
    epochs, a tiny model: seconds on a CPU."""
    if name is not None and name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[name]() if name is not None else TrainConfig(preset="none")
    if smoke:
        cfg.data.subset, cfg.data.test_subset, cfg.data.batch_size = 512, 256, 64
        cfg.schedule.epochs, cfg.schedule.warmup_epochs = 2, 0.5
        shrink_for_smoke(cfg, replace=True)
        cfg.run.out_dir = cfg.run.out_dir + "-smoke"
        cfg.run.ckpt_every, cfg.run.log_every = 4, 2
    return cfg


def preset_for(dataset: str | None, config_preset: str | None = None) -> str | None:
    """The preset a `vitkit train` that names none starts from: a config file's own (a run's config.yaml records
    it), else `fashion-mnist` for its dataset (or no dataset named), else none: plain defaults, not a recipe tuned
    for another dataset."""
    if config_preset in PRESETS:
        return config_preset
    return "fashion-mnist" if dataset in (None, "fashion-mnist") else None


def shrink_for_smoke(cfg: TrainConfig, replace: bool = False) -> None:
    """A smoke run's tiny transformer (SMOKE_MODEL) over the preset's sizes (`replace`), or only where the model
    overrides do not size it already (after the user's own); a model trained from a checkpoint keeps its own."""
    if not cfg.model.checkpoint:
        smoke = SMOKE_SWIN if get_entry(cfg.model.name).arch == "swin" else SMOKE_MODEL
        for k, v in smoke.items():
            cfg.model.overrides[k] = v if replace else cfg.model.overrides.get(k, v)


def run_config(preset: str | None = None, config: str | None = None, overrides: Mapping[str, Any] | None = None,
               smoke: bool = False) -> tuple[TrainConfig, str | None]:
    """The config a run trains with, as `vitkit train` resolves it: the preset (None: the config file's own, else
    `preset_for` the dataset named), its smoke version, the YAML/JSON file `config` over it, then `overrides` by
    dotted key ({"optim.lr": "1e-3"}); a smoke run whose overrides name another model shrinks that one too.
    Returns (the config, the preset it started from)."""
    pairs = dict(overrides or {})
    file_cfg = load_config_file(config) if config else {}
    if preset is None:
        data = file_cfg.get("data")
        dataset = pairs.get("data.dataset", data.get("dataset") if isinstance(data, dict) else None)
        preset = preset_for(None if dataset is None else str(dataset), file_cfg.get("preset"))
    cfg = get_preset(preset, smoke=smoke)
    if file_cfg:
        apply_overrides(cfg, flatten_config(file_cfg))
    preset_model = cfg.model.name
    apply_overrides(cfg, pairs)
    if smoke and cfg.model.name != preset_model:  # another model than the preset's: the smoke run shrinks it too
        shrink_for_smoke(cfg)
    return cfg, preset
