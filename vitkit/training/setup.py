"""Setting a run up: its data (through `vitkit.data.splits`), model (a registry model sized for the data, or a
checkpoint with a new head), precision, wrapping for the strategy, optimizer, EMA and teacher, all checked on every
rank before anything is written. `prepare_run` returns the `Run` the loop (`loop.py`) and `trainer.train` use.
"""
from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoints import create_model, load
from ..data.datasets import DataSpec, load_dataset
from ..data.image import replicate_channels
from ..data.splits import Splits, prepare, training_data
from ..errors import UsageError, VitkitError
from ..evaluation import check_tta, check_tta_margin
from ..machine import precision as precision_mod
from ..machine.cpu import inductor_cache_for_caps
from . import compile as compile_mod
from ..machine.fast_linear import pack_linears
from ..models import lora
from ..models.registry import name_of
from ..models.stats import count_flops
from .config import TrainConfig
from .distill import load_teacher
from .distributed import Dist, resolve_strategy, wrap_model
from .optim import build_optimizer, schedule_steps
from .prune import Pruner
from .resize import Resizer, resizer_for
from .stem_init import apply_stem_init, check_stem_init, check_stem_init_config

log = logging.getLogger(__name__)


class TrainingError(VitkitError, RuntimeError):
    """The run cannot go on (a non-finite loss, labels that do not fit the checkpoint, ...)."""


@dataclass
class Run:
    """Everything a run sets up once and its loop uses."""

    cfg: TrainConfig
    dist: Dist
    out: Path
    data: Splits  # train, val (a held-out part of the training set, or None), test; their transforms; the augmentation
    split: str  # what the periodic evaluations use: "test" or "val"
    precision: str  # what run.precision resolved to: fp32 | bf16 | fp16
    model: nn.Module  # the model itself (sharded in place under FSDP2)
    net: nn.Module  # what the loop calls: the model, DDP around it, or torch.compile of either
    strategy: str
    opt: torch.optim.Optimizer
    ema: nn.Module | None
    scaler: torch.amp.GradScaler
    autocast_dtype: torch.dtype | None
    teacher: nn.Module | None
    fewshot_data: tuple | None  # (train, test, replicate) of the periodic few-shot evaluation, or None
    steps_per_epoch: int
    total: int
    warmup: int
    pruner: Pruner | None = None  # data.prune's stream of training batches (the trainer sets it), or None
    resizer: Resizer | None = None  # schedule.resize_from's sizes, or None

    @property
    def device(self) -> torch.device:
        return self.dist.device


def build_model_for(cfg: TrainConfig, spec: DataSpec) -> nn.Module:
    """A fresh registry model sized for the data, or a checkpoint with a new head / resolution."""
    ov = dict(cfg.model.overrides)
    k = len(spec.classes)
    model = _build(cfg, spec, ov, k)
    mpp = cfg.model.objective == "mpp"
    if mpp or getattr(model.config, "mpp", False):
        if not hasattr(model, "add_mpp"):
            raise UsageError("model.objective=mpp predicts patches: it needs a plain ViT, not a CNN")
        model.add_mpp() if mpp else model.drop_mpp()  # fine-tuning an mpp checkpoint leaves its head behind
        if mpp:
            model.reset_classifier(0)  # no labels: a class head would be a parameter without gradients (DDP refuses those)
    if cfg.distill.teacher and not getattr(model.config, "distilled", False):
        raise UsageError("distill.teacher needs a student with DeiT's distillation token: model.overrides.distilled=true "
                         "(from scratch), or a distilled checkpoint")
    return model


def _build(cfg: TrainConfig, spec: DataSpec, ov: dict, k: int) -> nn.Module:
    if cfg.distill.teacher and not cfg.model.checkpoint:
        ov.setdefault("distilled", True)
    if cfg.model.checkpoint:
        model = load(cfg.model.checkpoint, resample=cfg.model.resample, **{kk: v for kk, v in ov.items() if kk != "num_classes"})
        c = model.config
        if c.num_classes == k and c.class_names and list(c.class_names) != list(spec.classes):
            raise TrainingError(f"the checkpoint's classes {c.class_names} do not match the data's {spec.classes}; "
                                f"pass model.overrides.num_classes=0 ... or use data whose classes match")
        if c.num_classes != k:
            model.reset_classifier(k, class_names=list(spec.classes))  # a new zero-initialised head for the data's classes
        else:
            c.class_names = list(spec.classes)
        if c.in_chans != spec.in_chans:
            replicate = replicate_channels(spec.in_chans, c.in_chans)
            if replicate is None:
                raise TrainingError(f"the checkpoint takes {c.in_chans} channels, the data has {spec.in_chans}")
            spec.extra["replicate_channels"] = replicate
        model.config.crop_pct = 1.0  # evaluated on whole images resized to the model's size, as in training
        return model
    ov.setdefault("crop_pct", 1.0)
    ov.setdefault("img_size", spec.img_size)
    ov.setdefault("in_chans", spec.in_chans)
    if spec.extra.get("replicate_channels"):
        ov["in_chans"] = spec.extra["replicate_channels"]
    return create_model(cfg.model.name, num_classes=k, class_names=list(spec.classes), mean=tuple(spec.mean), std=tuple(spec.std), **ov)


