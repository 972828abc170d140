"""Red-team findings: predict refuses a headless checkpoint and one with non-finite weights by name (one line)."""
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.errors import UsageError
from vitkit.inference.predict import predict_images

KW = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)


def _image(tmp_path):
    Image.new("RGB", (20, 20)).save(tmp_path / "img.png")
    return str(tmp_path / "img.png")


def test_predict_refuses_a_headless_checkpoint(tmp_path):
    ckpt = str(tmp_path / "headless.safetensors")
    vitkit.save(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, **KW), ckpt)
    with pytest.raises(UsageError, match=r"no classifier head \(num_classes=0\).*vitkit features"):
        predict_images([_image(tmp_path)], ckpt, progress=False, precision="fp32", format="json")


def test_predict_refuses_nan_weights_by_name(tmp_path):
    m = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, **KW)
    with torch.no_grad():
        m.norm.weight.fill_(float("nan"))
    ckpt = str(tmp_path / "nan.safetensors")
    vitkit.save(m, ckpt)
    with pytest.raises(UsageError, match=r"norm\.weight holds NaN"):
        predict_images([_image(tmp_path)], ckpt, progress=False, precision="fp32", format="json")
