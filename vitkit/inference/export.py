"""Exporting a model for deployment: ONNX (run by onnxruntime), an OpenVINO IR, a torch.export program or an
AOTInductor package (vitkit's compiled engine, `vitkit.machine.aoti`; fp32 or bf16), checked against eager.

`export_model` traces the model with `torch.export` (the dynamo-based ONNX exporter for ONNX), its batch dynamic by
default (`dynamic_batch=False` fixes it at one image). With a dynamic size, a ViT takes any H x W that is a multiple
of its patch size: the position embedding is resampled inside the graph (bilinear with aligned corners, the official
method; an ONNX Resize), so one file serves every size. Every export is run against eager PyTorch on the batch sizes
and resolutions it accepts (two of each where dynamic); the worst difference is reported, and
above the tolerance the export fails and its file is removed. A model with LoRA adapters (`vitkit.models.lora`) is
exported with them merged into its weights, and checked against the model with its adapters. The ONNX file carries the model's config
(preprocessing, class names) in its metadata, so `vitkit serve --backend onnx` needs nothing else.
"""
from __future__ import annotations

import copy
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..cache import check_output
from ..errors import CheckpointError, UsageError, VitkitError
from ..machine import aoti
from ..machine.engine_probe import EngineError, import_onnxruntime, import_openvino, openvino_core
from ..machine.engine_probe import openvino_compile as compile_
from ..models.layers.packing import PackedBatch, pack
from ..models.lora import lora_layers, merge_lora
from ..safety import check_regular

FORMATS = ("onnx", "torch-export", "openvino", "aoti")
TOLERANCE = 1e-4  # float32: max |exported - eager| over the check inputs
AOTI_BATCH_HINT = 8  # the batch a compiled package is traced at (its weights laid out for): `export_model`
LOWP_TOLERANCE = 0.05  # bf16 (aoti): max |exported - fp32 eager| <= this x max |fp32 logit| + 1e-3 (as --backend auto)


class ExportError(VitkitError):
    """An export that could not be made, or whose outputs differ from the eager model's."""


@dataclass
class ExportReport:
    path: Path
    format: str
    dynamic_batch: bool
    dynamic_size: bool
    checks: list[dict] = field(default_factory=list)  # {"shape", "max_abs_diff"[, "max_abs_logit"]}
    quantized: str | None = None
    precision: str = "fp32"  # what the exported graph computes in (bf16: an aoti package under autocast)

    @property
    def worst(self) -> float:
        return max(c["max_abs_diff"] for c in self.checks)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "format": self.format, "dynamic_batch": self.dynamic_batch,
                "dynamic_size": self.dynamic_size, "checks": self.checks, "worst_abs_diff": self.worst,
                "quantized": self.quantized, "precision": self.precision}


def _step(model: nn.Module) -> int:
    """The multiple every input side must be: the patch size of a ViT (the total stride of a hybrid), 32 for BiT."""
    return model.config.patch_size[0] if hasattr(model.config, "patch_size") else 32


def check_shapes(model: nn.Module, dynamic_batch: bool, dynamic_size: bool) -> list[tuple[int, int, int, int]]:
    """The inputs an export is checked on: two batch sizes and two resolutions where they are dynamic."""
    c = model.config
    h, w = c.img_size
    step = _step(model)
    sizes = [(h, w)]
    if dynamic_size:
        sizes.append((max(step, round(h * 1.5 / step) * step), max(step, round(w * 0.75 / step) * step)))
    batches = [1, 3] if dynamic_batch else [1]  # a fixed batch is one image, as a service or a script sends it
    return [(b, c.in_chans, sh, sw) for b in batches for sh, sw in sizes]


def _prepare(model: nn.Module, dynamic_size: bool, merge: bool = True) -> nn.Module:
    """The model as exported: a float32 CPU copy in eval mode, LoRA adapters merged into its weights (the graph holds
    plain weights, as every peer reads them; `merge=False`: the reference the export is checked against), no
    packed-weight caches."""
    m = copy.deepcopy(model).float().cpu().eval()
    if merge:
        merge_lora(m)
    if dynamic_size and hasattr(m, "set_dynamic_img_size"):
        m.set_dynamic_img_size(True)
    for mod in m.modules():  # packed MKL weights are an inference cache of eager mode, not part of a graph
        if hasattr(mod, "packable"):
            mod.packable, mod._packed = False, None
    return m


