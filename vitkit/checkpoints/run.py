"""A training run's step folder as a checkpoint: `meta.json` (the run's config and the model's) and the tensors
torch.distributed.checkpoint (DCP) wrote, read without unpickling anything but DCP's own index types
(`SafeReader`, `SafeLoadPlanner`). `vitkit.training.checkpoint` writes these folders and resumes from them;
`vitkit.load(step_folder)` reads the weights for inference."""
from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element

from ..errors import CheckpointError, VitkitError
from ..safety import open_regular, untrusted


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# DCP writes its index (.metadata) with pickle and loads non-tensor items with torch.load(weights_only=False): a
# step folder from someone else could run code through either. vitkit reads both with allow-lists instead.
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a checkpoint index (only DCP's own metadata types)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the index unpickled through an allow-list and every storage it names checked to be a
    file of the step folder that holds the bytes it claims."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        with untrusted(str(path)):
            with open_regular(path, error=CheckpointError) as f:  # a FIFO here would block the reader
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, dcp.metadata.Metadata):
                raise CheckpointError(f"{path} is not DCP metadata")
            for info in (metadata.storage_data or {}).values():
                name = str(getattr(info, "relative_path", ""))
                file = Path(self.path) / name
                if "/" in name or name.startswith(".") or not file.is_file():
                    raise CheckpointError(f"{path}: a storage in {name!r}, not a file of the step folder")
                if info.offset < 0 or info.length < 0 or info.offset + info.length > file.stat().st_size:
                    raise CheckpointError(f"{path}: {name} bytes {info.offset}-{info.offset + info.length} claimed, "
                                          f"the file has {file.stat().st_size}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp.metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state: dict, step_dir: Path) -> None:
    """dcp.load through the safe reader and planner. DCP wraps every failure in a CheckpointException (a
    BaseException, which no `except Exception` sees): the first rank's error is raised instead, as a vitkit error."""
    SafeReader(str(step_dir)).read_metadata()  # refused here, before DCP logs its fallbacks' tracebacks
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(step_dir)), planner=SafeLoadPlanner())
    except dcp.api.CheckpointException as e:
        exc = next((pair[0] for pair in e.failures.values()), None)
        if isinstance(exc, VitkitError):
            raise exc from None
        raise CheckpointError(f"{step_dir}: cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:500]})") from exc


def load_model_weights(step_dir: Path, model: nn.Module, key: str = "model") -> None:
    """Only the weights (`key`: "model" or "ema") of a step folder, into a plain single-process model."""
    state = {key: model.state_dict()}
    dcp_load(state, step_dir)
    model.load_state_dict(state[key])
