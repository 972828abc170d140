"""`vitkit.load`, `vitkit.save`, export and conversion: format detection, config inference, strict key checks."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..models import ResNetV2Config, SamViTConfig, SwinConfig, ViTConfig, build_model
from ..models.layers.patch_embed import to_2tuple
from ..models.lora import merged_state_dict
from ..models.registry import config_with
from . import bit, hf, hf_backbones, hf_vision, mobileclip, official, swin, timm, timm_beit, timm_sam, torchvision
from .infer import infer_resnetv2_config, infer_vit_config
from .swin import infer_swin_config
from .io import CheckpointError, read_hf_dir, read_meta, read_npz, read_safetensors, read_torch, sniff
from ..cache import atomic_write, check_output
from ..errors import UsageError
from ..safety import parse_json, read_bytes, untrusted
from .catalog import resolve
import safetensors.torch

log = logging.getLogger(__name__)

FORMATS = ("vitkit", "timm", "hf", "npz")
NATIVE_FORMAT = "vitkit"
NATIVE_VERSION = "1"


# ---- the format registry: every layout vitkit reads (and the ones it writes), in the order they are recognised ----

@dataclass(frozen=True)
class Format:
    """One checkpoint layout: how it is recognised (`detect`), read into vitkit's names (`read`), what a hub folder
    states beside its tensors (`facts`) and, where vitkit exports it, how it is written (`write`)."""

    name: str  # `Checkpoint.format` of what it reads
    detect: Callable[[dict, dict | None], bool]  # (tensors, config.json; None for a bare file) -> this layout's
    read: Callable[[dict, dict | None], tuple[dict, dict, list[str]]]  # -> (vitkit state dict, facts, unused keys)
    containers: tuple[str, ...] = ("file", "folder")  # a bare state dict, a hub folder, an .npz
    bare_name: str | None = None  # the name of a bare state dict in this layout, where not `name`
    facts: Callable[[Path, dict], dict] | None = None  # a folder's facts (config.json, preprocessing), over the tensors'
    bare_defaults: dict = field(default_factory=dict)  # facts a bare state dict has where its reader sets none
    # writing: the export format (`to`) writing it, for the models it `holds` (the first entry that holds one wins)
    target: str | None = None
    holds: Callable[[object], bool] | None = None
    write: Callable[[dict, object], tuple[dict, dict | None]] | None = None  # (tensors, config) -> (tensors, config.json)
    folder_config: Callable[[object], dict] | None = None  # a timm folder's config.json
    readback: Callable[[dict, dict | None, object], tuple[dict, dict, list[str]]] | None = None  # default: read
    own_qv_bias: bool = False  # written from the model's own q_bias / v_bias (not fused into (q, 0, v))
    label: str = ""  # what export's refusals call it
    family: str | None = None  # transformers' family (`hf_family`)
    table: Callable[[dict, dict | None], tuple] | None = None  # its `layouts` table: (Layout, flags, ctx)


def _hf_folder_facts(path: Path, hub_config: dict) -> dict:
    """What a transformers folder's preprocessor_config.json records (mean, std, interpolation, crop)."""
    pre = path / hf.PREPROCESSOR_FILE
    return hf.preprocessing_facts(_json_file(pre)) if pre.exists() else {}


def _timm(detect_keys: Callable) -> Callable[[dict, dict | None], bool]:
    """A timm layout's detector: its keys, and in a folder timm's config.json."""
    return lambda raw, cfg: (cfg is None or timm.is_timm_folder(cfg)) and detect_keys(set(raw))


def _keys(detect_keys: Callable) -> Callable[[dict, dict | None], bool]:
    return lambda raw, cfg: detect_keys(set(raw))


def _hf_format(module, fam: str, bare_name: str, holds: Callable) -> Format:
    """A transformers family of `module` (hf_vision, hf_backbones): a folder `hf-{fam}`, a bare file `bare_name`."""
    return Format(f"hf-{fam}", lambda raw, cfg: module.family(raw, cfg) == fam, module.to_vitkit, bare_name=bare_name,
                  facts=_hf_folder_facts, target="hf", holds=holds, label=f"a Hugging Face {fam} folder",
                  write=lambda sd, c: module.from_vitkit(sd, c, fam), family=fam, table=module.table,
                  own_qv_bias=module is hf_backbones)


def _timm_folder_unknown(raw: dict, cfg: dict | None):
    raise CheckpointError(f"a timm folder ({cfg['architecture']}) that is not a ViT or BiT vitkit recognises "
                          f"(first keys: {sorted(raw)[:6]})")


