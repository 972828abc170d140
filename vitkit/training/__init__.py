"""Training and fine-tuning: configs as code, presets, the loop with exact resume.

The loop (`train`, `TrainingError`) and the checkpoint module are imported on first use, so that reading the
presets and configs (the CLI's help, `--print-config`) does not load torch.distributed's checkpointing.
"""
from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig, apply_overrides, load_config_file
from .presets import PRESETS, get_preset

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "load_config_file", "PRESETS", "get_preset", "TrainingError", "train", "checkpoint"]


def __getattr__(name: str):
    import importlib

    if name in ("train", "TrainingError"):
        return getattr(importlib.import_module(".trainer", __name__), name)
    if name == "checkpoint":
        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
