"""Matmul layers on the fastest float32 CPU GEMM of this machine, from a weight packed once (`gemm.py`): the
`FastGemm` mixin that `models.layers.Linear` and `PatchEmbed` inherit, and `pack_linears` that turns it on.

`pack_linears(model)` lets every vitkit Linear (the attention and MLP projections, the heads, the patch
embedding's matmul and a hybrid's 1x1 patch embedding) run float32 CPU calls on the path `gemm.choose` measured
fastest for its shape:
- inference (no gradients): from the weight packed once, repacked when the weight changes;
- training (`training=True`): the forward and the input gradient dX = dY W both run from packed weights (W and
  W^T), repacked once per optimizer step (after any torch optimizer's step, or when the weight's version counter
  or storage moves), each on the path measured fastest with that repacking counted (`gemm.measure`'s kinds
  "train" and "train-t": where MKL's own GEMM is as fast, as on Intel CPUs, a pack per step does not pay and the
  layer trains on plain MKL); the weight gradient dW = dY^T X, whose operands are both activations, on the path
  measured fastest for it (oneDNN reading the transposed views, or MKL). Gradients equal the plain path to fp32
  rounding (tests/test_gemm.py).
Everything else (autocast, bf16, GPUs, torch.compile and fx tracing, DTensor weights) takes the plain `F.linear`
path. A weight written in place outside an optimizer and past autograd's version counter (`p.data.copy_(...)`)
is not seen: call `pack_linears` again after such a write. The packed copies cost as much memory as the weights
they pack (twice in training).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import torch.fx._symbolic_trace as _fx

from . import gemm

# torch.fx symbolic tracing in progress (the model layers ask the same through models/layers/tracing.py)
is_fx_tracing = getattr(_fx, "is_fx_symbolic_tracing", _fx.is_fx_tracing)


# Every optimizer step moves this counter (a global post-step hook, registered by `pack_linears`): the fused
# optimizers (torch.optim's fused=True, vitkit's default on CPUs) and FSDP2's all-gathers write the weights
# without moving their version counter, which alone would leave a stale packed copy in use.
_step = 0
_hook = None


def _optimizer_stepped(*_args) -> None:
    global _step
    _step += 1


def packing_available() -> bool:
    """Whether this torch build has a packed float32 GEMM (MKL's or oneDNN's)."""
    return gemm.available("mkl-packed") or gemm.available("onednn-packed")


class _PackedLinear(torch.autograd.Function):
    """y = x W^T + b on a packed GEMM path; dX from a packed W^T and dW, each on its own fastest path."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, path, packed, packed_t, rows, wpath, tpath):
        ctx.save_for_backward(x2d, weight)
        ctx.tpath, ctx.packed_t, ctx.rows, ctx.wpath, ctx.has_bias = tpath, packed_t, rows, wpath, bias is not None
        return gemm.run(path, x2d, packed, weight, bias, rows)

    @staticmethod
    def backward(ctx, gy):
        x2d, weight = ctx.saved_tensors
        gy = gy.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:  # dX = dY W: a linear layer with weight W^T (k, n)
            gx = gemm.run(ctx.tpath, gy, ctx.packed_t, weight.t(), None, ctx.rows)
        if ctx.needs_input_grad[1]:
            gw = gemm.wgrad(ctx.wpath, gy, x2d)  # (n, rows) @ (rows, k)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum(0)
        return gx, gw, gb, None, None, None, None, None, None


_GELU_POST_OPS = {"gelu": "none", "gelu_tanh": "tanh"}  # vitkit's act -> oneDNN's GELU post-op algorithm
_BF16_PACKS: bool | None = None  # oneDNN reorders bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT


def _pack_bf16(wb: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A bf16 weight reordered for oneDNN, or None where this CPU cannot (then F.linear on the cast copy)."""
    global _BF16_PACKS
    if _BF16_PACKS is False or not gemm.available("onednn-packed"):
        return None
    try:
        packed = gemm.pack("onednn-packed", wb, rows)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        _BF16_PACKS = False
        return None
    _BF16_PACKS = True
    return packed


def _bf16_autocast(x: torch.Tensor, param: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and param.dtype == torch.float32 and param.device.type == "cpu"
            and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and x.numel() > 0 and not hasattr(param, "to_local") and not torch.compiler.is_compiling())


class FastGemm:
    """Mixin for modules whose forward is a matmul y = x W^T + b with a weight they own (`Linear`, `PatchEmbed`):
    `_linear` runs it on the packed fast path where `pack_linears` allowed it, on `F.linear` otherwise."""

    packable: bool = False  # set by `pack_linears`: inference calls use the packed path
    train_fast: bool = False  # set by `pack_linears(training=True)`: training calls too
    # (path, packed W, packed W^T or None, rows, weight version, data_ptr, dW path or None, dX path or None,
    #  optimizer steps so far)
    _packed: tuple | None = None
    _packed_bf16: tuple | None = None  # ((weight version, data_ptr, bias version), bf16 W, bf16 b, oneDNN-packed W)

    def _fast(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, grad: bool) -> tuple | None:
        if not (self.train_fast if grad else self.packable) or is_fx_tracing() or torch.compiler.is_compiling():
            return None
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or torch.is_autocast_enabled("cpu"):
            return None
        if param.dtype != torch.float32 or param.device.type != "cpu" or hasattr(param, "to_local"):
            return None
        rows = x.numel() // x.shape[-1]
        p = self._packed
        if p is None or param._version != p[4] or param.data_ptr() != p[5] or p[8] != _step or (grad and p[6] is None) \
                or ("mkl-packed" in (p[0], p[7]) and p[3] != rows):  # MKL's packed GEMM: only the row count packed for
            # training: both packs are made again after every optimizer step, so they are chosen with that cost
            # counted (kinds "train", "train-t"): where packing does not pay, plain MKL and no copy of W^T
            path = gemm.choose(w2d.shape[1], w2d.shape[0], rows, kind="train" if grad else "linear")
            wd = w2d.detach()
            # training: dX = dY W is a linear layer (n -> k) with weight W^T, on its own fastest path
            tpath = gemm.choose(w2d.shape[0], w2d.shape[1], rows, kind="train-t") if grad else None
            packed_t = gemm.pack(tpath, wd.t().contiguous(), rows) if grad and tpath != "mkl" else None
            wpath = gemm.choose(w2d.shape[1], w2d.shape[0], rows, kind="wgrad") if grad else None
            p = self._packed = (path, gemm.pack(path, wd, rows), packed_t, rows, param._version, param.data_ptr(), wpath,
                                tpath, _step)
        return p

    def _linear(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., k) @ w2d (n, k)^T + bias -> (..., n); `param` is the parameter w2d is (a view of)."""
        if is_fx_tracing():  # proxies: nothing to read (requires_grad included), the plain op is traced
            return F.linear(x, w2d, bias)
        grad = torch.is_grad_enabled() and (x.requires_grad or param.requires_grad)
        if not grad and self.packable and _bf16_autocast(x, param):
            return self._linear_bf16(x, param, w2d, bias)
        p = self._fast(x, param, w2d, grad)
        if p is None or (p[0] == "mkl" and (not grad or p[6] == p[7] == "mkl")):
            return F.linear(x, w2d, bias)
        path, packed, packed_t, rows = p[:4]
        if not grad:
            return gemm.run(path, x, packed, w2d, bias, rows)
        lead = x.shape[:-1]
        y = _PackedLinear.apply(x.reshape(-1, x.shape[-1]), w2d, bias, path, packed, packed_t, rows, p[6], p[7])  # (rows, n)
        # a 2-D input's output is the function's own tensor, not a view of it (FSDP2 warns of a root returning a view)
        return y if x.dim() == 2 else y.view(*lead, w2d.shape[0])

    def _bf16_weights(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """(versions, bf16 W, bf16 b, oneDNN-packed W or None): cast (and reordered) once, again when they change."""
        versions = (param._version, param.data_ptr(), None if bias is None else bias._version)
        p = self._packed_bf16
        if p is None or p[0] != versions:
            wb = w2d.detach().to(torch.bfloat16)
            bb = None if bias is None else bias.detach().to(torch.bfloat16)
            packed = _pack_bf16(wb, x.numel() // x.shape[-1])
            p = self._packed_bf16 = (versions, wb, bb, packed)
        return p

    def _linear_bf16(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
        """Inference under bf16 autocast on a CPU: the weight cast to bf16 and reordered for oneDNN once (autocast
        casts every weight at every call, which at batch 1 costs more than the matmuls), recast when it changes.
        The same numbers as autocast's F.linear: bf16 operands, fp32 accumulation, a bf16 result."""
        _, wb, bb, packed = self._bf16_weights(x, param, w2d, bias)
        xb = x.to(torch.bfloat16)
        if packed is not None:
            return gemm.run("onednn-packed", xb, packed, wb, bb, 0)
        return F.linear(xb, wb, bb)

    def _linear_act(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, bias: torch.Tensor | None,
                    act: str) -> torch.Tensor | None:
        """act(x W^T + b) as one oneDNN call (the activation applied to the fp32 accumulator, as a post-op) where
        this inference call runs on oneDNN's packed path: bf16 under autocast, or fp32 where oneDNN is the path
        measured fastest. None elsewhere (the caller applies the activation itself). act: gelu | gelu_tanh."""
        algorithm = _GELU_POST_OPS.get(act)
        if algorithm is None or not self.packable or is_fx_tracing() \
                or (torch.is_grad_enabled() and (x.requires_grad or param.requires_grad)):
            return None
        if _bf16_autocast(x, param):
            _, _, bb, packed = self._bf16_weights(x, param, w2d, bias)
            if packed is None:
                return None
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, bb, "gelu", [], algorithm)
        p = self._fast(x, param, w2d, False)
        if p is None or p[0] != "onednn-packed":
            return None
        return torch.ops.mkldnn._linear_pointwise(x, p[1], bias, "gelu", [], algorithm)

    def __getstate__(self) -> dict:
        # copies (copy.deepcopy, pickling) leave the packed weights behind: opaque tensors, rebuilt on demand
        return {k: v for k, v in super().__getstate__().items()  # type: ignore[misc]
                if k not in ("_packed", "_packed_bf16")}


def pack_linears(model: nn.Module, enable: bool = True, training: bool = False) -> int:
    """Let the model's matmul layers (vitkit `Linear`s, the patch embedding) run float32 CPU calls on this
    machine's fastest GEMM (`gemm.choose`, measured once per CPU and shape), from weights packed at their first
    call and repacked when they change: inference calls, and with `training` the training forward and input
    gradient too. Returns how many layers will. `enable=False` undoes it and frees the packed copies."""
    global _hook
    layers = [m for m in model.modules() if isinstance(m, FastGemm)]
    on = enable and packing_available()
    if on and _hook is None:
        _hook = register_optimizer_step_post_hook(_optimizer_stepped)
    for m in layers:
        m.packable, m.train_fast, m._packed, m._packed_bf16 = on, on and training, None, None
    return len(layers) if on else 0
