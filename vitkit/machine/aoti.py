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

Loading a package runs its shared library, so every package goes through one door, `open_package`, before a byte
of it is extracted or loaded (docs/safety.md, "Compiled packages"):

1. It is copied (a regular file only) into a private folder (mode 0700) while its SHA-256 is computed: what is
   checked is what is loaded, whoever can write the original.
2. The zip itself is checked: one top folder, member names without `..`, absolute paths, backslashes or odd
   characters, no duplicates, no links or other special members, only the members AOTInductor writes for vitkit's
   exports (the generated C++, its metadata JSON, the shared library and the archive's version records: anything
   else, such as an exported program's pickled sample inputs, is refused), no pickle anywhere, sizes bounded and
   no decompression bombs.
3. It loads without an opt-in only if this machine's vitkit compiled it: `compile_package` records each package's
   digest under `$VITKIT_HOME/trusted/packages/` (a folder that must be this user's and writable by nobody else).
   Any other package (from another machine or user, or changed since) needs `trust=True` (`--trust-package`), and
   vitkit then says what native code it is about to run. The metadata's own checks (`check_runnable`) come after;
   they protect against a crash, not an attacker.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..cache import WriteError, cache_dir, replace_output
from ..download import sha256_of
from ..errors import CheckpointError, UsageError
from ..safety import check_regular, check_zip_entry, gib, open_regular
from .cpu import cpu_info, inductor_cache_for_caps

log = logging.getLogger(__name__)

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
    # AOTInductor names the package's top folder after the file's stem, which `check_members` reads as a plain name
    # of at most 128 characters: compiled as `model.pt2` in a folder of its own beside `out` (0700), vouched for
    # there, then renamed over `out` once it is whole (a cache's long file name, or a user's with spaces or accents,
    # would give a package its own loader refuses; a failed or interrupted compile leaves the file there as it was)
    try:
        work = Path(tempfile.mkdtemp(prefix=".aoti-", dir=Path(out).parent))
    except OSError as e:
        raise WriteError(f"cannot compile a package into {Path(out).parent} ({e.strerror or e}): "
                         f"nothing was written") from e
    # Inductor writes loops that run at whatever thread count the caller has (`#pragma omp parallel`) only when it
    # compiles at os.cpu_count() threads; at any other count it writes that count into the package for good (one
    # compiled while vitkit.machine.threads had lowered torch's count for a busy machine would never run wider)
    threads = torch.get_num_threads()
    inductor_cache_for_caps()
    try:
        torch.set_num_threads(os.cpu_count() or threads)
        with torch.no_grad():
            ep = torch.export.export(module, example, dynamic_shapes=None if dims is None else (tuple(dims),))
            aoti_compile_and_package(ep, package_path=str(work / "model.pt2"),
                                     inductor_configs={"freezing": True, "aot_inductor.metadata": meta})
        record_trusted(work / "model.pt2")  # made here: this machine's vitkit loads it without an opt-in
        replace_output(work / "model.pt2", out)  # a link, FIFO or device put at `out` meanwhile is refused
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    return Path(out)


def package_metadata(path: str | Path) -> dict[str, str]:
    """The metadata an AOTInductor package carries (AOTInductor's own keys and the `vitkit_*` ones), read from the
    zip without loading its code. CheckpointError for a file that is not such a package. Anyone can write these
    keys: they describe a package, they do not vouch for it (`open_package` does)."""
    path = check_regular(path, error=CheckpointError)
    try:
        with zipfile.ZipFile(path) as z:
            return _read_metadata(z, path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is not an AOTInductor package (vitkit export --format aoti): {e}") from e


def _read_metadata(z: zipfile.ZipFile, path: str | Path) -> dict[str, str]:
    for info in z.infolist():
        if info.filename.endswith("wrapper_metadata.json"):
            check_zip_entry(info, str(path))
            if info.file_size > _META_LIMIT:
                break
            meta = json.loads(z.read(info))
            if isinstance(meta, dict):
                return {str(k): str(v) for k, v in meta.items()}
            break
    raise CheckpointError(f"{path} is not an AOTInductor package (vitkit export --format aoti): no model metadata in it")


# ---- the one door: a package validated, copied where only this user can write, and trusted or opted into ------

TRUST_HINT = ("if you made it or trust whoever did, load it with --trust-package (Python: trust=True); otherwise "
              "compile the checkpoint here: vitkit export CHECKPOINT OUT.pt2 --format aoti")
# The members AOTInductor writes for vitkit's exports, below the package's one top folder: the archive's records, and
# per model the generated C++ (and header), its metadata JSON and the shared library. Nothing else is accepted:
# not an exported program's pickled sample inputs or constants, not a custom object's pickle, not a link.
_RECORDS = {"archive_format": 64, "archive_version": 64, "byteorder": 64, ".data/version": 64,
            ".data/serialization_id": 256}
_MEMBER = re.compile(r"data/aotinductor/(?P<model>[A-Za-z0-9_]{1,64})/(?P<stem>[A-Za-z0-9_]{1,128})"
                     r"(?:\.wrapper|\.kernel)?(?P<kind>\.cpp|\.h|\.so|_metadata\.json|\.json)")
_KIND_LIMIT = {".so": 1 << 40, ".cpp": 1 << 30, ".h": 64 << 20, ".json": _META_LIMIT}
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_PICKLE = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass
class Package:
    """A package that passed `open_package`: `file` its private copy (in a folder only this user can open, removed
    with this object), `digest` its SHA-256, `trusted` whether this machine's vitkit compiled it, `meta` its
    metadata, `libraries` (member, bytes) of the native code loading it runs."""

    source: Path
    file: Path
    digest: str
    size: int
    trusted: bool
    meta: dict[str, str]
    libraries: list[tuple[str, int]]

    def describe(self) -> str:
        libs = ", ".join(f"{Path(n).name} ({gib(b)})" for n, b in self.libraries)
        made = (f"compiled by torch {self.meta.get('vitkit_torch', '?')} for {self.meta.get('vitkit_isa') or '?'}"
                if "vitkit_torch" in self.meta else "no vitkit metadata")
        return f"{self.source} (sha256 {self.digest[:16]}..., {gib(self.size)}; {made}; native code: {libs})"


def _private_copy(path: str | Path) -> tuple[Path, str, int]:
    """`path` (a regular file) copied into a new folder of mode 0700, hashed as it is copied: (the copy, SHA-256,
    bytes). Refused where the temporary folder has no room for it three times over (the copy, the archive rebuilt
    from it, the loader's extraction)."""
    with open_regular(path, error=CheckpointError) as src:
        size = os.fstat(src.fileno()).st_size
        folder = Path(tempfile.mkdtemp(prefix="vitkit-package-"))  # 0700: nobody else can swap what is checked
        try:
            free = shutil.disk_usage(folder).free
            if 3 * size > free:
                raise CheckpointError(f"{path}: {gib(size)}; loading it needs three times that in {folder.parent} (a "
                                      f"copy, the archive rebuilt from its checked members, the loader's files), which has "
                                      f"{gib(free)} free (TMPDIR picks another folder)")
            h, copy = hashlib.sha256(), folder / "package.pt2"
            with open(copy, "xb") as dst:
                copied = 0
                while chunk := src.read(1 << 20):
                    copied += len(chunk)
                    if copied > size:
                        raise CheckpointError(f"{path} grew while it was read: refused")
                    h.update(chunk)
                    dst.write(chunk)
            return copy, h.hexdigest(), copied
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise


def check_members(z: zipfile.ZipFile, path: str | Path) -> list[tuple[str, int]]:
    """Refuse a zip that is not what vitkit's exports write (see `_MEMBER`): odd or duplicate names, `..`, links and
    special members, encryption, unexpected members, pickles, members whose bytes are not their kind, bombs.
    Returns the shared libraries (name, bytes). Reads every member's first bytes, nothing more."""
    what = f"{path} (AOTInductor package)"
    infos = z.infolist()
    if not infos or len(infos) > 4096:
        raise CheckpointError(f"{what}: {len(infos)} members: not a package vitkit wrote")
    # Python's zipfile forgives bytes before the archive (it shifts every offset) and after it; torch's reader does
    # not, and would read another archive hidden there: only a zip that is nothing but itself is read at all
    z.fp.seek(0)
    start = z.fp.read(4)
    z.fp.seek(-22, os.SEEK_END)
    end = z.fp.read(22)
    if start != b"PK\x03\x04" or min(i.header_offset for i in infos) != 0 or not end.startswith(b"PK\x05\x06") \
            or end[20:22] != b"\x00\x00":
        raise CheckpointError(f"{what}: bytes before or after the archive (another zip could hide there): refused")
    roots = {i.filename.split("/", 1)[0] for i in infos}
    if len(roots) != 1 or not _SAFE_NAME.fullmatch(next(iter(roots))) or next(iter(roots)) in (".", ".."):
        raise CheckpointError(f"{what}: its members are not all in one top folder with a plain name: refused")
    seen: set[str] = set()
    libraries, total = [], 0
    for info in infos:
        name = info.filename
        rel = name.split("/", 1)[1] if "/" in name else ""
        parts = name.split("/")
        if (name in seen or name.lower() in seen or "\\" in name or "\x00" in info.orig_filename or name.startswith("/")
                or any(p in ("", ".", "..") for p in parts) or not name.isascii()):
            raise CheckpointError(f"{what}: member {name!r} has a name that could point outside the package or "
                                  f"shadow another: refused before anything is extracted")
        seen.update((name, name.lower()))
        mode = info.external_attr >> 16  # unix mode bits, where the writer set any: a type other than a file refused
        if info.is_dir() or stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if info.is_dir() else "not a regular file"
            raise CheckpointError(f"{what}: member {name!r} is {kind}: refused (a package holds regular files only)")
        if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CheckpointError(f"{what}: member {name!r} is encrypted or compressed with method "
                                  f"{info.compress_type}: not a package vitkit wrote")
        check_zip_entry(info, what)
        m = _MEMBER.fullmatch(rel)
        if rel in _RECORDS:
            limit, kind = _RECORDS[rel], "record"
        elif m:
            kind = ".json" if m["kind"].endswith(".json") else m["kind"]
            limit = _KIND_LIMIT[kind]
        else:
            raise CheckpointError(f"{what}: unexpected member {name!r}: vitkit's packages hold only AOTInductor's "
                                  f"generated C++, its metadata JSON and the shared library (an exported program's "
                                  f"pickled parts, custom objects and other files are refused: nothing is unpickled)")
        if info.file_size > limit:
            raise CheckpointError(f"{what}: member {name!r} claims {gib(info.file_size)}, over the {gib(limit)} a "
                                  f"{kind} member may have: refused")
        total += info.file_size
        with z.open(info) as f:
            head = f.read(8)
        if head.startswith(_PICKLE) or head.startswith(b"PK"):
            raise CheckpointError(f"{what}: member {name!r} holds a pickle or a nested archive: refused (vitkit "
                                  f"never unpickles)")
        if kind == ".so":
            if not head.startswith(b"\x7fELF"):
                raise CheckpointError(f"{what}: member {name!r} is not a shared library (no ELF header): refused")
            libraries.append((name, info.file_size))
        elif head.startswith(b"\x7fELF") or (kind != ".so" and b"\x00" in head):
            raise CheckpointError(f"{what}: member {name!r} holds binary code where text was expected: refused")
    if not libraries:
        raise CheckpointError(f"{what}: no shared library in it: not an AOTInductor package")
    if total > 1 << 41:
        raise CheckpointError(f"{what}: its members claim {gib(total)} in all: refused")
    return libraries


def _rebuild(copy: Path, path: str | Path) -> Path:
    """The checked members of `copy` written again, in order, into a fresh zip beside it (stored, no comment): what
    torch's loader reads is what `check_members` read through Python's zipfile, whatever tricks the original's bytes
    play on another reader (a second central directory, offsets that differ between readers)."""
    out = copy.with_name("model.pt2")
    try:
        with zipfile.ZipFile(copy) as zin, zipfile.ZipFile(out, "x", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                with zin.open(info) as src, zout.open(zipfile.ZipInfo(info.filename, info.date_time), "w",
                                                      force_zip64=info.file_size > (1 << 31)) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:  # a CRC error, a member cut short, a full disk
        raise CheckpointError(f"{path}: its members cannot be read whole ({e}): refused") from e
    return out


def _trust_dir(create: bool = False) -> Path | None:
    """`$VITKIT_HOME/trusted/packages`, if it (and `trusted/`) is this user's own folder, no link, and writable by
    nobody else; None otherwise (a shared or planted folder vouches for nothing). `create` makes it (0700)."""
    base = cache_dir() / "trusted"
    folder = base / "packages"
    if create:
        for d in (base, folder):
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700, parents=True)
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
                os.chmod(d, 0o700)  # our own folder made under a loose umask: tightened
    for d in (base, folder):
        try:
            st = os.lstat(d)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
    return folder


_MADE_HERE: set[str] = set()  # the packages this process compiled


def record_trusted(path: str | Path) -> str:
    """Vouch for a package this process compiled: its SHA-256 recorded under `$VITKIT_HOME/trusted/packages/`, so
    that this machine's vitkit loads it without an opt-in. Returns the digest. Where the folder cannot be used (not
    this user's, or writable by others), a warning says so and the package then needs --trust-package."""
    digest = sha256_of(Path(path))
    _MADE_HERE.add(digest)  # this process vouches for it even where the record cannot be written (a read-only home)
    try:
        folder = _trust_dir(create=True)
        if folder is None:
            raise PermissionError(f"{cache_dir() / 'trusted'} is not this user's own folder, or others can write it")
        record = folder / f"{digest}.json"
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"sha256": digest, "bytes": os.path.getsize(path), "torch": torch.__version__,
                       "made": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, out)
    except OSError as e:
        log.warning("could not record %s as made here (%s): loading it will need --trust-package", path, e)
    return digest


def is_trusted(digest: str) -> bool:
    """Whether this machine's vitkit compiled the package of this SHA-256 (`record_trusted`)."""
    if digest in _MADE_HERE:
        return True
    folder = _trust_dir()
    if folder is None or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return False
    try:
        st = os.lstat(folder / f"{digest}.json")
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def open_package(path: str | Path, trust: bool = False) -> Package:
    """The one door every package goes through before any of it is extracted or loaded: copied privately and
    hashed, its zip checked (`check_members`), then accepted if this machine's vitkit compiled it (`is_trusted`) or
    `trust` is given (a warning then names the native code about to run). CheckpointError otherwise, naming the
    opt-in. The caller removes nothing: the copy goes when the returned object does."""
    path = Path(path)
    copy, digest, size = _private_copy(path)
    try:
        try:
            with zipfile.ZipFile(copy) as z:
                libraries = check_members(z, path)
                meta = _read_metadata(z, path)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path} is not an AOTInductor package (vitkit export --format aoti): {e}") from e
        package = Package(path, copy, digest, size, is_trusted(digest), meta, libraries)
        if not package.trusted:
            if not trust:
                raise CheckpointError(f"{path}: a compiled package that this machine's vitkit did not make (or that "
                                      f"changed since): loading it runs its native code "
                                      f"({', '.join(Path(n).name for n, _ in libraries)}) with your permissions; "
                                      f"{TRUST_HINT}")
            # a warning: shown on stderr where the program set no logging up, the opt-in's chance to be read before the
            # code runs
            log.warning(f"loading {package.describe()}: its native code runs in this process with your permissions, "
                        f"as you asked (--trust-package)")
        package.file = _rebuild(copy, path)
        copy.unlink()  # only the rebuilt archive is kept, and only it is handed to torch
    except BaseException:
        shutil.rmtree(copy.parent, ignore_errors=True)
        raise
    weakref.finalize(package, shutil.rmtree, str(copy.parent), True)
    return package


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


def load_package(path: str | Path, trust: bool = False) -> tuple[Callable[..., torch.Tensor], dict[str, str]]:
    """An AOTInductor package loaded for inference: (a function of the traced inputs -> float32 logits, its
    metadata). Through `open_package` (validated, private, trusted or `trust`), then checked (`check_runnable`);
    torch's loader is handed the checked private copy, never the original."""
    package = open_package(path, trust=trust)
    meta = package.meta
    check_runnable(meta, path)
    from torch._inductor import aoti_load_package  # start-up time: Inductor costs ~0.5 s to import

    try:
        runner = aoti_load_package(str(package.file))
    except Exception as e:
        raise CheckpointError(f"{path}: AOTInductor could not load it: {str(e).splitlines()[0][:200]}") from e

    loader = runner.loader  # its boxed call: what runner(*x) does, without re-reading the call's spec every time

    def run(*x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return loader.boxed_run(list(x))[0]  # one tensor in the graph's output (the logits)

    run.package = package  # the private copy lives as long as the function
    return run, meta