_TIMM_FOLDER = dict(facts=lambda path, cfg: timm.folder_facts(cfg), folder_config=timm.folder_config, target="timm")
_TIMM_BICUBIC = {"pos_resample": "bicubic"}  # timm's resample_abs_pos_embed: antialiased bicubic
REGISTRY: tuple[Format, ...] = (
    Format("hf-swin", _keys(swin.is_hf_swin), swin.hf_to_vitkit, facts=_hf_folder_facts),
    Format("swin-official", _keys(lambda k: swin.is_swin(k) and any(x.startswith("layers.0.downsample.") for x in k)),
           lambda raw, cfg: swin.to_vitkit(raw), containers=("file",)),  # microsoft/Swin-Transformer's layout
    Format("timm-swin", _timm(swin.is_swin), lambda raw, cfg: swin.to_vitkit(raw),
           facts=lambda path, cfg: swin.folder_facts(cfg), target="timm", holds=lambda c: c.arch == "swin",
           write=lambda sd, c: (swin.from_vitkit(sd), None), folder_config=swin.folder_config, label="a timm Swin"),
    # timm's SAM image encoder (also SAM's own release files: the image encoder read, the rest left unused)
    Format("timm-sam", _timm(timm_sam.is_timm_sam), lambda raw, cfg: timm_sam.to_vitkit(raw),
           facts=lambda path, cfg: timm_sam.folder_facts(cfg, timm.timm_args(cfg)[1]), target="timm",
           holds=lambda c: c.arch == "samvit", write=lambda sd, c: (timm_sam.from_vitkit(sd, c), None),
           folder_config=timm_sam.folder_config, label="a timm SAM ViT"),
    _hf_format(hf_backbones, "dinov3", "hf-backbones", holds=lambda c: c.rope == "dinov3"),
    _hf_format(hf_backbones, "aimv2", "hf-backbones", holds=lambda c: c.norm == "rmsnorm"),
    _hf_format(hf_vision, "siglip", "hf-vision", holds=lambda c: c.classifier == "map"),
    _hf_format(hf_vision, "clip", "hf-vision", holds=lambda c: c.pre_norm),
    _hf_format(hf_vision, "dinov2", "hf-vision",
               holds=lambda c: c.init_values is not None or c.reg_tokens or c.mlp_layer == "swiglu"),
    _hf_format(hf_vision, "siglip2", "hf-vision", holds=lambda c: False),
    Format("hf", lambda raw, cfg: hf.is_hf(raw), hf.to_vitkit, facts=_hf_folder_facts, target="hf",
           holds=lambda c: True, write=hf.from_vitkit, label="a Hugging Face ViT folder", table=hf.table),
    Format("torchvision", _keys(torchvision.is_torchvision), lambda raw, cfg: torchvision.to_vitkit(raw),
           containers=("file",)),
    Format("timm-naflex", _timm(timm.is_timm_naflex), lambda raw, cfg: timm.naflex_to_vitkit(raw), **_TIMM_FOLDER,
           holds=lambda c: getattr(c, "naflex", False), write=lambda sd, c: (timm.naflex_from_vitkit(sd, c), None),
           readback=lambda out, cfg, c: timm.naflex_to_vitkit(out, c.in_chans), label="a timm NaFlexVit"),
    # Apple's MobileCLIP release (the whole CLIP model): its image tower, timm's vit_base_mci_224
    Format("mobileclip-release", _keys(mobileclip.is_release), lambda raw, cfg: mobileclip.to_vitkit(raw),
           containers=("file",)),
    Format("dinov3-release", _keys(timm.is_dinov3_release), lambda raw, cfg: timm.dinov3_release_to_vitkit(raw),
           containers=("file",)),
    # vitkit's own names: a model.state_dict() saved by hand
    Format("vitkit-state-dict", _keys(lambda k: timm.is_timm_vit(k) and bool({"pos_embed.weight", "pos_embed.row"} & k)),
           lambda raw, cfg: timm.vit_to_vitkit(raw), containers=("file",)),
    # DINOv2's own hub files (facebookresearch/dinov2), which timm converts the same way
    Format("dinov2-release", _keys(lambda k: timm.is_timm_vit(k) and "mask_token" in k),
           lambda raw, cfg: timm.vit_to_vitkit(raw), containers=("file",), bare_defaults=_TIMM_BICUBIC),
    Format("timm-vit", _timm(timm.is_timm_vit), lambda raw, cfg: timm.vit_to_vitkit(raw), **_TIMM_FOLDER,
           bare_defaults=_TIMM_BICUBIC, holds=lambda c: c.arch == "vit",
           write=lambda sd, c: (timm.vit_from_vitkit(sd, c), None), label="a timm"),
    Format("timm-resnetv2", _timm(timm.is_timm_resnetv2), lambda raw, cfg: timm.resnetv2_to_vitkit(raw),
           **_TIMM_FOLDER, holds=lambda c: c.arch == "resnetv2",
           write=lambda sd, c: (timm.resnetv2_from_vitkit(sd, c), None), label="a timm"),
    # a timm folder of none of the layouts above: what its architecture is, or why vitkit refuses it, first
    Format("timm", lambda raw, cfg: cfg is not None and timm.is_timm_folder(cfg), _timm_folder_unknown,
           containers=("folder",), facts=lambda path, cfg: timm.folder_facts(cfg)),
    Format("official-npz", _keys(official.is_official), lambda raw, cfg: official.to_vitkit(raw),
           containers=("file", "npz"), target="npz", holds=lambda c: c.arch == "vit",
           write=lambda sd, c: (official.from_vitkit(sd, c), None), label="the official .npz format"),
    Format("bit-npz", _keys(bit.is_bit_npz), lambda raw, cfg: bit.to_vitkit(raw), containers=("npz",)),
)


