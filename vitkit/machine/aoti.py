"""vitkit's compiled engine: a model compiled ahead of time by PyTorch's Inductor (AOTInductor) into one `.pt2`
package for this CPU, which loads in a fraction of a second and runs without Python between the ops.

`compile_package` traces the model with `torch.export` (the batch dynamic) and compiles it with Inductor's freezing:
the weights become constants, the Linears' weights are reordered once for oneDNN (`mkldnn._linear_pointwise`,
with the bias, the GELU and the residual add fused into the GEMM where the pattern allows), LayerNorm, softmax and
the other elementwise work fused into generated C++ loops, attention on the fused SDPA kernel. bf16 is the fp32
model under bf16 autocast, traced: freezing folds the weights' casts, so the package holds bf16 weights and the
graph casts only activations (the same numbers as eager autocast).

Why freezing needs no gradients, and why not `torch.compile(model)` at inference: Inductor freezes (and prepacks
for oneDNN) only when it compiles with gradients off, and a `torch.compile` of a fixed batch sends its fp32
Linears to MKL's packed GEMM (`mkl._mkl_linear`), which on AMD CPUs runs MKL's AVX2 code (on an AVX-512 Zen 4 at
~0.8x vitkit's eager). The ahead-of-time path (and any dynamic batch) takes oneDNN's, which runs the CPU's widest
instructions (benchmarks/NOTES.md section 35).

A package is machine code for one CPU's instruction sets (it is compiled with -march=native) and one torch: its
metadata (read from the zip before anything is loaded) names the compiling CPU's instruction-set flags, Inductor's
vector ISA and the torch, and `load_package` refuses a package that uses a flag this CPU lacks, one wider than
this process's ISA cap (ATEN_CPU_CAPABILITY), or one another torch wrote, with the command that rebuilds it.
Loading a package runs its shared library: load only packages you made.
"""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from ..safety import check_regular, check_zip_entry
from .cpu import cpu_info

PRECISIONS = ("fp32", "bf16")
NO_COMPILER = "no C++ compiler for Inductor here (apt install g++, or set CXX)"  # why there is no compiled engine
_META_LIMIT = 1 << 20  # a metadata file over 1 MiB is not one AOTInductor wrote


class Autocast(nn.Module):
    """`model` under CPU autocast in `precision` (bf16: bf16 matmuls, fp32 LayerNorm and softmax), float32 logits
    out: what a bf16 package traces."""

    def __init__(self, model: nn.Module, precision: str) -> None:
        super().__init__()
        self.model, self.precision = model, precision

    def forward(self, *x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            y = self.model(*x)
        return y.float()


def compiler() -> str | None:
    """The C++ compiler Inductor would call here ($CXX, else g++), or None where there is none: no compiled engine."""
    return shutil.which(os.environ.get("CXX") or "g++")


# /proc/cpuinfo flags that name instruction sets a compiler may emit for -march=native (x86 "flags", Arm "Features")
_ISA_FLAG = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "adx", "movbe", "popcnt", "lzcnt", "abm", "sha",
             "aes", "vaes", "pclmul", "vpclmul", "gfni", "vnni", "rdrand", "rdseed", "asimd", "sve", "sme", "fp",
             "bf16", "i8mm", "dot")
