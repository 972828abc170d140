"""The training loop: fine-tuning or training from scratch, in one process or many, with exact resume.

A run directory holds:
  config.yaml            the resolved config
  checkpoints/step-N/    everything to resume (model, optimizer, EMA, step), sharded (see `checkpoint.py`)
  best.safetensors       the best weights so far (vitkit format: loads with vitkit.load, alone)
  final.safetensors      the weights at the end
  metrics.jsonl          one JSON line per log step and per evaluation
  result.json            the run's outcome
  test_report.json       the final weights on the test set (top-1/5, per class, confusion), as `vitkit eval` writes
  test_confusion.png     its confusion matrix
  tb/                    TensorBoard event files (if tensorboard is installed)

Reading order: `train` sets a run up (`_prepare`), then runs steps (`_train_step`: the micro-batches of one
optimizer step, forward, backward, clipping, update, EMA), logs, evaluates (`_evaluate_and_keep_best`) and
checkpoints between them. Under torchrun every process runs this same code: `data.batch_size` is the global
batch, each rank takes its slice (`iterate_batches`), DDP or FSDP2 (`vitkit.training.distributed`) keeps the weights in
step, and only rank 0 writes logs and weights.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from ..checkpoints.api import save
from ..data.augment import BatchAugment
from ..data.datasets import DataSpec, InMemoryDataset, decodes_files, iterate_batches, load_dataset, split_holdout
from ..data.naflex import PackAugment, PackTransform, VarSizeDataset
from ..data.image import EvalTransform
from ..machine.device import resolve_device
from .distributed import Dist, full_state_dict, gradient_sync, resolve_strategy, wrap_model
from ..errors import UsageError, VitkitError
from ..evaluation import EvalResult, check_tta, evaluate, save_confusion_png, write_report
from ..machine.fast_linear import pack_linears
from ..machine import precision as precision_mod
from . import checkpoint
from .config import TrainConfig
from .logs import MetricsLog, Progress
from .optim import build_optimizer, lr_factor, schedule_steps, set_lr


class TrainingError(VitkitError, RuntimeError):
    """The run cannot go on (a non-finite loss, labels that do not fit the checkpoint, ...)."""


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
    from .. import create_model
    from ..checkpoints import load

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
            if c.in_chans == 3 and spec.in_chans == 1:
                spec.extra["replicate_channels"] = 3
            else:
                raise TrainingError(f"the checkpoint takes {c.in_chans} channels, the data has {spec.in_chans}")
        model.config.crop_pct = 1.0  # evaluated on whole images resized to the model's size, as in training
        return model
    ov.setdefault("crop_pct", 1.0)
    ov.setdefault("img_size", spec.img_size)
    ov.setdefault("in_chans", spec.in_chans)
    if spec.extra.get("replicate_channels"):
        ov["in_chans"] = spec.extra["replicate_channels"]
    return create_model(cfg.model.name, num_classes=k, class_names=list(spec.classes), mean=tuple(spec.mean), std=tuple(spec.std), **ov)


def _load_teacher(cfg: TrainConfig, device: torch.device) -> nn.Module | None:
    if not cfg.distill.teacher:
        return None
    from ..checkpoints import load

    if cfg.distill.kind not in ("hard", "soft"):
        raise UsageError(f"distill.kind must be hard or soft, got {cfg.distill.kind!r}")
    teacher = load(cfg.distill.teacher).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if cfg.run.fast_gemm:
        pack_linears(teacher)  # its fp32 CPU inference on the fastest GEMM (no effect elsewhere)
    return teacher


def _teacher_logits(teacher: nn.Module, x: torch.Tensor, student_config) -> torch.Tensor:
    """The teacher's logits for the student's (augmented, normalised) batch: re-normalised with the teacher's own
    mean/std and resized to its size when they differ."""
    tc, sc = teacher.config, student_config
    if tuple(tc.mean) != tuple(sc.mean) or tuple(tc.std) != tuple(sc.std):
        dev = x.device
        c = x.shape[1]
        raw = x * torch.tensor(sc.std, device=dev)[:c, None, None] + torch.tensor(sc.mean, device=dev)[:c, None, None]
        x = (raw - torch.tensor(tc.mean, device=dev)[:c, None, None]) / torch.tensor(tc.std, device=dev)[:c, None, None]
    if tuple(x.shape[-2:]) != tuple(tc.img_size):
        x = F.interpolate(x, size=tuple(tc.img_size), mode="bilinear", align_corners=False, antialias=True)
    with torch.no_grad():
        return teacher(x).float()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own data: the local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def check_gradients(model: nn.Module, clip: float | None, scaled: bool, step: int, where=lambda: "none written yet") -> None:
    """Clip the global gradient norm if asked, and stop the run on a non-finite one, clipping or not (with a
    grad scaler, fp16, a non-finite norm is the scaler's business: it skips that step). Under DDP and FSDP2 the
    norm is the global one, so every rank decides alike. `where()` names the last good checkpoint, for the message."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    elif scaled:
        return
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if not scaled and not torch.isfinite(norm):
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(_local(p.grad)).all()]
        raise TrainingError(f"the gradient norm became {norm.item()} at step {step} (first in {bad[:3]}); the run stopped "
                            f"before the update. The last good checkpoint is intact: {where()}")