def _recognise(container: str, raw: dict, hub_config: dict | None = None) -> Format | None:
    """The first format of the registry that reads these tensors (and config.json) in this container."""
    return next((f for f in REGISTRY if container in f.containers and f.detect(raw, hub_config)), None)


def _writer(to: str, c) -> Format:
    """The first format of the registry written as `to` that holds this model."""
    fmt = next((f for f in REGISTRY if f.target == to and f.holds(c)), None)
    if fmt is None:
        raise CheckpointError(f"no {to!r} format holds a {c.arch} model")
    return fmt


@dataclass
class Checkpoint:
    """What a file holds, in vitkit's terms."""

    path: Path
    format: str  # "vitkit", "official-npz", "timm-vit", "timm-resnetv2", "hf", "torchvision", "vitkit-state-dict"
    config: ViTConfig | ResNetV2Config
    state_dict: dict[str, torch.Tensor]
    unused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the reader left out on purpose, in words


def config_from_dict(d: dict) -> ViTConfig | ResNetV2Config:
    if not isinstance(d, dict):
        raise CheckpointError(f"the checkpoint's config is not a mapping ({type(d).__name__})")
    d = dict(d)
    arch = d.pop("arch", "vit")
    cls = {"vit": ViTConfig, "resnetv2": ResNetV2Config, "swin": SwinConfig, "samvit": SamViTConfig}.get(arch)
    if cls is None:
        raise CheckpointError(f"the checkpoint's architecture {arch!r} is not one this vitkit version knows")
    try:
        return cls(**d)
    except TypeError as e:
        raise CheckpointError(f"the checkpoint's config does not fit this vitkit version: {e}") from e


def read_checkpoint(path: str | Path, *, img_size_if_unknown=None, **hints) -> Checkpoint:
    """Read any supported checkpoint into vitkit names and infer its architecture; any failure to read it is a
    CheckpointError naming the file (`vitkit.safety.untrusted`). See `_read_checkpoint` for the arguments."""
    path = Path(path).expanduser()
    with untrusted(str(path)):
        return _read_checkpoint(path, img_size_if_unknown=img_size_if_unknown, **hints)


