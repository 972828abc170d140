"""LoRA (Hu et al. 2021, arXiv 2106.09685, Sec. 4.1): a frozen Linear W plus a trained low-rank update,
y = x W^T + b + (alpha / r) (x A^T) B^T, on the attention and MLP projections of every vitkit Transformer; merged
into the weights (W + (alpha / r) B A) so that what is saved or exported is a plain model.

A fused projection (the qkv of a ViT or Swin block, the k/v of an attention pool) takes one adapter over all its
rows (target "qkv"), or the paper's own adapters on some of its row blocks alone: targets "q" and "v" adapt the
query and value rows of the fused qkv, each with its own A and B, and leave the key rows as they are.

    apply_lora(model, rank=8, targets=("q", "v"))   # every targeted Linear becomes a LoRALinear (names unchanged)
    mark_only_lora_trainable(model, keep=("head.",))
    ... train ...
    merge_lora(model)                                # plain Linears again, W + (alpha / r) B A

A `LoRALinear` holds the same weight and bias Parameters as the Linear it replaces (state-dict names unchanged:
`blocks.0.attn.qkv.weight`) plus `lora_A` (S r, in) and `lora_B` (S p, r) for its S adapted row blocks of p rows.
It is a vitkit `Linear`, so the frozen base GEMM keeps its packed fast path (`machine/fast_linear.py`); the fused
GELU of an MLP's inference path is skipped (it would leave the adapter out).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .layers import Attention, AttentionPool, Linear, Mlp, SwiGLU
from .layers.diff_attention import DiffAttention
from .samvit import SamAttention
from .layers.tracing import is_fx_tracing
from .swin import WindowAttention

TARGETS = ("qkv", "q", "k", "v", "proj", "mlp")  # "qkv": a fused projection whole; "q"/"k"/"v": its row blocks
DEFAULT_TARGETS = ("q", "v")  # the paper's choice (Sec. 7.1): the query and value projections

# where each layer type keeps its projections: attribute -> the names of its output's row blocks, in order
_QKV = {"qkv": ("q", "k", "v"), "proj": ("proj",)}
LAYOUTS: dict[type, dict[str, tuple[str, ...]]] = {
    Attention: _QKV,
    WindowAttention: _QKV,
    DiffAttention: _QKV,  # (its fused qkv: q, k, v of D rows each, as Attention's)
    SamAttention: _QKV,
    AttentionPool: {"q": ("q",), "kv": ("k", "v"), "proj": ("proj",)},
    Mlp: {"fc1": ("mlp",), "fc2": ("mlp",)},
    SwiGLU: {"fc1_g": ("mlp",), "fc1_x": ("mlp",), "fc2": ("mlp",)},
}


class LoRALinear(Linear):
    """A `Linear` with low-rank adapters on all its output rows or on some of its `parts` equal row blocks.

    Args:
        base: the Linear adapted; its weight and bias Parameters become this module's (nothing is copied).
        rank: r, the adapters' rank.
        alpha: the update is scaled by alpha / r (None: r, a scale of 1).
        dropout: dropout on the adapters' input (training only).
        parts: how many equal row blocks the output has (3 for a fused qkv).
        slices: the row blocks adapted, each with its own A and B; None: one adapter over all rows.
    """

    def __init__(self, base: Linear, rank: int, alpha: float | None = None, dropout: float = 0.0, parts: int = 1,
                 slices: tuple[int, ...] | None = None) -> None:
        nn.Module.__init__(self)  # no weight of its own: the base's Parameters are registered below
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.packable, self.train_fast = base.packable, base.train_fast
        if base.out_features % parts:
            raise UsageError(f"a Linear of {base.out_features} outputs does not split into {parts} parts")
        self.rank, self.alpha = rank, float(rank if alpha is None else alpha)
        self.scale = self.alpha / rank
        self.parts, self.slices = parts, None if slices is None else tuple(slices)
        blocks = 1 if self.slices is None else len(self.slices)
        self.part = base.out_features if self.slices is None else base.out_features // parts  # rows per adapted block
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(blocks * rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(blocks * self.part, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's (and peft's) A; B = 0: W at the start
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def _blocks(self) -> list[tuple[int, slice, slice]]:
        """(row block of the output, rows of lora_A, rows of lora_B) of every adapter."""
        r, p = self.rank, self.part
        chosen = [0] if self.slices is None else self.slices
        return [(i, slice(k * r, (k + 1) * r), slice(k * p, (k + 1) * p)) for k, i in enumerate(chosen)]

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output (alpha / r) B A x: (..., in) -> (..., out), zero on the rows not adapted."""
        h = F.linear(self.lora_dropout(x), self.lora_A) * self.scale  # (..., S r)
        if self.slices is None:
            return F.linear(h, self.lora_B)  # (..., out)
        out = {i: F.linear(h[..., a], self.lora_B[b]) for i, a, b in self._blocks()}  # each (..., p)
        zeros = torch.zeros_like(next(iter(out.values()))) if len(out) < self.parts else None  # the rows left alone
        return torch.cat([out.get(i, zeros) for i in range(self.parts)], dim=-1)  # (..., out)

    def delta_weight(self, lora_A: torch.Tensor | None = None, lora_B: torch.Tensor | None = None) -> torch.Tensor:
        """(alpha / r) B A as an (out, in) matrix, zero on the rows not adapted: what `merge_lora` adds to the weight.
        lora_A, lora_B: other values than this module's own (a saved state dict's)."""
        A = self.lora_A if lora_A is None else lora_A
        B = self.lora_B if lora_B is None else lora_B
        if self.slices is None:
            return (B @ A) * self.scale
        dw = A.new_zeros(self.out_features, self.in_features)
        for i, a, b in self._blocks():
            dw[i * self.part:(i + 1) * self.part] = (B[b] @ A[a]) * self.scale
        return dw

    def _linear(self, x: torch.Tensor, param: torch.Tensor, w2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Every call of the base GEMM (the forward, an attention's own-bias path) with the adapters' update added
        into its output's rows in place: no (..., out) temporaries beside it (the GEMM's backward keeps its input
        and weight, not its output)."""
        y = super()._linear(x, param, w2d, bias)  # (..., out)
        if is_fx_tracing():  # proxies: the out-of-place sum is what a traced graph records
            return y + self.lora_delta(x)
        h = F.linear(self.lora_dropout(x), self.lora_A) * self.scale  # (..., S r)
        for i, a, b in self._blocks():
            rows = y if self.slices is None else y.narrow(-1, i * self.part, self.part)  # (..., p)
            rows.add_(F.linear(h[..., a], self.lora_B[b]))
        return y

    def _linear_act(self, *args, **kwargs) -> None:
        return None  # no fused GELU: the caller applies act(self(x)), adapters included

    def extra_repr(self) -> str:
        blocks = "all rows" if self.slices is None else f"row blocks {list(self.slices)} of {self.parts}"
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, {blocks}"


def check_targets(targets) -> tuple[str, ...]:
    """LoRA targets as a tuple, from a list or a comma-separated string; unknown or overlapping ones refused."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(" ", "").split(",") if t]
    out = tuple(str(t) for t in targets or ())
    bad = [t for t in out if t not in TARGETS]
    if bad:
        raise UsageError(f"unknown LoRA target {bad[0]!r}; choose from {', '.join(TARGETS)} (qkv: the fused query-key-"
                         f"value projection whole; q, k, v: its row blocks alone, e.g. [q, v] as the LoRA paper)")
    if not out:
        raise UsageError(f"no LoRA target given; choose from {', '.join(TARGETS)}")
    if "qkv" in out and {"q", "k", "v"} & set(out):
        raise UsageError(f"LoRA targets {list(out)}: qkv adapts the fused projection whole, which q, k or v would "
                         f"adapt again; give qkv or some of q, k, v")
    return out


def _plan(names: tuple[str, ...], targets: tuple[str, ...]) -> tuple[bool, tuple[int, ...] | None]:
    """(adapt?, slices) of a projection whose row blocks are `names`: None slices = one adapter over all rows."""
    if "qkv" in targets and set(names) <= {"q", "k", "v"}:
        return True, None
    chosen = tuple(i for i, n in enumerate(names) if n in targets)
    if not chosen:
        return False, None
    return True, None if len(names) == 1 else chosen


def apply_lora(model: nn.Module, rank: int, *, alpha: float | None = None, dropout: float = 0.0,
               targets=DEFAULT_TARGETS) -> list[str]:
    """Put LoRA adapters on the model's projections (in place); returns the names of the Linears adapted.

    Args:
        rank: the adapters' rank r (>= 1, at most the smallest dimension of an adapted block).
        alpha: the update's scale is alpha / r; None: r (a scale of 1).
        dropout: dropout on the adapters' input, in [0, 1).
        targets: some of "qkv" (every fused attention projection whole: a ViT's or Swin's qkv, an attention pool's
            q and kv), "q", "k", "v" (their query, key or value rows alone, each with its own adapter), "proj"
            (the attention output projections), "mlp" (every MLP Linear: fc1, fc2; SwiGLU's fc1_g, fc1_x, fc2).
    """
    targets = check_targets(targets)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"LoRA rank {rank!r}: give a positive integer (e.g. 8)")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise UsageError(f"LoRA alpha {alpha!r}: give a positive number (the update is scaled by alpha / rank)")
    if not 0.0 <= dropout < 1.0:
        raise UsageError(f"LoRA dropout {dropout!r}: give a probability in [0, 1)")
    if lora_layers(model):
        raise UsageError("this model already has LoRA adapters: merge them (merge_lora) before adding others")
    plans = []
    for name, module in model.named_modules():
        layout = LAYOUTS.get(type(module), {})
        for attr, names in layout.items():
            lin = getattr(module, attr, None)
            adapt, slices = _plan(names, targets)
            if not adapt or not isinstance(lin, Linear):
                continue
            if slices is not None and getattr(module, "num_kv_groups", 1) > 1:
                raise UsageError(f"LoRA targets q/k/v on {name}: its grouped-query attention has fewer key/value rows "
                                 f"than query rows; give target qkv (the fused projection whole)")
            parts = 1 if slices is None else len(names)  # one adapter over all rows: any row layout (GQA's too)
            part = lin.out_features // parts
            if rank > min(lin.in_features, part):
                raise UsageError(f"LoRA rank {rank} exceeds {name}.{attr}'s smallest dimension "
                                 f"({min(lin.in_features, part)}): a rank that high adapts no less than training it whole")
            plans.append((module, attr, f"{name}.{attr}" if name else attr, parts, slices))
    if not plans:
        raise UsageError(f"LoRA targets {list(targets)} found nothing to adapt in this {type(model).__name__}: LoRA "
                         f"adapts the attention and MLP projections of a Transformer (ViT, its hybrids, Swin), not a CNN")
    for module, attr, _, parts, slices in plans:
        setattr(module, attr, LoRALinear(getattr(module, attr), rank, alpha, dropout, parts, slices))
    return [full for _, _, full, _, _ in plans]


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{name: LoRALinear} of a model's adapted layers (empty without LoRA)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_lora_parameter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")


