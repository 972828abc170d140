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


@pytest.mark.parametrize("kw, what", [(dict(num_kv_heads=2), "grouped-query"), (dict(mlp_layer="swiglu"), "swiglu")])
def test_official_npz_export_refuses_what_it_cannot_hold_by_name(kw, what):
    from vitkit.checkpoints.io import CheckpointError
    from vitkit.checkpoints.official import from_vitkit
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                            mlp_dim=64, num_classes=3, act="gelu_tanh", **kw)
    with pytest.raises(CheckpointError, match=what):
        from_vitkit(m.state_dict(), m.config)