def prepare_run(cfg: TrainConfig, dist: Dist, resumed_precision: str | None = None, *, max_steps: int | None = None,
                done: int = 0, budget_spent: float = 0.0) -> Run:
    """Data, model (wrapped for the strategy), optimizer, EMA and augmentation of a run, checked on every rank.
    resumed_precision: what the run being resumed computed in (run.precision=auto then keeps it).
    max_steps, done: the step the run stops at (None: the schedule's end) and the steps already done (resumed):
    how many steps run.compile=auto weighs a compile against; budget_spent: the seconds of `schedule.time_budget`
    its earlier parts took (resumed), which those steps cannot use."""
    r, d = cfg.run, cfg.data
    device = dist.device
    precision_mod.check(r.precision, "run.precision")
    for name in ("eval_every", "ckpt_every", "log_every"):
        if getattr(r, name) < 0:
            raise UsageError(f"run.{name}={getattr(r, name)}: give 0 (only at the end) or more")
    if r.precision == "fp16" and device.type != "cuda":
        raise UsageError("fp16 needs a GPU (it relies on a grad scaler); use bf16 or auto on a CPU")
    if cfg.aug.hflip_alternate and not cfg.aug.hflip:
        raise UsageError("aug.hflip_alternate alternates the horizontal flips: set aug.hflip=true, or "
                         "aug.hflip_alternate=false")
    if check_tta(r.tta, "run.tta") != "none" and not cfg.aug.hflip:
        raise UsageError(f"run.tta={r.tta} averages over mirrored images, for models trained with flips: "
                         "set aug.hflip=true or run.tta=none")
    check_tta_margin(r.tta_margin, r.tta, "run.tta_margin")
    compile_mod.normalize(r.compile)  # on every rank, before any collective: a bad value ends every rank alike
    strategy = resolve_strategy(r.strategy, dist)
    if strategy == "fsdp" and r.ema:
        raise UsageError("run.ema with run.strategy=fsdp is not supported: the EMA would need its own shards; use ddp")
    if d.batch_size % dist.world:
        raise UsageError(f"data.batch_size {d.batch_size} (the global batch) does not split over {dist.world} processes")
    check_lora(cfg, strategy)
    check_stem_init_config(cfg)
    dist.check_same("config", cfg.to_dict())
    torch.manual_seed(r.seed)

    spec = training_data(d, img_size=cfg.model.overrides.get("img_size"), in_chans=cfg.model.overrides.get("in_chans"),
                         device=device)
    dist.check_same("data", {"train": len(spec.train), "test": len(spec.test), "classes": spec.classes,
                             "labels": int(spec.train.labels.sum())})
    model = build_model_for(cfg, spec).to(device)
    resizer = resizer_for(cfg, model)  # checked before the probes; from here the model takes any grid of patches
    check_stem_init(cfg, model, spec.train)  # on every rank, before the probes and any collective
    mc = model.config
    if cfg.model.checkpoint:
        cfg.model.loaded = checkpoint_model_name(cfg.model.checkpoint, mc)
    if dist.main:  # before any wrapping: counting FLOPs runs a forward, which under FSDP2 every rank would have to join
        log.info(_describe_model(cfg, model))
    if len(spec.train) < d.batch_size * r.accumulate:
        raise UsageError(f"{len(spec.train)} training images are fewer than one batch of {d.batch_size * r.accumulate}")
    if cfg.model.linear_probe:
        for n_, p in model.named_parameters():
            p.requires_grad = n_.startswith(("head.", "fc_norm."))
    if cfg.model.lora:
        _add_lora(cfg, model, dist)
    if r.activation_checkpointing:
        model.set_grad_checkpointing(True)
    precision = _choose_precision(cfg, model, dist, resumed_precision)
    if r.lowp_stream and precision != "fp32" and hasattr(model, "lowp_stream"):
        model.lowp_stream = True  # a ViT; a CNN (BiT) has no token stream, so the option changes nothing there
    teacher = load_teacher(cfg, device)
    if getattr(model.config, "distilled", False):
        model.distilled_training = True  # both heads' logits in training: label loss and distillation loss
    fewshot_data = None
    if r.fewshot:
        fs = load_dataset(r.fewshot, d.data_dir)
        fewshot_data = (fs.train.select(n=2000, device=device), fs.test.select(n=2000, device=device),
                        replicate_channels(fs.in_chans, mc.in_chans))
    if d.max_patches:  # native aspect ratios: files decoded at the patch budget, batches packed (vitkit.data.naflex)
        _check_packed(cfg, model)
    # files are decoded at the model's size with its evaluation geometry (a 384-px checkpoint reads at 384); the
    # augmentation normalises with the model's own preprocessing (a checkpoint's, or the data's)
    data = prepare(mc, train=spec.train, val=spec.val, test=spec.test, max_patches=d.max_patches, aug=cfg.aug, seed=r.seed)
    check_prune(cfg, data.train, model)
    check_alternate_flip(cfg, data.train)
    apply_stem_init(cfg, model, data, dist)  # before the compile probe, the EMA's copy, the wrapping and the optimizer
    steps_per_epoch = len(data.train) // (d.batch_size * r.accumulate)
    total, warmup = schedule_steps(cfg.schedule, steps_per_epoch)
    last = total if max_steps is None else min(total, max_steps)
    # a step is `accumulate` forward-backward passes of a batch: what the probe times one of
    compiled = _choose_compile(cfg, model, dist, precision, max(0, last - done) * r.accumulate, budget_spent)
    if r.fast_gemm and device.type == "cpu" and precision == "fp32" and not compiled:
        pack_linears(model, training=True)  # repacked after every optimizer step (fused ones and FSDP2 included)
    ema = copy.deepcopy(model).eval() if r.ema else None  # before sharding: the EMA is a whole model on every rank
    if ema is not None:
        for p in ema.parameters():
            p.requires_grad_(False)
    net = wrap_model(model, dist, strategy, precision)
    opt = build_optimizer(model, cfg.optim)  # after FSDP2 has sharded the parameters
    if compiled:
        inductor_cache_for_caps()  # Inductor's cache does not tell ISA caps apart
        net = torch.compile(net)
    amp = precision_mod.AMP_DTYPES.get(precision)
    return Run(cfg, dist, Path(r.out_dir), data, "val" if spec.val is not None else "test", precision, model, net,
               strategy, opt, ema, torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
               None if strategy == "fsdp" else amp,  # FSDP2 computes in low precision by its policy instead
               teacher, fewshot_data, steps_per_epoch, total, warmup, resizer=resizer)