def _ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        e = [p for p in ema.state_dict().values() if p.is_floating_point()]
        m = [p for p in model.state_dict().values() if p.is_floating_point()]
        torch._foreach_lerp_(e, m, 1 - decay)


@dataclass
class _Run:
    """Everything a run sets up once and its loop uses."""

    cfg: TrainConfig
    dist: Dist
    out: Path
    spec: DataSpec
    val: object  # the held-out part of the training set, or None
    split: str  # what the periodic evaluations use: "test" or "val"
    precision: str  # what run.precision resolved to: fp32 | bf16 | fp16
    model: nn.Module  # the model itself (sharded in place under FSDP2)
    net: nn.Module  # what the loop calls: the model, DDP around it, or torch.compile of either
    strategy: str
    opt: torch.optim.Optimizer
    ema: nn.Module | None
    scaler: torch.amp.GradScaler
    aug: BatchAugment
    autocast_dtype: torch.dtype | None
    teacher: nn.Module | None
    fewshot_data: tuple | None  # (train, test, replicate) of the periodic few-shot evaluation, or None
    steps_per_epoch: int
    total: int
    warmup: int

    @property
    def device(self) -> torch.device:
        return self.dist.device


def _prepare(cfg: TrainConfig, dist: Dist, resumed_precision: str | None = None) -> _Run:
    """Data, model (wrapped for the strategy), optimizer, EMA and augmentation of a run, checked on every rank.
    resumed_precision: what the run being resumed computed in (run.precision=auto then keeps it)."""
    r, d = cfg.run, cfg.data
    device = dist.device
    precision_mod.check(r.precision, "run.precision")
    for name in ("eval_every", "ckpt_every", "log_every"):
        if getattr(r, name) < 0:
            raise UsageError(f"run.{name}={getattr(r, name)}: give 0 (only at the end) or more")
    if r.precision == "fp16" and device.type != "cuda":
        raise UsageError("fp16 needs a GPU (it relies on a grad scaler); use bf16 or auto on a CPU")
    if check_tta(r.tta, "run.tta") != "none" and not cfg.aug.hflip:
        raise UsageError(f"run.tta={r.tta} averages over mirrored images, for models trained with flips: "
                         "set aug.hflip=true or run.tta=none")
    strategy = resolve_strategy(r.strategy, dist)
    if strategy == "fsdp" and r.ema:
        raise UsageError("run.ema with run.strategy=fsdp is not supported: the EMA would need its own shards; use ddp")
    if d.batch_size % dist.world:
        raise UsageError(f"data.batch_size {d.batch_size} (the global batch) does not split over {dist.world} processes")
    dist.check_same("config", cfg.to_dict())
    torch.manual_seed(r.seed)

    spec = load_dataset(d.dataset, d.data_dir, img_size=cfg.model.overrides.get("img_size"), strict_images=d.strict_images,
                        test_dir=d.test_dir, in_chans=cfg.model.overrides.get("in_chans"))
    if isinstance(spec.train, (InMemoryDataset, VarSizeDataset)):
        spec.train = spec.train.with_classes(d.classes).subset(d.subset).to(device)
        spec.test = spec.test.with_classes(d.classes).subset(d.test_subset).to(device)
        spec.classes = spec.train.classes
    elif d.classes is not None:
        raise UsageError("data.classes selects classes of an in-memory dataset (fashion-mnist, cifar, digits)")
    val, split = None, "test"
    if d.val_split:
        spec.train, val = split_holdout(spec.train, d.val_split)
        split = "val"
    dist.check_same("data", {"train": len(spec.train), "test": len(spec.test), "classes": spec.classes,
                             "labels": int(spec.train.labels.sum())})
    model = build_model_for(cfg, spec).to(device)
    mc = model.config
    if dist.main:  # before any wrapping: counting FLOPs runs a forward, which under FSDP2 every rank would have to join
        print(f"vitkit: {_describe_model(cfg, model)}", file=sys.stderr, flush=True)
    if len(spec.train) < d.batch_size * r.accumulate:
        raise UsageError(f"{len(spec.train)} training images are fewer than one batch of {d.batch_size * r.accumulate}")
    if cfg.model.linear_probe:
        for n_, p in model.named_parameters():
            p.requires_grad = n_.startswith(("head.", "fc_norm."))
    if r.activation_checkpointing:
        model.set_grad_checkpointing(True)
    precision = _choose_precision(cfg, model, dist, resumed_precision)
    if r.lowp_stream and precision != "fp32" and hasattr(model, "lowp_stream"):
        model.lowp_stream = True  # a ViT; a CNN (BiT) has no token stream, so the option changes nothing there
    if r.fast_gemm and device.type == "cpu" and precision == "fp32" and not r.compile:
        pack_linears(model, training=True)  # repacked after every optimizer step (fused ones and FSDP2 included)
    teacher = _load_teacher(cfg, device)
    if getattr(model.config, "distilled", False):
        model.distilled_training = True  # both heads' logits in training: label loss and distillation loss
    fewshot_data = None
    if r.fewshot:
        fs = load_dataset(r.fewshot, d.data_dir)
        subset = (lambda ds: ds.subset(2000)) if isinstance(fs.train, InMemoryDataset) else (lambda ds: ds)
        fewshot_data = (subset(fs.train).to(device) if isinstance(fs.train, InMemoryDataset) else fs.train,
                        subset(fs.test).to(device) if isinstance(fs.test, InMemoryDataset) else fs.test,
                        3 if fs.in_chans == 1 and mc.in_chans == 3 else None)
    # files are decoded at the model's size with its evaluation geometry (a 384-px checkpoint reads at 384)
    spec.train, spec.test, val = (ds.configured(mc) if decodes_files(ds) else ds for ds in (spec.train, spec.test, val))
    if d.max_patches:  # native aspect ratios: files decoded at the patch budget, batches packed (vitkit.data.naflex)
        _check_packed(cfg, model)
        spec.train, spec.test, val = (ds.packed(d.max_patches, mc.patch_size) if hasattr(ds, "packed") else ds
                                      for ds in (spec.train, spec.test, val))
    else:  # images of many sizes in memory, one square size per batch: each resized to the model's (aspect lost)
        spec.train, spec.test, val = (ds.squared(mc.img_size) if isinstance(ds, VarSizeDataset) else ds
                                      for ds in (spec.train, spec.test, val))
    aug_cfg = cfg.aug
    if decodes_files(spec.train) and aug_cfg.crop == "rrc" and not d.max_patches:  # packed: PackAugment crops
        # random-resized crops of files are cut from the full-resolution image in the DataLoader workers, not from
        # the model-size batch (a small crop of it would be upsampled blur); flips and the rest stay on the batch
        spec.train = spec.train.with_train_crop(aug_cfg.scale, aug_cfg.ratio, r.seed)
        aug_cfg = dataclasses.replace(aug_cfg, crop="none")
    ema = copy.deepcopy(model).eval() if r.ema else None  # before sharding: the EMA is a whole model on every rank
    if ema is not None:
        for p in ema.parameters():
            p.requires_grad_(False)
    net = wrap_model(model, dist, strategy, precision)
    opt = build_optimizer(model, cfg.optim)  # after FSDP2 has sharded the parameters
    if r.compile:
        net = torch.compile(net)
    amp = precision_mod.AMP_DTYPES.get(precision)
    # the augmentation normalises with the model's own preprocessing (a checkpoint's, or the data's)
    if d.max_patches:
        aug = PackAugment(d.max_patches, mc.patch_size, mc.mean, mc.std, scale=aug_cfg.scale if aug_cfg.crop == "rrc" else (1.0, 1.0),
                          hflip=aug_cfg.hflip, replicate_to=spec.extra.get("replicate_channels"))
    else:
        aug = BatchAugment(aug_cfg, tuple(mc.img_size), mc.mean, mc.std, len(spec.classes), spec.extra.get("replicate_channels"))
    steps_per_epoch = len(spec.train) // (d.batch_size * r.accumulate)
    total, warmup = schedule_steps(cfg.schedule, steps_per_epoch)
    return _Run(cfg, dist, Path(r.out_dir), spec, val, split, precision, model, net, strategy, opt, ema,
                torch.amp.GradScaler(device.type, enabled=precision == "fp16"), aug,
                None if strategy == "fsdp" else amp,  # FSDP2 computes in low precision by its policy instead
                teacher, fewshot_data, steps_per_epoch, total, warmup)


