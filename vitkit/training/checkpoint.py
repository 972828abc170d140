"""A run's resumable state, sharded with torch.distributed.checkpoint (DCP), and the rules for resuming it.

    run/checkpoints/step-00000040/   one DCP file set per step: every rank writes its shards (__R_0.distcp) and
        .metadata                    rank 0 the index; model, optimizer and EMA tensors, keyed by parameter name
        meta.json                    step, best, elapsed time, the run's config and the model's, the world size

A step's folder is written as `step-N.tmp` and renamed once every rank has finished, and only then is the
previous step's folder removed: a killed run always leaves one complete checkpoint. DCP reshards on load, so a
run saved by 2 processes resumes in 1 (or 8), and `vitkit convert` reads a step folder into one .safetensors.
Random state is not saved: every random choice of a step derives from (seed, step, rank), and the sample order
from (seed, epoch), so the step number is the whole position of the run.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .config import _flatten
from .distributed import Dist
from ..errors import CheckpointError, VitkitError
from ..safety import open_regular, parse_json, read_bytes, untrusted

CKPT_DIR = "checkpoints"
# Settings that do not change what a training step computes: a run may resume with them changed.
RESUME_SAFE = {"preset", "data.data_dir", "data.num_workers", "data.eval_batch_size", "run.out_dir", "run.device",
               "run.threads", "run.progress", "run.log_every", "run.ckpt_every", "run.eval_every", "run.tta", "run.compile",
               "run.strategy", "run.activation_checkpointing", "run.precision_choice"}
RUN_FILES = (CKPT_DIR, "last.ckpt", "best.safetensors", "final.safetensors", "metrics.jsonl", "result.json", "config.yaml", "tb",
             "test_report.json", "test_confusion.png")


def config_differences(before: dict, now: dict) -> list[str]:
    """'key: before -> now' for every setting that differs and changes what a step means (not RESUME_SAFE)."""
    def flat(d: dict) -> dict:
        f = _flatten(json.loads(json.dumps(d)))  # tuples and lists alike
        f.update({f"model.overrides.{k}": v for k, v in (f.pop("model.overrides", None) or {}).items()})
        return f

    a, b = flat(before), flat(now)
    if b.get("run.precision") == "auto" and resolved_precision(before):
        a["run.precision"] = "auto"  # auto resumes in what the saved run computed in: the same steps
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


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def latest(out: Path) -> Path | None:
    """The newest complete step folder of a run, or None."""
    steps = sorted(p for p in (out / CKPT_DIR).glob("step-*") if p.suffix != ".tmp" and (p / "meta.json").exists())
    return steps[-1] if steps else None


def read_meta(step_dir: Path) -> dict:
    meta = parse_json(read_bytes(step_dir / "meta.json", error=CheckpointError), str(step_dir / "meta.json"),
                      CheckpointError)
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{step_dir / 'meta.json'} is not a vitkit run's step record")
    return meta


# DCP writes its index (.metadata) with pickle and loads non-tensor items with torch.load(weights_only=False): a
# step folder from someone else could run code through either. vitkit reads both with allow-lists instead.
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a checkpoint index (only DCP's own metadata types)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the index unpickled through an allow-list and every storage it names checked to be a
    file of the step folder that holds the bytes it claims."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        with untrusted(str(path)):
            with open_regular(path, error=CheckpointError) as f:  # a FIFO here would block the reader
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, dcp.metadata.Metadata):
                raise CheckpointError(f"{path} is not DCP metadata")
            for info in (metadata.storage_data or {}).values():
                name = str(getattr(info, "relative_path", ""))
                file = Path(self.path) / name
                if "/" in name or name.startswith(".") or not file.is_file():
                    raise CheckpointError(f"{path}: a storage in {name!r}, not a file of the step folder")
                if info.offset < 0 or info.length < 0 or info.offset + info.length > file.stat().st_size:
                    raise CheckpointError(f"{path}: {name} bytes {info.offset}-{info.offset + info.length} claimed, "
                                          f"the file has {file.stat().st_size}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp.metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _dcp_load(state: dict, step_dir: Path) -> None:
    """dcp.load through the safe reader and planner. DCP wraps every failure in a CheckpointException (a
    BaseException, which no `except Exception` sees): the first rank's error is raised instead, as a vitkit error."""
    SafeReader(str(step_dir)).read_metadata()  # refused here, before DCP logs its fallbacks' tracebacks
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(step_dir)), planner=SafeLoadPlanner())
    except dcp.api.CheckpointException as e:
        exc = next((pair[0] for pair in e.failures.values()), None)
        if isinstance(exc, VitkitError):
            raise exc from None
        raise CheckpointError(f"{step_dir}: cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:500]})") from exc


def _tensors(model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None) -> dict:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def save(out: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None, meta: dict,
         dist: Dist) -> Path:
    """Write step `step` (every rank calls this); returns its folder. The previous step's folder goes only after."""
    root = out / CKPT_DIR
    final = root / f"step-{step:08d}"
    tmp = final.with_suffix(".tmp")
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with _single_process_quiet():
        dcp.save(_tensors(model, opt, ema), checkpoint_id=str(tmp))
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


def load(step_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, ema: nn.Module | None) -> dict:
    """Load a step folder into the (possibly sharded) model, its optimizer and EMA; returns its meta.json."""
    state = _tensors(model, opt, ema)
    _dcp_load(state, step_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    return read_meta(step_dir)


def load_model_weights(step_dir: Path, model: nn.Module, key: str = "model") -> None:
    """Only the weights (`key`: "model" or "ema") of a step folder, into a plain single-process model."""
    state = {key: model.state_dict()}
    _dcp_load(state, step_dir)
    model.load_state_dict(state[key])