# what trains beside the adapters in a LoRA run: the head (new for the data's classes), a distilled model's second
# head, and the norm in front of a pooled head
LORA_TRAINED = ("head.", "head_dist.", "fc_norm.")


def check_lora(cfg: TrainConfig, strategy: str) -> None:
    """model.lora and its settings, and what they cannot combine with, checked before any work."""
    m = cfg.model
    if m.lora is None:
        return
    if isinstance(m.lora, bool) or not isinstance(m.lora, int) or m.lora < 1:
        raise UsageError(f"model.lora={m.lora!r}: LoRA's rank must be a positive integer (e.g. 8); null turns LoRA off")
    if m.lora_alpha is not None and not (math.isfinite(m.lora_alpha) and m.lora_alpha > 0):
        raise UsageError(f"model.lora_alpha={m.lora_alpha!r}: must be positive (the update is scaled by alpha / rank; "
                         f"null: the rank)")
    if not 0.0 <= m.lora_dropout < 1.0:
        raise UsageError(f"model.lora_dropout={m.lora_dropout!r}: must be in [0, 1)")
    try:
        m.lora_targets = list(lora.check_targets(m.lora_targets))
    except UsageError as e:
        raise UsageError(f"model.lora_targets={m.lora_targets!r}: {e}") from None
    if m.linear_probe:
        raise UsageError("model.lora and model.linear_probe are exclusive: linear_probe trains the head alone, lora "
                         "trains low-rank adapters and the head; set one of them (model.linear_probe=false or "
                         "model.lora=null)")
    if m.objective != "classify":
        raise UsageError(f"model.lora fine-tunes a classifier; model.objective={m.objective} pre-trains every weight")
    if strategy == "fsdp":
        raise UsageError("model.lora with run.strategy=fsdp is not supported: LoRA's trained state is small, so "
                         "run.strategy=ddp (or auto) holds it on every process at little cost")


