"""Reading tensors from checkpoint files without unpickling anything untrusted."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..errors import VitkitError


class CheckpointError(VitkitError, ValueError):
    """A checkpoint that is missing, truncated, of an unknown format or that does not fit the model."""


def sniff(path: Path) -> str:
    """The container of a file from its bytes: "dir", "npz", "torch", "safetensors"."""
    if path.is_dir():
        return "dir"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 8:
        raise CheckpointError(f"{path} is empty or truncated ({len(head)} bytes)")
    if head[:2] == b"PK":
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile as e:
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


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: torch.from_numpy(np.array(z[k], dtype=np.float32)) for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"cannot read {path} as .npz (truncated, or holds pickled objects): {e}") from e


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
        return tensors, meta
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt): {e}") from e


def read_torch(path: Path) -> dict[str, torch.Tensor]:
    """A state dict saved with torch.save, loaded with weights_only=True (no arbitrary unpickling)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types here; all mean "not a safe state dict"
        raise CheckpointError(
            f"cannot read {path} as a PyTorch state dict with weights_only=True (truncated, or it holds objects "
            f"other than tensors, which vitkit refuses to unpickle): {e}"
        ) from e
    for key in ("state_dict", "model", "model_state", "module", "ema"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
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


def read_hf_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} is a folder without config.json (expected a Hugging Face model folder)")
    config = json.loads(cfg_file.read_text())
    if (path / "model.safetensors").exists():
        tensors, _ = read_safetensors(path / "model.safetensors")
    elif (path / "pytorch_model.bin").exists():
        tensors = read_torch(path / "pytorch_model.bin")
    else:
        raise CheckpointError(f"{path} has no model.safetensors or pytorch_model.bin")
    return tensors, config
