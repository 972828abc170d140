"""Optimizers and schedules: AdamW / SGD-momentum / Muon (its matrices; AdamW for the rest), no weight decay on
norms, biases, position embeddings and tokens, layer-wise LR decay, linear warmup then cosine or linear decay (App. B.1
of the paper)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError
from ..models import layer_groups
from ..models.timm_api import NO_WEIGHT_DECAY
from .config import OptimConfig, ScheduleConfig
from .muon import Muon


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Norms, biases, and the learned tokens and embeddings (`model.no_weight_decay()`, as timm's): no weight decay."""
    return p.ndim <= 1 or name.endswith(".bias") or any(t in name for t in NO_WEIGHT_DECAY)


def layer_ids(model: nn.Module) -> dict[str, int]:
    """{parameter name: layer}, as timm's layer-wise LR decay numbers them (`model.group_matcher()`: the embeddings
    0, each block (Swin: each block of each stage; BiT: the stem, then each stage) its own layer, the final norm with
    the last block, the head last)."""
    return {name: gid for gid, names in layer_groups(model).items() for name in names}


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    ids = layer_ids(model) if layer_decay else {}
    top = max(ids.values(), default=0)
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if _no_decay(name, p) else weight_decay
        scale = layer_decay ** (top - ids[name]) if layer_decay else 1.0
        g = groups.setdefault((wd, scale), {"params": [], "weight_decay": wd, "lr_scale": scale, "names": []})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


def muon_names(model: nn.Module) -> set[str]:
    """The parameters Muon updates: the hidden layers' weight matrices and conv kernels. The input layer (the model's
    `_first_conv`), the outputs (the classifier, masked patch prediction's `mpp_head`), and the learned tokens and
    embeddings stay with AdamW, as Muon's authors do. The fused qkv is one matrix, as timm's and Keller Jordan's
    ViTs hold it. A model that does not name its input layer and classifier (not one of vitkit's) is refused."""
    if not (hasattr(model, "_first_conv") and hasattr(model, "_classifier_names")):
        raise UsageError(f"optim.name=muon needs to know the model's input layer and classifier ({type(model).__name__} "
                         f"names neither: vitkit's models do); use optim.name=adamw")
    heads = model._classifier_names()
    outputs = ((heads,) if isinstance(heads, str) else tuple(heads)) + ("mpp_head",)
    first = f"{model._first_conv}.weight"
    return {name for name, p in model.named_parameters()
            if p.ndim >= 2 and not _no_decay(name, p) and name != first
            and not any(name == h or name.startswith(h + ".") for h in outputs)}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay)
    if cfg.name == "muon":
        return _build_muon(groups, muon_names(model), cfg)
    for g in groups:
        g.pop("names")
    # the fused kernels (CPU and CUDA): one AdamW step over ViT-S/16 takes 15 ms on a 2-core CPU, 53 ms foreach
    # (`python benchmarks/ops.py adamw`, NOTES.md section 8)
    params = [p for g in groups for p in g["params"]]
    sharded = any(hasattr(p, "to_local") for p in params)  # FSDP2's DTensors: fused SGD has no sharding rule for them
    fused = all(p.device.type in ("cpu", "cuda") for p in params) and not (sharded and cfg.name == "sgd")
    impl = {"fused": True} if fused else {"foreach": True}
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **impl)
    raise UsageError(f"optimizer must be 'adamw', 'sgd' or 'muon', got {cfg.name!r}")


def _build_muon(groups: list[dict], muon: set[str], cfg: OptimConfig) -> Muon:
    """Each weight-decay / LR-scale group split in two: its Muon matrices and its AdamW rest."""
    split = []
    for g in groups:
        for use in (True, False):
            params = [p for n, p in zip(g["names"], g["params"]) if (n in muon) == use]
            if any(hasattr(p, "to_local") for p in params):
                raise UsageError("optim.name=muon orthogonalises whole matrices: not with FSDP2's sharded parameters "
                                 "(use run.strategy=ddp, or optim.name=adamw)")
            if params:
                split.append({**{k: v for k, v in g.items() if k not in ("params", "names")}, "params": params,
                              "muon": use})
    return Muon(split, lr=cfg.lr, betas=tuple(cfg.betas), momentum=cfg.muon_momentum)


def lr_factor(step: int, total: int, warmup: int, decay: str, min_ratio: float) -> float:
    """The LR multiplier at an optimizer step."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "cosine":
        f = 0.5 * (1 + math.cos(math.pi * t))
    elif decay == "linear":
        f = 1 - t
    else:
        raise UsageError(f"decay must be 'cosine', 'linear' or 'constant', got {decay!r}")
    return min_ratio + (1 - min_ratio) * f


def set_lr(opt: torch.optim.Optimizer, base_lr: float, factor: float) -> float:
    for g in opt.param_groups:
        g["lr"] = base_lr * factor * g.get("lr_scale", 1.0)
    return base_lr * factor


def schedule_steps(cfg: ScheduleConfig, steps_per_epoch: int) -> tuple[int, int]:
    return max(1, round(cfg.epochs * steps_per_epoch)), round(cfg.warmup_epochs * steps_per_epoch)
