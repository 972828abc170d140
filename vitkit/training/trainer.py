"""The training loop: fine-tuning or training from scratch, with exact resume, EMA, mixed precision and logs.

A run directory holds:
  config.yaml            the resolved config
  last.ckpt              everything to resume (model, optimizer, EMA, step, RNG states), written atomically
  best.safetensors       the best weights so far (vitkit format: loads with vitkit.load, alone)
  final.safetensors      the weights at the end
  metrics.jsonl          one JSON line per log step and per evaluation
  tb/                    TensorBoard event files (if tensorboard is installed)
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from ..checkpoints.api import _atomic_write, save
from ..data.augment import BatchAugment
from ..data.datasets import DataSpec, FileDataset, InMemoryDataset, iterate_batches, load_dataset, split_holdout
from ..data.image import EvalTransform
from ..evaluation import EvalResult, check_tta, evaluate
from ..device import resolve_device
from .config import TrainConfig
from .optim import build_optimizer, lr_factor, schedule_steps, set_lr
from ..errors import UsageError, VitkitError


class TrainingError(VitkitError, RuntimeError):
    """The run cannot go on (a non-finite loss, labels that do not fit the checkpoint, ...)."""


def build_model_for(cfg: TrainConfig, spec: DataSpec) -> nn.Module:
    """A fresh registry model sized for the data, or a checkpoint with a new head / resolution."""
    from .. import create_model
    from ..checkpoints import load

    ov = dict(cfg.model.overrides)
    k = len(spec.classes)
    if cfg.model.checkpoint:
        model = load(cfg.model.checkpoint, resample=cfg.model.resample, **{kk: v for kk, v in ov.items() if kk != "num_classes"})
        c = model.config
        if c.num_classes == k and c.class_names and list(c.class_names) != list(spec.classes):
            raise TrainingError(f"the checkpoint's classes {c.class_names} do not match the data's {spec.classes}; "
                                f"pass model.overrides.num_classes=0 ... or use data whose classes match")
        if c.num_classes != k:
            model.reset_classifier(k, list(spec.classes))  # a new zero-initialised head for the data's classes
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


class Progress:
    """One status line: loss, accuracy, images/s, ETA; plain lines when not on a terminal."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()

    def update(self, step: int, epoch: int, loss: float, acc: float, ips: float, eta_s: float, lr: float) -> None:
        if not self.enabled:
            return
        frac = step / self.total
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        eta = time.strftime("%H:%M:%S", time.gmtime(max(0, eta_s)))
        line = f"[{bar}] {step}/{self.total} ep {epoch} loss {loss:.4f} acc {acc:.3f} {ips:.0f} img/s lr {lr:.2e} ETA {eta}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)
        print(text, file=sys.stderr, flush=True)


class _Logger:
    """metrics.jsonl and TensorBoard. A resumed run first drops what was logged after its checkpoint's step (the
    steps it is about to run again), and a record cut short by a kill, so every step is logged once."""

    def __init__(self, out: Path, resumed_at: int | None = None) -> None:
        path = out / "metrics.jsonl"
        if resumed_at is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line being written when the run was killed
                if rec.get("step", 0) <= resumed_at:
                    kept.append(line)
            _atomic_write(path, lambda p: p.write_text("".join(f"{x}\n" for x in kept)))
        self.file = open(path, "a")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events at and after it, as metrics.jsonl above
            self.tb = SummaryWriter(str(out / "tb"), purge_step=None if resumed_at is None else resumed_at + 1)
        except Exception:  # noqa: BLE001 - tensorboard is optional
            self.tb = None

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{prefix}/{k}", v, record["step"])
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate()),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    st = json.loads(s["python"])
    random.setstate((st[0], tuple(st[1]), st[2]))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        e = [p for p in ema.state_dict().values() if p.is_floating_point()]
        m = [p for p in model.state_dict().values() if p.is_floating_point()]
        torch._foreach_lerp_(e, m, 1 - decay)


# Settings that do not change what a training step computes: a run may resume with them changed.
RESUME_SAFE = {"preset", "data.data_dir", "data.num_workers", "data.eval_batch_size", "run.out_dir", "run.device",
               "run.threads", "run.progress", "run.log_every", "run.ckpt_every", "run.eval_every", "run.tta", "run.compile"}
RUN_FILES = ("last.ckpt", "best.safetensors", "final.safetensors", "metrics.jsonl", "result.json", "config.yaml", "tb")