def _add_lora(cfg: TrainConfig, model: nn.Module, dist: Dist) -> None:
    """Adapters on the targeted projections; only they and the head train."""
    m = cfg.model
    adapted = lora.apply_lora(model, m.lora, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=m.lora_targets)
    trained = lora.mark_only_lora_trainable(model, keep=LORA_TRAINED)
    total = sum(p.numel() for p in model.parameters())
    if dist.main:
        log.info(f"LoRA rank {m.lora} (alpha {m.lora_alpha or m.lora:g}) on {', '.join(m.lora_targets)}: "
                 f"{len(adapted)} Linears adapted; {trained / 1e6:.3g}M of {total / 1e6:.3g}M parameters train "
                 f"({100 * trained / total:.2f}%: the adapters and the head)")
    if not m.checkpoint and dist.main:
        log.warning("model.lora without model.checkpoint adapts randomly initialised weights")


def _choose_precision(cfg: TrainConfig, model: nn.Module, dist: Dist, resumed: str | None) -> str:
    """run.precision as asked, or for auto the faster of fp32 and bf16 for this model on this device (measured by
    rank 0, the same for every rank; a resumed run keeps its first choice). Printed, and recorded in
    run.precision_choice (config.yaml)."""
    r = cfg.run
    if r.precision == "auto" and resumed in ("fp32", "bf16", "fp16"):
        choice = precision_mod.Choice(resumed, f"auto -> {resumed}: the choice of the run being resumed")
    else:
        choice = None
        if dist.main:
            choice = precision_mod.resolve(r.precision, model, dist.device, batch=cfg.data.batch_size // dist.world,
                                           training=True, lowp_stream=r.lowp_stream,
                                           fast_gemm=r.fast_gemm and compile_mod.normalize(r.compile) != "on")
        choice = dist.broadcast(choice)
    r.precision_choice = choice.reason
    if dist.main:
        log.info(f"precision {choice.reason}")
    return choice.precision


def _choose_compile(cfg: TrainConfig, model: nn.Module, dist: Dist, precision: str, steps: int,
                    budget_spent: float = 0.0) -> bool:
    """run.compile as asked, or for auto compiled where measured to pay over the run's steps, or those its time budget
    holds in what is left of it (rank 0 measures, the same for every rank: `vitkit.training.compile`). Printed, and
    recorded in run.compile_choice (config.yaml)."""
    r = cfg.run
    choice = None
    left = None if cfg.schedule.time_budget is None else max(0.0, float(cfg.schedule.time_budget) - budget_spent)
    if dist.main:
        choice = compile_mod.decide(r.compile, model, dist.device, batch=cfg.data.batch_size // dist.world,
                                    precision=precision, lowp_stream=r.lowp_stream, fast_gemm=r.fast_gemm,
                                    steps=steps, world=dist.world, budget_s=left)
    choice = dist.broadcast(choice)
    r.compile_choice = choice.reason
    if dist.main:
        log.info(f"compile {choice.reason}")
    return choice.on


def checkpoint_model_name(checkpoint: str, config) -> str:
    """The architecture a checkpoint holds, by name: timm's (`architecture` in a timm folder's config.json), else the
    registered name of its size (`registry.name_of`: `vit_b16`, `deit3_s16-like`, or its size in words)."""
    path = Path(checkpoint)
    try:
        hub = json.loads((path / "config.json").read_text()) if path.is_dir() else {}
    except (OSError, ValueError):
        hub = {}
    timm_name = hub.get("architecture") if isinstance(hub, dict) else None
    return timm_name if isinstance(timm_name, str) and timm_name else name_of(config)


def run_model_name(cfg: TrainConfig) -> str:
    """The model a run trains, as printed and recorded: the checkpoint's architecture (`model.loaded`) or the name."""
    return cfg.model.loaded or cfg.model.name


