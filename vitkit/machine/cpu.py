"""What this CPU is and what it may run: /proc/cpuinfo's fields, the instruction-set caps in force, native bf16 and
AMX, and the key every measurement made on this machine is cached under."""
from __future__ import annotations

import hashlib
import os
import platform

import torch

from .. import env


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = line.split(":", 1)
                    info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """Vendor, family, model and name: what the choice of path depends on."""
    info = cpu_info()
    if not info:
        return platform.processor() or platform.machine()
    return "-".join(info.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name"))


# Environment variables that cap the instruction sets oneDNN, MKL and ATen use (`ONEDNN_MAX_CPU_ISA=AVX2` makes an
# AVX-512 machine run as an AVX2-only one): a capped process measures its own choices.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def isa_caps() -> str:
    """The instruction-set caps in force, e.g. "ONEDNN_MAX_CPU_ISA=AVX2,ATEN_CPU_CAPABILITY=avx2" ("" for none)."""
    return ",".join(f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k))


_CACHE_BASE = "VITKIT_INDUCTOR_CACHE_BASE"  # the user's folder, kept for this process's later calls and its children


def inductor_cache_for_caps() -> str | None:
    """Give Inductor's on-disk cache a folder of its own for the instruction-set caps in force; call it before
    compiling. Returns that folder, or None where no cap is set (the cache is then the user's own folder).

    Inductor's FX graph cache keys a compiled graph on torch, the graph, its config and the thread count, not on the
    vector ISA (`ATEN_CPU_CAPABILITY`) or oneDNN's cap, so a graph compiled without caps is served again under
    them. With torch 2.13 on an AVX-512 CPU, fashion-mnist-fast's compiled step computed NaN under the AVX2 caps from
    such an entry, and under `ONEDNN_MAX_CPU_ISA=AVX2` alone the process aborted in malloc; from a fresh cache both
    were right (benchmarks/NOTES.md, section 53). The folder is `caps-<the caps, sanitised>-<hash>` under the
    user's `TORCHINDUCTOR_CACHE_DIR` (unset or empty: Inductor's default, /tmp/torchinductor_<user>), and
    `TORCHINDUCTOR_CACHE_DIR` is set to it, so this process and its children use it. The user's folder is kept in
    `VITKIT_INDUCTOR_CACHE_BASE`: a child with other caps, or none, goes back to it, never into its parent's.
    A cache shared between machines of different CPUs has the same fault without caps; that is Inductor's."""
    caps = isa_caps()
    base = env.get(_CACHE_BASE)  # None: the first call in this process tree
    if not caps:
        if base is not None:  # a parent under caps moved the cache: back to the user's
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base)
        return None
    if base is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # only before a compile, which imports it

        base = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    # the caps are environment variables, so anything may be in them: the name keeps ASCII letters, digits, "=", "_"
    # and "-" to a bounded length, and a hash of each (name, value) pair tells apart what the cut or the joins merge
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "=_-") else "_" for c in caps)[:96]
    pairs = b"\0".join(os.fsencode(k) + b"=" + os.fsencode(os.environ[k]) for k in ISA_CAPS if os.environ.get(k))
    folder = os.path.join(str(base), f"caps-{safe}-{hashlib.sha256(pairs).hexdigest()[:12]}")
    os.environ[_CACHE_BASE] = str(base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) below which it has no bf16 dot product, and those that allow AMX
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_AMX_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16"}


def _onednn_cap() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def bf16_native() -> bool:
    """Whether oneDNN computes bf16 matmuls with the CPU's own bf16 instructions (AVX-512 BF16 or AMX) rather than
    emulating them (AVX2-only CPUs, or a cap below AVX512_CORE_BF16), where a bf16 matmul is ~10x slower."""
    flags = cpu_info().get("flags", "").split()
    has = "avx512_bf16" in flags or "amx_bf16" in flags
    return has and _onednn_cap() not in _NO_BF16_ISAS


def amx_usable() -> bool:
    """Whether oneDNN may use this CPU's AMX tiles (present, and not capped away)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()) and _onednn_cap() in _AMX_ISAS


def machine_key(threads: bool = True) -> str:
    """A file-name-safe key for measurements that hold on this machine: CPU, ISA caps, torch version, threads
    (`threads=False`: without them, for what does not depend on them, as compiled code)."""
    caps = isa_caps()
    raw = f"{cpu_name()}{'-caps-' + caps if caps else ''}-{torch.__version__}"
    raw += f"-t{torch.get_num_threads()}" if threads else ""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in raw)


def cpu_model() -> str:
    """`lscpu`'s model name, CPU family and model, as every CPU speed is reported beside (a cloud VM's model name
    may be as bare as "Intel(R) Xeon(R) Processor" for chips as far apart as one with AMX and one without)."""
    info = cpu_info()
    # x86's model number; on other CPUs /proc/cpuinfo has no family, and a "model" there may be the board's
    model = f", model {info['model']}" if info.get("model") and info.get("cpu family") else ""
    return f"{info.get('model name', 'unknown CPU')}, family {info.get('cpu family', '?')}{model}"
