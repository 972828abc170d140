"""The training run: fine-tuning or training from scratch, in one process or many, with exact resume.

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

Reading order: `train` sets a run up (`setup.prepare_run`: data through `vitkit.data.splits`, model, optimizer,
EMA, teacher), then runs steps (`loop.train_step`: the micro-batches of one optimizer step, forward, backward,
clipping, update, EMA; the distillation loss in `distill.py`), logs, evaluates (`loop.evaluate_and_keep_best`) and
checkpoints between them. Under torchrun every process runs this same code: `data.batch_size` is the global
batch, each rank takes its slice (`iterate_batches`), DDP or FSDP2 (`vitkit.training.distributed`) keeps the weights in
step, and only rank 0 writes logs and weights.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
import yaml

from ..cache import output_dir
from ..data.datasets import iterate_batches
from ..errors import CheckpointError
from ..evaluation import save_confusion_png, write_report
from ..evaluation.metrics import tta_views
from ..machine.device import resolve_device
from ..machine.threads import Governor
from . import budget as budgeting
from . import checkpoint
from .budget import CASCADE_SHARE, FIRST_TIMED_STEP, FIT_EVERY, MIN_FIT_EVERY, Budget, budgeted_total, run_start, saved_state
from .config import TrainConfig
from .distributed import Dist
from .logs import MetricsLog, Progress
from .loop import due, evaluate_and_keep_best, evaluate_on, save_weights, train_step, write_checkpoint
from .prune import Pruner
from .setup import TrainingError, prepare_run, run_model_name

log = logging.getLogger(__name__)

__all__ = ["TrainingError", "train"]


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


class _StopRequest:
    """SIGTERM, SIGHUP (the terminal or the ssh session closed), or a first Ctrl-C (SIGINT): stop after the step in
    hand, save it and return (`interrupted`); every
    rank stops at the same step (`Dist.any`). A second Ctrl-C aborts at once (KeyboardInterrupt: the steps since the
    last checkpoint are lost, the checkpoints on disk are intact, a half-written one never replaces a good one)."""

    SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", **({signal.SIGHUP: "SIGHUP"} if hasattr(signal, "SIGHUP") else {})}

    def __init__(self, main: bool) -> None:
        self.main, self.asked, self.interrupts = main, None, 0

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt
            if self.main:  # os.write: a print here could land inside the main thread's own print
                os.write(2, b"\nvitkit: Ctrl-C: stopping after this step and saving it (Ctrl-C again aborts at once, "
                            b"losing the steps since the last checkpoint)\n")
        self.asked = self.asked or self.SIGNALS[signum]

    def install(self) -> dict:
        """Handle SIGTERM, SIGHUP and SIGINT; returns the handlers they had (none off the main thread: nothing installed).
        A SIGHUP ignored from the start (`nohup vitkit train ...`) stays ignored: hangups are not a stop there."""
        old = {}
        for sig in self.SIGNALS:
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            try:
                old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                break
        return old

    def restore(self, old: dict) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _budget(run, meta: dict, called_at: float) -> tuple[Budget | None, int | None]:
    """The clock of a run with `schedule.time_budget` (None without) and the length an earlier part of it fixed
    (None: none, or under another budget or maximum): what one evaluation evaluates (its views, the EMA's too), what
    a step trains, and the seconds earlier parts of the run took (a resumed run's checkpoint)."""
    cfg = run.cfg
    if cfg.schedule.time_budget is None:
        return None, None
    seconds = float(cfg.schedule.time_budget)
    total, spent = saved_state(meta, seconds, run.total) if meta else (None, 0.0)
    views = len(tta_views(torch.zeros(1, 1, 4, 4), cfg.run.tta)) if cfg.model.objective != "mpp" else 1
    if cfg.run.tta_margin is not None and views > 2:  # a cascade: the two first views of all, the others of a share
        views = 2 + (views - 2) * CASCADE_SHARE
    periodic = run.data.val if run.data.val is not None else run.data.test
    return Budget(seconds, run_start(called_at), spent, eval_views=round(len(periodic) * views * (2 if run.ema is not None else 1)),
                  images_per_step=cfg.data.batch_size * cfg.run.accumulate,
                  cost=run.resizer.costs if run.resizer is not None else None), total


def _fit_to_budget(run, budget: Budget, step: int, max_total: int, eval_steps: int, logger: MetricsLog,
                   bar: Progress) -> None:
    """Fix the run's length (run.total) to the most steps that end within the budget, from the step time of the
    steps since the last fit; every rank computes it from the same rank-averaged numbers, so all stop at the same
    step (every rank reaches this call at the same steps, and has timed as many)."""
    step_s = budget.step_time(step, run.total)  # a whole step's, under progressive resizing too
    if step_s is None:
        return
    timed = step - budget.mark[0]
    step_s, spent, eval_s = (v / run.dist.world for v in run.dist.sum([step_s, budget.spent(), budget.eval_time(step_s)]))
    final_s = eval_s * len(run.data.test) / max(len(run.data.val), 1) / (2 if run.ema is not None else 1) \
        if run.data.val is not None else 0.0  # the test set's one evaluation after the held-out split's
    if run.resizer is not None:  # progressive resizing: the sizes still to come each cost a first step (a compile)
        final_s += run.resizer.sizes_to_come(step, run.total) * run.dist.sum([budget.new_size_s])[0] / run.dist.world
    total = budgeted_total(budget_s=budget.seconds, spent_s=spent, step=step, step_s=step_s, max_total=max_total,
                           eval_steps=eval_steps, eval_s=eval_s, final_s=final_s, cost=budget.cost)
    budget.begin(step)  # the next fit times the steps from here: a machine's speed of late, not its first minutes
    budget.fit_every = max(MIN_FIT_EVERY, round(FIT_EVERY * budget.seconds / step_s))  # the same on every rank
    first, budget.fits = budget.fits == 0, budget.fits + 1
    if first or abs(total - run.total) >= 0.01 * run.total:  # every length is logged; a message where it moved 1%
        end = spent + budgeting.weighed(budget.cost, step, total, total) * step_s
        warm = f"; it ends within the warmup ({run.warmup} steps), before the learning rate decays" \
            if total < run.warmup else ""
        bar.message(f"time budget {budget.seconds:.0f} s: {step_s * 1e3:.0f} ms a step over {timed} steps, "
                    f"{spent:.0f} s spent; {'training' if first else 'now'} {total} steps "
                    f"({total / run.steps_per_epoch:.2f} epochs{f'; at most {max_total} steps' if first else ''}), the "
                    f"last at ~{end:.0f} s{warm}")
    if first or total != run.total:  # split "budget": not a training log step (whose readers expect its loss and rate)
        logger.log({"split": "budget", "step": step, "total": total, "step_s": step_s, "spent": spent,
                    "eval_s": eval_s, "budget": budget.seconds})
        run.total = total
        bar.total = max(total, 1)


def _train(cfg: TrainConfig, dist: Dist, resume: bool, max_steps: int | None, force: bool) -> dict:
    called_at = budgeting.clock()  # a budgeted run started from Python counts from here (vitkit.training.budget)
    r, d = cfg.run, cfg.data
    out = Path(r.out_dir)
    ck = checkpoint.latest(out) if resume else None
    resumed_precision, done = None, 0
    if ck is not None:
        saved_meta = checkpoint.read_meta(ck)
        saved, done = saved_meta["config"], int(saved_meta.get("step", 0) or 0)
        resumed_precision = checkpoint.resolved_precision(saved)
        diffs = checkpoint.config_differences(saved, cfg.to_dict())
        if diffs and not force:
            raise TrainingError(f"{out} holds a run whose config differs in what a step means; resuming it would mix two "
                                f"runs:\n  " + "\n  ".join(diffs) + "\nUse another run.out_dir, start fresh with --no-resume "
                                f"(the old files move to {out}/previous-<time>/), or resume anyway with --force.")
    spent = saved_state(saved_meta, float(cfg.schedule.time_budget), 0)[1] \
        if ck is not None and cfg.schedule.time_budget is not None else 0.0  # the budget's earlier parts
    run = prepare_run(cfg, dist, resumed_precision, max_steps=max_steps, done=done, budget_spent=spent)  # data, model and settings checked before anything is written
    if dist.main:
        if ck is None:  # a fresh start: whatever an earlier run left here moves aside, so its records do not mix with these
            checkpoint.set_aside(out)
        output_dir(out)
    dist.barrier()
    if dist.main:
        (out / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False))
    step, best, elapsed, meta = 0, -1.0, 0.0, {}
    if d.prune:  # InfoBatch's pruned passes (vitkit.training.prune) in place of the epochs' shuffles
        run.pruner = Pruner(run.data.train, d.batch_size, d.prune, d.prune_anneal, r.seed, r.accumulate,
                            lambda: run.total, run.device, dist.rank, dist.world,
                            dist.check_same if dist.world > 1 else None, hflip_alternate=cfg.aug.hflip_alternate)
    if ck is not None:
        saved_prune = run.pruner is not None and saved_meta.get("prune") is not None
        prune_state = {"prune": run.pruner.state_tensors()} if saved_prune else None  # filled by the load
        meta = checkpoint.load(ck, run.model, run.opt, run.ema, prune_state)
        if meta.get("scaler"):
            run.scaler.load_state_dict(meta["scaler"])
        step, best, elapsed = meta["step"], meta["best"], meta["elapsed"]
        if run.pruner is not None:
            run.pruner.drawn = step * r.accumulate  # the stream's position, saved state or not
        if saved_prune:
            try:
                if not isinstance(meta["prune"], dict):
                    raise TypeError(f"meta.json's prune is a {type(meta['prune']).__name__}")
                run.pruner.load(prune_state["prune"], meta["prune"], step)
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise CheckpointError(f"{ck}: data.prune's state cannot be resumed ({e})") from None
        elif run.pruner is not None and dist.main:
            log.warning(f"resuming {out} at step {step} with data.prune={d.prune}, which it was not saved with: the "
                        f"images' scores start afresh, and the first pass keeps every image"
                        + (" (aug.hflip_alternate's sides start again from it)" if cfg.aug.hflip_alternate else ""))
        if meta.get("world_size", 1) != dist.world and dist.main:
            log.warning(f"resuming {out} at step {step}, saved by {meta.get('world_size')} process(es), in {dist.world}: "
                        f"the weights and optimizer are resharded; the rest of the run is not bitwise the one never "
                        f"stopped")

    stop = _StopRequest(dist.main)
    old_handlers = stop.install()

    per_step = d.batch_size * r.accumulate
    eval_steps = max(1, round(r.eval_every * run.steps_per_epoch)) if r.eval_every > 0 else 0  # and at the last step
    max_total = run.total
    budget, saved_total = _budget(run, meta, called_at)
    if saved_total is not None:
        run.total = max(step, min(saved_total, max_total))  # the length the run fixed before it was stopped
    elif budget is None and isinstance(meta.get("budget"), (int, float)) and dist.main:
        log.warning(f"resuming {out} without the time budget it was fitted to ({meta['budget']} s): it trains to "
                    f"schedule.epochs ({run.total} steps), and its learning rate follows that length from here")
    first_step = step
    limit = min(run.total, max_steps) if max_steps is not None else run.total  # 0 means no step
    logger = MetricsLog(out, resumed_at=step if ck is not None else None, enabled=dist.main)
    bar = Progress(run.total, r.progress, dist.main)
    g = torch.Generator(device=run.device)
    run.net.train()
    # torch's threads follow the cores other processes leave, step by step (vitkit.machine.threads); run.threads, or
    # run.deterministic (bitwise resume needs one thread count), fixes them
    governor = Governor(r.threads or (torch.get_num_threads() if r.deterministic else None)) \
        if run.device.type == "cpu" else None
    t_start = t_log = time.perf_counter()
    loss_log = correct_log = seen_log = 0.0
    skipped_total = 0
    result: dict = {"model": run_model_name(cfg), "interrupted": False}
    last_eval: tuple[int, dict] = (-1, {})  # (step, {"model": EvalResult, "ema": EvalResult}) of the latest evaluation
    stream = run.pruner.batches() if run.pruner is not None else None  # one stream across the epochs
    try:
        while step < limit:
            epoch, in_epoch = divmod(step, run.steps_per_epoch)
            batches = stream if run.pruner is not None else iterate_batches(
                run.data.train, d.batch_size, seed=r.seed, epoch=epoch, start_step=in_epoch * r.accumulate,
                num_workers=d.num_workers, device=run.device, rank=dist.rank, world=dist.world,
                hflip_alternate=cfg.aug.hflip_alternate)
            for _ in range(in_epoch, run.steps_per_epoch):
                # every random choice of this step derives from (seed, step, rank): exact resume anywhere
                torch.manual_seed(r.seed * 1_000_003 + step + dist.rank * 1_000_000_007)
                g.manual_seed(r.seed * 1_000_033 + step + dist.rank * 1_000_000_007)
                if governor is not None:
                    governor.step()
                t_step = budgeting.clock()
                size = run.resizer.size(step, run.total) if run.resizer is not None else None  # before a fit moves it
                loss_s, correct, seen, skipped, lr = train_step(run, batches, step, g)
                if size is not None and size not in run.resizer.seen:
                    run.resizer.seen.add(size)
                    if budget is not None:  # a new size's first step compiles it (run.compile): spent, not a rate
                        budget.exclude(budgeting.clock() - t_step, run.resizer.cost(step, run.total))
                loss_log, correct_log, seen_log, skipped_total = loss_log + loss_s, correct_log + correct, seen_log + seen, skipped_total + skipped
                step += 1
                if run.pruner is not None:
                    for event in run.pruner.pop_events():
                        logger.log(event)
                if budget is not None and step < limit:
                    if budget.mark is None and step >= first_step + FIRST_TIMED_STEP:
                        budget.begin(step)  # this process's first steps compile and warm the caches: not timed
                    if budget.due(step, run.warmup):
                        _fit_to_budget(run, budget, step, max_total, eval_steps, logger, bar)
                        limit = min(run.total, max_steps) if max_steps is not None else run.total
                if due(step, r.log_every) or step == limit:
                    now = time.perf_counter()
                    loss_all, correct_all, seen_all, skipped_all = dist.sum([loss_log, correct_log, seen_log, skipped_total])
                    ips = seen_all / max(now - t_log, 1e-9)
                    rec = {"step": step, "epoch": step / run.steps_per_epoch, "lr": lr, "loss": loss_all / max(seen_all, 1),
                           "train_acc": correct_all / max(seen_all, 1), "img_per_s": ips,
                           "time": elapsed + now - t_start, "skipped_images": int(skipped_all)}
                    if size is not None:  # progressive resizing: the size this step trained at
                        rec["size"] = list(size)
                    logger.log(rec)
                    bar.update(step, epoch, rec["loss"], rec["train_acc"], ips, (limit - step) * per_step / max(ips, 1e-9), lr)
                    t_log, loss_log, correct_log, seen_log = now, 0.0, 0.0, 0.0
                if due(step, eval_steps) or step == limit:  # eval_every may be a fraction of an epoch
                    data = run.data.test if run.data.val is None else run.data.val
                    t_eval = budgeting.clock()
                    best, evaluated = evaluate_and_keep_best(run, data, step, best, logger, bar,
                                                             clock=lambda: elapsed + time.perf_counter() - t_start)
                    last_eval = (step, evaluated)
                    if budget is not None:
                        budget.evaluated(budgeting.clock() - t_eval)
                stopping = dist.any(stop.asked is not None)  # every rank stops at the same step
                if due(step, r.ckpt_every) or step % run.steps_per_epoch == 0 or step == limit or stopping:
                    write_checkpoint(run, step, best, elapsed + time.perf_counter() - t_start,
                                     None if budget is None else {"total": run.total, "spent": budget.spent(),
                                                                  "budget": budget.seconds, "max_total": max_total})
                if stopping:
                    how = {"SIGINT": "Ctrl-C (SIGINT)", None: "a signal to another process"}.get(stop.asked, stop.asked)
                    bar.message(f"stopped by {how} at step {step}: the run is saved in {checkpoint.latest(out) or out}")
                    result["interrupted"] = True
                    return result | {"step": step, "signal": stop.asked or "SIGTERM"}
                if step >= limit:
                    break
        if run.data.val is not None:
            test_eval = evaluate_on(run, run.ema if run.ema is not None else run.model, run.data.test)
            logger.log({"split": "test", "step": step, "epoch": step / run.steps_per_epoch, "acc1": test_eval.acc1,
                        "acc5": test_eval.acc5, "loss": test_eval.loss,
                        "time": elapsed + time.perf_counter() - t_start})
    finally:
        logger.close()
        stop.restore(old_handlers)
        if governor is not None:
            governor.close()
    final = run.ema if run.ema is not None else run.model
    save_weights(run, final, out / "final.safetensors")
    # the loop evaluated the final weights at its last step; evaluate again only if it did not, or if it held out
    # part of the training set for that (the test set's one evaluation)
    final_eval = last_eval[1].get("ema" if run.ema is not None else "model") if last_eval[0] == step else None
    if run.data.val is not None:  # the loop evaluated on held-out training images; the test set is evaluated once, here
        if final_eval is not None:
            result["val_acc1"] = final_eval.acc1
        final_eval = test_eval
    elif final_eval is None:
        final_eval = evaluate_on(run, final, run.data.test)
    skipped_all = int(dist.sum([skipped_total])[0])
    if budget is not None:
        result.update(time_budget_s=budget.seconds, budget_spent_s=budget.spent())
    result.update(step=step, acc1=final_eval.acc1, acc5=final_eval.acc5,
                  best_acc1=best if run.data.val is not None else max(best, final_eval.acc1), best_split=run.split,
                  time_s=elapsed + time.perf_counter() - t_start, skipped_images=skipped_all, world_size=dist.world)
    bar.message(f"done: {step} steps in {result['time_s']:.0f} s; test top-1 {final_eval.acc1:.4f}, top-5 {final_eval.acc5:.4f}")
    if dist.main:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        if final_eval.classes:  # the final weights' test evaluation, as `vitkit eval` reports it: no second pass needed
            write_report(final_eval, out / "test_report.json", {"checkpoint": str(out / "final.safetensors"),
                                                                "data": cfg.data.dataset, "tta": cfg.run.tta,
                                                                "tta_margin": cfg.run.tta_margin,
                                                                "precision": run.precision})
            try:
                save_confusion_png(final_eval, out / "test_confusion.png")
            except (OSError, ValueError, MemoryError) as e:  # a figure is not worth a failed run after its training
                bar.message(f"test_confusion.png not written: {e}")
    return result
