"""The models of arXiv 2010.11929: ViT, the ResNet+ViT hybrids and the BiT ResNet-v2 baseline."""
from .registry import build_config, build_model, config_with, create_model, get_entry, list_models
from .resnet import ResNetV2, ResNetV2Config
from .vit import ViTConfig, VisionTransformer

__all__ = ["build_config", "build_model", "config_with", "create_model", "get_entry", "list_models",
           "ResNetV2", "ResNetV2Config", "ViTConfig", "VisionTransformer"]
