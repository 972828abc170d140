"""Several processes, one run: torch.distributed as PyTorch ships it (torchrun, DDP, FSDP2), nothing home-made.

`Dist.from_env()` joins the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT): NCCL on CUDA, gloo on the CPU. Without those variables it is a world of one and every
collective is a no-op, so the same code runs alone or under `torchrun`. `wrap_model` applies the strategy:
DDP, or FSDP2 (`fully_shard` per block, then the root) with the mixed-precision policy of the run.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch import nn

from ..errors import UsageError

STRATEGIES = ("auto", "none", "ddp", "fsdp")


@dataclass
class Dist:
    """This process's place in the run: rank, world size, device; collectives that do nothing in a world of one."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, device: torch.device) -> "Dist":
        """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR), on
        `device`'s backend; a world of one under torchrun is a group too (DDP or FSDP2 can run alone in it)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
            return cls(device=device)
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        owns = not tdist.is_initialized()
        if owns:
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(rank=rank, world=world, local_rank=local_rank, device=device, owns_group=owns)

    def close(self, clean: bool = True) -> None:
        """Leave the process group. After a normal finish every rank first waits for the others: a rank tearing its
        gloo connections down while a peer still uses them aborts it ("terminate called without an active
        exception"). After an error there is no waiting: the other ranks may never arrive."""
        if self.owns_group and tdist.is_initialized():
            gc.collect()  # free FSDP2's meshes and states (module cycles) while their process groups still exist
            if clean:
                tdist.barrier()
            tdist.destroy_process_group()
            gc.collect()

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        tdist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any."""
        return self.sum([float(flag)])[0] > 0 if self.enabled else flag

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def check_same(self, what: str, obj) -> None:
        """Every rank must hold the same `obj` (its config, its data): a clear error otherwise, on every rank."""
        if not self.enabled:
            return
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
        digests = [None] * self.world
        tdist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            groups: dict[str, list[int]] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            raise UsageError(f"the ranks disagree on the {what}: " + "; ".join(f"ranks {v} hold {k[:12]}" for k, v in groups.items())
                             + f". Every rank must run the same command on the same {what}.")

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def resolve_strategy(strategy: str, dist: Dist) -> str:
    """"auto": DDP when there are several processes, else none."""
    if strategy not in STRATEGIES:
        raise UsageError(f"run.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        return "ddp" if dist.enabled else "none"
    return strategy


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (each gathers its parameters when it runs): the transformer blocks, or
    the residual blocks of a CNN, and a hybrid's ResNet stages (a conv stem is left to the root's unit)."""
    units = list(getattr(model, "blocks", []))  # a ViT's, or a Swin's (its stages' blocks, in order)
    backbone = getattr(getattr(model, "patch_embed", None), "backbone", None)
    stages = getattr(backbone, "stages", []) if backbone is not None else getattr(model, "stages", [])
    for stage in stages:
        units += list(stage.blocks)
    return units


def wrap_model(model: nn.Module, dist: Dist, strategy: str, precision: str) -> nn.Module:
    """Apply the strategy to `model` in place (FSDP2) or around it (DDP); returns the module to call.

    FSDP2 computes in the run's low precision by its MixedPrecisionPolicy (parameters gathered in bf16/fp16,
    gradients reduced in fp32) instead of autocast; the optimizer must be built after this call, on the sharded
    parameters."""
    if strategy == "none":
        return model
    if not tdist.is_initialized():
        raise UsageError(f"run.strategy={strategy} needs a process group: launch with torchrun (`torchrun --nproc-per-node N "
                         "-m vitkit train ...`, N = 1 too) or `vitkit train --nproc N`")
    if strategy == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    # start-up time: FSDP2 imports DTensor (~0.6 s), loaded only for a sharded run
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if low and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise UsageError(f"run.strategy=fsdp at precision {precision} with BatchNorm in the model (hybrid_norm=batch, a "
                         f"conv stem): FSDP2 casts the norms' weights to {precision}, not their running statistics, "
                         f"and the norm refuses the mix; use run.strategy=ddp or run.precision=fp32")
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Accumulation without communication: DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`."""
    if enabled:
        yield
        return
    if isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def full_state_dict(model: nn.Module, dist: Dist) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on rank 0 (gathered from the shards under FSDP2), None on the others."""
    # start-up time: DTensor (~0.6 s), as in wrap_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.main else None
