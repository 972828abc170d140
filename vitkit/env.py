"""vitkit's environment knobs (`VITKIT_*`), in one table, each parsed from `os.environ` when it is used.

Nothing here runs at import: `import vitkit` and `vitkit --help` work whatever the environment holds. A knob is read
with `get(name)` at the moment it is used (so a test or a long-lived process may change it), and a value it cannot
work with is a `UsageError` naming the variable, its value and what it must be, one line:

    VITKIT_FETCH_DEADLINE_S='abc': must be a finite number in (0, 1e+09] (seconds)

`vitkit COMMAND` checks every knob that is set before the command starts (`check_all`), so a bad one is
`vitkit: error: ...`, exit 2, before any work. An empty value is the same as an unset one (`VAR= vitkit ...`).
`markdown_table()` is the table docs/safety.md shows (a test keeps the two equal).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UsageError

_INT_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Knob:
    """One environment variable: its kind ("int", "float", "choice", "path", "secret"), its default (None: off),
    the range [lo, hi] of a number (a float's lo is exclusive when `lo_open`), a choice's values, and its meaning."""

    name: str
    kind: str
    default: Any
    meaning: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()
    unit: str = ""

    def requirement(self) -> str:
        """What a value must be, in words."""
        if self.kind == "int":
            return f"an integer in [{self.lo:,}, {self.hi:,}]" if self.hi != _INT_MAX else f"an integer >= {self.lo:,}"
        if self.kind == "float":
            return f"a finite number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "secret":
            return "printable characters without spaces"
        return "a path"

    def default_text(self) -> str:
        if self.default is None:
            return "unset"
        if self.kind == "int":
            return f"{self.default:,}"
        if self.kind == "float":
            return f"{self.default:g}"
        return str(self.default)


def _bytes(name: str, default: int, meaning: str) -> Knob:
    return Knob(name, "int", default, meaning, lo=1, hi=_INT_MAX, unit="bytes")


KNOBS: dict[str, Knob] = {k.name: k for k in (
    _bytes("VITKIT_MAX_TENSOR_BYTES", 1 << 30, "the most one tensor of a checkpoint (or one dataset array) may take, "
           "as float32 once read"),
    _bytes("VITKIT_MAX_TEXT_BYTES", 16 << 20, "the largest config.json, YAML, index.json or JSON request body read"),
    Knob("VITKIT_MAX_NESTING", "int", 64, "how deep lists and mappings of a JSON/YAML document may nest",
         lo=1, hi=100_000),
    Knob("VITKIT_MAX_NODES", "int", 1_000_000, "the most values one JSON/YAML document may hold (YAML aliases "
         "counted each time they are reached)", lo=1, hi=_INT_MAX),
    Knob("VITKIT_MAX_COMPRESSION_RATIO", "int", 200, "the most a zip entry over 16 MiB may expand over its "
         "compressed size (a decompression bomb beyond)", lo=1, hi=_INT_MAX),
    _bytes("VITKIT_MAX_SAMPLE_BYTES", 64 << 20, "the largest single image file of a dataset shard or of `vitkit "
           "data pack`"),
    Knob("VITKIT_MAX_IMAGE_PIXELS", "int", 64 * 1024 * 1024, "the most pixels an image may declare before it is "
         "decoded (a decompression bomb beyond)", lo=1, hi=_INT_MAX, unit="pixels"),
    _bytes("VITKIT_MAX_DOWNLOAD_BYTES", 64 << 30, "the largest download (declared or sent) of a checkpoint or "
           "dataset"),
    Knob("VITKIT_FETCH_DEADLINE_S", "float", 60.0, "every network fetch's wall-clock budget (connect, headers, body), "
         "whatever its size ...", lo=0, hi=1e9, lo_open=True, unit="seconds"),
    Knob("VITKIT_FETCH_MIN_RATE", "float", 100_000.0, "... plus its size at this rate: a slower server is cut off",
         lo=1, hi=1e15, unit="bytes/s"),
    Knob("VITKIT_GEMM", "choice", None, "force this float32 GEMM path instead of measuring the fastest "
         "(`vitkit.machine.gemm`)", choices=("mkl", "mkl-packed", "onednn-packed")),
    Knob("VITKIT_HOME", "path", "~/.cache/vitkit", "vitkit's cache: downloads, datasets, machine measurements, "
         "exports"),
    Knob("VITKIT_DATA", "path", None, "where to look for the named datasets (after --data-dir)"),
    Knob("VITKIT_RUN_START", "float", None, "when the `vitkit` command started (seconds since the epoch): written by "
         "the command for the processes it launches; where `schedule.time_budget` counts from", lo=0, hi=1e12,
         unit="seconds"),
    Knob("VITKIT_INDUCTOR_CACHE_BASE", "path", None, "Inductor's cache folder as the user had it: written by vitkit "
         "where instruction-set caps move TORCHINDUCTOR_CACHE_DIR into a folder of their own, so a process it launches "
         "without caps goes back to it (`vitkit.machine.cpu.inductor_cache_for_caps`)"),
    Knob("VITKIT_API_KEY", "secret", None, "`vitkit serve`'s API key when --api-key is not given (requests without "
         "it get 401)"),
)}


def parse(name: str, text: str | None) -> Any:
    """`text` as the value of knob `name` (None or "": its default); a UsageError names the variable otherwise."""
    knob = KNOBS[name]
    if text is None or text == "":
        return Path(knob.default).expanduser() if knob.kind == "path" and knob.default is not None else knob.default

    def bad(why: str = "") -> UsageError:
        shown = f" (set, {len(text)} characters)" if knob.kind == "secret" else f"={text[:80]!r}"
        unset = f"unset it for the default ({knob.default_text()})" if knob.default is not None else "or unset it"
        return UsageError(f"{name}{shown}: must be {knob.requirement()}{why}"
                          f"{f' ({knob.unit})' if knob.unit else ''}; {unset}")

    if knob.kind == "int":
        if len(text) > 40 or not re.fullmatch(r"\s*[+-]?[0-9]+(_[0-9]+)*\s*", text):  # no "1.5", "1e9", "0x10", "nan"
            raise bad()
        value = int(text)
        if not knob.lo <= value <= knob.hi:
            raise bad()
        return value
    if knob.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise bad() from None
        if not math.isfinite(value) or value > knob.hi or value < knob.lo or (knob.lo_open and value == knob.lo):
            raise bad()
        return value
    if knob.kind == "choice":
        if text not in knob.choices:
            raise bad()
        return text
    if knob.kind == "secret":
        if not text.isprintable() or any(c.isspace() for c in text):
            raise bad()
        return text
    if "\0" in text:  # a path
        raise bad(" (it holds a NUL byte)")
    return Path(text).expanduser()


def get(name: str) -> Any:
    """The knob's value now: parsed from os.environ (its default when unset), or a UsageError naming it."""
    return parse(name, os.environ.get(name))


def check_all() -> None:
    """Parse every knob that is set: the first bad one is a UsageError (what `vitkit COMMAND` runs first)."""
    for name in KNOBS:
        get(name)


def markdown_table() -> str:
    """The knobs as the Markdown table of docs/safety.md."""
    rows = ["| variable | default | must be | meaning |", "|---|---|---|---|"]
    for k in KNOBS.values():
        unit = f" ({k.unit})" if k.unit else ""
        rows.append(f"| `{k.name}` | {k.default_text()} | {k.requirement()}{unit} | {k.meaning} |")
    return "\n".join(rows)
