"""Data: image decoding and evaluation preprocessing (datasets and augmentation come with training)."""
from .image import ImageDecodeError, load_image, preprocess