def _due(step: int, every: int) -> bool:
    """Whether a periodic action every `every` steps (log, evaluation, checkpoint) falls on `step`; 0: never (the
    action still happens where the loop always does it: the last step, an epoch's end)."""
    return every > 0 and step % every == 0


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
                                           training=True, lowp_stream=r.lowp_stream, fast_gemm=r.fast_gemm and not r.compile)
        choice = dist.broadcast(choice)
    r.precision_choice = choice.reason
    if dist.main:
        print(f"vitkit: precision {choice.reason}", file=sys.stderr, flush=True)
    return choice.precision


def _describe_model(cfg: TrainConfig, model: nn.Module) -> str:
    """One line on the model a run built: name, architecture, parameters and GFLOPs per image."""
    from ..models.stats import count_flops

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
    except Exception:  # counting is informative only; a model it cannot trace still trains
        gflops = "GFLOPs not counted"
    arch = f", D {c.embed_dim}, depth {c.depth}, {c.num_heads} heads, patch {tuple(c.patch_size)}" if hasattr(c, "depth") else ""
    src = f" from {cfg.model.checkpoint}" if cfg.model.checkpoint else ""
    return (f"model {cfg.model.name}{src}: {kind}{arch}, {tuple(c.img_size)} px, {params / 1e6:.3g}M parameters, "
            f"{gflops} per image")


