"""Checkpoints: the official .npz, timm, HF, torchvision and vitkit formats; resampling; the pretrained catalog."""
from .api import Checkpoint, convert, export, inspect_checkpoint, load, load_state, read_checkpoint, save
from .catalog import CATALOG, register_checkpoint, resolve
from .create import create_model
from .io import CheckpointError

__all__ = ["Checkpoint", "convert", "export", "inspect_checkpoint", "load", "load_state", "read_checkpoint", "save",
           "CATALOG", "create_model", "register_checkpoint", "resolve", "CheckpointError"]