def _read_checkpoint(path: Path, *, img_size_if_unknown=None, **hints) -> Checkpoint:
    """Read any supported checkpoint into vitkit names and infer its architecture.

    Args:
        path: an official or BiT .npz, a timm/torchvision/vitkit state dict (.safetensors, .pth, .bin), or a
            Hugging Face or timm hub folder.
        img_size_if_unknown: a resolution taken as the checkpoint's own only where nothing else can tell its grid
            (see `infer_vit_config`); `vitkit.load` passes the resolution it is asked for.
        **hints: config fields the format cannot encode (num_heads, the checkpoint's own img_size, ...); they
            also override what the file states.
    """
    kind = sniff(path)
    facts: dict = {}
    meta: dict[str, str] = {}
    architecture = hints.pop("architecture", None)
    if kind == "dir" and (path / ".metadata").exists() and (path / "meta.json").exists():
        return _read_run_checkpoint(path, hints)
    if kind == "dir" and not (path / "config.json").exists() and (path / "config.yaml").exists():
        weights = [f.name for f in (path / "best.safetensors", path / "final.safetensors") if f.exists()]
        raise CheckpointError(f"{path} is a training run's folder, not a checkpoint: load "
                              + (" or ".join(str(path / w) for w in weights) if weights else "its best.safetensors once the run has written it")
                              + " (best: the best evaluation so far; final: the last weights)")
    if kind == "dir":
        raw, hub_config = read_hf_dir(path)
        fmt, sd, facts, unused = _convert_folder(path, unwrap_state_dict(raw), hub_config)
    elif kind == "npz":
        raw = read_npz(path)
        if (npz := _recognise("npz", raw)) is not None:
            fmt, (sd, facts, unused) = npz.name, npz.read(raw, None)
        else:
            raise CheckpointError(f"{path}: an .npz without 'embedding/kernel' or 'resnet/root_block/...': neither an "
                                  f"official ViT nor a BiT checkpoint (keys: {sorted(raw)[:6]} ...)")
    else:
        raw, meta = read_safetensors(path) if kind == "safetensors" else (read_torch(path), {})
        if meta.get("format") == NATIVE_FORMAT:
            config = config_from_dict(parse_json(meta["config"], f"{path} (metadata 'config')", CheckpointError))
            if hints:
                config = config_with(config, **{k: v for k, v in hints.items() if k != "img_size"})
            return Checkpoint(path, "vitkit", config, raw, [])
        if "vitkit_config" in meta:  # files written by vitkit 0.1's timm export carried the config along
            old = parse_json(meta["vitkit_config"], f"{path} (metadata 'vitkit_config')", CheckpointError)
            facts = {k: v for k, v in (old if isinstance(old, dict) else {}).items() if k != "arch"}
        raw = unwrap_state_dict(raw)
        bare = _recognise("file", raw)
        if bare is None:
            raise CheckpointError(f"{path}: not a ViT or BiT checkpoint vitkit recognises (first keys: {sorted(raw)[:6]})")
        fmt = bare.bare_name or bare.name
        sd, f, unused = bare.read(raw, None)
        facts = {**bare.bare_defaults, **f, **facts}
        if architecture is not None:  # a bare timm state dict named by its timm architecture, as timm users load it
            if not fmt.startswith("timm"):
                raise UsageError(f"architecture={architecture!r} names a timm architecture; {path} is a {fmt} file")
            facts = {**facts, **timm.architecture_facts(architecture)}
            timm.check_architecture_sizes(architecture, sd, hints)
        elif fmt == "timm-vit" and not {"pos_embed.weight", "pos_embed.row", "blocks.0.attn.rel_pos.table",
                                        "rope.freqs", "blocks.0.attn.rel_pos.mlp.fc1.weight",
                                        "shared_rel_pos.mlp.fc1.weight"} & set(sd) \
                and "rope" not in {**facts, **hints} and "pos_embed" not in hints:
            raise CheckpointError(
                f"{path}: a timm state dict with no position embedding: its positions are a rotary embedding the file "
                f"does not record (DINOv3, ROPE-ViT, the Perception Encoder, timm's ROPE ViTs). Name the architecture "
                f"as timm does, architecture='vit_base_patch16_dinov3' say, or give rope=... (pos_embed='none': "
                f"a model without positions)")
        elif facts.get("pos_embed") == "relative_mlp" and "blocks.0.ls1.gamma" not in sd \
                and "res_post_norm" not in hints:
            # timm's ViT-RelPos without LayerScale: its _rpn_ models (post-norm blocks, the same names) or a pre-norm
            # one built with init_values=None; every registered pre-norm one has LayerScale
            raise CheckpointError(
                f"{path}: a timm ViT-RelPos state dict without LayerScale: the residual post-norm blocks of timm's "
                f"vit_relpos_*_rpn_* models have the same names as pre-norm ones. Name the architecture as timm does "
                f"(architecture='vit_relpos_small_patch16_rpn_224' say), or give res_post_norm=True or False")
    if architecture is not None and kind in ("dir", "npz"):
        raise UsageError(f"architecture={architecture!r} is for a bare timm state dict; {path} records its own")
    notes = facts.pop("notes", [])
    config = _infer_config(sd, {**facts, **hints}, img_size_if_unknown, what=str(path))
    return Checkpoint(path, fmt, config, sd, unused, notes)


