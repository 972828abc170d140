"""The engine an inference command runs on (`--backend auto|torch|onnx|openvino`): vitkit's one engine choice
(`vitkit.machine.engine`), handed the export its ONNX and OpenVINO candidates run. eval, predict, serve and bench
all come here."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..cache import atomic_write, cache_dir
from ..errors import UsageError
from ..machine import engine
from ..machine.engine import BackendChoice, BackendModel, weights_digest
from ..machine.precision import for_inference
from .export import export_model


def export_for(model: nn.Module, digest: str | None = None) -> Path:
    """vitkit's ONNX export of `model` (dynamic batch, fp32, checked against eager), cached by its weights: ONNX
    Runtime and OpenVINO both run this one file."""
    digest = digest or weights_digest(model)
    path = cache_dir() / "backends" / "exports" / f"{digest}.onnx"
    if path.is_file():
        return path

    def write(tmp: Path) -> None:
        onnx = tmp.with_name(tmp.name + ".onnx")  # the exporter wants the suffix
        try:
            export_model(model, onnx, "onnx", dynamic_batch=True)
            if onnx.with_name(onnx.name + ".data").exists():  # over 2 GB: weights beside the graph, which names them
                onnx.with_name(onnx.name + ".data").unlink()
                raise UsageError(f"{type(model).__name__} is over 2 GB: run it with --backend torch")
            os.replace(onnx, tmp)
        finally:
            onnx.unlink(missing_ok=True)

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