# Inductor's vector ISAs by width, and ATEN_CPU_CAPABILITY's caps
_WIDTH = {"AVX2": 256, "AVX512": 512, "DEFAULT": 0}


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo)."""
    info = cpu_info()
    raw = (info.get("flags") or info.get("Features") or "").split()
    return {f for f in raw if f.startswith(_ISA_FLAG)}


def vec_isa() -> str:
    """The vector instruction set Inductor generates code for here (the ISA caps included: ATEN_CPU_CAPABILITY), as
    AOTInductor names it in a package ("AVX512", "AVX2", ...; "" where it has none)."""
    from torch._inductor import cpu_vec_isa  # start-up time: Inductor costs ~0.5 s to import

    isa = cpu_vec_isa.pick_vec_isa()
    return str(isa).upper() if isa else ""


def compile_package(module: Autocast, example: tuple[torch.Tensor, ...], dims: tuple[dict, ...] | None,
                    out: str | Path, metadata: dict[str, str]) -> Path:
    """`module` traced at `example` (called as module(*example)) with each input's dynamic dimensions `dims` (one
    {dim: torch.export.Dim} per input; None: all static) and compiled by AOTInductor with freezing into the package
    `out`, `metadata` stored in it (with this machine's ISA and torch). Gradients are off throughout (freezing needs
    it)."""
    from torch._inductor import aoti_compile_and_package  # start-up time: Inductor costs ~0.5 s to import

    if compiler() is None:
        raise UsageError(f"compiling a package (--format aoti, --backend aoti) needs a C++ compiler: {NO_COMPILER}")
    meta = {**metadata, "vitkit_torch": torch.__version__, "vitkit_isa": vec_isa(),
            "vitkit_cpu_flags": " ".join(sorted(cpu_flags()))}
    with torch.no_grad():
        ep = torch.export.export(module, example, dynamic_shapes=None if dims is None else (tuple(dims),))
        aoti_compile_and_package(ep, package_path=str(out),
                                 inductor_configs={"freezing": True, "aot_inductor.metadata": meta})
    return Path(out)


def package_metadata(path: str | Path) -> dict[str, str]:
    """The metadata an AOTInductor package carries (AOTInductor's own keys and the `vitkit_*` ones), read from the
    zip without loading its code. CheckpointError for a file that is not such a package."""
    path = check_regular(path, error=CheckpointError)
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.filename.endswith("wrapper_metadata.json"):
                    check_zip_entry(info, str(path))
                    if info.file_size > _META_LIMIT:
                        break
                    meta = json.loads(z.read(info))
                    if isinstance(meta, dict):
                        return {str(k): str(v) for k, v in meta.items()}
                    break
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"{path} is not an AOTInductor package (vitkit export --format aoti): {e}") from e
    raise CheckpointError(f"{path} is not an AOTInductor package (vitkit export --format aoti): no model metadata in it")


def check_runnable(meta: dict[str, str], path: str | Path) -> None:
    """Refuse, with what to do, a package that uses an instruction-set flag this CPU lacks, a vector ISA wider than
    this process's cap (ATEN_CPU_CAPABILITY), or another torch: its code would crash (SIGILL) or fail to link. Needs
    no compiler."""
    again = f"compile it again here: vitkit export CHECKPOINT {Path(path).name} --format aoti"
    if meta.get("AOTI_DEVICE_KEY", "cpu") != "cpu":
        raise CheckpointError(f"{path} was compiled for {meta['AOTI_DEVICE_KEY']}, not the CPU; {again}")
    made = meta.get("vitkit_torch")
    if made and made != torch.__version__:
        raise CheckpointError(f"{path} was compiled by torch {made}; this is torch {torch.__version__}; {again}")
    missing = sorted(set(meta.get("vitkit_cpu_flags", "").split()) - cpu_flags())
    if missing:
        raise CheckpointError(f"{path} was compiled on a CPU with instructions this one lacks ({' '.join(missing[:8])}"
                              f"{' ...' if len(missing) > 8 else ''}); {again}")
    isa = (meta.get("vitkit_isa") or meta.get("AOTI_CPU_ISA", "")).upper().split()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    if isa and cap in _WIDTH and _WIDTH.get(isa[0], 0) > _WIDTH[cap]:
        raise CheckpointError(f"{path} was compiled for {' '.join(isa)} instructions; this process is capped at "
                              f"ATEN_CPU_CAPABILITY={cap.lower()}; {again}")


def load_package(path: str | Path) -> tuple[Callable[..., torch.Tensor], dict[str, str]]:
    """An AOTInductor package loaded for inference: (a function of the traced inputs -> float32 logits, its
    metadata). Checked first (`check_runnable`)."""
    meta = package_metadata(path)
    check_runnable(meta, path)
    from torch._inductor import aoti_load_package  # start-up time: Inductor costs ~0.5 s to import

    try:
        runner = aoti_load_package(str(path))
    except Exception as e:  # noqa: BLE001 - the loader raises RuntimeError and others on a bad package
        raise CheckpointError(f"{path}: AOTInductor could not load it: {str(e).splitlines()[0][:200]}") from e

    loader = runner.loader  # its boxed call: what runner(*x) does, without re-reading the call's spec every time

    def run(*x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return loader.boxed_run(list(x))[0]  # one tensor in the graph's output (the logits)

    return run, meta
