"""The engine an inference command runs on (`--backend auto|torch|aoti|onnx|openvino`): vitkit's one engine choice
(`vitkit.machine.engine`), handed the export its compiled, ONNX and OpenVINO candidates run. eval, predict, serve and
bench all come here."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from torch import nn

from ..cache import atomic_write, cache_dir
from ..checkpoints import load
from ..download import sha256_of
from ..checkpoints.api import config_from_dict
from ..errors import CheckpointError, UsageError
from ..safety import parse_json, untrusted
from ..machine import aoti, cpu, engine
from ..machine.engine import BackendChoice, BackendModel, weights_digest
from ..machine.precision import for_inference
from .export import AOTI_BATCH_HINT, export_model


def export_for(model: nn.Module, digest: str | None = None, what: str = "onnx", batch: int = AOTI_BATCH_HINT) -> Path:
    """What an engine runs, made once and cached by the model's weights (and, for a compiled package, by this
    machine: CPU, ISA caps, torch): `what` "onnx" is vitkit's ONNX export (dynamic batch, fp32, checked against
    eager), which ONNX Runtime and OpenVINO both run; "aoti-fp32" / "aoti-bf16" the model compiled by AOTInductor
    (dynamic batch, its weights laid out for `batch` images, in two buckets: up to AOTI_BATCH_HINT, or PROBE_BATCH;
    checked against eager: `vitkit.inference.export`, format aoti)."""
    digest = digest or weights_digest(model)
    folder = cache_dir() / "backends" / "exports"
    if what.startswith("aoti-"):
        hint = AOTI_BATCH_HINT if batch <= AOTI_BATCH_HINT else engine.PROBE_BATCH
        cached = folder / f"{digest}-{what}-b{hint}-{cpu.machine_key(threads=False)}.pt2"
        _forget_unvouched(cached)
        return _made_once(cached, ".pt2",
                          lambda f: export_model(model, f, "aoti", dynamic_batch=True, precision=what.split("-")[1],
                                                 batch_hint=hint))

    def onnx(f: Path) -> None:
        export_model(model, f, "onnx", dynamic_batch=True)
        if f.with_name(f.name + ".data").exists():  # over 2 GB: weights beside the graph, which names them
            f.with_name(f.name + ".data").unlink()
            raise UsageError(f"{type(model).__name__} is over 2 GB: run it with --backend torch")

    return _made_once(folder / f"{digest}.onnx", ".onnx", onnx)


def _forget_unvouched(path: Path) -> None:
    """A cached compiled package that this machine's vitkit did not record making (planted in a shared
    `$VITKIT_HOME`, changed since, or cached before packages were recorded) is removed, to be compiled again: the
    cache is never a way around `aoti.open_package`'s trust check."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and aoti.is_trusted(sha256_of(path)):
        return
    engine.say(f"{path.name}: a cached compiled package this machine's vitkit did not record making: compiling it "
               f"again")
    try:
        path.unlink()
    except OSError as e:
        raise UsageError(f"{path}: a cached compiled package vitkit cannot vouch for, and cannot remove ({e}): "
                         f"remove it, or point VITKIT_HOME at a folder of your own") from e


def _made_once(path: Path, suffix: str, make) -> Path:
    """`path`, made by `make(file)` if it is not there yet: into a temporary file with the `suffix` the exporters
    want, then renamed into place (a half-made file is never seen)."""
    if path.is_file():
        return path

    def write(tmp: Path) -> None:
        f = tmp.with_name(tmp.name + suffix)
        try:
            make(f)
            os.replace(f, tmp)
        finally:
            f.unlink(missing_ok=True)

    return atomic_write(path, write)


def choose(model: nn.Module, batch: int, *, refresh: bool = False, threads: int | None = None,
           log=engine.say) -> BackendChoice:
    """`--backend auto`'s measurement for `model` at `batch` (`vitkit.machine.engine.choose`), with this package's
    export for the ONNX and OpenVINO candidates."""
    return engine.choose(model, batch, refresh=refresh, threads=threads, log=log, export=export_for)


