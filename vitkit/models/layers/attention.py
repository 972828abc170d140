"""Multi-head self-attention (Sec. 3.1, App. A) with an optional learned relative-position bias (App. D.4).

The later ViTs' options, each off by default: qk-norm (a LayerNorm on every head's queries and keys, ViT-22B),
a LayerNorm on the heads' output before the projection (EVA-02 CLIP's sub-LN), 2-D rotary embeddings of the
patch tokens' queries and keys (`rope.py`, EVA-02) and grouped-query attention (fewer key/value heads than query
heads, each shared by a group of query heads: Sapiens2).

The fused kernel `F.scaled_dot_product_attention` is the default path; the explicit softmax path runs when
the attention weights are asked for, and on CPU in bf16 where it is measured to be faster.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...machine.cpu import amx_usable, bf16_native
from .linear import Linear
from .norm import LayerNorm
from .rope import apply_rope
from .tracing import is_fx_tracing
from ...errors import UsageError
from ...safety import check_alloc
from .pos_embed import _GridCache, _same_grid, tracing
from .pos_embed import resample_offset_table


# oneDNN's native bf16 (AVX-512 BF16, AMX) makes the explicit path's bf16 matmuls fast; AMX tiles make the fused
# kernel's bf16 forward the faster one for inference (see `_explicit_is_faster`)
_CPU_BF16_NATIVE = bf16_native()
_CPU_HAS_AMX = amx_usable()


def check_bias_size(grid: tuple[int, int], num_heads: int, prefix: int) -> None:
    """A relative bias at another grid (dynamic_img_size) is an (H, T, T) tensor beside its (N, N) int64 index,
    where the fused attention itself holds nothing of size T x T: refused before allocating what the process does not
    have (a 1024 x 1024 image in patches of 4 would need 64 GiB per head group). Checked when a grid's index is
    built, not on every forward that finds it cached."""
    if tracing():  # (sizes are symbols while torch.export or dynamo traces: checked when the traced model runs eager)
        return
    n = grid[0] * grid[1]
    t = n + prefix
    check_alloc(n * n * 8 + num_heads * t * t * 4, f"the relative position bias at a {grid[0]}x{grid[1]} grid",
                UsageError)


def offset_index(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """(N, N): for every pair of a grid's N patches, the row of their offset (dy, dx) in a (2gh - 1) x (2gw - 1)
    table of offsets, (0, 0) at its centre."""
    gh, gw = grid
    ys, xs = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    coords = torch.stack([ys, xs]).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N)
    return (rel[0] + gh - 1) * (2 * gw - 1) + (rel[1] + gw - 1)  # (N, N)


class RelativePositionBias(nn.Module):
    """A learned bias per head for every relative offset (dy, dx) between two patches.

    Tokens in front of the patch grid (the class token) get three extra learned entries:
    prefix-to-patch, patch-to-prefix and prefix-to-prefix, as in BEiT.

    At another grid the table of offsets is resampled by `method` (the model's `pos_resample`, a fact of where the
    checkpoint comes from: "geometric" for timm's BEiT, "bilinear_noaa" for transformers' BEiT and data2vec-vision;
    `pos_embed.resample_offset_table`); the three entries are kept.
    """

    def __init__(self, grid_size: tuple[int, int], num_heads: int, num_prefix_tokens: int = 1) -> None:
        super().__init__()
        gh, gw = grid_size
        self.grid_size = (gh, gw)
        self.num_prefix_tokens = num_prefix_tokens
        num_rel = (2 * gh - 1) * (2 * gw - 1)
        self.table = nn.Parameter(torch.zeros(num_rel + (3 if num_prefix_tokens else 0), num_heads))
        # on the default device, as the table: inside build_model's meta-device dry run it allocates nothing and is
        # counted by its size check (a (T, T) int64 per block: a hostile grid is refused before it is built)
        self.register_buffer("index", self._build_index(self.grid_size, self.table.device), persistent=False)
        self._cache = None
        self.method = "bilinear"  # how the table is resampled for another grid (the model's `pos_resample`)

    def _build_index(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        gh, gw = grid
        idx = offset_index(grid, device)  # (N, N)
        if not self.num_prefix_tokens:
            return idx
        p, base = self.num_prefix_tokens, (2 * gh - 1) * (2 * gw - 1)
        idx = F.pad(idx, (p, 0, p, 0), value=base)  # prefix -> patch (the first rows): base
        idx[p:, :p] = base + 1  # patch -> prefix
        idx[:p, :p] = base + 2  # prefix -> prefix
        return idx

    def _table_for(self, grid: tuple[int, int], method: str = "bilinear") -> torch.Tensor:
        """The table of relative offsets resampled for another grid; the prefix entries kept."""
        gh, gw = self.grid_size
        nh, nw = grid
        base = (2 * gh - 1) * (2 * gw - 1)
        t = self.table
        cells = resample_offset_table(t[:base].reshape(2 * gh - 1, 2 * gw - 1, -1), (2 * nh - 1, 2 * nw - 1), method)
        return torch.cat([cells.flatten(0, 1), t[base:]])

    def resample(self, new_grid: tuple[int, int], method: str = "bilinear") -> None:
        """Resample the table of relative offsets for a new patch grid; the prefix entries are kept."""
        self.table = nn.Parameter(self._table_for(new_grid, method).detach())
        self.grid_size = tuple(new_grid)
        self.index = self._build_index(self.grid_size, self.index.device)

    def forward(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(H, T, T): the bias between every pair of tokens, for the model's grid or another (dynamic_img_size)."""
        if _same_grid(grid, self.grid_size):
            table, index = self.table, self.index
        else:
            self._cache = self._cache or _GridCache()
            table, index = self._cache.get(tuple(grid), [self.table], lambda: (
                check_bias_size(tuple(grid), self.table.shape[1], self.num_prefix_tokens),
                self._table_for(grid, self.method), self._build_index(grid, self.index.device))[1:])
        t = index.shape[0]
        return table[index.flatten()].view(t, t, -1).permute(2, 0, 1)  # (T, T, H) -> (H, T, T)


