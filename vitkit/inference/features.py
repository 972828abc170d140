"""Frozen features of image files: the pooled representation (what k-NN, few-shot and linear probes read), and on
request the dense patch features of chosen blocks as feature maps (B, D, gh, gw): what segmentation, depth and
correspondence heads on DINOv2-style backbones read."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..data.image import EvalTransform, ImageDecodeError, decode_for
from ..machine.precision import autocast


@torch.no_grad()
def extract_features(model: nn.Module, images: list[str | Path], *, dense: bool = False,
                     layers: list[int] | None = None, norm: bool = True, batch_size: int = 32,
                     precision: str = "fp32") -> tuple[dict[str, torch.Tensor], list[dict]]:
    """({"pooled": (N, D), and with `dense` "patch_grid.L": (N, D, gh, gw) and "prefix.L": (N, p, D) per block L},
    one record per image: {"image", "row"} or {"image", "error"}). Rows follow the readable images' order.

    Args:
        dense: also keep the patch tokens of `layers` (default: the last block) as feature maps.
        layers: block indices, negative from the end.
        norm: apply the final norm to the dense tokens (as DINOv2's dense features are read).
    """
    c = model.config
    transform = EvalTransform.for_model(c, geometry=False)
    device = next(model.parameters()).device
    layers = list(layers) if layers is not None else [-1]
    out: dict[str, list[torch.Tensor]] = {}
    records, pending = [], []

    def flush() -> None:
        if not pending:
            return
        x = torch.stack(pending).to(device)
        with autocast(precision, device):
            if dense:
                res = model.forward_intermediates(x, layers, attention=False, patch_grid=True, norm=norm)
                for i, t in res["patch_grid"].items():
                    out.setdefault(f"patch_grid.{i}", []).append(t.float().cpu())
                    out.setdefault(f"prefix.{i}", []).append(res["prefix"][i].float().cpu())
                feats = res["features"]
            else:
                feats = model.forward_features(x)
            out.setdefault("pooled", []).append(model.forward_head(feats, pre_logits=True).float().cpu())
        pending.clear()

    model.eval()
    rows = 0
    for path in images:
        try:
            pending.append(transform(decode_for(path, c)[None])[0])
        except (ImageDecodeError, OSError, MemoryError) as e:  # that image's record; the others go on
            records.append({"image": str(path), "error": str(e) if not isinstance(e, MemoryError) else
                            f"{path}: decoding it ran out of memory"})
            continue
        records.append({"image": str(path), "row": rows})
        rows += 1
        if len(pending) == batch_size:
            flush()
    flush()
    return {k: torch.cat(v) for k, v in out.items()}, records
