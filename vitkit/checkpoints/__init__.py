"""Checkpoints: the official .npz, timm, HF, torchvision and vitkit formats; resampling; the pretrained catalog."""
from .api import (Checkpoint, convert, export, inspect_checkpoint, load, load_state, read_checkpoint,
                  resolve_data_config, save)
from .catalog import CATALOG, register_checkpoint, resolve
from .create import create_model
from .io import CheckpointError

__all__ = ["Checkpoint", "convert", "export", "inspect_checkpoint", "load", "load_state", "read_checkpoint", "resolve_data_config", "save",
           "CATALOG", "create_model", "register_checkpoint", "resolve", "CheckpointError"]