def _check_packed(cfg: TrainConfig, model: nn.Module) -> None:
    """What native-aspect (packed) training cannot combine with, said before any work."""
    a = cfg.aug
    if getattr(model.config, "arch", "") != "vit" or model.config.hybrid_layers is not None:
        raise UsageError("data.max_patches (packed batches of mixed sizes) trains plain ViTs, not hybrids, BiT or Swin")
    if a.mixup or a.cutmix or a.randaugment or a.random_erasing or a.crop == "pad":
        raise UsageError("with data.max_patches every image keeps its own size: mixup, cutmix, RandAugment, random "
                         "erasing and pad-and-crop need one size per batch (set aug.mixup=0 aug.cutmix=0 "
                         "aug.randaugment= aug.random_erasing=0 and aug.crop=rrc or none)")
    if cfg.model.objective != "classify" or cfg.distill.teacher:
        raise UsageError("data.max_patches trains classifiers without a teacher (no mpp, no distillation)")


def _evaluate_on(run: _Run, module: nn.Module, data) -> EvalResult:
    """Every evaluation of a run: its batch size, precision and TTA, the checkpoint's preprocessing, all ranks."""
    r, mc = run.cfg.run, run.model.config
    if run.cfg.model.objective == "mpp":
        return _evaluate_mpp(run, module, data)
    if run.cfg.data.max_patches:
        transform = PackTransform.for_model(mc, run.cfg.data.max_patches, sized=decodes_files(data),
                                            replicate_to=run.spec.extra.get("replicate_channels"))
    else:
        transform = EvalTransform.for_model(mc, replicate_to=run.spec.extra.get("replicate_channels"),
                                            geometry=not decodes_files(data))
    # the model itself, not DDP around it (no collectives in an evaluation); FSDP2's shards all run every forward
    return evaluate(module, data, transform, batch_size=run.cfg.data.eval_batch_size, device=run.device,
                    precision=run.precision, tta=r.tta, dist=run.dist, lockstep=run.strategy == "fsdp" and module is run.model)


