"""`vitkit.load`, `vitkit.save`, export and conversion: format detection, config inference, strict key checks."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models import ResNetV2Config, ViTConfig, build_model
from ..models.layers.patch_embed import to_2tuple
from ..models.registry import config_with
from . import hf, official, timm, torchvision
from .infer import infer_resnetv2_config, infer_vit_config
from .io import CheckpointError, read_hf_dir, read_npz, read_safetensors, read_torch, sniff

FORMATS = ("vitkit", "timm", "hf", "npz")
NATIVE_FORMAT = "vitkit"
NATIVE_VERSION = "1"


# State-dict formats in the order they are tried: (name, detector on the key set, converter to vitkit names).
STATE_DICT_FORMATS = (
    ("hf", hf.is_hf, hf.to_vitkit),
    ("torchvision", torchvision.is_torchvision, torchvision.to_vitkit),
    ("timm-vit", timm.is_timm_vit, timm.vit_to_vitkit),
    ("timm-resnetv2", timm.is_timm_resnetv2, timm.resnetv2_to_vitkit),
    ("official-npz", official.is_official, official.to_vitkit),
)


@dataclass
class Checkpoint:
    """What a file holds, in vitkit's terms."""

    path: Path
    format: str  # "vitkit", "official-npz", "timm-vit", "timm-resnetv2", "hf", "torchvision", "vitkit-state-dict"
    config: ViTConfig | ResNetV2Config
    state_dict: dict[str, torch.Tensor]
    unused: list[str] = field(default_factory=list)


def _config_from_dict(d: dict) -> ViTConfig | ResNetV2Config:
    d = dict(d)
    arch = d.pop("arch", "vit")
    cls = ViTConfig if arch == "vit" else ResNetV2Config
    try:
        return cls(**d)
    except TypeError as e:
        raise CheckpointError(f"the checkpoint's config does not fit this vitkit version: {e}") from e


def read_checkpoint(path: str | Path, **hints) -> Checkpoint:
    """Read any supported checkpoint into vitkit names and infer its architecture.

    Args:
        path: an official .npz, a timm/torchvision/vitkit state dict (.safetensors, .pth, .bin), or a HF folder.
        **hints: config fields the format cannot encode (num_heads, img_size, ...); they also override.
    """
    path = Path(path).expanduser()
    kind = sniff(path)
    facts: dict = {}
    meta: dict[str, str] = {}
    if kind == "dir":
        raw, hf_config = read_hf_dir(path)
        if not hf.is_hf(raw):
            raise CheckpointError(f"{path}: a folder with config.json but no Hugging Face ViT weights")
        sd, facts, unused = hf.to_vitkit(raw, hf_config)
        fmt = "hf"
    elif kind == "npz":
        raw = read_npz(path)
        if not official.is_official(raw):
            raise CheckpointError(f"{path}: an .npz without 'embedding/kernel': not an official ViT checkpoint "
                                  f"(keys: {sorted(raw)[:6]} ...)")
        sd, facts, unused = official.to_vitkit(raw)
        fmt = "official-npz"
    else:
        raw, meta = read_safetensors(path) if kind == "safetensors" else (read_torch(path), {})
        if meta.get("format") == NATIVE_FORMAT:
            config = _config_from_dict(json.loads(meta["config"]))
            if hints:
                config = config_with(config, **{k: v for k, v in hints.items() if k != "img_size"})
            return Checkpoint(path, "vitkit", config, raw, [])
        if "vitkit_config" in meta:  # an export of ours in a peer's format: the config rides along
            facts = {k: v for k, v in json.loads(meta["vitkit_config"]).items() if k != "arch"}
        keys = set(raw)
        match = next(((fmt, convert) for fmt, detect, convert in STATE_DICT_FORMATS if detect(keys)), None)
        if match is None:
            raise CheckpointError(f"{path}: not a ViT or BiT checkpoint vitkit recognises (first keys: {sorted(keys)[:6]})")
        fmt, convert = match
        if fmt == "timm-vit" and {"pos_embed.weight", "pos_embed.row"} & keys:
            fmt = "vitkit-state-dict"  # vitkit's own names: a model.state_dict() saved by hand
        sd, f, unused = convert(raw)
        facts = {**f, **facts}
    facts = {**facts, **hints}
    if "stem.conv.weight" in sd and "patch_embed.proj.weight" not in sd:
        config = infer_resnetv2_config(sd, facts)
    elif "patch_embed.proj.weight" in sd:
        config = infer_vit_config(sd, facts)
    else:
        raise CheckpointError(f"{path}: no patch embedding or stem found")
    return Checkpoint(path, fmt, config, sd, unused)


