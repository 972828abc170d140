"""Data: image decoding and the one evaluation preprocessing of a checkpoint (datasets and augmentation come with training)."""
from .image import EvalTransform, ImageDecodeError, decode_for, load_image, preprocess

__all__ = ["EvalTransform", "ImageDecodeError", "decode_for", "load_image", "preprocess"]
