"""The models of arXiv 2010.11929 (ViT, the ResNet+ViT hybrids, the BiT ResNet-v2 baseline), the ViTs that followed,
the Swin Transformer and SAM's image encoder."""
from .registry import build_config, build_model, config_with, get_entry, list_models, lookup
from .resnet import ResNetV2, ResNetV2Config
from .samvit import SamViTConfig, SamVisionTransformer
from .swin import SwinConfig, SwinTransformer
from .timm_api import layer_groups
from .vit import VisionTransformer
from .vit_config import ViTConfig

__all__ = ["build_config", "build_model", "config_with", "get_entry", "layer_groups", "list_models", "lookup",
           "ResNetV2", "ResNetV2Config", "SamViTConfig", "SamVisionTransformer", "SwinConfig", "SwinTransformer", "ViTConfig", "VisionTransformer"]
