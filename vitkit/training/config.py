"""Training configuration as code: nested dataclasses, presets with a smoke mode, YAML/JSON files, key=value overrides."""
from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from ..data.augment import AugConfig
from ..errors import UsageError
from ..safety import parse_json, parse_yaml, read_bytes, untrusted

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    """Args:
    dataset: "fashion-mnist", "cifar10", "cifar100", an ImageFolder root, or a train .csv.
    data_dir: where to look for the named datasets (also $VITKIT_DATA).
    test_dir: a test folder or CSV, when not inside the dataset root.
    batch_size: the global training batch of a micro-step, split over the processes of a distributed run (per
        optimizer step: times run.accumulate).
    eval_batch_size: evaluation batch, per process and per view of run.tta. 256, not larger: on the fashion-mnist
        presets' model a CPU forward of 1000 images runs its activations out of cache, 1.4-2.2x slower per image
        (AVX2 to AVX-512; benchmarks/NOTES.md section 45). Masked patch prediction corrupts each evaluation batch
        from its own seed: its evaluation is the same task at one eval_batch_size and world size.
    num_workers: DataLoader workers for folder datasets.
    subset: use only this many training images (smoke runs).
    test_subset: use only this many test images (smoke runs).
    val_split: hold out this fraction of the training images (per class, a fixed shuffle) for the periodic
        evaluations and the choice of best.safetensors; the test set is then evaluated once, at the end.
        0: evaluate on the test set throughout, the convention of published Fashion-MNIST and CIFAR numbers.
    strict_images: fail on an undecodable image instead of skipping and counting it.
    classes: keep only these classes (their indices in the dataset), relabelled 0..k-1 in that order (in-memory
        datasets): an upstream task of some classes, another downstream.
    prune: InfoBatch's dynamic data pruning (`vitkit.training.prune`): each pass over the training images leaves out
        this fraction of the images whose latest training loss is below the mean, and weighs the loss of the rest
        of them up to keep the pass's gradient unbiased; the steps (and a time budget's) then see the images still
        being learnt more often. 0: off. In-memory datasets, hard labels (no mixup, cutmix, mpp or distillation).
    prune_anneal: passes that start at or past this fraction of the run's steps keep every image, unweighted.
    max_patches: native aspect ratios (NaFlex): every image resized, keeping its aspect ratio, to at most this many
        patches and the batch packed into one forward of mixed sizes (`vitkit.data.naflex`); training augments with
        crops of the image's own aspect ratio (aug.crop=rrc, area aug.scale) and flips. None: one square size.
    """

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    test_dir: str | None = None
    batch_size: int = 256
    eval_batch_size: int = 256
    num_workers: int = 2
    subset: int | None = None
    test_subset: int | None = None
    val_split: float = 0.0
    strict_images: bool = False
    classes: list[int] | None = None
    max_patches: int | None = None
    prune: float = 0.0
    prune_anneal: float = 0.875


@dataclass
class ModelConfig:
    """Args:
    name: a registered model name; the starting architecture.
    overrides: config fields for it (img_size, patch_size, embed_dim, depth, ...).
    checkpoint: fine-tune from this checkpoint (any format vitkit loads) instead of random weights.
    resample: position-embedding resampling when fine-tuning at a new resolution (default: the checkpoint's own
        method, `vitkit.load`'s resample).
    linear_probe: train only the head (frozen backbone).
    objective: "classify" (labels), or "mpp": masked patch prediction (Sec. 4.6), self-supervised pre-training
        that predicts corrupted patches' 3-bit mean colour; its checkpoints fine-tune like any other.
    lora: LoRA's rank r (Hu et al. 2021; `vitkit.models.lora`): the weights stay frozen and only low-rank adapters on
        the projections named by lora_targets train, with the head; the run's weight files are written with the
        adapters merged in (plain models). None: off (every weight trains, or the head alone with linear_probe).
    lora_alpha: the adapters' update is scaled by lora_alpha / lora; None: lora (a scale of 1).
    lora_dropout: dropout on the adapters' input.
    lora_targets: what gets adapters: qkv (the fused query-key-value projection, one adapter over it whole), or
        some of q, k, v (its row blocks alone, each with its own adapter: [q, v] is the LoRA paper's choice), proj
        (attention output), mlp (fc1 and fc2; SwiGLU's fc1_g, fc1_x and fc2).
    loaded: written by the run that starts from a checkpoint: the architecture it holds (timm's name from a timm
        folder, else the registered name of its size, `vitkit.models.registry.name_of`), as printed; not read.
    stem_init: "random"; "pca": the first conv of a convolutional stem (a hybrid's ResNet stem, a conv_stem) set to
        the leading principal components of the training images' patches, each beside its negative (airbench's
        first layer; `vitkit.training.stem_init`); "pca-frozen": the same, and that conv never trains.
    """

    name: str = "vit_ti16"
    overrides: dict = field(default_factory=dict)
    checkpoint: str | None = None
    resample: str | None = None
    linear_probe: bool = False
    objective: str = "classify"
    lora: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q", "v"])
    loaded: str | None = None
    stem_init: str = "random"


