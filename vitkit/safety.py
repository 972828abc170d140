"""Limits on what untrusted bytes may claim, and the one error path for reading them.

vitkit reads files from strangers (checkpoints, configs, dataset shards over HTTP) and request bodies from the
network. Two rules hold for every such read:

1. **Limits before allocation.** What a file claims (an array's shape and dtype, a zip entry's uncompressed size, a
   shard's byte range, a model's size from its config, a document's nesting) is checked against what it can be,
   and against the memory this process has, before anything of that size is read or allocated. A violation names
   the file and the field.
2. **One error path.** Every parse of untrusted bytes runs inside `untrusted(what)`: the libraries' own exceptions
   (zip, json, yaml, PIL, safetensors, numpy, torch), and MemoryError or RecursionError caused by the input, become
   one vitkit error naming the file, which the CLI prints as one line (`vitkit: error: ...`, exit 2).

The limits are generous for real models (ViT-22B's largest tensor is 0.6 GB in fp32) and each can be raised by an
environment variable.
"""
from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import resource
from pathlib import Path
from typing import Any, Iterator

from .errors import CheckpointError, UsageError, VitkitError


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


MAX_TENSOR_BYTES = _env_int("VITKIT_MAX_TENSOR_BYTES", 1 << 30)  # one array, as float32 once read
MAX_TEXT_BYTES = _env_int("VITKIT_MAX_TEXT_BYTES", 16 << 20)  # a config.json / YAML / index.json / JSON body
MAX_NESTING = _env_int("VITKIT_MAX_NESTING", 64)  # lists and mappings inside each other
MAX_NODES = _env_int("VITKIT_MAX_NODES", 1_000_000)  # values in one document (YAML aliases can multiply them)
MAX_COMPRESSION_RATIO = _env_int("VITKIT_MAX_COMPRESSION_RATIO", 200)  # for zip entries over 16 MiB
MAX_SAMPLE_BYTES = _env_int("VITKIT_MAX_SAMPLE_BYTES", 64 << 20)  # one image of a dataset shard
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit


def memory_budget() -> int:
    """Bytes this process may still allocate: the machine's available memory, or what is left under RLIMIT_AS
    when a lower address-space limit is set."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            used = 0
        left = max(soft - used, 0)
        avail = left if avail is None else min(avail, left)
    return avail if avail is not None else 1 << 62


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_alloc(nbytes: int, what: str, error: type[VitkitError] = CheckpointError) -> None:
    """Refuse to allocate `nbytes` for `what` when this process does not have them."""
    budget = memory_budget()
    if nbytes > budget:
        raise error(f"{what} needs {gib(nbytes)}, more than the {gib(budget)} of memory this process has left: refused "
                    f"before allocating")


def check_tensor(name: str, shape: tuple, itemsize: int, what: str) -> int:
    """The bytes an array of `shape` takes as float32 (or its own itemsize if larger); refused over the limit or
    with a negative or non-integer dimension."""
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{what}: tensor {name!r} has an invalid shape {shape}")
    nbytes = math.prod(shape) * max(itemsize, 4)
    if nbytes > MAX_TENSOR_BYTES:
        raise CheckpointError(f"{what}: tensor {name!r} claims shape {tuple(shape)} ({gib(nbytes)}), over the limit of "
                              f"{gib(MAX_TENSOR_BYTES)} for one tensor (no published ViT has one that large; "
                              f"VITKIT_MAX_TENSOR_BYTES raises it)")
    return nbytes


def check_zip_entry(info, what: str) -> None:
    """A zip entry whose uncompressed size is far beyond its compressed one: a decompression bomb."""
    if info.file_size > 16 << 20 and info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
        raise CheckpointError(f"{what}: entry {info.filename!r} expands from {gib(info.compress_size)} to "
                              f"{gib(info.file_size)} ({info.file_size // max(info.compress_size, 1)}x): refused as a "
                              f"decompression bomb (real checkpoints compress less than {MAX_COMPRESSION_RATIO}x; "
                              f"VITKIT_MAX_COMPRESSION_RATIO raises it)")


def check_tree(obj: Any, what: str, error: type[VitkitError] = UsageError) -> Any:
    """A parsed JSON/YAML document within MAX_NESTING levels and MAX_NODES values (shared YAML aliases count every
    time they are reached, as a walk over the document would reach them)."""
    stack, nodes = [(obj, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise error(f"{what}: more than {MAX_NODES:,} values (YAML aliases can multiply a small file): refused")
        if isinstance(node, (dict, list, tuple)):
            if depth > MAX_NESTING:
                raise error(f"{what}: nested more than {MAX_NESTING} levels deep: refused")
            children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return obj


def read_bytes(path: str | Path, what: str | None = None, limit: int = MAX_TEXT_BYTES,
               error: type[VitkitError] = UsageError) -> bytes:
    """A small file's bytes (a config, an index), refused from its size before it is read."""
    path = Path(path)
    size = path.stat().st_size
    if size > limit:
        raise error(f"{what or path}: {gib(size)}, over the limit of {gib(limit)} for a file of this kind "
                    f"(VITKIT_MAX_TEXT_BYTES raises it)")
    return path.read_bytes()


