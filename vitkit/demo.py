"""`vitkit demo`: the main job on the embedded default: train on Fashion-MNIST, evaluate, predict."""
from __future__ import annotations

import shutil
from pathlib import Path


def demo(epochs: float = 2.0, out: str = "runs/demo", images: int = 4) -> dict:
    """Train the fashion-mnist preset for a few minutes on this machine, evaluate it on the test set
    (top-1/top-5, per class, confusion matrix), then predict a few test images saved as PNG files.

    Fashion-MNIST is read from Debian's dataset-fashion-mnist package (`make demo` installs it when it can),
    --data-dir / $VITKIT_DATA, or downloaded from the official URL.

    Args:
        epochs: training length (the full preset uses 10). 2 take under 2 minutes on a 2-core CPU with bf16
            instructions and under 5 on an AVX2-only one (fp32, which `run.precision=auto` picks there).
        out: the run directory.
        images: how many test images to write out and classify.
    """
    from PIL import Image

    from .cli import evaluate, predict
    from .data.datasets import load_fashion_mnist
    from .training import get_preset, train

    cfg = get_preset("fashion-mnist")
    cfg.schedule.epochs = epochs
    cfg.schedule.warmup_epochs = min(cfg.schedule.warmup_epochs, epochs / 4)
    cfg.run.out_dir = out
    print(f"== training the fashion-mnist preset for {epochs} epochs into {out}")
    shutil.rmtree(out, ignore_errors=True)  # the demo's own scratch folder: each demo starts from nothing
    result = train(cfg, resume=False)
    ckpt = str(Path(out) / "best.safetensors")
    print(f"\n== evaluating {ckpt}")
    evaluate(ckpt, data="fashion-mnist", out=out, tta=cfg.run.tta)
    test = load_fashion_mnist("test")
    samples = Path(out) / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(images):
        f = samples / f"test{i}_{test.classes[int(test.labels[i])].replace('/', '-').replace(' ', '_')}.png"
        Image.fromarray(test.images[i, 0].numpy()).save(f)
        files.append(str(f))
    print(f"\n== predicting {images} test images (the file names carry the true class)")
    predict(files, checkpoint=ckpt, top_k=3, tta=cfg.run.tta)
    return result
