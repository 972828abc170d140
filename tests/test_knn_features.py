"""k-NN on frozen features (against scikit-learn's own classifier), the `knn` and `features` commands on a modern
backbone (the DINOv2-with-registers fixture timm made), dense features as feature maps."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.cli import main
from vitkit.evaluation.knn import knn_predict

MODERN = Path(__file__).resolve().parent / "fixtures" / "modern"


@pytest.mark.parametrize("temperature", [0.07, None])
def test_knn_votes_as_scikit_learn_does(temperature):
    """The same rule as KNeighborsClassifier on cosine distance, weights exp((1 - distance) / T) (or uniform)."""
    from sklearn.neighbors import KNeighborsClassifier

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(5, 16, generator=g)
    y = torch.randint(0, 5, (400,), generator=g)
    x = centers[y] + 1.5 * torch.randn(400, 16, generator=g)
    train_x, train_y, test_x = x[:300], y[:300], x[300:]
    ours = knn_predict(train_x, train_y, test_x, ks=(1, 7, 20), temperature=temperature)
    for k in (1, 7, 20):
        weights = "uniform" if temperature is None else (lambda d: np.exp((1 - d) / temperature))
        ref = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute", weights=weights)
        ref.fit(train_x.numpy(), train_y.numpy())
        agree = (ours[k].numpy() == ref.predict(test_x.numpy())).mean()
        assert agree >= 0.99, (k, agree)  # exact up to ties between equally weighted classes
        if k == 1:
            assert agree == 1.0


def test_knn_command_on_a_dinov2_backbone(capsys):
    code = main(["knn", str(MODERN / "timm_dinov2_reg"), "--data", "digits", "--k", "5", "10", "--json-out",
                 "--precision", "fp32", "--device", "cpu"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ks"] == [5, 10] and all(0.0 <= a <= 1.0 for a in res["accuracy"].values())
    # random weights still see the digits' pixels: far above the 10% of chance
    assert res["accuracy"]["10"] > 0.3 and res["test_images"] > 0
    # the paper's few-shot linear evaluation on the same backbone
    code = main(["fewshot", str(MODERN / "timm_dinov2_reg"), "--data", "digits", "--shots", "1", "5", "--draws", "2",
                 "--json-out", "--precision", "fp32", "--device", "cpu"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["shots"] == [1, 5] and res["mean"]["5"] > res["mean"]["1"] > 0.1


def test_features_command_writes_pooled_and_dense_features(tmp_path, capsys):
    from PIL import Image
    from safetensors import safe_open

    imgs = []
    for i, size in enumerate([(70, 56), (56, 56)]):
        p = tmp_path / f"img{i}.png"
        Image.fromarray((np.random.default_rng(i).random((*size[::-1], 3)) * 255).astype(np.uint8)).save(p)
        imgs.append(str(p))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    out = tmp_path / "f.safetensors"
    code = main(["features", *imgs, str(bad), "--checkpoint", str(MODERN / "timm_dinov2_reg"), "--out", str(out),
                 "--dense", "--layers", "0", "-1", "--precision", "fp32", "--device", "cpu"])
    assert code == 1  # the unreadable image is named; the others are written
    assert "bad.png: ERROR" in capsys.readouterr().out
    with safe_open(out, "pt") as f:
        assert json.loads(f.metadata()["images"]) == imgs
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert t["pooled"].shape == (2, 64) and t["patch_grid.1"].shape == (2, 64, 4, 4) and t["prefix.0"].shape == (2, 5, 64)
    # the pooled features are the model's own output for the same preprocessing
    m = vitkit.load(MODERN / "timm_dinov2_reg")
    from vitkit.data.image import EvalTransform, decode_for

    x = torch.stack([EvalTransform.for_model(m.config, geometry=False)(decode_for(p, m.config)[None])[0] for p in imgs])
    with torch.no_grad():
        assert torch.allclose(m.forward_head(m.forward_features(x), pre_logits=True), t["pooled"], atol=1e-5)