@dataclass
class DistillConfig:
    """Args:
    teacher: a checkpoint (any model vitkit loads) whose predictions the student's distillation token learns, as
        in DeiT; the student gets that token (distilled=True). None: no distillation.
    kind: "hard" (the teacher's argmax, DeiT's choice) or "soft" (KL to the teacher's softened distribution).
    alpha: the distillation loss's weight; the label loss gets 1 - alpha.
    tau: the softening temperature of kind "soft".
    """

    teacher: str | None = None
    kind: str = "hard"
    alpha: float = 0.5
    tau: float = 3.0


@dataclass
class OptimConfig:
    """Args:
    name: "adamw", "sgd" (momentum 0.9, as the paper's fine-tuning) or "muon" (orthogonalised updates for the hidden
        matrices and conv kernels, AdamW with `betas` for the rest, one learning rate: `training/muon.py`).
    lr: peak learning rate.
    weight_decay: not applied to norms, biases, position embeddings and tokens.
    layer_decay: layer-wise LR decay for fine-tuning (e.g. 0.75); None: off.
    clip_grad: clip the global gradient norm (the paper: 1); None: off.
    muon_momentum: Muon's Nesterov momentum.
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    muon_momentum: float = 0.95
    layer_decay: float | None = None
    clip_grad: float | None = 1.0


@dataclass
class ScheduleConfig:
    """Args:
    epochs: training length in epochs (may be fractional).
    warmup_epochs: linear warmup from 0.
    decay: "cosine", "linear" or "constant" after warmup.
    min_lr_ratio: the final LR as a fraction of the peak.
    time_budget: seconds the whole run may take (the command's wall clock: start-up, data, steps, evaluations);
        the run measures its step time and trains the most steps that fit, at most `epochs` (vitkit.training.budget:
        the length is fixed at the warmup's end and again at every epoch's end). None: `epochs`, however long.
    resize_from: progressive resizing (vitkit.training.resize): the first steps train on the images made smaller,
        this many pixels high (a multiple of the model's patch height), the size rising linearly with the step to the
        model's at `resize_until` of the run; a smaller step costs about its pixels' share, and a time budget counts
        it so. ViTs (plain or hybrid) only. None: every step at the model's size.
    resize_until: how far from the run's first step to its last progressive resizing reaches the model's size, in
        (0, 1]; the last step is always at the model's size.
    """

    epochs: float = 10
    warmup_epochs: float = 1
    decay: str = "cosine"
    min_lr_ratio: float = 0.0
    time_budget: float | None = None
    resize_from: int | None = None
    resize_until: float = 0.75


@dataclass
class RunConfig:
    """Args:
    out_dir: the run directory (checkpoints, metrics.jsonl, TensorBoard events, config).
    seed: everything random derives from it.
    device: "auto", "cpu", "cuda", ...
    precision: "auto" (bf16 where a short probe measures it faster than fp32 for this model on this device, else
        fp32; measured once per machine and cached, `vitkit.machine.precision`), "fp32", "bf16" (autocast, CPU or GPU) or
        "fp16" (autocast + grad scaler, GPU). A resumed run keeps what its auto chose.
    precision_choice: written by the run: what precision resolved to and why (e.g. "auto -> fp32: bf16 0.10x
        fp32 on this CPU ..."); not read.
    lowp_stream: when the run computes in bf16/fp16 (asked for, or chosen by auto), keep the tokens between blocks
        in that dtype too, not fp32: no casts around every Linear (faster, most on CPUs); weights, gradients and
        optimizer stay fp32. ViTs only; no effect on a CNN or in fp32.
    compile: "auto" (compile the model with torch.compile where a probe measures the compiled training step
        faster and the time it saves over the run's steps exceeds the compile's; short runs are not compiled;
        measured once per machine and cached, `vitkit.training.compile`), "on" or "off" (true/false too).
    compile_choice: written by the run: what compile resolved to and why; not read.
    fast_gemm: fp32 on a CPU: the Linear layers' forward and input gradient on the fastest GEMM this machine has,
        chosen by measurement once per CPU (`vitkit.machine.gemm`; oneDNN's packed GEMM runs 2x MKL's on
        AMD Zen 5); false: PyTorch's own (MKL). The same gradients to fp32 rounding.
    strategy: under torchrun (or `vitkit train --nproc N`): "ddp" (DistributedDataParallel) or
        "fsdp" (FSDP2: parameters, gradients and optimizer state sharded per block); "auto" is ddp with several
        processes and none in one (torchrun at one process runs either strategy alone, to measure its overhead).
    activation_checkpointing: recompute each block's activations in the backward instead of storing them.
    accumulate: gradient accumulation steps (no gradient all-reduce on the accumulating ones).
    ema: EMA decay of the weights (e.g. 0.9998); None: off.
    threads: CPU threads (None: torch's default).
    deterministic: deterministic algorithms (bitwise resume on CPU).
    eval_every: evaluate every this many epochs (fractions too: 0.5 is twice an epoch), and at the end (0: only there).
    tta: test-time augmentation of those evaluations: "none", "flip" (the image and its mirror), "flip-shift"
        (also moved by one pixel each way: 10 views) or "flip-shift2" (by one and by two pixels: 18 views); the mean
        of the views' probabilities is the prediction.
    tta_margin: with flip-shift or flip-shift2, a cascade: an image whose two first views (it and its mirror image)
        put, in their mean probabilities, the first class ahead of the second by this margin or more is answered by
        them, the others by all the views (`vitkit.evaluation.tta_log_probs`; 0.75 with flip-shift2: the same
        predictions as every view on Fashion-MNIST's held-out split, at under a third of its cost). None: every image
        in every view (1 is not quite that: a pair whose probabilities saturate to one class keeps its answer).
    ckpt_every: write the resumable checkpoint every this many steps (and at every epoch end and the end; 0: only there).
    log_every: log every this many steps, and at the end (0: only there).
    fewshot: a dataset (fashion-mnist, digits, a folder, ...) on which every evaluation also measures few-shot
        linear accuracy of the frozen features (`vitkit.evaluation.fewshot`); None: off.
    fewshot_shots: the shots of those measurements.
    fewshot_draws: their random draws.
    """

    out_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    precision_choice: str | None = None
    lowp_stream: bool = False
    compile: str = "auto"
    compile_choice: str | None = None
    fast_gemm: bool = True
    strategy: str = "auto"
    activation_checkpointing: bool = False
    accumulate: int = 1
    ema: float | None = None
    threads: int | None = None
    deterministic: bool = False
    eval_every: float = 1.0
    tta: str = "none"
    tta_margin: float | None = None
    ckpt_every: int = 200
    log_every: int = 20
    progress: bool = True
    fewshot: str | None = None
    fewshot_shots: tuple[int, ...] = (5,)
    fewshot_draws: int = 3


@dataclass
class TrainConfig:
    """A whole run: data, augmentation, model, optimizer, schedule, run settings."""

    preset: str = "custom"
    data: DataConfig = field(default_factory=DataConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        cfg = cls()
        apply_overrides(cfg, flatten_config(d))
        return cfg


def flatten_config(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key != "model.overrides":
            out.update(flatten_config(v, key + "."))
        else:
            out[key] = v
    return out


# Numbers a run cannot work with are refused by name: (lowest, highest) per key; every float must be finite.
NUMBER_BOUNDS = {
    "data.batch_size": (1, 1 << 20), "data.eval_batch_size": (1, 1 << 20), "data.num_workers": (0, 1024),
    "data.subset": (0, None), "data.test_subset": (0, None), "data.val_split": (0.0, 0.99),
    "data.prune": (0.0, 0.99), "data.prune_anneal": (0.0, 1.0),
    "optim.lr": (0.0, None), "optim.weight_decay": (0.0, None), "optim.layer_decay": (0.0, 1.0), "optim.clip_grad": (0.0, None),
    "schedule.epochs": (0.0, 1e6), "schedule.warmup_epochs": (0.0, 1e6), "schedule.min_lr_ratio": (0.0, 1.0),
    "schedule.time_budget": (1.0, 1e7), "schedule.resize_from": (1, 1 << 16), "schedule.resize_until": (0.0, 1.0),
    "run.accumulate": (1, 1 << 16), "run.threads": (1, 4096), "run.eval_every": (0.0, 1e6), "run.ckpt_every": (0, None),
    "run.log_every": (0, None), "run.fewshot_draws": (1, 10_000), "run.ema": (0.0, 1.0), "distill.alpha": (0.0, 1.0),
    "distill.tau": (1e-6, 1e6), "run.seed": (0, 2**32 - 1), "run.fewshot_shots": (1, 1 << 20),
    "data.max_patches": (1, 1 << 20), "optim.momentum": (0.0, 1.0), "optim.muon_momentum": (0.0, 0.999999),
    "optim.betas": (0.0, 0.999999),
    "aug.pad": (0, 4096), "aug.scale": (1e-6, 1.0), "aug.ratio": (1e-6, 1e6), "aug.mixup": (0.0, 1e6),
    "aug.cutmix": (0.0, 1e6), "aug.mix_prob": (0.0, 1.0), "aug.label_smoothing": (0.0, 1.0),
    "aug.random_erasing": (0.0, 1.0), "run.tta_margin": (0.0, 1.0),
}


def _check_number(key: str, value: Any) -> None:
    """`value` (or each of a tuple or list) finite and within NUMBER_BOUNDS[key]; a UsageError names the key."""
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _check_number(key, v)
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{key}={value!r}: must be a finite number")
    lo, hi = NUMBER_BOUNDS.get(key, (None, None))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
            (lo is not None and value < lo) or (hi is not None and value > hi)):
        raise UsageError(f"{key}={value!r}: must be {'>= ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}")


def _number(value: Any, base: type) -> int | float:
    """`value` as an int (a whole number: 4 or 4.0, never 4.7 truncated to 4) or a finite float; ValueError else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{type(value).__name__} {str(value)[:60]!r} is not a number")
    if base is int and isinstance(value, int):
        return value
    f = float(value)  # YAML reads "2e-3" as a string
    if not math.isfinite(f):
        raise ValueError(f"{value!r} is not a finite number")
    if base is int:
        if not f.is_integer():
            raise ValueError(f"{value!r} is not a whole number (it would be truncated to {int(f)})")
        return int(f)
    return f


def _coerce(value: Any, tp: Any, key: str = "a config value") -> Any:
    """A command-line or file value to the field's declared type (YAML syntax for lists, null, booleans)."""
    if isinstance(value, str):
        value = parse_yaml(value, key) if value != "" else ""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp
    if value is None:
        if type(None) not in typing.get_args(tp) and tp is not Any:
            raise ValueError("null is not allowed here")
        return None
    if base in (int, float):
        return _number(value, base)
    if base is bool and not isinstance(value, bool):
        raise ValueError(f"{str(value)[:60]!r} is not true or false")
    if base is str:
        return str(value)
    if typing.get_origin(base) is list and typing.get_args(base) == (str,) and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]  # model.lora_targets=q,v as [q, v]
    if typing.get_origin(base) in (tuple, list) and isinstance(value, (list, tuple, int, float)) \
            and not isinstance(value, bool):
        inner = [a for a in typing.get_args(base) if a is not Ellipsis]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if typing.get_origin(base) is tuple and Ellipsis not in typing.get_args(base) and len(items) != len(inner):
            raise ValueError(f"{len(items)} values where {len(inner)} are needed")
        items = [_number(v, inner[0]) if inner and inner[0] in (int, float) else v for v in items]
        return tuple(items) if typing.get_origin(base) is tuple else items
    return value


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Set fields by dotted key: {"optim.lr": "2e-3", "model.overrides.depth": 4}. Unknown keys raise.

    Model overrides: `model.overrides=<dict>` replaces them all (`null`: none), `model.overrides.KEY=V` edits one,
    and a `model.name` other than the config's drops the overrides it had (they describe the other model: a preset's
    hybrid stages would otherwise silently change the model asked for), before the other keys apply, whatever their
    order; the dropped ones are printed."""
    name = overrides.get("model.name")
    if name is not None and str(name) != cfg.model.name and cfg.model.overrides:
        dropped = ", ".join(f"{k}={v!r}" for k, v in cfg.model.overrides.items())
        log.warning(f"model.name={name} replaces {cfg.model.name}: its model overrides are dropped ({dropped}); "
                    f"set model.overrides.KEY=V for any you want")
        cfg.model.overrides = {}
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] == "preset" and len(parts) == 1:
            cfg.preset = str(value)
            continue
        if len(parts) >= 3 and parts[0] == "model" and parts[1] == "overrides":
            try:
                cfg.model.overrides[".".join(parts[2:])] = _coerce(value, Any, key)
            except UsageError as e:
                raise UsageError(f"{key}={value!r}: not valid YAML ({e})") from e
            continue
        if len(parts) != 2 or not hasattr(cfg, parts[0]) or not dataclasses.is_dataclass(getattr(cfg, parts[0])):
            raise UsageError(f"unknown config key {key!r}; use section.field, e.g. optim.lr (sections: data, aug, model, distill, optim, schedule, run)")
        section = getattr(cfg, parts[0])
        hints = get_type_hints(type(section))
        if parts[1] not in hints:
            raise UsageError(f"unknown config key {key!r}; {parts[0]} has {sorted(hints)}")
        if parts[0] == "model" and parts[1] == "overrides":
            value = parse_yaml(value, key) if isinstance(value, str) else value
            if not isinstance(value, (dict, type(None))):
                raise UsageError(f"{key}={value!r}: not a mapping; use {key}='{{depth: 4, embed_dim: 192}}' or "
                                 f"{key}.KEY=VALUE")
            bad = [k for k in (value or {}) if not isinstance(k, str) or not k.isidentifier()]
            if bad:
                raise UsageError(f"{key}: {str(bad[0])[:60]!r} is not a config field name")
            # model.overrides=null or {}: none of the preset's (e.g. to fine-tune a checkpoint as it is)
            cfg.model.overrides = dict(value or {})
            continue
        try:
            value = _coerce(value, hints[parts[1]], key)
        except (ValueError, TypeError, OverflowError) as e:
            tp = str(hints[parts[1]]).replace("typing.", "") if typing.get_args(hints[parts[1]]) else \
                getattr(hints[parts[1]], "__name__", str(hints[parts[1]]))
            raise UsageError(f"{key}={value!r}: not a valid {tp} ({e})") from e
        _check_number(key, value)
        setattr(section, parts[1], value)
    return cfg


def load_config_file(path: str | Path) -> dict:
    """A YAML or JSON file of the same nested shape as `TrainConfig.to_dict()`."""
    data = read_bytes(path)
    if str(path).endswith(".json"):
        d = parse_json(data, str(path))
    else:
        with untrusted(str(path), UsageError):
            text = data.decode("utf-8")
        d = parse_yaml(text, str(path))
    if not isinstance(d, dict):
        raise UsageError(f"{path} does not hold a mapping")
    return d