def open_engine(model: nn.Module, backend: str, precision: str, batch: int, threads: int | None = None
                ) -> BackendModel:
    """`model` on the engine `--backend`/`--precision` name (auto: measured, `vitkit.machine.engine.resolve`), the
    choice, its progress and (auto) its table printed on stderr: `.choice` says which."""
    choice = engine.resolve_and_announce(model.eval(), backend, precision, batch, threads=threads, export=export_for)
    return BackendModel(model, choice, threads)


def inference_engine(model: nn.Module, device: torch.device, precision: str, backend: str, batch: int
                     ) -> tuple[nn.Module, str, str]:
    """What `predict`, `eval` and `fewshot` run on: (the model to call, the autocast precision around it, the reason
    line). backend torch: the eager model, `precision` resolved (`vitkit.machine.precision.for_inference`); auto /
    onnx / openvino: a `BackendModel` on the engine chosen (`open_engine`), which applies its own precision."""
    engine.check_backend(backend)
    if isinstance(model, ExportedModel):
        if device.type != "cpu":
            raise UsageError(f"{model.path} runs on the CPU ({model.backend}): add --device cpu")
        if precision not in ("auto", "fp32"):
            raise UsageError(f"{model.path} runs in fp32 on {model.backend}, not {precision}")
        return model, "fp32", f"backend {model.reason}"
    if isinstance(model, PackageModel):
        if device.type != "cpu":
            raise UsageError(f"{model.path} runs on the CPU (an AOTInductor package compiled for it): add --device cpu")
        if precision not in ("auto", model.precision):
            raise UsageError(f"{model.path} computes in {model.precision}, not {precision}: compile a package with "
                             f"`vitkit export CHECKPOINT OUT.pt2 --format aoti --precision {precision}`")
        return model, "fp32", f"backend {model.reason}"
    if backend == "torch":
        choice = for_inference(model, device, precision, batch)
        return model, choice.precision, choice.reason
    if device.type != "cpu":
        if backend != "auto":
            raise UsageError(f"--backend {backend} runs on the CPU: add --device cpu")
        choice = for_inference(model, device, precision, batch)
        return model, choice.precision, f"backend auto on {device}: torch; precision {choice.reason}"
    m = open_engine(model, backend, precision, batch)
    return m, "fp32", f"backend {m.choice.reason}"


def is_package(path: str | Path) -> bool:
    """Whether `path` names an AOTInductor package (a .pt2 zip with AOTInductor's metadata; a torch.export .pt2
    program is not one)."""
    if not str(path).endswith(".pt2") or not Path(path).is_file():
        return False
    try:
        aoti.package_metadata(path)
    except CheckpointError:
        return False
    return True


class PackageModel(nn.Module):
    """A package made by `vitkit export --format aoti`, called like the eager model: (B, C, H, W) float32 tensor
    -> float32 logits on the CPU. `config` is the model's (preprocessing, class names), from the package. Inputs are
    checked against it (AOTInductor itself checks no shapes), and so are the logits it returns (one per class).
    A package this machine's vitkit did not compile loads only with `trust` (`vitkit.machine.aoti.open_package`)."""

    def __init__(self, path: str | Path, trust: bool = False) -> None:
        super().__init__()
        meta = aoti.package_metadata(path)
        if "vitkit_config" not in meta:
            raise CheckpointError(f"{path} carries no vitkit config: compile it with `vitkit export --format aoti`")
        cfg = parse_json(meta["vitkit_config"], f"{path} (its vitkit_config)", CheckpointError)
        if isinstance(cfg, dict) and cfg.pop("packed_inputs", False):
            raise UsageError(f"{path} takes packed batches (patches, coords, valid): run it from Python with "
                             "vitkit.machine.aoti.load_package; predict, eval, serve and bench run square-image packages")
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path}: its vitkit_config is not a mapping")
        with untrusted(f"{path} (its vitkit_config)", CheckpointError):
            self.config = config_from_dict(cfg)
        self.run, meta = aoti.load_package(path, trust=trust)
        self.digest = self.run.package.digest  # the SHA-256 of what was checked and loaded
        self.path, self.precision = Path(path), meta.get("vitkit_precision", "fp32")
        self.dynamic_size = meta.get("vitkit_dynamic_size") == "true"
        self.device = torch.device("cpu")
        self.reason = (f"aoti-{self.precision}: the package {self.path.name} (compiled for {meta.get('vitkit_isa')} by "
                       f"torch {meta.get('vitkit_torch')})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != c.in_chans or not 1 <= len(x) <= 4096 or \
                (tuple(x.shape[2:]) != tuple(c.img_size) and not self.dynamic_size):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UsageError(f"{self.path.name} takes (1-4096, {c.in_chans}, {c.img_size[0]}, {c.img_size[1]}) images, "
                             f"got {shape}")
        y = self.run(x.detach().float().cpu().contiguous())
        classes = getattr(c, "num_classes", 0) or getattr(c, "embed_dim", None)
        if y.dim() != 2 or len(y) != len(x) or (classes and y.shape[1] != classes):
            raise CheckpointError(f"{self.path}: returned {tuple(y.shape)} for {len(x)} images where its config says "
                                  f"{classes} outputs each: the package and its metadata disagree")
        return y


