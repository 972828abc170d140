"""vitkit's cache and its writes, in one place: where cached things live (`$VITKIT_HOME`), how a file is written so
that a reader never sees half of it (`atomic_write`), and the small JSON records keyed by the machine (the GEMM
choice, the precision probe, the engine choice) that are best kept but never worth failing for (`read_json_cache`,
`write_json_cache`).

Downloads (`checkpoints.catalog`), datasets, ONNX exports and the machine measurements all live under `cache_dir()`:

    $VITKIT_HOME (default ~/.cache/vitkit)/
        <catalog name>/, urls/, verified/    downloaded checkpoints and their verification markers
        data/<dataset>/                      downloaded datasets
        gemm/, precision/, backends/         what was measured on this machine (JSON, keyed by `machine.cpu.machine_key`)
        backends/exports/                    the ONNX exports the engines run
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import UsageError


def cache_dir() -> Path:
    """`$VITKIT_HOME`, by default `~/.cache/vitkit`: read at every call, so a test or a user can move it."""
    from . import env  # the knob's one parser (vitkit.env); imported here, where it is used

    return env.get("VITKIT_HOME")


class WriteError(UsageError, OSError):
    """An output vitkit will not write (a FIFO, socket, device, folder or symbolic link where a file is to be
    written), or a write the system refused (a full disk, a quota, a read-only filesystem): one line, and the file
    that was there is intact. Also an OSError, so that a caller that shrugs off a failed write (`write_json_cache`)
    still does."""


_NOT_REPLACEABLE = ((stat.S_ISFIFO, "a FIFO (named pipe): opening it for writing waits for a reader"),
                    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                    (stat.S_ISDIR, "a folder"))
# what a write may fail with that is the system's answer, not a bug: said in one line, the old file kept
_WRITE_ERRNOS = tuple(n for n in (getattr(errno, name, None) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EIO"))
                      if n is not None)


def check_output(path: str | Path) -> Path:
    """`path`, if vitkit may write it: missing, or a regular file (which a write replaces). Anything else is refused
    (`WriteError`, naming it) from its `lstat`, before anything opens it: a FIFO (opening it to write waits for a
    reader), a device or socket (a rename would put a file where /dev/null was), a folder, or a symbolic link
    (replacing it would destroy the link, and writing through it would write where it points, a path vitkit was not
    given: the message names that path, to be given instead). The one check every output of vitkit goes through
    (`atomic_write`, `replace_output`, `open_output`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Path(path)
    except OSError as e:  # a path too long, a component that is no folder, ...
        raise WriteError(f"{path}: cannot be written ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode):
        return Path(path)
    if stat.S_ISLNK(st.st_mode):
        raise WriteError(f"{path}: a symbolic link (to {os.readlink(path)}), not a regular file: refused as an output "
                         f"(vitkit replaces regular files only; give the file it points to, or remove the link)")
    kind = next((name for test, name in _NOT_REPLACEABLE if test(st.st_mode)), f"mode {st.st_mode:#o}")
    raise WriteError(f"{path}: {kind}, not a regular file: refused as an output (vitkit writes regular files only, "
                     f"and leaves anything else where it is)")


def write_failure(error: BaseException, path: str | Path) -> WriteError | None:
    """A `WriteError` naming `path` if `error` is the system refusing a write (no space, a quota, a file size
    limit, a read-only filesystem, an I/O error), as an OSError or as a library's own exception that quotes it
    (safetensors, torch); None for anything else."""
    if isinstance(error, WriteError):
        return error
    reason = None
    if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
        reason = error.strerror or os.strerror(error.errno)
    else:
        text = str(error)
        reason = next((os.strerror(n) for n in _WRITE_ERRNOS if os.strerror(n) in text or f"os error {n})" in text),
                      None)
    return None if reason is None else WriteError(f"{path}: could not be written ({reason})")


def replace_output(src: str | Path, dst: str | Path) -> Path:
    """Rename `src` (a finished temporary file) over `dst`, if `dst` is missing or a regular file (`check_output`,
    checked right before the rename)."""
    dst = check_output(dst)
    os.replace(src, dst)
    return dst


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file in `path`'s folder, then rename it over `path`: a reader sees the old
    file or the new one, never half of one, and a failed or interrupted write leaves the old file intact (the
    temporary file removed). The folder is created. `path` must be missing or a regular file (`check_output`: a
    FIFO, device, socket, folder or symbolic link is refused before anything is written); a write the system
    refuses (a full disk) is a `WriteError`, the old file intact."""
    path = check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        replace_output(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        failed = write_failure(e, path) if isinstance(e, Exception) else None
        if failed is not None and failed is not e:
            raise WriteError(f"{failed}; {'the file there is unchanged' if path.exists() else 'nothing was written'}"
                             ) from e
        raise
    return path


def output_dir(path: str | Path, make: bool = True) -> Path:
    """`path` made a folder to write outputs into (its parents too), or a `WriteError` naming it: a file, FIFO,
    device, socket or a link to nowhere where the folder should be, or a parent that is not a folder. A link to a
    folder is followed (the user named that folder). Called before the work whose outputs go there; `make=False`
    only checks (a missing folder passes, its nearest existing parent must be a folder), creating nothing."""
    p = Path(path)
    try:
        if make:
            p.mkdir(parents=True, exist_ok=True)
            return p
        q = p
        while not os.path.lexists(q) and q != q.parent:
            q = q.parent
        if not os.path.isdir(q):
            raise FileExistsError(q)
        return p
    except (FileExistsError, NotADirectoryError):
        try:
            st = os.stat(p)
        except OSError:
            raise WriteError(f"{p}: a link to nowhere, or below something that is not a folder: refused as an output "
                             f"folder") from None
        kind = next((name for test, name in _NOT_REPLACEABLE if test(st.st_mode)), "a file")
        raise WriteError(f"{p}: {kind.split(':')[0]}, not a folder: refused as an output folder (vitkit leaves it as it "
                         f"is)") from None
    except OSError as e:
        raise write_failure(e, p) or WriteError(f"{p}: cannot be made a folder ({e.strerror or e})") from None


def open_output(path: str | Path, keep: int = 0):
    """`path` opened to write text (UTF-8, newlines as written) after its first `keep` bytes (0: emptied), if it
    is missing or a regular file (`check_output`), checked again on what was opened: opened without following a
    symbolic link and without blocking (a FIFO put there since the check is refused, not waited on)."""
    path = check_output(path)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link or a FIFO without a reader, put there since the check
            check_output(path)
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WriteError(f"{path}: not a regular file (replaced while it was opened): refused as an output")
        os.set_blocking(fd, True)
        os.ftruncate(fd, keep)
        os.lseek(fd, 0, os.SEEK_END)
        return os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="")
    except BaseException:
        os.close(fd)
        raise


def read_json_cache(path: Path, default: Any) -> Any:
    """A cached JSON record, or `default` when it is missing, unreadable or not JSON (measured again then)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def write_json_cache(path: Path, data: Any, **dumps) -> bool:
    """Write a cached JSON record atomically; False (nothing raised) where the cache cannot be written, e.g. a
    read-only home: the measurement is simply made again next time."""
    try:
        atomic_write(path, lambda p: p.write_text(json.dumps(data, **dumps)))
        return True
    except OSError:
        return False
