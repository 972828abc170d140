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

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def cache_dir() -> Path:
    """`$VITKIT_HOME`, by default `~/.cache/vitkit`: read at every call, so a test or a user can move it."""
    from . import env  # the knob's one parser (vitkit.env); imported here, where it is used

    return env.get("VITKIT_HOME")


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file in `path`'s folder, then rename it over `path`: a reader sees the old
    file or the new one, never half of one, and a failed or interrupted write leaves the old file intact (the
    temporary file removed). The folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
