"""Parameter and FLOP counts of a model, measured on the meta device (no memory, no compute)."""
from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .registry import ModelEntry, build_on_meta


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _cpu_sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:  # shapes, as FlopCounterMode passes them
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


def _mkl_linear_flops(x, packed_w, w, *args, out_shape=None, **kwargs) -> int:  # x (..., K), w (N, K)
    return 2 * math.prod(x[:-1]) * x[-1] * w[0]


def _onednn_linear_flops(x, packed_w, *args, out_shape=None, **kwargs) -> int:  # x (..., K), packed w (N, K)
    return 2 * math.prod(x[:-1]) * x[-1] * packed_w[0]


# The counter knows the CUDA attention kernels only; without these the CPU's fused attention counts 0 FLOPs,
# and so would a Linear running from a packed weight (`vitkit.models.layers.linear`).
CPU_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}
if hasattr(torch.ops.mkl, "_mkl_linear"):
    CPU_FLOPS[torch.ops.mkl._mkl_linear] = _mkl_linear_flops
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    CPU_FLOPS[torch.ops.mkldnn._linear_pointwise] = _onednn_linear_flops


def count_flops(model: torch.nn.Module, img_size: tuple[int, int], in_chans: int = 3, batch: int = 1,
                alike_once: bool = True) -> int:
    """FLOPs of one forward pass per image, counted by `torch.utils.flop_counter`.

    A multiply-add counts as 2 FLOPs (the counter's convention: a (M, K) x (K, N) matmul is 2MKN).
    Only matmuls, convolutions and attention are counted; norms, activations and softmax are not.
    These are the model's FLOPs, as the paper and the peers count them: every token through every block
    (`forward_features`, then the head), also where vitkit's `forward` runs the last block on the class token
    alone (`model.last_block_cls_only`), whose saving then shows as speed, not as fewer FLOPs.
    Counted in eval mode (the same matmuls), the modules' modes restored after: a train-mode forward of this probe
    would move a BatchNorm's running statistics (a conv stem's) by an input that is not data.
    alike_once: on the meta device (`vitkit models`), a block alike an earlier sibling is counted from that
    sibling's call instead of run again (`_alike_blocks_counted_once`); the same count, fewer ops traced.
    """
    x = torch.zeros(batch, in_chans, *img_size, device=next(model.parameters()).device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    skipped = [0]
    try:
        with FlopCounterMode(display=False, custom_mapping=CPU_FLOPS) as counter, torch.no_grad(), \
                _alike_blocks_counted_once(model, counter, skipped, alike_once and x.is_meta):
            model.forward_head(model.forward_features(x))
    finally:
        for m, training in modes:
            m.training = training
    return (counter.get_total_flops() + skipped[0]) // batch


def _fingerprint(m: torch.nn.Module) -> tuple:
    """What a module's count can depend on, beyond its printed form: its type, every plain attribute (a window size,
    a shift, a flag), its parameters' and buffers' shapes and dtypes, and its children's fingerprints."""
    parts: list = [type(m).__qualname__]
    for k, v in sorted(vars(m).items()):
        if k in ("_parameters", "_buffers"):
            parts.append((k, *((n, None if t is None else (tuple(t.shape), t.dtype)) for n, t in v.items())))
        elif k == "_modules":
            parts.append((k, *((n, None if c is None else _fingerprint(c)) for n, c in v.items())))
        elif "hook" in k:  # the hooks' dicts: a counter's or a user's, not the block's arithmetic
            continue
        elif isinstance(v, torch.Tensor):
            parts.append((k, tuple(v.shape), v.dtype))
        else:
            parts.append((k, _plain(v)))
    return tuple(parts)


def _plain(v) -> object:
    """A value as a fingerprint holds it: numbers, strings and None as they are, containers of them item by item,
    anything else by its type."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *map(_plain, v))
    if isinstance(v, dict):
        return ("dict", *sorted(((repr(k), _plain(u)) for k, u in v.items()), key=repr))
    return ("object", type(v).__qualname__)


def _signature(v) -> object:
    """What a block's count can depend on in an argument: a tensor's shape, dtype, strides and device; any other
    value as it prints."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.stride(), str(v.device))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *map(_signature, v))
    if isinstance(v, dict):
        return ("dict", *((k, _signature(u)) for k, u in v.items()))
    return repr(v)


@contextlib.contextmanager
def _alike_blocks_counted_once(model: torch.nn.Module, counter: FlopCounterMode, skipped: list[int], on: bool):
    """While counting, a block of a ModuleList or Sequential that prints as an earlier sibling, holds the same
    attributes (`_fingerprint`: SAM's windowed and global blocks print alike) and takes arguments of the same
    signature is counted from that sibling's call instead of run: its FLOPs (with those of any alike blocks inside
    it) added, its output returned. A ViT's L blocks then run once. Meant for meta tensors, which hold no values
    a block could depend on; `tests/test_models.py` checks the count against running every block."""
    seen: dict[tuple, tuple[int, object]] = {}
    wrapped: list[torch.nn.Module] = []

    def wrap(block: torch.nn.Module, text: tuple) -> None:
        run = block.forward

        def forward(*args, **kwargs):
            key = (text, _signature(args), _signature(kwargs))
            if key in seen:
                flops, out = seen[key]
                skipped[0] += flops
                return out
            before = counter.get_total_flops() + skipped[0]  # alike blocks inside this one add to skipped
            out = run(*args, **kwargs)
            seen[key] = (counter.get_total_flops() + skipped[0] - before, out)
            return out

        block.forward = forward
        wrapped.append(block)

    if on:
        for seq in model.modules():
            if isinstance(seq, (torch.nn.ModuleList, torch.nn.Sequential)) and len(seq) > 1:
                texts = [(repr(b), _fingerprint(b)) for b in seq]
                for b, text in zip(seq, texts):
                    if texts.count(text) > 1 and "forward" not in b.__dict__:
                        wrap(b, text)
    try:
        yield
    finally:
        for b in wrapped:
            del b.forward


def model_stats(entry: ModelEntry, num_classes: int = 1000) -> dict:
    """Params, GFLOPs, tokens and resolution of a registry entry at its default resolution."""
    config = entry.default_config()
    config.num_classes = num_classes
    model = build_on_meta(config)
    tokens = getattr(config, "num_tokens", None)
    return {
        "name": entry.name,
        "paper_name": entry.paper_name,
        "params_m": count_params(model) / 1e6,
        "gflops": count_flops(model, config.img_size, config.in_chans) / 1e9,
        "tokens": tokens,
        "resolution": config.img_size[0] if config.img_size[0] == config.img_size[1] else config.img_size,
    }
