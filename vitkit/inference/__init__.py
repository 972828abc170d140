"""Inference: top-k predictions with a checkpoint's own preprocessing and class names, for many images at a time."""
from .predict import gather_inputs, predict, predict_batches, top_classes

__all__ = ["gather_inputs", "predict", "predict_batches", "top_classes"]
