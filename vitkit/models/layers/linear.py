"""nn.Linear with an optional pre-packed weight for float32 inference on CPU.

Every call of `F.linear` on CPU hands MKL the weight in PyTorch's layout, and MKL re-packs it into its
blocked GEMM layout on each call: a full read and write of the weight that the arithmetic does not need.
`pack_linears(model)` has each Linear pack its weight once (`torch.ops.mkl._mkl_reorder_linear_weight`, the
op that `torch.compile`'s freezing pass uses); afterwards float32 CPU calls without gradients run the
packed GEMM (`torch.ops.mkl._mkl_linear`), with bit-identical outputs (measured in benchmarks/NOTES.md,
section 16). Everything else (training, autocast, bf16, GPU, a weight changed after packing) takes the
plain `F.linear` path. The packed copy costs as much memory as the weights it packs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tracing import is_fx_tracing


def packing_available() -> bool:
    """Whether this torch build has MKL's packed sgemm (x86 CPU builds do; ARM and some source builds not)."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and initialisation) that can run from a packed weight."""

    packable: bool = False  # set by `pack_linears`: pack at the first float32 CPU call without gradients
    _packed: tuple[torch.Tensor, int, int, int] | None = None  # (packed weight, rows it was packed for, weight version, data_ptr)

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.packable or is_fx_tracing() or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling() or x.numel() == 0:
            return None
        w = self.weight.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        p = self._packed
        if p is None or w._version != p[2] or w.data_ptr() != p[3]:  # not packed yet, or the weight changed since
            rows = x.numel() // x.shape[-1]  # batch x tokens; the packed weight serves any row count
            p = self._packed = (torch.ops.mkl._mkl_reorder_linear_weight(w, rows), rows, w._version, w.data_ptr())
        return p[0]

    def __getstate__(self) -> dict:
        # copies (copy.deepcopy, pickling) leave the packed weight behind: an opaque MKL tensor, rebuilt on demand
        return {k: v for k, v in super().__getstate__().items() if k != "_packed"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wp = self._packed_weight(x)
        if wp is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, wp, self.weight, self.bias, self._packed[1])


def pack_linears(model: nn.Module, enable: bool = True) -> int:
    """Let the model's `vitkit` Linear layers (the attention and MLP projections) pack their weights at their
    first float32 CPU call without gradients, and run from the packed copy after that (repacked if the weight
    changes). Returns how many layers will pack: 0 when this torch build has no MKL. `enable=False` undoes it
    and frees the copies."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    on = enable and packing_available()
    for m in layers:
        m.packable, m._packed = on, None
    return len(layers) if on else 0