def parse_json(data: str | bytes, what: str, error: type[VitkitError] = UsageError) -> Any:
    """JSON from untrusted bytes: size, nesting and values bounded; any failure is `error` naming `what`."""
    if len(data) > MAX_TEXT_BYTES:
        raise error(f"{what}: {gib(len(data))} of JSON, over the limit of {gib(MAX_TEXT_BYTES)} "
                    f"(VITKIT_MAX_TEXT_BYTES)")
    with untrusted(what, error):
        return check_tree(json.loads(data), what, error)


def parse_yaml(text: str, what: str, error: type[VitkitError] = UsageError) -> Any:
    """YAML with the safe loader (no Python tags): size, nesting and values bounded."""
    import yaml

    if len(text) > MAX_TEXT_BYTES:
        raise error(f"{what}: {gib(len(text))} of YAML, over the limit of {gib(MAX_TEXT_BYTES)} "
                    f"(VITKIT_MAX_TEXT_BYTES)")
    with untrusted(what, error):
        try:
            return check_tree(yaml.safe_load(text), what, error)
        except yaml.constructor.ConstructorError as e:
            raise error(f"{what}: {e.problem or e} (vitkit reads plain YAML only: Python tags such as !!python/... "
                        f"are refused)") from e
        except yaml.YAMLError as e:
            raise error(f"{what}: not valid YAML ({' '.join(str(e).split())})") from e


def _renamed(e: VitkitError, what: str) -> VitkitError:
    try:
        new = type(e)(f"{what}: {e}")
    except Exception:  # noqa: BLE001 - an error type with another signature keeps its own message
        return e
    new.__cause__ = e.__cause__
    return new


@contextlib.contextmanager
def untrusted(what: str, error: type[VitkitError] = CheckpointError) -> Iterator[None]:
    """Run a parse of untrusted bytes: any failure ends as `error` (or the vitkit error raised inside) naming
    `what`. MemoryError and RecursionError are refusals here: the input asked for them."""
    try:
        yield
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, KeyboardInterrupt):
        raise
    except VitkitError as e:
        if what in str(e):
            raise
        raise _renamed(e, what) from e.__cause__
    except MemoryError:
        raise error(f"{what}: reading it ran out of memory (it claims more than this process can hold): "
                    f"refused") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply to read: refused") from None
    except Exception as e:  # noqa: BLE001 - the libraries raise many types on bad bytes; each is a refusal
        detail = " ".join(str(e).split())[:500]
        raise error(f"{what}: cannot be read ({type(e).__name__}: {detail})") from e


# The bounds of a model config's sizes: far beyond any published model, small enough that a hostile or mistyped
# number is refused by name before the model is built (`build_model` then checks the whole model against memory).
SIZE_BOUNDS = {
    "img_size": (1, 16384), "patch_size": (1, 4096), "in_chans": (1, 256), "num_classes": (0, 10_000_000),
    "embed_dim": (1, 65536), "depth": (0, 1024), "num_heads": (1, 4096), "mlp_dim": (1, 1 << 20),
    "representation_size": (1, 65536), "reg_tokens": (0, 4096), "depths": (0, 1024), "window_size": (1, 1024),
    "layers": (0, 1024), "width_factor": (1, 64), "channels": (1, 1 << 20), "stem_width": (1, 1 << 16),
    "hybrid_layers": (0, 1024), "rope_ref_grid": (1, 16384),
}


def _fits(value: Any, base: str) -> bool:
    if base == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if base == "bool":
        return isinstance(value, (bool, numbers.Integral)) and value in (0, 1)
    if base == "str":
        return isinstance(value, str)
    if base.startswith(("tuple[", "list[")):  # a tuple field also takes one value (img_size=224)
        inner = base[base.index("[") + 1:].split(",")[0].rstrip("]").strip()
        items = value if isinstance(value, (list, tuple)) else (value,) if base.startswith("tuple[") else None
        return items is not None and len(items) <= 4096 and all(_fits(v, inner) for v in items)
    return True


def check_types(config: Any) -> None:
    """Every field of a model config dataclass holds a value of its declared type (ints, finite floats, booleans,
    strings, tuples of them; None only where the field allows it): a UsageError names the field otherwise. Run
    before any conversion, so that a file's or an override's wrong value is refused by name."""
    import dataclasses

    for f in dataclasses.fields(config):
        ann = f.type if isinstance(f.type, str) else str(f.type)
        value, optional = getattr(config, f.name), "None" in ann
        base = ann.replace("| None", "").replace("None |", "").strip()
        if value is None and (optional or f.default is None):
            continue
        if value is None or not _fits(value, base):
            raise UsageError(f"{type(config).__name__}.{f.name}={str(value)[:100]!r}: must be {ann}")


def check_sizes(config: Any) -> None:
    """Every size field of a model config: integers within SIZE_BOUNDS (one value or each of a tuple); a
    UsageError names the field otherwise."""
    for name, (lo, hi) in SIZE_BOUNDS.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
                raise UsageError(f"{type(config).__name__}.{name}={value!r}: must be "
                                 f"{'integers' if isinstance(value, (tuple, list)) else 'an integer'} in [{lo}, {hi}]")
    for name in ("mean", "std"):
        value = getattr(config, name, None)
        if value is not None and (not 1 <= len(value) <= 256 or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                                                        for v in value)):
            raise UsageError(f"{type(config).__name__}.{name}={value!r}: must be 1 to 256 finite numbers")