def mark_only_lora_trainable(model: nn.Module, keep: tuple[str, ...] = ()) -> int:
    """requires_grad on the adapters and on parameters whose names start with one of `keep` (a new head), off on
    everything else; returns how many parameters (elements) train."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_parameter(name) or name.startswith(keep))
        n += p.numel() if p.requires_grad else 0
    return n


def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain state dict from a LoRA model's (`model`'s or a copy's, e.g. its EMA): every adapted weight W + (alpha
    / r) B A, no lora_A or lora_B keys. The tensors given are not changed."""
    out = dict(state_dict)
    for name, m in lora_layers(model).items():
        a, b = out.pop(f"{name}.lora_A"), out.pop(f"{name}.lora_B")
        w = out[f"{name}.weight"]
        with torch.no_grad():
            out[f"{name}.weight"] = w + m.delta_weight(a.to(w.device, w.dtype), b.to(w.device, w.dtype))
    return out


def adapter_keys(model: nn.Module) -> set[str]:
    """The state-dict keys a merge changes or removes: each adapted layer's weight, lora_A and lora_B."""
    return {f"{n}.{k}" for n in lora_layers(model) for k in ("weight", "lora_A", "lora_B")}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W += (alpha / r) B A) and put a plain `Linear` back in its place, in
    place; returns the model, now with the state dict of the model it adapted (no LoRA keys)."""
    for name, m in lora_layers(model).items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        m.weight.add_(m.delta_weight().to(m.weight.dtype))
        plain = Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight = m.weight
        plain.register_parameter("bias", m.bias)
        plain.packable, plain.train_fast = m.packable, m.train_fast
        setattr(parent, attr, plain)
    return model