def _describe_model(cfg: TrainConfig, model: nn.Module) -> str:
    """One line on the model a run built: name, architecture, parameters and GFLOPs per image."""
    c = model.config
    kind = "CNN" if not hasattr(model, "blocks") else \
        ("plain ViT" if getattr(c, "hybrid_layers", None) is None else f"hybrid (ResNet stages {tuple(c.hybrid_layers)})")
    if c.arch == "swin":
        kind = f"Swin (depths {c.depths}, window {c.window_size})"
    if hasattr(c, "options") and c.options():
        kind = kind.replace("plain ViT", "ViT") + f" ({', '.join(c.options())})"
    params = sum(p.numel() for p in model.parameters())
    try:
        gflops = f"{count_flops(model, tuple(c.img_size), c.in_chans) / 1e9:.3g} GFLOPs"
    except Exception:  # noqa: BLE001 - counting is informative only; a model it cannot trace still trains
        gflops = "GFLOPs not counted"
    arch = f", D {c.embed_dim}, depth {c.depth}, {c.num_heads} heads, patch {tuple(c.patch_size)}" if hasattr(c, "depth") else ""
    src = f" from {cfg.model.checkpoint}" if cfg.model.checkpoint else ""
    return (f"model {run_model_name(cfg)}{src}: {kind}{arch}, {tuple(c.img_size)} px, {params / 1e6:.3g}M parameters, "
            f"{gflops} per image")


def check_prune(cfg: TrainConfig, train, model: nn.Module) -> None:
    """What data.prune (InfoBatch's pruning, `vitkit.training.prune`) cannot combine with, said before any work: its
    scores are each image's own loss against its own label, and its passes are drawn from a set held in memory."""
    d, a = cfg.data, cfg.aug
    if not (isinstance(d.prune, (int, float)) and 0.0 <= d.prune < 1.0):
        raise UsageError(f"data.prune={d.prune!r}: the share of the well-learned images a pass leaves out, in [0, 1)")
    if not (isinstance(d.prune_anneal, (int, float)) and 0.0 <= d.prune_anneal <= 1.0):
        raise UsageError(f"data.prune_anneal={d.prune_anneal!r}: a share of the run's steps, in [0, 1]")
    if not d.prune:
        return
    if cfg.model.objective != "classify" or cfg.distill.teacher or getattr(model.config, "distilled", False):
        raise UsageError("data.prune scores each image by its classification loss: it trains classifiers of one head "
                         "without a teacher (no model.objective=mpp, no distillation token or distill.teacher); set "
                         "data.prune=0")
    if a.mixup or a.cutmix:
        raise UsageError("data.prune scores each image by its own loss, which mixup and cutmix blend with another "
                         "image's: set aug.mixup=0 aug.cutmix=0, or data.prune=0")
    if d.max_patches or getattr(train, "decodes", True):
        raise UsageError("data.prune draws its passes from a training set held in memory at one size (fashion-mnist, "
                         "cifar10, cifar100, digits, .npz arrays); image folders and data.max_patches stream files in "
                         "epochs: set data.prune=0")


def check_alternate_flip(cfg: TrainConfig, train) -> None:
    """What aug.hflip_alternate needs, said before any work: flips, and a training set held in memory at one size
    (the stream of batches mirrors each image by its index, `vitkit.data.augment.alternate_flip`); that it needs
    aug.hflip is checked with the other settings, before the data."""
    a = cfg.aug
    if not a.hflip_alternate:
        return
    if cfg.data.max_patches or getattr(train, "decodes", True):
        raise UsageError("aug.hflip_alternate mirrors the images of a training set held in memory at one size "
                         "(fashion-mnist, cifar10, cifar100, digits, .npz arrays); image folders, file lists, shards "
                         "and data.max_patches draw their flips at random: set aug.hflip_alternate=false")


def _check_packed(cfg: TrainConfig, model: nn.Module) -> None:
    """What native-aspect (packed) training cannot combine with, said before any work."""
    a = cfg.aug
    check_tta(cfg.run.tta, "run.tta", packed=True)  # shifted views need one size per batch
    if getattr(model.config, "arch", "") != "vit" or model.config.hybrid_layers is not None:
        raise UsageError("data.max_patches (packed batches of mixed sizes) trains plain ViTs, not hybrids, BiT or Swin")
    if a.mixup or a.cutmix or a.randaugment or a.random_erasing or a.crop == "pad":
        raise UsageError("with data.max_patches every image keeps its own size: mixup, cutmix, RandAugment, random "
                         "erasing and pad-and-crop need one size per batch (set aug.mixup=0 aug.cutmix=0 "
                         "aug.randaugment= aug.random_erasing=0 and aug.crop=rrc or none)")
    if cfg.model.objective != "classify" or cfg.distill.teacher:
        raise UsageError("data.max_patches trains classifiers without a teacher (no mpp, no distillation)")
    if model.config.patch_drop_rate:
        raise UsageError("data.max_patches packs images of mixed sizes: patch_drop_rate drops tokens from batches of "
                         "one size (set model.overrides.patch_drop_rate=0)")