def load_state(model: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> dict[str, list[str]]:
    """Copy tensors into the model; strict: every key must match by name and shape, else a CheckpointError lists them."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in sd)
    unexpected = sorted(k for k in sd if k not in own)
    mismatched = sorted(f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                        for k in own if k in sd and sd[k].shape != own[k].shape)
    report = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    if strict and (missing or unexpected or mismatched):
        lines = [f"  {name} ({len(v)}): {', '.join(v[:12])}{' ...' if len(v) > 12 else ''}" for name, v in report.items() if v]
        raise CheckpointError("the checkpoint does not fit the model (strict=True):\n" + "\n".join(lines))
    fits = {k: v for k, v in sd.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(fits, strict=False)
    return report


def load(
    path_or_name: str | Path,
    *,
    strict: bool = True,
    resample: str = "bilinear",
    device: str | torch.device = "cpu",
    **overrides,
) -> nn.Module:
    """Load a model from any supported checkpoint, or a name from the pretrained catalog.

    The architecture is inferred from the tensors; overrides supply what the format cannot encode
    (e.g. num_heads for a timm state dict) and change what may change after loading.

    Args:
        path_or_name: a checkpoint file or HF folder, or a catalog name (see `vitkit.checkpoints.catalog`).
        strict: every tensor must match the model; with False, what was skipped is reported in
            `model.load_report` (and printed).
        resample: position-embedding resampling when img_size changes: "bilinear" (the official
            method, scipy zoom order 1) or "bicubic" (timm's).
        device: where to put the model.
        **overrides: config fields by keyword, as for `create_model`. img_size resamples the position
            embedding; num_classes different from the checkpoint's gives a new zero-initialised head.
    """
    from .catalog import resolve

    path = resolve(path_or_name)
    img_size = overrides.get("img_size")
    num_classes = overrides.pop("num_classes", None)
    class_names = overrides.pop("class_names", None)
    ckpt = read_checkpoint(path, **overrides)
    model = build_model(ckpt.config)
    report = load_state(model, ckpt.state_dict, strict)
    report["unused"] = ckpt.unused
    report["format"] = ckpt.format
    if not strict and any(report[k] for k in ("missing", "unexpected", "mismatched")):
        print(f"vitkit: loaded {path} with strict=False; skipped: " +
              "; ".join(f"{k}: {', '.join(report[k])}" for k in ("missing", "unexpected", "mismatched") if report[k]))
    if img_size is not None and to_2tuple(img_size) != tuple(model.config.img_size):
        if hasattr(model, "set_img_size"):  # a ViT: the position embedding is resampled
            model.set_img_size(img_size, method=resample)
        else:  # a CNN takes any size: only the recorded preprocessing changes
            model.config.img_size = to_2tuple(img_size)
    if num_classes is not None and num_classes != model.config.num_classes:
        model.reset_classifier(num_classes)
    if class_names is not None:
        model.config.class_names = list(class_names)
    model.load_report = report
    return model.to(device).eval()


def _atomic_write(path: Path, write) -> None:
    """Write via a temporary file in the same folder, then rename: a failed write leaves the old file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous().clone()
            for k, v in model.state_dict().items()}


def save(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Save in vitkit's format: one .safetensors whose metadata holds the config (architecture,
    preprocessing: mean, std, resolution, interpolation; class names), so loading needs nothing else."""
    from safetensors.torch import save_file

    path = Path(path)
    meta = {"format": NATIVE_FORMAT, "version": NATIVE_VERSION, "config": json.dumps(model.config.to_dict())}
    meta.update(metadata or {})
    tensors = _tensors(model)
    _atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))
    return path


def export(model: nn.Module, path: str | Path, to: str = "vitkit") -> Path:
    """Write a model in a peer's format.

    Args:
        to: "vitkit" (.safetensors with config), "timm" (state dict .safetensors or .pth),
            "hf" (a folder: config.json + model.safetensors), "npz" (the official format).
    """
    from safetensors.torch import save_file

    path, c, sd = Path(path), model.config, _tensors(model)
    if to == "vitkit":
        return save(model, path)
    if to == "timm":
        out = timm.vit_from_vitkit(sd, c) if c.arch == "vit" else timm.resnetv2_from_vitkit(sd, c)
        meta = {"format": "pt", "vitkit_config": json.dumps(c.to_dict())}
        if path.suffix in (".pth", ".pt", ".bin"):
            _atomic_write(path, lambda p: torch.save(out, p))
        else:
            _atomic_write(path, lambda p: save_file(out, str(p), metadata=meta))
        return path
    if c.arch != "vit":
        raise CheckpointError(f"a {c.arch} model exports to 'vitkit' or 'timm' only, not {to!r}")
    if to == "hf":
        out, hf_config = hf.from_vitkit(sd, c)
        path.mkdir(parents=True, exist_ok=True)
        _atomic_write(path / "model.safetensors", lambda p: save_file(out, str(p), metadata={"format": "pt"}))
        (path / "config.json").write_text(json.dumps(hf_config, indent=2))
        return path
    if to == "npz":
        out = official.from_vitkit(sd, c)
        arrays = {k: v.numpy() for k, v in out.items()}
        _atomic_write(path, lambda p: np.savez(open(p, "wb"), **arrays))
        return path
    raise ValueError(f"unknown export format {to!r}; choose one of {FORMATS}")


def convert(src: str | Path, dst: str | Path, to: str = "vitkit", **overrides) -> Path:
    """Load any supported checkpoint and write it in another format (`to`: vitkit, timm, hf, npz)."""
    return export(load(src, **overrides), dst, to)


def inspect_checkpoint(path: str | Path, **hints) -> dict:
    """Format, inferred config, parameter count and the keys left unused, without building more than needed."""
    ckpt = read_checkpoint(path, **hints)
    with torch.device("meta"):
        model = build_model(ckpt.config)
    own = model.state_dict()
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "config": ckpt.config.to_dict(),
        "params": sum(v.numel() for k, v in ckpt.state_dict.items() if k in own),
        "unused": ckpt.unused + sorted(k for k in ckpt.state_dict if k not in own),
        "missing": sorted(k for k in own if k not in ckpt.state_dict),
    }
