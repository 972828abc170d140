"""The loop's parts, as torchvision's reference scripts split them: one optimizer step (`train_step`: the
micro-batches of one step, forward, backward, clipping, update, EMA), the evaluations of a run (`evaluate_on`,
`evaluate_and_keep_best`), and what it writes between them (`write_checkpoint`, `save_weights`). `trainer.train`
drives them over the steps of a run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints import save
from ..data.datasets import load_batches, eval_index_batches
from ..evaluation import EvalResult, evaluate
from ..evaluation.fewshot import fewshot
from ..models.lora import lora_layers, merged_state_dict
from . import checkpoint
from .distill import distilled_loss
from .distributed import full_state_dict, gradient_sync
from .logs import MetricsLog, Progress
from .optim import lr_factor, set_lr
from .resize import as_built
from .setup import Run, TrainingError


def due(step: int, every: int) -> bool:
    """Whether a periodic action every `every` steps (log, evaluation, checkpoint) falls on `step`; 0: never (the
    action still happens where the loop always does it: the last step, an epoch's end)."""
    return every > 0 and step % every == 0


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


def train_step(run: Run, batches, step: int, g: torch.Generator) -> tuple[float, float, int, int, float]:
    """One optimizer step over `run.cfg.run.accumulate` micro-batches; (loss sum, correct, seen, skipped, lr) of this rank."""
    cfg, r = run.cfg, run.cfg.run
    lr = set_lr(run.opt, cfg.optim.lr, lr_factor(step, run.total, run.warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio))
    loss_sum = correct = 0.0
    seen = skipped = 0
    for micro in range(r.accumulate):
        x, y, s = next(batches)
        skipped += s
        xa, target = run.data.augment(x, y, g)
        if run.resizer is not None:  # progressive resizing: this step's size (vitkit.training.resize)
            xa = run.resizer(xa, step, run.total)
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
                                    f"run stopped. The last good checkpoint is intact: {last_good(run)}. Try a lower "
                                    f"optim.lr, optim.clip_grad, or run.precision=fp32.")
            run.scaler.scale(loss / r.accumulate).backward()
        # the log's loss: data.prune's weights left out, comparable with an unpruned run's
        loss_sum += (loss.item() if run.pruner is None else run.pruner.plain_loss) * len(y)
        correct += (logits.argmax(1) == y).sum().item()  # mpp: y are the corrupted patches' colour codes
        seen += len(y)
    if cfg.optim.clip_grad:
        run.scaler.unscale_(run.opt)
    check_gradients(run.model, cfg.optim.clip_grad, run.scaler.is_enabled(), step, lambda: last_good(run))
    run.scaler.step(run.opt)
    run.scaler.update()
    run.opt.zero_grad(set_to_none=True)
    if run.ema is not None:
        _ema_update(run.ema, run.model, r.ema)
    return loss_sum, correct, seen, skipped, lr