@torch.no_grad()
def _evaluate_mpp(run: _Run, module: nn.Module, data) -> EvalResult:
    """Masked patch prediction's accuracy on a split: the share of corrupted patches whose colour code is right
    (top-1 and top-5), with a fixed corruption per batch so that every evaluation is the same task."""
    import numpy as np

    from ..data.datasets import _load_batches, eval_index_batches
    from ..data.image import EvalTransform

    mc = run.model.config
    transform = EvalTransform.for_model(mc, replicate_to=run.spec.extra.get("replicate_channels"),
                                        geometry=not decodes_files(data))
    was = module.training
    module.eval()
    g = torch.Generator(device=run.device)
    top1 = top5 = loss = n = 0.0
    plan = eval_index_batches(len(data), run.cfg.data.eval_batch_size, run.dist.rank, run.dist.world,
                              lockstep=run.strategy == "fsdp")
    for i, ((x, y, _), (_, counts)) in enumerate(zip(_load_batches(data, [b for b, _ in plan], 0, run.device), plan)):
        g.manual_seed(10_007 + i)
        xa = transform(x)
        logits, target = module(xa, mpp_pixels=_pixels(xa, mc), mpp_generator=g)
        if counts:
            top1 += (logits.argmax(1) == target).sum().item()
            top5 += (logits.topk(5, 1).indices == target[:, None]).any(1).sum().item()
            loss += F.cross_entropy(logits.float(), target, reduction="sum").item()
            n += len(target)
    top1, top5, loss, n = run.dist.sum([top1, top5, loss, n])
    module.train(was)
    return EvalResult(top1 / n, top5 / n, loss / n, int(n), 0, [], np.zeros((0, 0), dtype=np.int64), [])


def _pixels(x: torch.Tensor, config) -> torch.Tensor:
    """A normalised batch back in [0, 1]: masked patch prediction's targets are colours."""
    c = x.shape[1]
    std = torch.tensor(config.std, device=x.device, dtype=x.dtype)[:c, None, None]
    mean = torch.tensor(config.mean, device=x.device, dtype=x.dtype)[:c, None, None]
    return (x * std + mean).clamp(0, 1)


def _save_weights(run: _Run, module: nn.Module, path: Path, metadata: dict | None = None) -> None:
    """The whole weights of `module` (gathered from the shards under FSDP2) as a vitkit checkpoint, by rank 0."""
    sd = module.state_dict() if module is run.ema else full_state_dict(run.model, run.dist)
    if run.dist.main:
        save(run.model, path, metadata=metadata, state_dict=sd)


def _train_step(run: _Run, batches, step: int, g: torch.Generator) -> tuple[float, float, int, int, float]:
    """One optimizer step over `run.cfg.run.accumulate` micro-batches; (loss sum, correct, seen, skipped, lr) of this rank."""
    cfg, r = run.cfg, run.cfg.run
    lr = set_lr(run.opt, cfg.optim.lr, lr_factor(step, run.total, run.warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio))
    loss_sum = correct = 0.0
    seen = skipped = 0
    for micro in range(r.accumulate):
        x, y, s = next(batches)
        skipped += s
        xa, target = run.aug(x, y, g)
        with gradient_sync(run.net, micro == r.accumulate - 1):  # no all-reduce while accumulating
            with torch.autocast(run.device.type, dtype=run.autocast_dtype or torch.float32, enabled=run.autocast_dtype is not None):
                if cfg.model.objective == "mpp":  # self-supervised: the labels are the corrupted patches' colours
                    logits, y = run.net(xa, mpp_pixels=_pixels(xa, run.model.config), mpp_generator=g)
                    target = y
                else:
                    logits = run.net(xa)
            loss, logits = _loss(run, logits, target, xa)
            if run.dist.any(not bool(torch.isfinite(loss))):
                raise TrainingError(f"the loss became non-finite ({loss.item()} on rank {run.dist.rank}) at step {step}; the "
                                    f"run stopped. The last good checkpoint is intact: {_last_good(run)}. Try a lower "
                                    f"optim.lr, optim.clip_grad, or run.precision=fp32.")
            run.scaler.scale(loss / r.accumulate).backward()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()  # mpp: y are the corrupted patches' colour codes
        seen += len(y)
    if cfg.optim.clip_grad:
        run.scaler.unscale_(run.opt)
    check_gradients(run.model, cfg.optim.clip_grad, run.scaler.is_enabled(), step, lambda: _last_good(run))
    run.scaler.step(run.opt)
    run.scaler.update()
    run.opt.zero_grad(set_to_none=True)
    if run.ema is not None:
        _ema_update(run.ema, run.model, r.ema)
    return loss_sum, correct, seen, skipped, lr


