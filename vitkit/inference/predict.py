"""Top-k predictions for image files, with the checkpoint's own preprocessing (size, crop, mean, std) and class names."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..data.image import EvalTransform, ImageDecodeError, decode_for
from ..evaluation.metrics import check_tta, tta_log_probs
from ..precision import autocast


@torch.no_grad()
def predict(model: nn.Module, images: list[str | Path], top_k: int = 5, batch_size: int = 32, tta: str = "none",
            precision: str = "fp32", max_patches: int | None = None) -> list[dict]:
    """One record per image: {"image", "top": [(label, probability), ...]} or {"image", "error"} if unreadable.

    tta: test-time augmentation (`vitkit.evaluation.tta_views`): probabilities averaged over the views.
    precision: fp32 | bf16 | fp16 (autocast), as resolved by `vitkit.precision`.
    max_patches: native aspect ratio (NaFlex): each image resized, keeping its aspect ratio, to at most this many
        patches, the batch packed into one forward (`vitkit.data.naflex`); None: the checkpoint's square size.
    """
    check_tta(tta)  # before any image is read
    c = model.config
    transform = EvalTransform.for_model(c, geometry=False)  # decode_for already resized and cropped
    if max_patches:
        from ..data.image import load_image, to_uint8_tensor
        from ..data.naflex import PackTransform
        from ..models.layers.packing import pack

        packer = PackTransform.for_model(c, max_patches)
    names = c.class_names or [str(i) for i in range(c.num_classes)]
    device = getattr(model, "device", None) or next(model.parameters()).device  # a BackendModel names its own
    records: list[dict] = []
    pending: list[tuple[int, torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        if max_patches:
            x = pack([t for _, t in pending], tuple(c.patch_size), length=max_patches).to(device)
        else:
            x = torch.stack([t for _, t in pending]).to(device)
        with autocast(precision, device):
            probs = tta_log_probs(model, x, tta).float().exp()  # (B, K)
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        for (i, _), v, idx in zip(pending, top.values.tolist(), top.indices.tolist()):
            records[i]["top"] = [(names[j], p) for j, p in zip(idx, v)]
        pending.clear()

    model.eval()
    for path in images:
        records.append({"image": str(path)})
        try:
            if max_patches:  # its own aspect ratio at the patch budget
                pending.append((len(records) - 1, packer.image(to_uint8_tensor(load_image(path, c.in_chans)))))
            else:
                pending.append((len(records) - 1, transform(decode_for(path, c)[None])[0]))  # the checkpoint's eval transform
        except (ImageDecodeError, FileNotFoundError, IsADirectoryError) as e:
            records[-1]["error"] = str(e)
            continue
        if len(pending) == batch_size:
            flush()
    flush()
    return records