def _loss(run: Run, logits, target: torch.Tensor, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss and the logits that accuracy is counted on. A distilled student (DeiT) returns two heads'
    logits, learnt as `distill.distilled_loss` says."""
    cfg = run.cfg

    def label_loss(z: torch.Tensor) -> torch.Tensor:
        if target.ndim == 2:  # mixup / cutmix: soft targets
            return torch.sum(-target * F.log_softmax(z, -1), -1).mean()
        smoothing = cfg.aug.label_smoothing if cfg.model.objective == "classify" else 0.0
        if run.pruner is not None:  # data.prune: each image's loss is its score, and weighs as its pass says
            return run.pruner.weigh(F.cross_entropy(z, target, label_smoothing=smoothing, reduction="none"), run.dist.sum)
        return F.cross_entropy(z, target, label_smoothing=smoothing)

    if not isinstance(logits, tuple):
        logits = logits.float()
        return label_loss(logits), logits
    cls, dist = (z.float() for z in logits)
    return distilled_loss(cls, dist, label_loss, run.teacher, xa, run.model.config, cfg.distill)


def _pixels(x: torch.Tensor, config) -> torch.Tensor:
    """A normalised batch back in [0, 1]: masked patch prediction's targets are colours."""
    c = x.shape[1]
    std = torch.tensor(config.std, device=x.device, dtype=x.dtype)[:c, None, None]
    mean = torch.tensor(config.mean, device=x.device, dtype=x.dtype)[:c, None, None]
    return (x * std + mean).clamp(0, 1)


def last_good(run: Run) -> str:
    ck = checkpoint.latest(run.out)
    return str(ck) if ck is not None else "none written yet"


def write_checkpoint(run: Run, step: int, best: float, elapsed: float, extra: dict | None = None) -> None:
    """The resumable state of step `step` (and `extra` in its meta.json); never over a good checkpoint with
    non-finite weights."""
    bad = [n for n, p in run.model.named_parameters() if not torch.isfinite(_local(p)).all()]
    if run.dist.any(bool(bad)):
        raise TrainingError(f"the weights became non-finite by step {step} ({bad[:3]} ...); the run stopped and the last "
                            f"good checkpoint is intact: {last_good(run)}. Try a lower optim.lr or optim.clip_grad.")
    with as_built(run.resizer, run.model, run.ema):  # progressive resizing's dynamic_img_size is not the model's
        meta = {"best": best, "elapsed": elapsed, "config": run.cfg.to_dict(), "model_config": run.model.config.to_dict(),
                "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None, **(extra or {})}
        tensors = None
        if run.pruner is not None:  # data.prune's scores and pass in hand: an exact resume
            meta["prune"], tensors = run.pruner.state_meta(), {"prune": run.pruner.state_tensors()}
        checkpoint.save(run.out, step, run.model, run.opt, run.ema, meta, run.dist, tensors)


def save_weights(run: Run, module: nn.Module, path: Path, metadata: dict | None = None) -> None:
    """The whole weights of `module` (gathered from the shards under FSDP2) as a vitkit checkpoint, by rank 0; a
    LoRA run's with the adapters merged in: a plain model that every reader loads."""
    sd = module.state_dict() if module is run.ema else full_state_dict(run.model, run.dist)
    if sd is not None and lora_layers(run.model):
        sd = merged_state_dict(run.model, sd)
    if run.dist.main:
        with as_built(run.resizer, run.model):
            save(run.model, path, metadata=metadata, state_dict=sd)


def evaluate_on(run: Run, module: nn.Module, data) -> EvalResult:
    """Every evaluation of a run: its batch size, precision and TTA, the checkpoint's preprocessing, all ranks."""
    if run.cfg.model.objective == "mpp":
        return _evaluate_mpp(run, module, data)
    # the model itself, not DDP around it (no collectives in an evaluation); FSDP2's shards all run every forward
    return evaluate(module, data, run.data.transform(data), batch_size=run.cfg.data.eval_batch_size, device=run.device,
                    precision=run.precision, tta=run.cfg.run.tta, tta_margin=run.cfg.run.tta_margin, dist=run.dist,
                    lockstep=run.strategy == "fsdp" and module is run.model)


@torch.no_grad()
def _evaluate_mpp(run: Run, module: nn.Module, data) -> EvalResult:
    """Masked patch prediction's accuracy on a split: the share of corrupted patches whose colour code is right
    (top-1 and top-5), with a fixed corruption per batch so that every evaluation is the same task."""
    mc = run.model.config
    transform = run.data.transform(data)  # square images: masked patch prediction does not pack (`setup._check_packed`)
    was = module.training
    module.eval()
    g = torch.Generator(device=run.device)
    top1 = top5 = loss = n = 0.0
    plan = eval_index_batches(len(data), run.cfg.data.eval_batch_size, run.dist.rank, run.dist.world,
                              lockstep=run.strategy == "fsdp")
    for i, ((x, _y, _), (_, counts)) in enumerate(zip(load_batches(data, [b for b, _ in plan], 0, run.device), plan)):
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


def evaluate_and_keep_best(run: Run, data, step: int, best: float, logger: MetricsLog, bar: Progress,
                           clock: Callable[[], float] | None = None) -> tuple[float, dict]:
    """Evaluate the weights (and the EMA's) on `data` (the split "test" or "val"); best.safetensors keeps the better.
    `clock`: the run's training time in seconds, recorded with the evaluation when it is done (`time`: the time to
    accuracy)."""
    ep = step / run.steps_per_epoch
    res = evaluate_on(run, run.model, data)
    rec = {"split": run.split, "step": step, "epoch": ep, "acc1": res.acc1, "acc5": res.acc5, "loss": res.loss}
    cand, cand_acc = run.model, res.acc1
    results = {"model": res}
    if run.ema is not None:
        res_e = evaluate_on(run, run.ema, data)
        rec.update(ema_acc1=res_e.acc1, ema_acc5=res_e.acc5)
        results["ema"] = res_e
        if res_e.acc1 > cand_acc:
            cand, cand_acc = run.ema, res_e.acc1
    if run.fewshot_data is not None:
        train_fs, test_fs, replicate = run.fewshot_data
        r = run.cfg.run
        fs = fewshot(run.model, train_fs, test_fs, shots=tuple(r.fewshot_shots), draws=r.fewshot_draws, seed=r.seed,
                     replicate_to=replicate, device=run.device)
        rec.update({f"fewshot_{k}": fs.mean[k] for k in fs.shots})
    if clock is not None:
        rec["time"] = clock()
    logger.log(rec)
    bar.message(f"epoch {ep:.2f}: {run.split} top-1 {res.acc1:.4f} top-5 {res.acc5:.4f}" +
                (f" (EMA {rec['ema_acc1']:.4f})" if run.ema is not None else "") +
                "".join(f", {k.split('_')[1]}-shot {v:.4f}" for k, v in rec.items() if k.startswith("fewshot_")))
    if cand_acc > best:
        save_weights(run, cand, run.out / "best.safetensors", metadata={"acc1": str(cand_acc), "split": run.split, "step": str(step)})
        best = cand_acc
    run.net.train()
    return best, results
