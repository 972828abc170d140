"""Inference: top-k predictions with a checkpoint's own preprocessing and class names."""
from .predict import predict

__all__ = ["predict"]
