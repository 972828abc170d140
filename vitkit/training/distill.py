"""DeiT-style distillation: a frozen teacher checkpoint, and the loss of a student with a distillation token.

The student (`model.overrides.distilled=true`, or a distilled checkpoint) returns two heads' logits in training:
the class token's learns the labels, the distillation token's the teacher's predictions (`distill.kind`: hard, the
teacher's argmax; soft, KL to its distribution at temperature `distill.tau`), weighted 1 - alpha and alpha.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints import load
from ..errors import UsageError
from ..machine.fast_linear import pack_linears
from .config import TrainConfig


def load_teacher(cfg: TrainConfig, device: torch.device) -> nn.Module | None:
    """The teacher of `distill.teacher`, frozen on `device`, or None without one."""
    if not cfg.distill.teacher:
        return None
    if cfg.distill.kind not in ("hard", "soft"):
        raise UsageError(f"distill.kind must be hard or soft, got {cfg.distill.kind!r}")
    teacher = load(cfg.distill.teacher).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if cfg.run.fast_gemm:
        pack_linears(teacher)  # its fp32 CPU inference on the fastest GEMM (no effect elsewhere)
    return teacher


def teacher_logits(teacher: nn.Module, x: torch.Tensor, student_config) -> torch.Tensor:
    """The teacher's logits for the student's (augmented, normalised) batch: re-normalised with the teacher's own
    mean/std and resized to its size when they differ."""
    tc, sc = teacher.config, student_config
    if tuple(tc.mean) != tuple(sc.mean) or tuple(tc.std) != tuple(sc.std):
        dev = x.device
        c = x.shape[1]
        raw = x * torch.tensor(sc.std, device=dev)[:c, None, None] + torch.tensor(sc.mean, device=dev)[:c, None, None]
        x = (raw - torch.tensor(tc.mean, device=dev)[:c, None, None]) / torch.tensor(tc.std, device=dev)[:c, None, None]
    if tuple(x.shape[-2:]) != tuple(tc.img_size):
        x = F.interpolate(x, size=tuple(tc.img_size), mode="bilinear", align_corners=False, antialias=True)
    with torch.no_grad():
        return teacher(x).float()


def distilled_loss(cls: torch.Tensor, dist: torch.Tensor, label_loss: Callable[[torch.Tensor], torch.Tensor],
                   teacher: nn.Module | None, xa: torch.Tensor, student_config, d) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of a distilled student's two heads (`cls`, `dist`: float logits) and the logits accuracy is counted
    on (their mean). Without a teacher both heads learn the labels; with one the distillation token learns the
    teacher's predictions for the batch `xa`, as `d` (`cfg.distill`) says."""
    if teacher is None:
        return (label_loss(cls) + label_loss(dist)) / 2, (cls + dist) / 2
    t = teacher_logits(teacher, xa, student_config)
    if d.kind == "hard":
        distill = F.cross_entropy(dist, t.argmax(1))
    else:
        distill = F.kl_div(F.log_softmax(dist / d.tau, -1), F.log_softmax(t / d.tau, -1), reduction="batchmean",
                           log_target=True) * d.tau ** 2
    return (1 - d.alpha) * label_loss(cls) + d.alpha * distill, (cls + dist) / 2
