"""`vitkit demo`: the main job on an embedded default."""
from __future__ import annotations

import time

import torch


def demo(model: str = "vit_s16", image: str = "chelsea", top_k: int = 3) -> dict:
    """Build a model, classify one of scikit-image's sample photos end to end, print the model table.

    The weights are random (no download is possible here), so the labels mean nothing: the demo shows
    that decoding, preprocessing, the forward pass and the softmax run end to end.

    Args:
        model: a registered model name (see `vitkit models`).
        image: a scikit-image sample name (chelsea, astronaut, coffee, ...) or an image path.
        top_k: how many classes to print.
    """
    from . import create_model
    from .cli import models as models_table
    from .data import load_image, preprocess

    torch.manual_seed(0)
    net = create_model(model).eval()
    c = net.config
    if "/" in image or "." in image:
        img = load_image(image, c.in_chans)
    else:
        import skimage.data

        img = load_image(getattr(skimage.data, image)(), c.in_chans)
    x = preprocess(img, c.img_size, c.mean, c.std, crop_pct=c.crop_pct, interpolation=c.interpolation)[None]
    t0 = time.perf_counter()
    with torch.inference_mode():
        probs = net(x).softmax(-1)[0]
    dt = time.perf_counter() - t0
    top = probs.topk(top_k)
    print(f"{model}: image {image!r} {img.size[0]}x{img.size[1]} -> input {tuple(x.shape)}, forward {dt * 1e3:.0f} ms")
    print("random weights, so the classes are arbitrary (a zero-initialised head gives uniform probabilities):")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  class {i:4d}  p = {p:.4f}")
    print()
    models_table()
    return {"probs": probs, "input_shape": tuple(x.shape)}