# What training wrappers put before every key: torch.compile's OptimizedModule, DistributedDataParallel/DataParallel.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap_state_dict(sd: dict) -> dict:
    """A state dict saved from a wrapped model (`torch.compile(model).state_dict()`: `_orig_mod.` before every key;
    DDP: `module.`) -> the model's own names. Only a prefix every key carries is removed, as often as it repeats."""
    while sd:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in sd)), None)
        if prefix is None:
            break
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def _convert_folder(path: Path, raw: dict[str, torch.Tensor], hub_config: dict):
    """A Hugging Face or timm hub folder's tensors and config.json -> (format, vitkit state dict, facts, unused)."""
    hf.check_model_type(hub_config)  # a transformers model_type vitkit reads no model of: refused by name
    fmt = _recognise("folder", raw, hub_config)
    if fmt is None:
        raise CheckpointError(f"{path}: a folder with config.json but neither Hugging Face ViT, DINOv2, SigLIP or "
                              f"CLIP nor timm weights")
    if timm.is_timm_folder(hub_config) and timm_beit.is_timm_beit(raw):  # BEiT tensors: a Beit's config.json only
        arch, (cls, args) = hub_config.get("architecture"), timm.timm_args(hub_config)
        if cls not in (None, "Beit") or (cls is None and not str(arch).startswith("beit")):
            raise CheckpointError(f"{path}: BEiT tensors (relative position tables) with config.json's architecture "
                                  f"{arch!r} (timm's {cls or 'unknown class'}): the tensors are not that model's")
        if bad := sorted({"block_fn", "use_post_norm"} & set(args)):
            raise CheckpointError(f"{path}: BEiT tensors with config.json's {arch!r} model_args {', '.join(bad)}, "
                                  f"arguments timm's Beit does not take")
    stated = fmt.facts(path, hub_config) if fmt.facts else {}  # what the folder states, or why it is refused, first
    sd, facts, unused = fmt.read(raw, hub_config)
    if timm.is_timm_folder(hub_config):  # timm builds the patch conv its config.json says, and refuses another file
        patch, w = timm.timm_args(hub_config)[1].get("patch_size"), sd.get("patch_embed.proj.weight")
        plain = w is not None and w.ndim == 4 and not any(k.startswith("patch_embed.backbone.") for k in sd)
        if plain and isinstance(patch, (int, list, tuple)) and tuple(w.shape[-2:]) != timm.pair(patch):
            raise CheckpointError(f"{path}: config.json's patch_size {patch} but the patch embedding's kernel is "
                                  f"{tuple(w.shape[-2:])}: the tensors are not that model's")
    return fmt.name, sd, {**facts, **stated}, unused


def describe_folder(raw: dict[str, torch.Tensor], hub_config: dict, what: str = "the folder"):
    """The vitkit config a hub folder with these tensors and this config.json describes (the tensors may be on the
    meta device: only names and shapes are read), and its state dict in vitkit names."""
    with untrusted(what):
        fmt, sd, facts, unused = _convert_folder(Path(what), raw, hub_config)
        facts.pop("notes", None)
        return _infer_config(sd, facts, what=what), sd


def _json_file(path: Path) -> dict:
    d = parse_json(read_bytes(path, error=CheckpointError), str(path), CheckpointError)
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return d


def _read_run_checkpoint(path: Path, hints: dict) -> Checkpoint:
    """A training run's sharded checkpoint (torch.distributed.checkpoint, `vitkit.checkpoints.run`): the
    weights it would be used with for inference, the EMA's if the run kept one, gathered into one state dict."""
    from .run import load_model_weights  # start-up time: torch.distributed.checkpoint imports DTensor (~0.6 s)

    meta = read_meta(path)
    config = config_from_dict(meta["model_config"])
    if hints:
        config = config_with(config, **{k: v for k, v in hints.items() if k != "img_size"})
    with torch.device("cpu"):
        model = build_model(config)
    key = "ema" if (meta.get("config", {}).get("run", {}).get("ema")) else "model"
    load_model_weights(path, model, key)
    return Checkpoint(path, "vitkit-run-checkpoint", config, model.state_dict(), [])