def log_offsets(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """(2gh - 1, 2gw - 1, 2): every relative offset (dy, dx) of a grid, log-spaced, sign(d) * ln(1 + |d|) (the
    continuous position bias's input: Swin V2's log-spaced coordinates, timm's 'cr' mode)."""
    gh, gw = grid
    dy = torch.arange(-(gh - 1), gh, device=device, dtype=torch.float32)
    dx = torch.arange(-(gw - 1), gw, device=device, dtype=torch.float32)
    d = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1)  # (2gh - 1, 2gw - 1, 2)
    return torch.sign(d) * torch.log1p(d.abs())


class RelativePositionMlp(nn.Module):
    """A bias per head for every relative offset between two patches, computed by a small MLP from the offset's
    log-spaced coordinates (Swin V2's continuous position bias, as timm's ViT-RelPos uses it: `RelPosMlp`, mode 'cr'):
    2 -> hidden (ReLU, dropout 0.125 in training) -> heads. The MLP holds no grid, so one set of weights serves any
    resolution: another grid only recomputes the offsets. The prefix tokens (a class token) get no bias.

    One module per block, or one for the whole model (`rel_pos_shared`, timm's `vit_srelpos_*`): the model owns it
    and every block reads it through `Shared`."""

    def __init__(self, grid_size: tuple[int, int], num_heads: int, hidden: int = 128, num_prefix_tokens: int = 0) -> None:
        super().__init__()
        self.grid_size = tuple(grid_size)
        self.num_heads, self.num_prefix_tokens = num_heads, num_prefix_tokens
        self.mlp = nn.Module()  # timm's names: rel_pos.mlp.fc1, rel_pos.mlp.fc2
        self.mlp.fc1 = nn.Linear(2, hidden)
        self.mlp.drop = nn.Dropout(0.125)
        self.mlp.fc2 = nn.Linear(hidden, num_heads)
        self.register_buffer("offsets", log_offsets(self.grid_size, self.mlp.fc1.weight.device), persistent=False)
        self.register_buffer("index", offset_index(self.grid_size, self.mlp.fc1.weight.device), persistent=False)
        self._cache = None

    def resample(self, new_grid: tuple[int, int], method: str | None = None) -> None:
        """Lay the offsets out for another patch grid (the weights are the same at every grid; `method` unused)."""
        self.grid_size = tuple(new_grid)
        self.offsets = log_offsets(self.grid_size, self.index.device)
        self.index = offset_index(self.grid_size, self.index.device)

    def forward(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(H, T, T): the bias between every pair of tokens (zero on the prefix tokens' rows and columns), for the
        model's grid or another (dynamic_img_size)."""
        if _same_grid(grid, self.grid_size):
            offsets, index = self.offsets, self.index
        else:
            self._cache = self._cache or _GridCache()
            offsets, index = self._cache.get(tuple(grid), [], lambda: (
                check_bias_size(tuple(grid), self.num_heads, self.num_prefix_tokens),
                log_offsets(grid, self.index.device), offset_index(grid, self.index.device))[1:])
        m = self.mlp
        table = m.fc2(m.drop(F.relu(m.fc1(offsets.to(m.fc1.weight.dtype)))))  # (2gh - 1, 2gw - 1, H)
        n = index.shape[0]
        bias = table.reshape(-1, self.num_heads)[index.flatten()].view(n, n, -1).permute(2, 0, 1)  # (H, N, N)
        p = self.num_prefix_tokens
        return F.pad(bias, (p, 0, p, 0)) if p else bias  # (H, T, T)


class Shared:
    """A module every block reads and the model owns (not a submodule of the blocks: its weights are the model's
    `shared_rel_pos.*` alone, once in the state dict, once in the optimizer)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# how an Attention computes softmax(q k^T) v: "auto" picks per call (`Attention._explicit_is_faster`); "sdpa" (the
# fused kernel) and "explicit" (matmul + softmax) force a path (tests, benchmarks). Per instance: the constructor's
# `impl`, or for a whole model `VisionTransformer.set_attention_impl`.
ATTENTION_IMPLS = ("auto", "sdpa", "explicit")


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise UsageError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    return impl


class Attention(nn.Module):
    """Self-attention over tokens with a fused qkv projection: rows of `qkv.weight` are q, k, v, each head-major.

    With `num_kv_heads` (grouped-query attention, GQA) there are fewer key and value heads than query heads: the
    rows are q (num_heads x head_dim), then k and v (num_kv_heads x head_dim each), and query head h reads key/value
    head h // (num_heads // num_kv_heads), as timm's `AttentionRope` (whose separate q_proj, k_proj and v_proj are
    these three row blocks).

    `impl` ("auto", "sdpa", "explicit", `ATTENTION_IMPLS`): how this layer computes the attention; an attribute of
    the instance, so that one model's choice is not another's."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        rel_pos: RelativePositionBias | RelativePositionMlp | Shared | None = None,
        qk_norm: bool = False,
        inner_norm: bool = False,
        norm_eps: float = 1e-6,
        rope_prefix: int = 0,
        k_bias: bool = True,
        proj_bias: bool = True,
        rope_half: bool = False,
        norm_layer=None,
        num_kv_heads: int | None = None,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise UsageError(f"width {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_kv_heads < 1 or num_heads % self.num_kv_heads:
            raise UsageError(f"num_kv_heads {num_kv_heads} does not divide num_heads {num_heads}")
        self.num_kv_groups = num_heads // self.num_kv_heads  # query heads per key/value head (1: plain MHA)
        kv = self.num_kv_heads * self.head_dim
        # EVA-02's keys have no bias: the query and value biases are then parameters of their own (timm Eva's names)
        split_bias = qkv_bias and not k_bias
        self.qkv = Linear(dim, dim + 2 * kv, bias=qkv_bias and not split_bias)
        self.q_bias = nn.Parameter(torch.zeros(dim)) if split_bias else None
        self.v_bias = nn.Parameter(torch.zeros(kv)) if split_bias else None
        self.attn_drop = attn_drop
        self.proj = Linear(dim, dim, bias=proj_bias)  # AIMv2: no bias
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_pos = rel_pos
        norm_layer = norm_layer or (lambda n: LayerNorm(n, eps=norm_eps))
        self.q_norm = norm_layer(self.head_dim) if qk_norm else None
        self.k_norm = norm_layer(self.head_dim) if qk_norm else None
        self.norm = norm_layer(dim) if inner_norm else None
        self.rope_prefix = rope_prefix  # tokens in front of the patch grid: not rotated
        self.rope_half = rope_half  # the rotary embedding's channel layout (`rope.apply_rope`)
        self.impl = check_impl(impl)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Official init: xavier-uniform on each of the q, k, v ((D, D) each without GQA) and out kernels, zero biases.
        d, kv = self.proj.in_features, self.num_kv_heads * self.head_dim
        with torch.no_grad():
            for start, rows in ((0, d), (d, kv), (d + kv, kv)):
                nn.init.xavier_uniform_(self.qkv.weight[start : start + rows])
            if self.qkv.bias is not None:
                self.qkv.bias.zero_()
        nn.init.xavier_uniform_(self.proj.weight)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def _explicit_is_faster(self, q: torch.Tensor, tokens: int) -> bool:
        """On CPU in bf16 with native bf16 matmuls, plain matmul + softmax beats the fused kernel up to ~600 tokens
        when gradients flow: the fused kernel's bf16 backward is slow (ViT-S/16, 197 tokens: 28 ms vs 11 ms per
        layer; 49 tokens: 89 ms vs 13 ms). For inference it wins too on CPUs without AMX (AMD EPYC, S/16 batch 16:
        8.5 vs 4.9 ms per layer), not with AMX (Xeon: 2.7 vs 3.4 ms). Where bf16 matmuls are emulated (AVX2-only
        CPUs) the fused kernel wins both (Xeon capped to AVX2, S/16: 6.7 vs 152 ms forward, 100 vs 348 ms
        training). In fp32 the fused kernel is as fast or faster. Measured in benchmarks/NOTES.md, sections 7, 12
        and 23 (`python benchmarks/isa.py ops`)."""
        if self.impl != "auto":
            return self.impl == "explicit"
        if is_fx_tracing():
            return False
        if q.device.type != "cpu" or q.dtype != torch.bfloat16 or tokens > 640 or not _CPU_BF16_NATIVE:
            return False
        return q.requires_grad or not _CPU_HAS_AMX

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                grid: tuple[int, int] | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None):
        """x: (B, T, D) -> (B, T, D); with `return_attention`, also the softmax weights (B, H, T, T).
        grid: the patch grid of this input, when it is not the model's (dynamic_img_size; the relative bias).
        rope: (sin, cos), each (N, head_dim) (or (B, 1, N, head_dim) for a packed batch; (heads, N, head_dim), or
            (B, heads, N, head_dim), of ROPE-ViT-Mixed's learned frequencies), rotating the patch tokens' queries and
            keys (`rope.py`).
        mask: (B, 1, 1, T) bool, the keys each row may read (a packed batch's `packing.key_mask`); None: all.

        queries: only the first `queries` tokens attend (keys and values still come from all T tokens), and
            only their outputs are returned: (B, queries, D). What the model's last block needs when the head
            reads the class token alone."""
        B, T, D = x.shape
        # split, not view+permute+unbind: the backward is then one cat into a contiguous (B, T, 3D) gradient
        # instead of a stack and a permuted copy (measured 9% faster per attention layer, benchmarks/NOTES.md)
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:  # (q_bias, 0, v_bias)
            bias = torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias])
            qkv = self.qkv._linear(x, self.qkv.weight, self.qkv.weight, bias)
        kv = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([D, kv, kv], dim=-1)  # (B, T, D), (B, T, kv), (B, T, kv); kv = D without GQA
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k, v = (t.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))  # each (B, Hkv, T, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            p = self.rope_prefix
            q = torch.cat([q[:, :, :p], apply_rope(q[:, :, p:], *rope, half=self.rope_half)], dim=2)
            k = torch.cat([k[:, :, :p], apply_rope(k[:, :, p:], *rope, half=self.rope_half)], dim=2)
        if self.num_kv_groups > 1:  # query head h reads key/value head h // groups: (B, Hkv, T, hd) -> (B, H, T, hd)
            k = k.repeat_interleave(self.num_kv_groups, dim=1)
            v = v.repeat_interleave(self.num_kv_groups, dim=1)
        if queries is not None:  # the other tokens' q costs one D x D matmul of a block's twelve: kept, so that
            q = q[:, :, :queries]  # the projection stays one (packable) Linear; (B, H, Q, hd)
        Q = q.shape[2]
        bias = self.rel_pos(grid)[:, :Q] if self.rel_pos is not None else None  # (H, Q, T) or None
        drop = self.attn_drop if self.training else 0.0
        if return_attention or self._explicit_is_faster(q, T):
            logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, Q, T)
            if bias is not None:
                logits = logits + bias
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            attn = logits.softmax(dim=-1)
            out = F.dropout(attn, drop) @ v  # (B, H, Q, hd)
            if not return_attention:
                attn = None
        else:
            attn = None
            if bias is not None:
                bias = bias.to(q.dtype)
            if mask is not None:  # a packed batch has no relative bias (refused by the model)
                bias = mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)  # (B, H, Q, hd)
        out = out.transpose(1, 2).reshape(B, Q, D)  # (B, H, Q, hd) -> (B, Q, D)
        if self.norm is not None:
            out = self.norm(out)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attention else out

