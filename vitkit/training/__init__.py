"""Training and fine-tuning: configs as code, presets, the loop with exact resume.

`train` (trainer.py) runs a run: `setup.py` sets it up (data through `vitkit.data.splits`, model, optimizer, resume),
`loop.py` holds its steps and evaluations, `distill.py` the DeiT-style teacher and loss, `checkpoint.py` the
resumable state.
"""
from . import checkpoint
from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig, apply_overrides, load_config_file
from .presets import PRESETS, get_preset, run_config
from .setup import TrainingError
from .trainer import train

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "load_config_file", "PRESETS", "get_preset", "run_config", "TrainingError", "train", "checkpoint"]
