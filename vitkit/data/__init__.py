"""Data: image decoding and the one evaluation preprocessing of a checkpoint; datasets, augmentation, and the one
entrance that makes a dataset's splits ready for a model (`prepare`, `vitkit.data.splits`)."""
from .image import EvalTransform, ImageDecodeError, decode_for, load_image, preprocess, replicate_channels
from .splits import Splits, feature_splits, prepare, test_split, training_data

__all__ = ["EvalTransform", "ImageDecodeError", "decode_for", "load_image", "preprocess", "replicate_channels",
           "Splits", "feature_splits", "prepare", "test_split", "training_data"]
