"""A run's resumable state, sharded with torch.distributed.checkpoint (DCP), and the rules for resuming it.

    run/checkpoints/step-00000040/   one DCP file set per step: every rank writes its shards (__R_0.distcp) and
        .metadata                    rank 0 the index; model, optimizer and EMA tensors, keyed by parameter name
        meta.json                    step, best, elapsed time, the run's config and the model's, the world size

A LoRA run's folder holds each model (the weights, the EMA) twice over where the adapters touch it: under "model"
(and "ema") the plain weights with the adapters merged in, what `vitkit.load` (convert, eval, export) reads of
a step folder; under "model_lora" (and "ema_lora") each adapted layer's frozen weight, lora_A and lora_B, from which
a resumed run continues exactly.

A step's folder is written as `step-N.tmp` and renamed once every rank has finished, and only then is the
previous step's folder removed: a killed run always leaves one complete checkpoint. DCP reshards on load, so a
run saved by 2 processes resumes in 1 (or 8), and `vitkit convert` reads a step folder into one .safetensors.
Random state is not saved: every random choice of a step derives from (seed, step, rank), and the sample order
from (seed, epoch), so the step number is the whole position of the run.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from .config import TrainConfig, flatten_config
from ..models.lora import adapter_keys, merged_state_dict
from .distributed import Dist
from ..checkpoints.io import read_meta

CKPT_DIR = "checkpoints"
# Settings that do not change what a training step computes: a run may resume with them changed.
RESUME_SAFE = {"preset", "data.data_dir", "data.num_workers", "data.eval_batch_size", "run.out_dir", "run.device",
               "run.threads", "run.progress", "run.log_every", "run.ckpt_every", "run.eval_every", "run.tta", "run.tta_margin",
               "run.compile", "run.strategy", "run.activation_checkpointing", "run.precision_choice",
               "run.compile_choice", "model.loaded",
               "schedule.time_budget"}  # a run resumed under another budget fits its length anew
RUN_FILES = (CKPT_DIR, "last.ckpt", "best.safetensors", "final.safetensors", "metrics.jsonl", "result.json", "config.yaml", "tb",
             "test_report.json", "test_confusion.png")


def config_differences(before: dict, now: dict) -> list[str]:
    """'key: before -> now' for every setting that differs and changes what a step means (not RESUME_SAFE). A
    setting the saved config lacks (a run from before vitkit had it) counts as its default then: a new option at its
    default changes no step of an old run."""
    def flat(d: dict) -> dict:
        f = flatten_config(json.loads(json.dumps(d)))  # tuples and lists alike
        f.update({f"model.overrides.{k}": v for k, v in (f.pop("model.overrides", None) or {}).items()})
        return f

    a, b = flat(before), flat(now)
    defaults = flat(TrainConfig().to_dict())
    for f in (a, b):
        f.update({k: v for k, v in defaults.items() if k not in f})
    if b.get("run.precision") == "auto" and resolved_precision(before):
        a["run.precision"] = "auto"  # auto resumes in what the saved run computed in: the same steps
    if a.get("schedule.resize_from") is None and b.get("schedule.resize_from") is None:
        a.pop("schedule.resize_until", None), b.pop("schedule.resize_until", None)  # no resizing: it means nothing
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b))
            if k not in RESUME_SAFE and a.get(k) != b.get(k)]


def resolved_precision(config: dict) -> str | None:
    """What a saved run computed in: run.precision, or what its `auto` resolved to (run.precision_choice,
    "auto -> bf16: ..."); None where the config does not say."""
    run = config.get("run") or {}
    if run.get("precision") in ("fp32", "bf16", "fp16"):
        return run["precision"]
    choice = str(run.get("precision_choice") or "")
    head = choice.split(":", 1)[0].split()
    return head[-1] if head and head[-1] in ("fp32", "bf16", "fp16") else None


def set_aside(out: Path) -> Path | None:
    """Move a previous run's files into out/previous-<time>/ (a fresh start loses nothing); the folder, or None."""
    present = [out / f for f in RUN_FILES if (out / f).exists()]
    if not present:
        return None
    dest = out / time.strftime("previous-%Y%m%d-%H%M%S")
    dest.mkdir()
    for p in present:
        os.replace(p, dest / p.name)
    return dest


def latest(out: Path) -> Path | None:
    """The newest complete step folder of a run, or None."""
    steps = sorted(p for p in (out / CKPT_DIR).glob("step-*") if p.suffix != ".tmp" and (p / "meta.json").exists())
    return steps[-1] if steps else None


def _tensors(model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None) -> dict:
    # start-up time: torch.distributed.checkpoint imports DTensor (~0.6 s): loaded when a run saves or resumes
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def _split_lora(state: dict, model: nn.Module, merged: bool) -> dict:
    """A LoRA model's entries ("model", "ema") split in two: the adapted layers' keys under "<entry>_lora", and
    under the entry itself the rest, with (`merged`, for writing) the adapted weights merged in: a plain model."""
    keys = adapter_keys(model)
    if not keys:
        return state
    for entry in ("model", "ema"):
        if entry in state:
            sd = state[entry]
            state[f"{entry}_lora"] = {k: v for k, v in sd.items() if k in keys}
            state[entry] = merged_state_dict(model, sd) if merged else {k: v for k, v in sd.items() if k not in keys}
    return state


def _join_lora(state: dict) -> dict:
    for entry in ("model", "ema"):
        if f"{entry}_lora" in state:
            state[entry] = {**state[entry], **state.pop(f"{entry}_lora")}
    return state


def save(out: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None, meta: dict,
         dist: Dist, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write step `step` (every rank calls this); returns its folder. The previous step's folder goes only after.
    `extra`: more state beside the model's, the same on every rank (data.prune's scores and pass)."""
    import torch.distributed.checkpoint as dcp  # start-up time (see _tensors)

    from ..checkpoints.run import single_process_quiet

    root = out / CKPT_DIR
    final = root / f"step-{step:08d}"
    tmp = final.with_suffix(".tmp")
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with single_process_quiet():
        dcp.save({**_split_lora(_tensors(model, opt, ema), model, merged=True), **(extra or {})}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.main:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": dist.world}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in root.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(step_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None,
         extra: dict[str, dict[str, torch.Tensor]] | None = None) -> dict:
    """Load a step folder into the (possibly sharded) model, its optimizer and EMA, and `extra`'s tensors (of the
    shapes saved, filled in place); returns its meta.json."""
    from torch.distributed.checkpoint.state_dict import set_state_dict  # start-up time (see _tensors)

    from ..checkpoints.run import dcp_load

    state = {**_split_lora(_tensors(model, opt, ema), model, merged=False), **(extra or {})}
    dcp_load(state, step_dir)
    state = _join_lora(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    return read_meta(step_dir)