def _infer_config(sd: dict[str, torch.Tensor], facts: dict, img_size_if_unknown=None, what: str = "the checkpoint"):
    if "layers.0.blocks.0.attn.relative_position_bias_table" in sd:
        return infer_swin_config(sd, facts)
    if any(k.startswith("neck.") for k in sd):  # SAM's image encoder: its neck (or the norm in its place)
        return timm_sam.infer_config(sd, facts, img_size_if_unknown)
    if "stem.conv.weight" in sd and "patch_embed.proj.weight" not in sd:
        return infer_resnetv2_config(sd, facts)
    if "patch_embed.proj.weight" in sd:
        return infer_vit_config(sd, facts, img_size_if_unknown)
    raise CheckpointError(f"{what}: no patch embedding or stem found")


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
        stats = [k for k in missing + unexpected if k.endswith(".running_var") and
                 k.startswith(("patch_embed.backbone.stem.", "patch_embed.backbone.stages."))]
        if stats:  # the hybrid's norm kind: BatchNorm has running statistics, GroupNorm none
            lines.append(f"  the hybrid's ResNet has {'BatchNorm' if stats[0] in unexpected else 'GroupNorm'} in the "
                         f"checkpoint and {'GroupNorm' if stats[0] in unexpected else 'BatchNorm'} in the model: set "
                         f"hybrid_norm={'batch' if stats[0] in unexpected else 'group'} (a preset's "
                         f"`model.overrides.hybrid_norm=...`)")
        raise CheckpointError("the checkpoint does not fit the model (strict=True):\n" + "\n".join(lines))
    fits = {k: v for k, v in sd.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(fits, strict=False)
    return report


def load(
    path_or_name: str | Path,
    *,
    strict: bool = True,
    resample: str | None = None,
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
        resample: position-embedding resampling when img_size changes: "bilinear" (the official method, scipy zoom
            order 1), "bicubic" (timm's: antialiased), "bicubic_noaa" (transformers' ViT, DeiT, DINOv2, SigLIP, CLIP)
            or "bilinear_aa" ("bilinear_noaa": transformers' BEiT's relative table; "geometric": timm's BEiT's, a relative
            table only); default: the checkpoint's own, recorded at load in `config.pos_resample` (a file
            vitkit wrote keeps the method of the checkpoint it came from).
        device: where to put the model.
        **overrides: config fields by keyword, as for `create_model`. img_size different from the checkpoint's
            (any change of the patch grid's shape) resamples the position embedding; num_classes different from
            the checkpoint's gives a new zero-initialised head.
    """
    path = resolve(path_or_name)
    img_size = overrides.pop("img_size", None)
    window_size = overrides.pop("window_size", None)  # a Swin's windows, laid out anew after loading
    num_classes = overrides.pop("num_classes", None)
    class_names = overrides.pop("class_names", None)
    ckpt = read_checkpoint(path, img_size_if_unknown=img_size, **overrides)
    with untrusted(str(path)):
        model = build_model(ckpt.config)
        report = load_state(model, ckpt.state_dict, strict)
    report["unused"] = ckpt.unused
    report["notes"] = ckpt.notes
    report["format"] = ckpt.format
    if not strict and any(report[k] for k in ("missing", "unexpected", "mismatched")):
        log.warning(f"loaded {path} with strict=False; skipped: " +
                    "; ".join(f"{k}: {', '.join(report[k])}" for k in ("missing", "unexpected", "mismatched") if report[k]))
    if window_size is not None and model.config.arch != "swin":
        raise UsageError(f"window_size is a Swin option; this checkpoint is a {model.config.arch} model")
    if window_size is not None and window_size != model.config.window_size:
        model.set_img_size(img_size or model.config.img_size, method=_swin_method(resample), window_size=window_size)
    elif img_size is not None and to_2tuple(img_size) != tuple(model.config.img_size):
        if model.config.arch == "swin":  # the windows laid out anew, tables resampled where a window changes
            model.set_img_size(img_size, method=_swin_method(resample))
        elif hasattr(model, "set_img_size"):  # a ViT: the position embedding is resampled
            model.set_img_size(img_size, method=resample)
        else:  # a CNN takes any size: only the recorded preprocessing changes
            model.config.img_size = to_2tuple(img_size)
    if num_classes is not None and num_classes != model.config.num_classes:
        model.reset_classifier(num_classes)
    if class_names is not None:
        model.config.class_names = list(class_names)
    model.load_report = report
    return model.to(device).eval()


DATA_CONFIG_KEYS = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")


def resolve_data_config(source=None, pretrained_cfg: dict | None = None, model: nn.Module | None = None,
                        use_test_size: bool = False, verbose: bool = False) -> dict:
    """The preprocessing a model or checkpoint expects, as timm's `timm.data.resolve_data_config` returns it:
    {input_size: (C, H, W), interpolation, mean, std, crop_pct, crop_mode}; `vitkit.create_transform(**it)` is the
    transform. Reads the config alone: a checkpoint is not built.

    Args:
        source: a vitkit model, a checkpoint (a path or catalog name, as `vitkit.load` takes: downloaded if need be,
            not built), or timm's `args`: a dict whose input_size / img_size, interpolation, mean, std, crop_pct,
            crop_mode (not None) go over the model's, as timm's do.
        pretrained_cfg, model: timm's keywords: a timm-style record (`model.pretrained_cfg`), or the model.
        use_test_size, verbose: accepted for timm's signature; vitkit's configs have one size.
    """
    args = source if isinstance(source, dict) else {}
    if source is not None and not isinstance(source, dict):
        if model is not None:
            raise UsageError("resolve_data_config: a model or checkpoint once (source or model=)")
        model = source
    if isinstance(model, (str, Path)):
        c = read_checkpoint(resolve(model)).config
        cfg = {"input_size": (c.in_chans, *to_2tuple(c.img_size)), "interpolation": c.interpolation,
               "mean": tuple(c.mean), "std": tuple(c.std), "crop_pct": c.crop_pct, "crop_mode": "center"}
    elif model is not None:
        if not hasattr(model, "pretrained_cfg"):
            raise UsageError(f"resolve_data_config: {type(model).__name__} is not a vitkit model (no pretrained_cfg)")
        cfg = model.pretrained_cfg
    elif pretrained_cfg is not None:
        cfg = pretrained_cfg
    else:
        raise UsageError("resolve_data_config: give a model, a checkpoint path or name, or pretrained_cfg=")
    out = {k: cfg.get(k) for k in DATA_CONFIG_KEYS}
    out["crop_mode"] = out["crop_mode"] or "center"
    out["input_size"] = tuple(out["input_size"])
    if args.get("input_size") is not None:
        out["input_size"] = tuple(args["input_size"])
    elif args.get("img_size") is not None:
        out["input_size"] = (out["input_size"][0], *to_2tuple(args["img_size"]))
    for k in DATA_CONFIG_KEYS[1:]:
        if args.get(k) is not None:
            out[k] = tuple(args[k]) if k in ("mean", "std") else args[k]
    if verbose:
        log.info("data config: " + ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


def _swin_method(resample: str | None) -> str:
    """A Swin's relative-position tables: PyTorch's plain bicubic unless asked otherwise (timm's and the official)."""
    return "bicubic_noaa" if resample in (None, "bilinear") else resample


def _plain(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with LoRA adapters (`vitkit.models.lora`) merged into its weights: what every format holds."""
    return merged_state_dict(model, sd) if any(k.endswith(".lora_A") for k in sd) else sd


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous().clone()
            for k, v in _plain(model, model.state_dict()).items()}


def save(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None,
         state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Save in vitkit's format: one .safetensors whose metadata holds the config (architecture,
    preprocessing: mean, std, resolution, interpolation; class names), so loading needs nothing else.

    Args:
        state_dict: the tensors to write instead of `model.state_dict()` (a sharded model's, gathered)."""
    path = Path(path)
    meta = {"format": NATIVE_FORMAT, "version": NATIVE_VERSION, "config": json.dumps(model.config.to_dict())}
    meta.update(metadata or {})
    sd = _plain(model, model.state_dict() if state_dict is None else state_dict)
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in sd.items()}
    atomic_write(path, lambda p: safetensors.torch.save_file(tensors, str(p), metadata=meta))
    return path


# Config fields that do not change what the model computes: preprocessing, names, regularisation in training.
_NOT_COMPUTED = {"mean", "std", "interpolation", "crop_pct", "class_names", "drop_rate", "attn_drop_rate", "drop_path_rate",
                 "patch_drop_rate", "dynamic_img_size", "init_values", "k_bias"}
TIMM_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def _check_reads_back(config, sd: dict[str, torch.Tensor], facts: dict, target: str, advice: str = "") -> None:
    """Refuse an export whose file, read as its format is read (the tensors plus what the file itself records),
    describes a model other than `config`: a CheckpointError names every field the format cannot hold."""
    try:
        got = _infer_config(sd, facts)
    except CheckpointError as e:
        # a reader is asked for these by name (a clear error, never a silent guess): fill them in as it would
        askable = {k: getattr(config, k) for k in ("num_heads", "img_size") if hasattr(config, k)}
        try:
            got = _infer_config(sd, {**facts, **askable})
        except CheckpointError:
            raise CheckpointError(f"{target} cannot hold this model: read back, the file does not tell its "
                                  f"architecture ({e}){advice}") from e
    ignore = _NOT_COMPUTED | ({"img_size"} if config.arch != "vit" else set())
    if not getattr(config, "naflex", False):
        # how the grid is resampled at another size: each format's own rule, recorded when the file is read back
        # (`pos_resample`); the model computes the same at its size. NaFlex resamples in every forward.
        ignore = ignore | {"pos_resample", "pos_resample_square"}
    want, have = config.to_dict(), got.to_dict()
    diffs = [f"{k}: {want[k]!r} in the model, {have.get(k)!r} as {target} reads back"
             for k in want if k not in ignore and want[k] != have.get(k)]
    if diffs:
        raise CheckpointError(f"{target} cannot hold this model; written, it would load as a different one:\n  "
                              + "\n  ".join(diffs) + advice)


def export(model: nn.Module, path: str | Path, to: str = "vitkit") -> Path:
    """Write a model in a peer's format. The exported file describes exactly this model, or the export is refused
    with a CheckpointError naming what the format cannot hold (exact GELU in the official format, a class token
    beside average pooling in a timm state dict, ...).

    Args:
        to: "vitkit" (.safetensors with config); "timm": a folder (config.json + model.safetensors, as timm's hub
            holds models: `timm.create_model("local-dir:PATH", pretrained=True)` reads it) for a path without a
            suffix, else a bare state dict (.safetensors or .pth) that timm's defaults must describe; "hf" (a
            folder: config.json + model.safetensors); "npz" (the official format).
    """
    path, c, sd = Path(path), model.config, _tensors(model)
    if to not in FORMATS:
        raise UsageError(f"unknown export format {to!r}; choose one of {FORMATS}")
    if c.arch == "vit" and not c.k_bias and not (to in ("vitkit", "timm") and timm.eva_style(c)):
        sd = _fused_qkv_bias(sd)  # formats with one qkv bias get (q, 0, v)
    if to == "vitkit":
        return save(model, path)
    if c.arch != "vit" and to != "timm":
        raise CheckpointError(f"a {c.arch} model exports to 'vitkit' or 'timm' only, not {to!r}")
    if getattr(c, "conv_stem", None) is not None and to not in ("vitkit", "timm"):  # MobileCLIP's MCi
        raise CheckpointError(f"a ViT on a convolutional stem (conv_stem) exports to 'vitkit' or 'timm' only, not {to!r}")
    fmt = _writer(to, c)
    out, hub_config = fmt.write(_tensors(model) if fmt.own_qv_bias else sd, c)
    back, facts, _ = fmt.readback(out, hub_config, c) if fmt.readback else fmt.read(out, hub_config)
    if to == "timm":
        if path.suffix in TIMM_FILE_SUFFIXES:
            _check_reads_back(c, back, facts, f"{fmt.label} state dict",
                              "\nA timm folder records these: export to a path without a suffix.")
            if path.suffix == ".safetensors":
                atomic_write(path, lambda p: safetensors.torch.save_file(out, str(p), metadata={"format": "pt"}))
            else:
                atomic_write(path, lambda p: torch.save(out, p))
            return path
        hub_config = fmt.folder_config(c)
        _check_reads_back(c, back, {**facts, **fmt.facts(path, hub_config)}, f"{fmt.label} folder")
        for name in ("model.safetensors", "config.json"):  # every file checked before any is written
            check_output(path / name)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / "model.safetensors", lambda p: safetensors.torch.save_file(out, str(p), metadata={"format": "pt"}))
        atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(hub_config, indent=2)))
        return path
    if to == "hf":
        pre = hf.preprocessor_config(c)
        _check_reads_back(c, back, {**facts, **hf.preprocessing_facts(pre)}, fmt.label)
        for name in ("model.safetensors", "config.json", hf.PREPROCESSOR_FILE):  # all checked before any is written
            check_output(path / name)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / "model.safetensors", lambda p: safetensors.torch.save_file(out, str(p), metadata={"format": "pt"}))
        atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(hub_config, indent=2)))
        atomic_write(path / hf.PREPROCESSOR_FILE, lambda p: p.write_text(json.dumps(pre, indent=2)))
        return path
    _check_reads_back(c, back, facts, fmt.label)
    arrays = {k: v.numpy() for k, v in out.items()}
    def write_npz(p: Path) -> None:
        with open(p, "wb") as f:
            np.savez(f, **arrays)

    atomic_write(path, write_npz)
    return path


def hf_family(c) -> str | None:
    """The transformers model class a ViT exports to (the registry's first "hf" format holding it): None
    (ViTForImageClassification, the paper's ViT), 'dinov3' (DINOv3's rotary embedding), 'aimv2' (RMSNorm), 'siglip'
    (attention pooling), 'clip' (a pre-norm), 'dinov2' (LayerScale, registers or SwiGLU)."""
    return _writer("hf", c).family


def _fused_qkv_bias(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A k_bias=False model's `attn.q_bias` and `attn.v_bias` as one `attn.qkv.bias` (q, 0, v)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("attn.q_bias"):
            out[k.replace("attn.q_bias", "attn.qkv.bias")] = torch.cat([v, torch.zeros_like(v), sd[k.replace("q_bias", "v_bias")]])
        elif not k.endswith("attn.v_bias"):
            out[k] = v
    return out


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
        "notes": ckpt.notes,
        "missing": sorted(k for k in own if k not in ckpt.state_dict),
    }