def _loss(run: _Run, logits, target: torch.Tensor, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss and the logits that accuracy is counted on. A distilled student (DeiT) returns two heads'
    logits: the class token's learns the labels, the distillation token's the teacher's predictions (hard: its
    argmax; soft: KL to its distribution at temperature tau), weighted 1 - alpha and alpha; without a teacher both
    learn the labels."""
    cfg = run.cfg

    def label_loss(z: torch.Tensor) -> torch.Tensor:
        if target.ndim == 2:  # mixup / cutmix: soft targets
            return torch.sum(-target * F.log_softmax(z, -1), -1).mean()
        smoothing = cfg.aug.label_smoothing if cfg.model.objective == "classify" else 0.0
        return F.cross_entropy(z, target, label_smoothing=smoothing)

    if not isinstance(logits, tuple):
        logits = logits.float()
        return label_loss(logits), logits
    cls, dist = (z.float() for z in logits)
    if run.teacher is None:
        return (label_loss(cls) + label_loss(dist)) / 2, (cls + dist) / 2
    t = _teacher_logits(run.teacher, xa, run.model.config)
    d = cfg.distill
    if d.kind == "hard":
        distill = F.cross_entropy(dist, t.argmax(1))
    else:
        distill = F.kl_div(F.log_softmax(dist / d.tau, -1), F.log_softmax(t / d.tau, -1), reduction="batchmean",
                           log_target=True) * d.tau ** 2
    return (1 - d.alpha) * label_loss(cls) + d.alpha * distill, (cls + dist) / 2


def _last_good(run: _Run) -> str:
    ck = checkpoint.latest(run.out)
    return str(ck) if ck is not None else "none written yet"


def _write_checkpoint(run: _Run, step: int, best: float, elapsed: float) -> None:
    """The resumable state of step `step`; never over a good checkpoint with non-finite weights."""
    bad = [n for n, p in run.model.named_parameters() if not torch.isfinite(_local(p)).all()]
    if run.dist.any(bool(bad)):
        raise TrainingError(f"the weights became non-finite by step {step} ({bad[:3]} ...); the run stopped and the last "
                            f"good checkpoint is intact: {_last_good(run)}. Try a lower optim.lr or optim.clip_grad.")
    meta = {"best": best, "elapsed": elapsed, "config": run.cfg.to_dict(), "model_config": run.model.config.to_dict(),
            "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None}
    checkpoint.save(run.out, step, run.model, run.opt, run.ema, meta, run.dist)


def train(cfg: TrainConfig, *, resume: bool = True, max_steps: int | None = None, force: bool = False) -> dict:
    """Train (or fine-tune) as configured; returns the final metrics (on every rank).

    Args:
        cfg: the run's configuration (see `vitkit.training.presets`).
        resume: continue from the newest `out_dir/checkpoints/step-N` (exactly: the same weights as an uninterrupted
            run at the same number of processes; at another number it continues, resharded). False starts fresh,
            moving a previous run's files into `out_dir/previous-<time>/`.
        max_steps: stop after this many optimizer steps in total (for tests); the schedule is unchanged.
        force: resume even though the config changed in a way that changes what a step means (batch size,
            schedule, data, model, optimizer, ...); by default that refuses, listing the differences.
    """
    r = cfg.run
    if r.threads:
        torch.set_num_threads(r.threads)
    if r.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist = Dist.from_env(resolve_device(r.device))
    try:
        result = _train(cfg, dist, resume, max_steps, force)
    except BaseException:
        dist.close(clean=False)
        raise
    dist.close()
    return result


def _train(cfg: TrainConfig, dist: Dist, resume: bool, max_steps: int | None, force: bool) -> dict:
    r, d = cfg.run, cfg.data
    out = Path(r.out_dir)
    ck = checkpoint.latest(out) if resume else None
    resumed_precision = None
    if ck is not None:
        saved = checkpoint.read_meta(ck)["config"]
        resumed_precision = checkpoint.resolved_precision(saved)
        diffs = checkpoint.config_differences(saved, cfg.to_dict())
        if diffs and not force:
            raise TrainingError(f"{out} holds a run whose config differs in what a step means; resuming it would mix two "
                                f"runs:\n  " + "\n  ".join(diffs) + "\nUse another run.out_dir, start fresh with --no-resume "
                                f"(the old files move to {out}/previous-<time>/), or resume anyway with --force.")
    run = _prepare(cfg, dist, resumed_precision)  # data, model and settings checked before anything is written
    if dist.main:
        if ck is None:  # a fresh start: whatever an earlier run left here moves aside, so its records do not mix with these
            checkpoint.set_aside(out)
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if dist.main:
        (out / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False))
    step, best, elapsed = 0, -1.0, 0.0
    if ck is not None:
        meta = checkpoint.load(ck, run.model, run.opt, run.ema)
        if meta.get("scaler"):
            run.scaler.load_state_dict(meta["scaler"])
        step, best, elapsed = meta["step"], meta["best"], meta["elapsed"]
        if meta.get("world_size", 1) != dist.world and dist.main:
            print(f"vitkit: resuming {out} at step {step}, saved by {meta.get('world_size')} process(es), in {dist.world}: "
                  f"the weights and optimizer are resharded; the rest of the run is not bitwise the one never stopped",
                  flush=True)

    stop = {"flag": False}
    old_handler = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    except ValueError:  # not the main thread
        old_handler = None

    per_step = d.batch_size * r.accumulate
    eval_steps = max(1, round(r.eval_every * run.steps_per_epoch)) if r.eval_every > 0 else 0  # and at the last step
    limit = min(run.total, max_steps) if max_steps is not None else run.total  # 0 means no step
    logger = MetricsLog(out, resumed_at=step if ck is not None else None, enabled=dist.main)
    bar = Progress(run.total, r.progress, dist.main)
    g = torch.Generator(device=run.device)
    run.net.train()
    t_start = t_log = time.perf_counter()
    loss_log = correct_log = seen_log = 0.0
    skipped_total = 0
    result: dict = {"interrupted": False}
    last_eval: tuple[int, dict] = (-1, {})  # (step, {"model": EvalResult, "ema": EvalResult}) of the latest evaluation
    try:
        while step < limit:
            epoch, in_epoch = divmod(step, run.steps_per_epoch)
            batches = iterate_batches(run.spec.train, d.batch_size, seed=r.seed, epoch=epoch, start_step=in_epoch * r.accumulate,
                                      num_workers=d.num_workers, device=run.device, rank=dist.rank, world=dist.world)
            for _ in range(in_epoch, run.steps_per_epoch):
                # every random choice of this step derives from (seed, step, rank): exact resume anywhere
                torch.manual_seed(r.seed * 1_000_003 + step + dist.rank * 1_000_000_007)
                g.manual_seed(r.seed * 1_000_033 + step + dist.rank * 1_000_000_007)
                loss_s, correct, seen, skipped, lr = _train_step(run, batches, step, g)
                loss_log, correct_log, seen_log, skipped_total = loss_log + loss_s, correct_log + correct, seen_log + seen, skipped_total + skipped
                step += 1
                if _due(step, r.log_every) or step == limit:
                    now = time.perf_counter()
                    loss_all, correct_all, seen_all, skipped_all = dist.sum([loss_log, correct_log, seen_log, skipped_total])
                    ips = seen_all / max(now - t_log, 1e-9)
                    rec = {"step": step, "epoch": step / run.steps_per_epoch, "lr": lr, "loss": loss_all / max(seen_all, 1),
                           "train_acc": correct_all / max(seen_all, 1), "img_per_s": ips,
                           "time": elapsed + now - t_start, "skipped_images": int(skipped_all)}
                    logger.log(rec)
                    bar.update(step, epoch, rec["loss"], rec["train_acc"], ips, (limit - step) * per_step / max(ips, 1e-9), lr)
                    t_log, loss_log, correct_log, seen_log = now, 0.0, 0.0, 0.0
                if _due(step, eval_steps) or step == limit:  # eval_every may be a fraction of an epoch
                    data = run.spec.test if run.val is None else run.val
                    best, evaluated = _evaluate_and_keep_best(run, data, step, best, logger, bar)
                    last_eval = (step, evaluated)
                stopping = dist.any(stop["flag"])
                if _due(step, r.ckpt_every) or step % run.steps_per_epoch == 0 or step == limit or stopping:
                    _write_checkpoint(run, step, best, elapsed + time.perf_counter() - t_start)
                if stopping:
                    bar.message(f"stopped by SIGTERM at step {step}; resume with the same command")
                    result["interrupted"] = True
                    return result | {"step": step}
                if step >= limit:
                    break
        if run.val is not None:
            test_eval = _evaluate_on(run, run.ema if run.ema is not None else run.model, run.spec.test)
            logger.log({"split": "test", "step": step, "epoch": step / run.steps_per_epoch, "acc1": test_eval.acc1,
                        "acc5": test_eval.acc5, "loss": test_eval.loss})
    finally:
        logger.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    final = run.ema if run.ema is not None else run.model
    _save_weights(run, final, out / "final.safetensors")
    # the loop evaluated the final weights at its last step; evaluate again only if it did not, or if it held out
    # part of the training set for that (the test set's one evaluation)
    final_eval = last_eval[1].get("ema" if run.ema is not None else "model") if last_eval[0] == step else None
    if run.val is not None:  # the loop evaluated on held-out training images; the test set is evaluated once, here
        if final_eval is not None:
            result["val_acc1"] = final_eval.acc1
        final_eval = test_eval
    elif final_eval is None:
        final_eval = _evaluate_on(run, final, run.spec.test)
    skipped_all = int(dist.sum([skipped_total])[0])
    result.update(step=step, acc1=final_eval.acc1, acc5=final_eval.acc5,
                  best_acc1=best if run.val is not None else max(best, final_eval.acc1), best_split=run.split,
                  time_s=elapsed + time.perf_counter() - t_start, skipped_images=skipped_all, world_size=dist.world)
    bar.message(f"done: {step} steps in {result['time_s']:.0f} s; test top-1 {final_eval.acc1:.4f}, top-5 {final_eval.acc5:.4f}")
    if dist.main:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        if final_eval.classes:  # the final weights' test evaluation, as `vitkit eval` reports it: no second pass needed
            write_report(final_eval, out / "test_report.json", {"checkpoint": str(out / "final.safetensors"),
                                                                "data": cfg.data.dataset, "tta": cfg.run.tta,
                                                                "precision": run.precision})
            try:
                save_confusion_png(final_eval, out / "test_confusion.png")
            except (OSError, ValueError, MemoryError) as e:  # a figure is not worth a failed run after its training
                bar.message(f"test_confusion.png not written: {e}")
    return result


def _evaluate_and_keep_best(run: _Run, data, step: int, best: float, logger: MetricsLog, bar: Progress) -> tuple[float, dict]:
    """Evaluate the weights (and the EMA's) on `data` (the split "test" or "val"); best.safetensors keeps the better."""
    ep = step / run.steps_per_epoch
    res = _evaluate_on(run, run.model, data)
    rec = {"split": run.split, "step": step, "epoch": ep, "acc1": res.acc1, "acc5": res.acc5, "loss": res.loss}
    cand, cand_acc = run.model, res.acc1
    results = {"model": res}
    if run.ema is not None:
        res_e = _evaluate_on(run, run.ema, data)
        rec.update(ema_acc1=res_e.acc1, ema_acc5=res_e.acc5)
        results["ema"] = res_e
        if res_e.acc1 > cand_acc:
            cand, cand_acc = run.ema, res_e.acc1
    if run.fewshot_data is not None:
        from ..evaluation.fewshot import fewshot

        train_fs, test_fs, replicate = run.fewshot_data
        r = run.cfg.run
        fs = fewshot(run.model, train_fs, test_fs, shots=tuple(r.fewshot_shots), draws=r.fewshot_draws, seed=r.seed,
                     replicate_to=replicate, device=run.device)
        rec.update({f"fewshot_{k}": fs.mean[k] for k in fs.shots})
    logger.log(rec)
    bar.message(f"epoch {ep:.2f}: {run.split} top-1 {res.acc1:.4f} top-5 {res.acc5:.4f}" +
                (f" (EMA {rec['ema_acc1']:.4f})" if run.ema is not None else "") +
                "".join(f", {k.split('_')[1]}-shot {v:.4f}" for k, v in rec.items() if k.startswith("fewshot_")))
    if cand_acc > best:
        _save_weights(run, cand, run.out / "best.safetensors", metadata={"acc1": str(cand_acc), "split": run.split, "step": str(step)})
        best = cand_acc
    run.net.train()
    return best, results