def config_differences(before: dict, now: dict) -> list[str]:
    """'key: before -> now' for every setting that differs and changes what a step means (not RESUME_SAFE)."""
    from .config import _flatten

    def flat(d: dict) -> dict:
        f = _flatten(json.loads(json.dumps(d)))  # tuples and lists alike
        f.update({f"model.overrides.{k}": v for k, v in (f.pop("model.overrides", None) or {}).items()})
        return f

    a, b = flat(before), flat(now)
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b))
            if k not in RESUME_SAFE and a.get(k) != b.get(k)]


def _set_aside(out: Path) -> Path | None:
    """Move a previous run's files into out/previous-<time>/ (a fresh start loses nothing); the folder, or None."""
    present = [out / f for f in RUN_FILES if (out / f).exists()]
    if not present:
        return None
    dest = out / time.strftime("previous-%Y%m%d-%H%M%S")
    dest.mkdir()
    for p in present:
        os.replace(p, dest / p.name)
    return dest


def check_gradients(model: nn.Module, clip: float | None, scaled: bool, step: int, ckpt_path: Path) -> None:
    """Clip the global gradient norm if asked, and stop the run on a non-finite one, clipping or not (with a
    grad scaler, fp16, a non-finite norm is the scaler's business: it skips that step)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    elif scaled:
        return
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if not scaled and not torch.isfinite(norm):
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        raise TrainingError(f"the gradient norm became {norm.item()} at step {step} (first in {bad[:3]}); the run stopped "
                            f"before the update. The last good checkpoint is intact: "
                            f"{ckpt_path if ckpt_path.exists() else 'none written yet'}")


def train(cfg: TrainConfig, *, resume: bool = True, max_steps: int | None = None, force: bool = False) -> dict:
    """Train (or fine-tune) as configured; returns the final metrics.

    Args:
        cfg: the run's configuration (see `vitkit.training.presets`).
        resume: continue from `out_dir/last.ckpt` if it exists (exactly: same weights as an uninterrupted run).
            False starts fresh, moving a previous run's files into `out_dir/previous-<time>/`.
        max_steps: stop after this many optimizer steps in total (for tests); the schedule is unchanged.
        force: resume even though the config changed in a way that changes what a step means (batch size,
            schedule, data, model, optimizer, ...); by default that refuses, listing the differences.
    """
    r = cfg.run
    out = Path(r.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "last.ckpt"
    state = None
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        diffs = config_differences(json.loads(state["config"]), cfg.to_dict()) if "config" in state else []
        if diffs and not force:
            raise TrainingError(f"{out} holds a run whose config differs in what a step means; resuming it would mix two "
                                f"runs:\n  " + "\n  ".join(diffs) + "\nUse another run.out_dir, start fresh with --no-resume "
                                f"(the old files move to {out}/previous-<time>/), or resume anyway with --force.")
    else:  # a fresh start: whatever an earlier run left here moves aside, so its records do not mix with these
        _set_aside(out)
    if r.threads:
        torch.set_num_threads(r.threads)
    if r.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = resolve_device(r.device)
    if r.precision == "fp16" and device.type != "cuda":
        raise UsageError("fp16 needs a GPU (it relies on a grad scaler); use bf16 on CPU")
    torch.manual_seed(r.seed)

    d = cfg.data
    if check_tta(r.tta, "run.tta") != "none" and not cfg.aug.hflip:
        raise UsageError(f"run.tta={r.tta} averages over mirrored images, for models trained with flips: "
                         "set aug.hflip=true or run.tta=none")
    spec = load_dataset(d.dataset, d.data_dir, img_size=cfg.model.overrides.get("img_size"), strict_images=d.strict_images,
                        test_dir=d.test_dir, in_chans=cfg.model.overrides.get("in_chans"))
    if isinstance(spec.train, InMemoryDataset):
        spec.train = spec.train.subset(d.subset).to(device)
        spec.test = spec.test.subset(d.test_subset).to(device)
    val, split = None, "test"  # what the periodic evaluations and best.safetensors use
    if d.val_split:
        spec.train, val = split_holdout(spec.train, d.val_split)
        split = "val"
    model = build_model_for(cfg, spec).to(device)
    mc = model.config
    if r.lowp_stream:
        if r.precision not in ("bf16", "fp16"):
            raise UsageError(f"run.lowp_stream needs run.precision bf16 or fp16 (got {r.precision}): set run.lowp_stream=false")
        if hasattr(model, "lowp_stream"):  # a ViT; a CNN (BiT) has no token stream, so the option changes nothing there
            model.lowp_stream = True
    if len(spec.train) < d.batch_size * r.accumulate:
        raise UsageError(f"{len(spec.train)} training images are fewer than one batch of {d.batch_size * r.accumulate}")
    if cfg.model.linear_probe:
        for n_, p in model.named_parameters():
            p.requires_grad = n_.startswith(("head.", "fc_norm."))
    # files are decoded at the model's size with its evaluation geometry (a 384-px checkpoint reads at 384)
    spec.train, spec.test, val = (ds.configured(mc) if isinstance(ds, FileDataset) else ds for ds in (spec.train, spec.test, val))
    replicate = spec.extra.get("replicate_channels")
    # the augmentation normalises with the model's own preprocessing (a checkpoint's, or the data's)
    aug = BatchAugment(cfg.aug, tuple(mc.img_size), mc.mean, mc.std, len(spec.classes), replicate)

    def evaluate_on(m: nn.Module, data) -> EvalResult:  # every evaluation of a run: its batch size, precision and TTA
        transform = EvalTransform.for_model(mc, replicate_to=replicate, geometry=not isinstance(data, FileDataset))
        return evaluate(m, data, transform, batch_size=d.eval_batch_size, device=device, precision=r.precision, tta=r.tta)
    (out / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False))

    opt = build_optimizer(model, cfg.optim)
    ema = copy.deepcopy(model).eval() if r.ema else None
    if ema is not None:
        for p in ema.parameters():
            p.requires_grad_(False)
    scaler = torch.amp.GradScaler(device.type, enabled=r.precision == "fp16")
    fwd = torch.compile(model) if r.compile else model
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(r.precision)

    per_step = d.batch_size * r.accumulate
    steps_per_epoch = len(spec.train) // per_step
    total, warmup = schedule_steps(cfg.schedule, steps_per_epoch)
    eval_steps = max(1, round(r.eval_every * steps_per_epoch))  # and at the last step
    step, best, elapsed = 0, -1.0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, best, elapsed = state["step"], state["best"], state.get("elapsed", 0.0)
        _set_rng_state(state["rng"])

    def write_state() -> None:
        # never replace a good checkpoint with non-finite weights
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise TrainingError(f"the weights became non-finite by step {step} ({bad[:3]} ...); the run stopped and the "
                                f"last good checkpoint is intact: {ckpt_path if ckpt_path.exists() else 'none written yet'}. "
                                f"Try a lower optim.lr or optim.clip_grad.")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict() if ema else None,
                 "scaler": scaler.state_dict() if scaler.is_enabled() else None, "step": step, "best": best,
                 "elapsed": elapsed + time.perf_counter() - t_start, "rng": _rng_state(), "config": json.dumps(cfg.to_dict())}
        _atomic_write(ckpt_path, lambda p: torch.save(state, p))

    stop = {"flag": False}
    old_handler = signal.getsignal(signal.SIGTERM)
    if hasattr(signal, "SIGTERM"):
        try:
            signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
        except ValueError:  # not the main thread
            old_handler = None

    logger = _Logger(out, resumed_at=step if state is not None else None)
    bar = Progress(total, r.progress)
    g = torch.Generator(device=device)
    model.train()
    t_start = time.perf_counter()
    t_log, seen_log, loss_log, correct_log, skipped_total = time.perf_counter(), 0, 0.0, 0.0, 0
    result: dict = {"interrupted": False}
    last_eval: tuple[int, dict] = (-1, {})  # (step, {"model": EvalResult, "ema": EvalResult}) of the latest evaluation
    limit = min(total, max_steps) if max_steps else total
    try:
        while step < limit:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            batches = iterate_batches(spec.train, d.batch_size, seed=r.seed, epoch=epoch, start_step=in_epoch * r.accumulate,
                                      num_workers=d.num_workers, device=device)
            for _ in range(in_epoch, steps_per_epoch):
                # every random choice of this step derives from (seed, step): exact resume anywhere
                torch.manual_seed(r.seed * 1_000_003 + step)
                g.manual_seed(r.seed * 1_000_033 + step)
                lr = set_lr(opt, cfg.optim.lr, lr_factor(step, total, warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio))
                for _micro in range(r.accumulate):
                    x, y, skipped = next(batches)
                    skipped_total += skipped
                    if len(y) == 0:
                        continue
                    xa, target = aug(x, y, g)
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        logits = fwd(xa)
                    logits = logits.float()
                    if target.ndim == 2:
                        loss = torch.sum(-target * F.log_softmax(logits, -1), -1).mean()
                    else:
                        loss = F.cross_entropy(logits, target, label_smoothing=cfg.aug.label_smoothing)
                    if not torch.isfinite(loss):
                        raise TrainingError(f"the loss became {loss.item()} at step {step} (epoch {epoch}); the run stopped. "
                                            f"The last good checkpoint is intact: {ckpt_path if ckpt_path.exists() else 'none written yet'}. "
                                            f"Try a lower optim.lr, optim.clip_grad, or run.precision=fp32.")
                    scaler.scale(loss / r.accumulate).backward()
                    loss_log += loss.item() * len(y)
                    correct_log += (logits.argmax(1) == y).sum().item()
                    seen_log += len(y)
                if cfg.optim.clip_grad:
                    scaler.unscale_(opt)
                check_gradients(model, cfg.optim.clip_grad, scaler.is_enabled(), step, ckpt_path)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if ema is not None:
                    _ema_update(ema, model, r.ema)
                step += 1
                if step % r.log_every == 0 or step == limit:
                    now = time.perf_counter()
                    ips = seen_log / max(now - t_log, 1e-9)
                    rec = {"step": step, "epoch": step / steps_per_epoch, "lr": lr, "loss": loss_log / max(seen_log, 1),
                           "train_acc": correct_log / max(seen_log, 1), "img_per_s": ips,
                           "time": elapsed + now - t_start, "skipped_images": skipped_total}
                    logger.log(rec)
                    bar.update(step, epoch, rec["loss"], rec["train_acc"], ips, (limit - step) * per_step / max(ips, 1e-9), lr)
                    t_log, seen_log, loss_log, correct_log = now, 0, 0.0, 0.0
                if step % eval_steps == 0 or step == limit:  # eval_every may be a fraction of an epoch
                    ep = step / steps_per_epoch
                    best, evaluated = _evaluate_and_keep_best(evaluate_on, model, ema, spec.test if val is None else val,
                                                              split, out, step, ep, best, logger, bar)
                    last_eval = (step, evaluated)
                if step % r.ckpt_every == 0 or step % steps_per_epoch == 0 or step == limit:
                    write_state()
                if stop["flag"]:
                    write_state()
                    bar.message(f"stopped by SIGTERM at step {step}; resume with the same command")
                    result["interrupted"] = True
                    return result | {"step": step}
                if step >= limit:
                    break
        if val is not None:
            test_eval = evaluate_on(ema if ema is not None else model, spec.test)
            logger.log({"split": "test", "step": step, "epoch": step / steps_per_epoch, "acc1": test_eval.acc1,
                        "acc5": test_eval.acc5, "loss": test_eval.loss})
    finally:
        logger.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    final = ema if ema is not None else model
    save(final, out / "final.safetensors")
    # the loop evaluated the final weights at its last step; evaluate again only if it did not, or if it held out
    # part of the training set for that (the test set's one evaluation)
    final_eval = last_eval[1].get("ema" if ema is not None else "model") if last_eval[0] == step else None
    if val is not None:  # the loop evaluated on held-out training images; the test set is evaluated once, here
        if final_eval is not None:
            result["val_acc1"] = final_eval.acc1
        final_eval = test_eval
    elif final_eval is None:
        final_eval = evaluate_on(final, spec.test)
    result.update(step=step, acc1=final_eval.acc1, acc5=final_eval.acc5,
                  best_acc1=best if val is not None else max(best, final_eval.acc1), best_split=split,
                  time_s=elapsed + time.perf_counter() - t_start, skipped_images=skipped_total)
    bar.message(f"done: {step} steps in {result['time_s']:.0f} s; test top-1 {final_eval.acc1:.4f}, top-5 {final_eval.acc5:.4f}")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _evaluate_and_keep_best(evaluate_on, model, ema, data, split, out, step, ep, best, logger, bar) -> tuple[float, dict]:
    """Evaluate the weights (and the EMA's) on `data` (the `split` "test" or "val"); best.safetensors keeps the better."""
    res = evaluate_on(model, data)
    rec = {"split": split, "step": step, "epoch": ep, "acc1": res.acc1, "acc5": res.acc5, "loss": res.loss}
    cand, cand_acc = model, res.acc1
    results = {"model": res}
    if ema is not None:
        res_e = evaluate_on(ema, data)
        rec.update(ema_acc1=res_e.acc1, ema_acc5=res_e.acc5)
        results["ema"] = res_e
        if res_e.acc1 > cand_acc:
            cand, cand_acc = ema, res_e.acc1
    logger.log(rec)
    bar.message(f"epoch {ep:.2f}: {split} top-1 {res.acc1:.4f} top-5 {res.acc5:.4f}" +
                (f" (EMA {rec['ema_acc1']:.4f})" if ema is not None else ""))
    if cand_acc > best:
        save(cand, out / "best.safetensors", metadata={"acc1": str(cand_acc), "split": split, "step": str(step)})
        best = cand_acc
    return best, results