def _reference(model: nn.Module, exported: nn.Module, dynamic_size: bool) -> nn.Module:
    """What an export is checked against: the model as it is, adapters unmerged (a LoRA model's), else `exported`."""
    return _prepare(model, dynamic_size, merge=False) if lora_layers(model) else exported


def _dynamic_shapes(model: nn.Module, dynamic_batch: bool, dynamic_size: bool) -> dict | None:
    if not (dynamic_batch or dynamic_size):
        return None
    dims: dict = {}
    if dynamic_batch:
        dims[0] = torch.export.Dim("batch", min=1, max=4096)
    if dynamic_size:
        step = _step(model)
        dims[2] = step * torch.export.Dim("grid_h", min=1, max=4096 // step)
        dims[3] = step * torch.export.Dim("grid_w", min=1, max=4096 // step)
    return {"x": dims}


class PackedInputs(nn.Module):
    """A ViT whose graph takes packed batches of mixed sizes (NaFlex): patches (B, L, P*P*C) float, coords (B, L, 2)
    int64, valid (B, L) bool -> logits (B, K); B and L dynamic. The position grid is resampled per token inside the
    graph (`packing.resample_for_coords`: a matmul by interpolation weights computed from each image's grid)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, patches: torch.Tensor, coords: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:

        return self.model.forward_packed(PackedBatch(patches, coords, valid))


def packed_examples(config, seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed batch of `batch` random images of different grids (for tracing and checking a packed export)."""
    g = torch.Generator().manual_seed(seed)
    (gh, gw), (ph, pw) = config.grid_size, config.patch_size
    shapes = [(max(1, gh // 2), gw), (gh, max(1, gw // 3)), (gh, gw), (max(1, gh - 1), gw + 1)]
    imgs = [torch.randn(config.in_chans, h * ph, w * pw, generator=g) for h, w in shapes[:batch]]
    b = pack(imgs, (ph, pw))
    return b.patches, b.coords, b.valid


def _export_packed(model: nn.Module, out: Path, format: str, opset: int, tolerance: float, precision: str
                   ) -> ExportReport:
    if format not in ("onnx", "aoti"):
        raise UsageError("--packed exports to ONNX (onnxruntime) or an AOTInductor package (--format aoti)")
    if getattr(model.config, "arch", "") != "vit" or model.config.hybrid_layers is not None:
        raise UsageError("--packed (batches of mixed sizes) exports a plain ViT")
    if format == "aoti":
        return _export_packed_aoti(model, out, tolerance, precision)
    try:
        import onnx  # optional: the [deploy] extra
        ort = import_onnxruntime()  # optional: the [deploy] extra; its telemetry off
    except ImportError as e:
        raise UsageError("ONNX export needs onnx, onnxscript and onnxruntime: pip install 'vitkit[deploy]'") from e
    m = PackedInputs(_prepare(model, False))
    example = packed_examples(model.config, 0, 3)
    dyn = _packed_dims()
    report = ExportReport(out, "onnx-packed", True, True)
    try:
        with warnings.catch_warnings(), _quiet_exporter():
            warnings.simplefilter("ignore")
            torch.onnx.export(m, example, str(out), dynamo=True, dynamic_shapes=dyn, opset_version=opset,
                              input_names=["patches", "coords", "valid"], output_names=["logits"], verbose=False)
            proto = onnx.load(str(out))
            meta = proto.metadata_props.add()
            meta.key, meta.value = "vitkit_config", json.dumps({**model.config.to_dict(), "packed_inputs": True})
            _save_onnx(onnx, proto, out)
            sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    except Exception as e:
        out.unlink(missing_ok=True)
        raise ExportError(f"exporting {type(model).__name__} with packed inputs failed: {type(e).__name__}: {e}") from e
    _check_packed(PackedInputs(_reference(model, m.model, False)),
                  lambda p, c, v: sess.run(None, {"patches": p.numpy(), "coords": c.numpy(), "valid": v.numpy()})[0], report)
    _hold(report, tolerance, "packed ONNX", (out,))
    return report


def _check_packed(m: nn.Module, run, report: ExportReport) -> None:
    """An export with packed inputs against eager on batches and lengths other than the traced one."""
    for seed, batch in ((1, 1), (2, 4), (3, 2)):
        p, c, v = packed_examples(m.config, seed, batch)
        with torch.no_grad():
            ref = m(p, c, v).numpy()
        got = run(p, c, v)
        report.checks.append({"shape": list(p.shape), "max_abs_diff": float(np.abs(got - ref).max()),
                              "max_abs_logit": float(np.abs(ref).max())})


def _packed_dims() -> dict:
    dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("length", min=1, max=65536)}
    return {"patches": dims, "coords": dims, "valid": dims}


def _export_packed_aoti(model: nn.Module, out: Path, tolerance: float, precision: str) -> ExportReport:
    """An AOTInductor package whose inputs are packed batches (patches, coords, valid; B and L dynamic)."""
    m = PackedInputs(_prepare(model, False))
    report = ExportReport(out, "aoti-packed", True, True, precision=precision)
    cfg = {**model.config.to_dict(), "packed_inputs": True}
    made = False  # a compile that fails leaves the file at `out` as it was (compile_package renames when whole)
    try:
        with warnings.catch_warnings(), _quiet_exporter():
            warnings.simplefilter("ignore")
            aoti.compile_package(aoti.Autocast(m, precision), packed_examples(model.config, 0, 3),
                                 tuple(_packed_dims().values()), out, _aoti_meta(cfg, precision))
            made = True
            run, _ = aoti.load_package(out)
    except (UsageError, VitkitError):
        if made:
            out.unlink(missing_ok=True)
        raise
    except Exception as e:
        if made:
            out.unlink(missing_ok=True)
        raise ExportError(f"compiling {type(model).__name__} with packed inputs failed: {type(e).__name__}: {e}") from e
    _check_packed(PackedInputs(_reference(model, m.model, False)), lambda p, c, v: run(p, c, v).numpy(), report)
    _hold(report, tolerance, "packed aoti", (out,))
    return report


def _aoti_meta(config: dict, precision: str, dynamic_size: bool = False) -> dict[str, str]:
    return {"vitkit_config": json.dumps(config), "vitkit_precision": precision,
            "vitkit_dynamic_size": str(bool(dynamic_size)).lower()}


def _hold(report: ExportReport, tolerance: float, what: str, files: tuple[Path, ...]) -> None:
    """Remove the files and fail where the export is further from eager than allowed: `tolerance` in fp32; in bf16
    LOWP_TOLERANCE of the largest logit (+ 1e-3) on every check."""
    if report.precision == "bf16":
        bad = [c for c in report.checks if c["max_abs_diff"] > LOWP_TOLERANCE * c["max_abs_logit"] + 1e-3]
        limit = f"{LOWP_TOLERANCE:g} x the largest logit + 1e-3"
    else:
        bad = [c for c in report.checks if c["max_abs_diff"] > tolerance]
        limit = f"{tolerance}"
    if bad:
        for f in files:
            f.unlink(missing_ok=True)
        raise ExportError(f"the {what} export differs from eager PyTorch by {report.worst:.3g} (> {limit}): "
                          f"{report.checks}; the file was removed")


def export_model(model: nn.Module, out: str | Path, format: str = "onnx", *, dynamic_batch: bool = True,
                 dynamic_size: bool = False, opset: int = 18, quantize: str | None = None,
                 tolerance: float = TOLERANCE, packed: bool = False, precision: str = "fp32",
                 batch_hint: int | None = None) -> ExportReport:
    """Export `model` to `out` and check it against eager PyTorch.

    Args:
        format: "onnx", "torch-export" (a .pt2 program: `torch.export.load(path).module()`) or "openvino" (an
            OpenVINO IR, PATH.xml + PATH.bin, converted from this ONNX export with fp32 weights; checked in
            OpenVINO's CPU plugin with INFERENCE_PRECISION_HINT f32) or "aoti" (a .pt2 AOTInductor package compiled
            for this CPU and this torch, `vitkit.machine.aoti`: loads with `aoti.load_package`, runs without Python).
        dynamic_batch: any batch size (the default, as `vitkit export` and timm's and optimum's ONNX exports; traced
            at 2 and checked at 1 and 3). False fixes the graph's batch at one image (traced and checked at 1).
        dynamic_size: any H x W that is a multiple of the patch size (ViTs and hybrids: the position embedding is
            resampled in the graph; BiT: multiples of 32).
        opset: the ONNX opset.
        quantize: "int8": onnxruntime's dynamic quantization of the weights (ONNX only); its difference from eager
            is reported, not held to the fp32 tolerance.
        tolerance: the largest max-abs difference from eager an fp32 export may have.
        packed: the graph takes packed batches of mixed sizes (`PackedInputs`: patches, coords, valid; ONNX, a plain
            ViT), checked against eager on packed batches of other sizes and lengths than the traced one.
        precision: aoti only: "fp32" or "bf16" (the model under bf16 autocast, compiled with bf16 weights; held to
            LOWP_TOLERANCE of the largest fp32 logit instead of `tolerance`).
        batch_hint: the batch a dynamic-batch graph is traced at (default 2, and AOTI_BATCH_HINT for aoti, whose
            oneDNN weights are laid out for the row count of this batch: ViT-S/16 at batch 8 ran 4% faster from
            weights laid out for 8 images than for 2, at batch 1 the same; benchmarks/NOTES.md section 35).
    """
    if format not in FORMATS:
        raise UsageError(f"export format must be one of {FORMATS}, got {format!r}")
    if precision not in aoti.PRECISIONS or (precision != "fp32" and format != "aoti"):
        raise UsageError(f"--precision {precision}: {format} exports compute in fp32 (bf16: --format aoti)")
    if format == "aoti" and Path(out).suffix != ".pt2":
        raise UsageError(f"an AOTInductor package is PATH.pt2; got {out}")
    if format == "aoti" and not dynamic_batch:
        raise UsageError("an AOTInductor package takes any batch (one image is a batch of 1): drop --no-dynamic-batch")
    for f in (out, Path(out).with_suffix(".bin") if format == "openvino" else _external(Path(out))):
        check_output(f)  # the exporters write where they are told: a FIFO, device or link is refused first
    if packed:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        return _export_packed(model, out, format, opset, tolerance, precision)
    if quantize not in (None, "int8"):
        raise UsageError(f"quantize must be 'int8', got {quantize!r}")
    if quantize and format != "onnx":
        raise UsageError("--quantize int8 applies to ONNX exports (onnxruntime's quantizer)")
    if dynamic_size and getattr(model.config, "arch", "") == "swin":
        raise UsageError("a Swin's windows and shift masks are laid out for one resolution: export it without "
                         "--dynamic-size (load it at another size with img_size= and export that)")
    if dynamic_size and format == "onnx" and getattr(model.config, "pos_resample", "") == "geometric":
        raise UsageError("timm's BEiT resamples its relative position table by a geometric progression "
                         "(torch.searchsorted), which ONNX cannot export for sizes known only at run time: export it "
                         "without --dynamic-size (load it at another size with img_size= and export that)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    m = _prepare(model, dynamic_size)
    c = model.config
    # a dynamic batch is traced at 2 or more (torch.export specialises a batch of 1 to the constant 1); a fixed one at 1
    hint = max(2, batch_hint or (AOTI_BATCH_HINT if format == "aoti" else 2)) if dynamic_batch else 1
    example = torch.randn(hint, c.in_chans, *c.img_size, generator=torch.Generator().manual_seed(0))
    dyn = _dynamic_shapes(m, dynamic_batch, dynamic_size)
    report = ExportReport(out, format, dynamic_batch, dynamic_size, quantized=quantize, precision=precision)
    made = True  # whether a failure leaves a file of this export's at `out` (the other exporters write there directly)
    try:
        with warnings.catch_warnings(), _quiet_exporter():
            warnings.simplefilter("ignore")
            if format == "onnx":
                run = _export_onnx(m, example, dyn, out, opset, quantize)
            elif format == "openvino":
                run = _export_openvino(m, example, dyn, out, opset)
            elif format == "aoti":
                made = False  # until the package is renamed over `out`, the file there is as it was
                aoti.compile_package(aoti.Autocast(m, precision), (example,), None if dyn is None else (dyn["x"],),
                                     out, _aoti_meta(m.config.to_dict(), precision, dynamic_size))
                made = True
                package, _ = aoti.load_package(out)

                def run(x: np.ndarray) -> np.ndarray:
                    return package(torch.from_numpy(x)).numpy()
            else:
                ep = torch.export.export(m, (example,), dynamic_shapes=dyn)
                torch.export.save(ep, str(out))
                program = torch.export.load(str(out)).module()

                def run(x: np.ndarray) -> np.ndarray:
                    with torch.no_grad():
                        return program(torch.from_numpy(x)).numpy()
    except (UsageError, ExportError):
        raise
    except Exception as e:
        if made:
            out.unlink(missing_ok=True)
        if format == "openvino":
            out.with_suffix(".bin").unlink(missing_ok=True)
        raise ExportError(f"exporting {type(model).__name__} to {format} failed: {type(e).__name__}: {e}") from e
    reference = _reference(model, m, dynamic_size)
    for shape in check_shapes(m, dynamic_batch, dynamic_size):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            ref = reference(x).numpy()
        got = run(x.numpy())
        report.checks.append({"shape": list(shape), "max_abs_diff": float(np.abs(got - ref).max()),
                              "max_abs_logit": float(np.abs(ref).max())})
    if not quantize:
        _hold(report, tolerance, format, (out, out.with_suffix(".bin")) if format == "openvino" else (out,))
    return report


class _quiet_exporter:
    """The exporters log every phase at INFO and warn about torchvision ops: keep the CLI's output readable."""

    def __enter__(self):
        self.level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        return self

    def __exit__(self, *exc):
        logging.disable(self.level)


def _export_onnx(m: nn.Module, example: torch.Tensor, dyn, out: Path, opset: int, quantize: str | None):
    try:
        import onnx  # optional: the [deploy] extra
        ort = import_onnxruntime()  # optional: the [deploy] extra; its telemetry off
    except ImportError as e:
        raise UsageError("ONNX export needs onnx, onnxscript and onnxruntime: pip install 'vitkit[deploy]'") from e
    fp32 = out if not quantize else out.with_name(out.stem + ".fp32.onnx")
    torch.onnx.export(m, (example,), str(fp32), dynamo=True, dynamic_shapes=dyn, opset_version=opset,
                      input_names=["pixel_values"], output_names=["logits"], verbose=False)
    proto = onnx.load(str(fp32))  # the exporter's external-data file read in
    meta = proto.metadata_props.add()
    meta.key, meta.value = "vitkit_config", json.dumps(m.config.to_dict())
    _save_onnx(onnx, proto, fp32)
    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic  # optional: the [deploy] extra

        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8)
        proto = onnx.load(str(out))
        if not any(p.key == "vitkit_config" for p in proto.metadata_props):
            meta = proto.metadata_props.add()
            meta.key, meta.value = "vitkit_config", json.dumps(m.config.to_dict())
            _save_onnx(onnx, proto, out)
        for f in (fp32, _external(fp32)):
            f.unlink(missing_ok=True)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {name: x})[0]


def _export_openvino(m: nn.Module, example: torch.Tensor, dyn, out: Path, opset: int):
    """The ONNX export (dynamic batch and size as asked) converted to an OpenVINO IR with fp32 weights, the config
    in its rt_info; returns a runner compiled for f32 on the CPU."""
    try:
        ov = import_openvino()  # optional: the [openvino] extra; its telemetry off
    except ImportError as e:
        raise UsageError("OpenVINO export needs openvino: pip install 'vitkit[openvino]'") from e
    if out.suffix != ".xml":
        raise UsageError(f"an OpenVINO IR is PATH.xml (+ PATH.bin); got {out}")
    onnx_file = out.with_suffix(".tmp.onnx")
    try:
        _export_onnx(m, example, dyn, onnx_file, opset, None)
        # the runtime's own ONNX reader (the same frontend `ov.convert_model` uses, without the converter tools)
        ovm = openvino_core().read_model(str(onnx_file))
        ovm.set_rt_info(json.dumps(m.config.to_dict()), ["vitkit_config"])
        ov.save_model(ovm, str(out), compress_to_fp16=False)  # the default halves the weights: not an fp32 export
        del ovm  # it maps the ONNX file's weights: let go before the file goes
    finally:
        for f in (onnx_file, _external(onnx_file)):
            f.unlink(missing_ok=True)
    compiled = openvino_compile(out, "fp32")
    return lambda x: compiled(x)[0]


def openvino_compile(path: str | Path, precision: str = "fp32", threads: int | None = None):
    """An OpenVINO IR compiled for the CPU with INFERENCE_PRECISION_HINT f32 or bf16, the hint read back (the CPU
    plugin computes in bf16 by default where the CPU has it): a CompiledModel, called as model(x)."""
    try:
        return compile_(path, precision, threads)
    except EngineError as e:
        raise ExportError(str(e)) from e


def openvino_config(path: str | Path) -> dict:
    """The vitkit config an OpenVINO export carries in its rt_info."""
    check_regular(path)  # a FIFO would keep OpenVINO waiting for a writer
    if Path(path).with_suffix(".bin").exists():
        check_regular(Path(path).with_suffix(".bin"))
    ovm = openvino_core().read_model(str(path))
    if not ovm.has_rt_info(["vitkit_config"]):
        raise UsageError(f"{path} carries no vitkit config: export it with `vitkit export --format openvino`")
    return json.loads(ovm.get_rt_info(["vitkit_config"]).astype(str))


def _external(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def _save_onnx(onnx, proto, path: Path) -> None:
    """One self-contained file where protobuf allows it (under 2 GB), else the weights beside it in PATH.data;
    never a stale .data file next to a file that holds every weight."""
    big = proto.ByteSize() > 1_800_000_000
    onnx.save(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True, location=_external(path).name)
    if not big:
        _external(path).unlink(missing_ok=True)


def check_external_data(proto, path: str | Path) -> None:
    """Every tensor an ONNX file keeps outside itself (external data) names a regular file inside the file's own
    folder, links resolved, and a byte range within it: refused otherwise before an engine reads it (an older
    onnxruntime follows `../`, an absolute path, a link to a device or a FIFO)."""
    from onnx.external_data_helper import _get_all_tensors  # the tensors of every graph and attribute

    folder = Path(path).resolve().parent
    for t in _get_all_tensors(proto):
        if t.data_location != t.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        target = (folder / loc).resolve()
        if not loc or Path(loc).is_absolute() or ".." in Path(loc).parts or not target.is_relative_to(folder):
            raise CheckpointError(f"{path}: tensor {t.name!r} keeps its data at {loc!r}, outside the file's folder: "
                                  f"refused")
        check_regular(target, f"{path}: tensor {t.name!r}'s external data {loc!r}", CheckpointError)
        size = target.stat().st_size
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", size))
        except ValueError:
            raise CheckpointError(f"{path}: tensor {t.name!r} has a malformed external data range {info}") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise CheckpointError(f"{path}: tensor {t.name!r} claims bytes {offset}..{offset + length} of {loc!r}, "
                                  f"which holds {size}: refused")


def onnx_config(path: str | Path) -> dict:
    """The vitkit config an ONNX export carries in its metadata."""
    import onnx  # optional: the [deploy] extra


    check_regular(path)  # a FIFO would keep onnx (and then onnxruntime) waiting for a writer
    proto = onnx.load(str(path), load_external_data=False)
    check_external_data(proto, path)
    for p in proto.metadata_props:
        if p.key == "vitkit_config":
            return json.loads(p.value)
    raise UsageError(f"{path} carries no vitkit config: export it with `vitkit export`")
