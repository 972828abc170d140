"""vitkit: Vision Transformers ("An Image Is Worth 16x16 Words", arXiv 2010.11929) in PyTorch."""
from .checkpoints import CheckpointError, convert, create_model, export, load, resolve_data_config, save
from .data.image import create_transform
from .models import ResNetV2, ResNetV2Config, ViTConfig, VisionTransformer, list_models
from .models.dense import DenseBackbone, SimpleFeaturePyramid, dense_features, dense_layer_indices, dense_strides
from .models.layers.packing import PackedBatch, pack

__version__ = "0.1.0"
__all__ = ["create_model", "resolve_data_config", "create_transform", "list_models", "load", "save", "export", "convert", "CheckpointError", "ViTConfig", "VisionTransformer", "ResNetV2", "ResNetV2Config",
           "PackedBatch", "pack", "dense_features", "dense_layer_indices", "dense_strides", "DenseBackbone",
           "SimpleFeaturePyramid"]
