"""`vitkit explain` and `vitkit inspect`: the analysis API applied to files, writing PNGs and the raw arrays (.npz)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from ..cache import output_dir
from ..data.datasets import IMAGE_EXTS, iterate_batches, load_dataset
from ..data.image import EvalTransform, ImageDecodeError, decode_for
from ..data.splits import prepare
from . import plots
from .attention import (attention_rollout, grad_cam, grad_rollout, layer_head_maps, mean_attention_distance, register_attention,
                        require_vit, swin_window_maps)
from .embeddings import embedding_filters, filter_principal_components, position_similarity
from ..errors import UsageError

log = logging.getLogger(__name__)


def _input(model: nn.Module, path: str | Path) -> tuple[torch.Tensor, np.ndarray]:
    """The model input (1, C, H, W) and the same crop as a displayable uint8 image."""
    c = model.config
    pixels = decode_for(path, c)  # uint8 (C, H, W): the checkpoint's resize and centre crop, as predict and eval
    x = EvalTransform.for_model(c, geometry=False)(pixels[None])
    shown = pixels[0].numpy() if pixels.shape[0] == 1 else pixels.permute(1, 2, 0).numpy()
    return x, shown


def explain_images(model: nn.Module, images: list[str | Path], out: str | Path, *, discard_ratio: float = 0.0,
                   head_fusion: str = "mean", class_index: int | None = None) -> list[dict]:
    """For each image: rollout and gradient-weighted rollout overlays, the per-layer/per-head maps, and an .npz.
    A CNN (the BiT baseline) has no attention: it gets a Grad-CAM overlay instead.
    Every image is decoded first: one that cannot be read gets a record {"image", "error"} and the others are still
    explained (as `predict` does); when none can be read, an ImageDecodeError before anything is written."""
    model.eval()
    vit = hasattr(model, "blocks")
    out = Path(out)
    names = model.config.class_names or [str(i) for i in range(model.config.num_classes)]
    inputs: dict[str, tuple | str] = {}
    for path in images:
        try:
            inputs[str(path)] = _input(model, path)
        except (ImageDecodeError, FileNotFoundError, IsADirectoryError) as e:
            inputs[str(path)] = str(e)
    if images and all(isinstance(v, str) for v in inputs.values()):
        raise ImageDecodeError("no image could be read: " + "; ".join(inputs.values()))
    output_dir(out)
    records = []
    for path in images:
        if isinstance(inputs[str(path)], str):
            records.append({"image": str(path), "error": inputs[str(path)]})
            continue
        x, shown = inputs[str(path)]
        stem = Path(path).stem
        rec: dict = {"image": str(path), "heads_png": None}
        arrays: dict = {}
        if getattr(model.config, "arch", "") == "swin":  # windows, not one sequence: Grad-CAM + per-window maps
            if not model.config.num_classes:
                raise UsageError("Grad-CAM needs a classifier head (this Swin has num_classes=0)")
            g, idx = grad_cam(model, x, class_index)
            maps = {f"Grad-CAM: {names[int(idx[0])]}": g[0].numpy()}
            arrays["grad_cam"] = g[0].numpy()
            win = {k: v[0].numpy() for k, v in swin_window_maps(model, x).items()}
            arrays.update({f"window_attention_{k}": v for k, v in win.items()})
            stage_of = [s_i for s_i, stage in enumerate(model.layers) for _ in stage.blocks]  # block -> its stage
            shifted = {i for i, blk in enumerate(model.blocks) if any(blk.shift)}
            rec["heads_png"] = str(plots.save_window_maps(win, stage_of, shifted, out / f"{stem}_windows.png",
                                                          title=f"{Path(path).name}: attention received within each window"))
        elif vit:
            roll = attention_rollout(model, x, discard_ratio, head_fusion)[0]
            maps = {"attention rollout": roll.numpy()}
            arrays["rollout"] = roll.numpy()
            if model.config.num_classes:
                with torch.enable_grad():
                    g, idx = grad_rollout(model, x, class_index, discard_ratio)
                maps[f"grad rollout: {names[int(idx[0])]}"] = arrays["grad_rollout"] = g[0].numpy()
            heads = {k: v[0].numpy() for k, v in layer_head_maps(model, x).items()}
            arrays["layer_head"] = np.stack([heads[k] for k in sorted(heads)])
            rec["heads_png"] = str(plots.save_layer_head_grid(heads, out / f"{stem}_heads.png",
                                                              title=f"{Path(path).name}: attention per layer and head"))
            if getattr(model.config, "reg_tokens", 0):  # registers: shown apart from the patch maps (Darcet et al.)
                reg = {k: v[0].numpy() for k, v in register_attention(model, x, head_fusion).items()}
                arrays.update({f"registers_{k}": v for k, v in reg.items()})
                rec["registers_png"] = str(plots.save_register_attention(
                    reg, out / f"{stem}_registers.png", title=f"{Path(path).name}: the {model.config.reg_tokens} registers"))
            if getattr(model, "attn_pool", None) is not None:  # SigLIP's MAP head: where its probe looks
                with torch.no_grad():
                    feats = model.forward_features(x)[:, model.config.num_prefix_tokens:]
                    _, probe = model.attn_pool(feats, return_attention=True)  # (1, H, 1, N)
                maps["MAP probe attention"] = arrays["map_probe"] = (
                    probe[0, :, 0].mean(0).reshape(model.patch_embed.grid_for(x)) / probe[0, :, 0].mean(0).max()).numpy()
        if not vit:
            if not model.config.num_classes:
                raise UsageError("Grad-CAM needs a classifier head (this CNN has num_classes=0)")
            g, idx = grad_cam(model, x, class_index)
            maps = {f"Grad-CAM: {names[int(idx[0])]}": g[0].numpy()}
            arrays["grad_cam"] = g[0].numpy()
        if model.config.num_classes:
            rec["class"] = names[int(idx[0])]
            arrays["class_index"] = np.array(int(idx[0]))
        rec["png"] = str(plots.save_explanation(shown, maps, out / f"{stem}_rollout.png", title=Path(path).name))
        np.savez(out / f"{stem}.npz", **arrays)
        rec["npz"] = str(out / f"{stem}.npz")
        records.append(rec)
    return records


def _batches_from(model: nn.Module, data: str, num_images: int, data_dir: str | None, batch_size: int = 32) -> Iterator[torch.Tensor]:
    c = model.config
    root = Path(data)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS)
        good, skipped = [], []
        for f in files:
            if len(good) == num_images:
                break
            try:
                good.append(_input(model, f)[0])
            except (ImageDecodeError, OSError):
                skipped.append(f.name)
        if skipped:
            log.warning(f"skipped {len(skipped)} unreadable image(s): {', '.join(skipped[:5])}")
        if not good:
            raise UsageError(f"no readable images under {root}")
        for i in range(0, len(good), batch_size):
            yield torch.cat(good[i : i + batch_size])
        return
    split = prepare(c, test=load_dataset(data, data_dir).test.select(n=num_images))
    tf = split.transform(split.test)
    for x, _, _ in iterate_batches(split.test, batch_size, shuffle=False, drop_last=False):
        yield tf(x)


def inspect_model(model: nn.Module, out: str | Path, *, data: str | None = None, data_dir: str | None = None,
                  num_images: int = 64, components: int = 28, name: str = "") -> dict:
    """Fig. 7: filter principal components, position-embedding similarity, and (with data) mean attention distance."""
    require_vit(model)
    model.eval()
    out = output_dir(out)
    res: dict = {}
    arrays: dict = {}
    pcs, ratio = filter_principal_components(embedding_filters(model), components)
    bb = model.patch_embed.backbone
    which = "embedding" if bb is None else "ResNet stem" if hasattr(bb, "stem") else "conv stem's first"
    res["filters_png"] = str(plots.save_filters(pcs, out / "filters.png",
                                                title=f"{name} {which} filters: top {len(pcs)} principal components"))
    arrays["filter_components"], arrays["filter_variance_ratio"] = pcs.numpy(), ratio.numpy()
    try:
        sim = position_similarity(model)
        res["pos_png"] = str(plots.save_position_similarity(sim, out / "pos_similarity.png", title=f"{name} position embedding similarity"))
        arrays["position_similarity"] = sim.numpy()
    except ValueError as e:
        res["pos_skipped"] = str(e)
    if data:
        dist = mean_attention_distance(model, lambda: _batches_from(model, data, num_images, data_dir))
        res["distance_png"] = str(plots.save_attention_distance(dist, out / "attention_distance.png",
                                                                title=f"{name} mean attention distance ({num_images} images)"))
        arrays["mean_attention_distance"] = dist.numpy()
    np.savez(out / "inspect.npz", **arrays)
    res["npz"] = str(out / "inspect.npz")
    return res
