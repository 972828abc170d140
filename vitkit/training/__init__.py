"""Training and fine-tuning: configs as code, presets, the loop with exact resume."""
from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig, apply_overrides, load_config_file
from . import checkpoint
from .presets import PRESETS, get_preset
from .trainer import TrainingError, train

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "load_config_file", "PRESETS", "get_preset", "TrainingError", "train", "checkpoint"]
