"""Reading tensors from checkpoint files without unpickling anything untrusted."""
from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from .. import env
from ..errors import CheckpointError
from ..safety import (MAX_SAFETENSORS_HEADER, check_alloc, check_regular, check_tensor,
                      check_zip_entry, gib, open_regular, parse_json, read_bytes, untrusted)
from safetensors import safe_open

__all__ = ["CheckpointError", "sniff", "read_npz", "read_safetensors", "read_torch", "read_hf_dir", "rename"]


def sniff(path: Path) -> str:
    """The container of a file from its bytes: "dir", "npz", "torch", "safetensors". A FIFO, socket or device is
    refused before it is read (`open_regular`)."""
    if path.is_dir():
        return "dir"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    with open_regular(path, error=CheckpointError) as f:
        head = f.read(16)
    if len(head) < 8:
        raise CheckpointError(f"{path} is empty or truncated ({len(head)} bytes)")
    if head[:2] == b"PK":
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, ValueError, OSError, NotImplementedError, EOFError) as e:
            raise CheckpointError(f"{path} is a truncated or corrupt zip archive (npz / torch file): {e}") from e
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "torch"
    n = int.from_bytes(head[:8], "little")
    if head[8:9] == b"{" and 0 < n < 100_000_000:
        return "safetensors"
    if head[:2] == b"\x80\x02" or head[:1] == b"\x80":
        return "torch"  # legacy (non-zip) torch.save
    raise CheckpointError(f"{path} is not a checkpoint vitkit can read (not npz, safetensors, torch or a HF folder)")


def _npy_header(f) -> tuple[tuple, "np.dtype", int]:
    """An .npy stream's (shape, dtype, header length), read from its header only."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f, max_header_size=100_000)
    return tuple(shape), dtype, f.tell()


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    """An .npz's arrays as float32 tensors. Every entry's header is checked before any array is read: no object
    arrays (pickle), a shape whose size is what the zip entry holds, under the one-tensor limit, no decompression
    bomb, and all of them within this process's memory."""
    what = f"{path}"
    with untrusted(what), open_regular(path, error=CheckpointError) as file:
        with zipfile.ZipFile(file) as z:
            total = 0
            for info in z.infolist():
                check_zip_entry(info, what)
                with z.open(info) as f:
                    shape, dtype, header = _npy_header(f)
                name = info.filename.removesuffix(".npy")
                if dtype.hasobject:
                    raise CheckpointError(f"{what}: array {name!r} holds Python objects (pickled): refused")
                if math.prod(shape) * dtype.itemsize != info.file_size - header:
                    raise CheckpointError(f"{what}: array {name!r} claims shape {shape} of {dtype} "
                                          f"({math.prod(shape) * dtype.itemsize:,} bytes) but its entry holds "
                                          f"{info.file_size - header:,}")
                total += check_tensor(name, shape, dtype.itemsize, what)
            check_alloc(total, f"{what} ({len(z.infolist())} arrays)")
        file.seek(0)
        with np.load(file, allow_pickle=False) as z:
            return {k: torch.from_numpy(np.array(z[k], dtype=np.float32)) for k in z.files}


def safetensors_header(path: Path) -> dict:
    """A .safetensors file's header, checked against the file: offsets inside it, sizes that match each tensor's
    shape and dtype, every tensor under the one-tensor limit."""
    what = f"{path}"
    with open_regular(path, error=CheckpointError) as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise CheckpointError(f"{what}: the safetensors header claims {n:,} bytes in a file of {size:,}")
        header = parse_json(f.read(n), f"{what} (safetensors header)", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{what}: the safetensors header is not a mapping")
    data, total = size - 8 - n, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (start, end), dtype = tuple(entry["shape"]), entry["data_offsets"], entry["dtype"]
            itemsize = _ST_ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{what}: tensor {name!r} has a malformed header entry {str(entry)[:200]}") from e
        nbytes = check_tensor(name, shape, itemsize, what)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data
                and end - start == math.prod(shape) * itemsize):
            raise CheckpointError(f"{what}: tensor {name!r} claims bytes {start}-{end} for shape {shape} of {dtype}; "
                                  f"the file holds {data:,} bytes of data")
        total += nbytes
    check_alloc(total, what)
    return header