class ExportedModel(nn.Module):
    """An ONNX file (onnxruntime) or an OpenVINO IR (.xml, OpenVINO in fp32) made by `vitkit export`, called like the
    eager model: (B, C, H, W) float32 tensor -> float32 logits on the CPU; `config` from the file's metadata. An
    export without a dynamic batch runs one image at a time."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        from .export import onnx_config, openvino_config

        self.path = Path(path)
        self.backend = "onnx" if self.path.suffix == ".onnx" else "openvino"
        if not self.path.is_file():
            raise FileNotFoundError(f"no {'ONNX file' if self.backend == 'onnx' else 'OpenVINO IR'} at {path}")
        with untrusted(str(path), CheckpointError):
            self.config = config_from_dict((onnx_config if self.backend == "onnx" else openvino_config)(path))
            self.run = engine.engine(self.backend, "fp32", path)
        self.device = torch.device("cpu")
        self.reason = f"{self.backend}-fp32: the export {self.path.name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().cpu().contiguous().numpy()
        try:
            return torch.from_numpy(self.run(x))
        except Exception:  # a fixed batch of one (exported without --dynamic-batch)
            if len(x) == 1:
                raise
            return torch.cat([torch.from_numpy(self.run(x[i:i + 1])) for i in range(len(x))])


def is_export(path: str | Path) -> bool:
    """An ONNX file or an OpenVINO IR made by `vitkit export`: its runtime is named by the file."""
    return str(path).endswith((".onnx", ".xml"))


def load_for_inference(checkpoint: str, backend: str, trust_package: bool = False) -> tuple[nn.Module, str]:
    """(the model, the backend to run it on) for `checkpoint`: a package from `vitkit export --format aoti` is its
    own engine (`PackageModel`, with `trust_package` for one this machine's vitkit did not compile; backend torch,
    auto or aoti run it), an ONNX file or OpenVINO IR runs on its runtime (`ExportedModel`; backend torch, auto or
    the file's own), anything else loads as a checkpoint."""
    engine.check_backend(backend)
    if is_export(checkpoint):
        model = ExportedModel(checkpoint) if backend in ("torch", "auto", "onnx", "openvino") else None
        if model is None or backend not in ("torch", "auto", model.backend):
            raise UsageError(f"{checkpoint} is an export for {'onnxruntime' if str(checkpoint).endswith('.onnx') else 'OpenVINO'}: "
                             f"run it with the default backend, or give the checkpoint for --backend {backend}")
        return model, model.backend
    if not is_package(checkpoint):
        return load(checkpoint), backend
    if backend in ("onnx", "openvino"):
        raise UsageError(f"{checkpoint} is an AOTInductor package: run it with --backend aoti (or give the checkpoint "
                         f"for --backend {backend})")
    return PackageModel(checkpoint, trust=trust_package), "aoti"
