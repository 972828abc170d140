"""Which device to run on: one place for the CLI's `--device` and the training config's `run.device`."""
from __future__ import annotations

import torch
from ..errors import UsageError


def resolve_device(name: str) -> torch.device:
    """'auto' -> a CUDA GPU if there is one, else the CPU; 'cpu', 'cuda', 'cuda:N' as given, checked.

    Raises ValueError for a name torch does not know, or a GPU this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {name!r} asked for, but this torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {name!r} asked for, but there are {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run asynchronously; a CPU's calls return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