_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:

    with untrusted(f"{path}"):
        safetensors_header(path)
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
        return tensors, meta


def read_torch(path: Path) -> dict[str, torch.Tensor]:
    """A state dict saved with torch.save, loaded with weights_only=True (no arbitrary unpickling). A zip archive's
    entries are checked first (no decompression bomb, the data within this process's memory)."""
    what = f"{path}"
    with untrusted(what):
        check_regular(path, error=CheckpointError)  # torch.load opens the path itself
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                total = 0
                for info in z.infolist():
                    check_zip_entry(info, what)
                    if info.file_size > env.get("VITKIT_MAX_TENSOR_BYTES"):
                        raise CheckpointError(f"{what}: entry {info.filename!r} holds {gib(info.file_size)}, over "
                                              f"the limit for one tensor's storage (VITKIT_MAX_TENSOR_BYTES)")
                    total += info.file_size
                check_alloc(total, what)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"cannot read {path} as a PyTorch state dict with weights_only=True (truncated, or it holds objects "
                f"other than tensors, which vitkit refuses to unpickle): {type(e).__name__}: {e}"
            ) from e
    for key in ("state_dict", "model", "model_state", "module", "ema"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def rename(key: str, exact: dict[str, str], prefixes: dict[str, str]) -> str | None:
    """A peer's tensor name in vitkit's terms by exact match or by prefix; None when neither table knows it."""
    if key in exact:
        return exact[key]
    for old, new in prefixes.items():
        if key.startswith(old):
            return new + key[len(old):]
    return None


def expect_shape(key: str, t: torch.Tensor, shape: tuple[int, ...], why: str = "") -> torch.Tensor:
    """`t`, if its shape is `shape`: a converter's check of a tensor it consumes (one that never reaches the model's
    own shape check, as a mask it multiplies by, whose wrong shape would broadcast silently). Refused naming the key
    and the shape expected otherwise."""
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{key}: shape {tuple(t.shape)}, expected {tuple(shape)}{f' ({why})' if why else ''}")
    return t


def fuse(parts: dict[str, torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Tensors of one shape (a query, key and value projection, by their keys) concatenated along `dim`: parts of
    different shapes would fuse into a tensor of the right total shape whose rows belong to the wrong projection, so
    they are refused naming each key's shape."""
    shapes = {k: tuple(t.shape) for k, t in parts.items()}
    if len(set(shapes.values())) > 1:
        raise CheckpointError("tensors that must have one shape differ: " + ", ".join(f"{k} {s}" for k, s in shapes.items()))
    return torch.cat(list(parts.values()), dim)


def read_hf_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} is a folder without config.json (expected a Hugging Face model folder)")
    config = parse_json(read_bytes(cfg_file, error=CheckpointError), f"{cfg_file}", CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_file} does not hold a JSON object")
    if (path / "model.safetensors").exists():
        tensors, _ = read_safetensors(path / "model.safetensors")
    elif (path / "pytorch_model.bin").exists():
        tensors = read_torch(path / "pytorch_model.bin")
    else:
        raise CheckpointError(f"{path} has no model.safetensors or pytorch_model.bin")
    return tensors, config


def read_meta(step_dir: Path) -> dict:
    """A training run's step record (`meta.json` of checkpoints/step-N: the run's config and its model's)."""
    meta = parse_json(read_bytes(step_dir / "meta.json", error=CheckpointError), str(step_dir / "meta.json"),
                      CheckpointError)
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{step_dir / 'meta.json'} is not a vitkit run's step record")
    return meta
