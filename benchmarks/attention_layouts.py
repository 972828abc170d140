"""Attention on a CPU: qkv layouts, and the fused kernel against plain matmul + softmax (NOTES.md, sections 1 and 7).

    python benchmarks/attention_layouts.py layouts   # forward + backward of qkv -> attention -> proj, B 256, T 49, D 128
    python benchmarks/attention_layouts.py kernels   # fused SDPA vs MATH backend vs explicit, fp32/bf16, train/infer
    python benchmarks/attention_layouts.py models    # whole ViT-S/16 and B/16 inference, batch 8: the attention impl
                                                     # sdpa vs explicit interleaved in one process (--dtype, --profile);
                                                     # --ab residual: Block's residual adds new vs in place;
                                                     # --ab pack: fp32 Linear layers plain vs MKL-packed weights;
                                                     # --ab cls: the last block on every token vs the class token
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, n: int = 10) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def layouts() -> None:
    B, T, D, H = 256, 49, 128, 4
    hd = D // H
    x = torch.randn(B, T, D, requires_grad=True)
    W, P = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def permute_unbind(x):  # the classic layout: one (3, B, H, T, hd) permute
        q, k, v = W(x).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
        return P(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))

    def split_views(x):  # vitkit: split the last dim; the backward is one cat into a contiguous gradient
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in W(x).split(D, -1))
        return P(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))

    def explicit(x):
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in W(x).split(D, -1))
        return P((((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))

    for f in (permute_unbind, split_views, explicit) * 2:
        print(f"{f.__name__:<16} {timed(lambda: f(x).sum().backward()):6.1f} ms forward + backward")


def kernels() -> None:
    shapes = [(256, 4, 49, 32), (16, 6, 197, 64), (8, 12, 197, 64), (8, 6, 577, 64), (4, 12, 1025, 64)]
    print("(B, H, T, hd) dtype: train fused / math / explicit | inference fused / explicit   [ms]")
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, T, hd in shapes:
            q, k, v = (torch.randn(B, H, T, hd, dtype=dtype, requires_grad=True) for _ in range(3))
            g = torch.randn(B, H, T, hd, dtype=dtype)

            def sdpa(backend, train):
                def f():
                    with sdpa_kernel(backend), torch.set_grad_enabled(train):
                        o = F.scaled_dot_product_attention(q, k, v)
                        if train:
                            o.backward(g)
                return f

            def explicit(train):
                def f():
                    with torch.set_grad_enabled(train):
                        o = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
                        if train:
                            o.backward(g)
                return f

            tr = [timed(sdpa(SDPBackend.FLASH_ATTENTION, True)), timed(sdpa(SDPBackend.MATH, True)), timed(explicit(True))]
            inf = [timed(sdpa(SDPBackend.FLASH_ATTENTION, False)), timed(explicit(False))]
            print(f"{(B, H, T, hd)} {str(dtype)[6:]:>8}: train {tr[0]:6.1f} / {tr[1]:6.1f} / {tr[2]:6.1f} | "
                  f"inference {inf[0]:6.1f} / {inf[1]:6.1f}", flush=True)


def once(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _variants(ab: str):
    """The two setups of a whole-model A/B: (name, install) pairs; install(model) patches the model or its code in place."""
    from vitkit.models.layers.linear import Linear
    from vitkit.models.layers.block import Block

    if ab == "attention":
        def impl(name: str):
            return lambda model: model.set_attention_impl(name)

        return [("sdpa", impl("sdpa")), ("explicit", impl("explicit"))], impl("auto")
    if ab == "pack":
        def packable(on: bool):  # switches the layers, keeping their packed copies (packed at the first call)
            return lambda model: [setattr(m, "packable", on) for m in model.modules() if isinstance(m, Linear)]

        return [("plain", packable(False)), ("packed", packable(True))], packable(True)
    if ab == "cls":
        def cls_only(on: bool):
            return lambda model: setattr(model, "last_block_cls_only", on)

        return [("all-tokens", cls_only(False)), ("cls-only", cls_only(True))], cls_only(True)
    block_forward = Block.forward

    def inplace_forward(self, x: torch.Tensor, return_attention: bool = False):
        # residual adds in place: one (B, T, D) allocation and write fewer per add (inference only)
        if return_attention:
            return block_forward(self, x, True)
        x += self.attn(self.norm1(x))
        x += self.mlp(self.norm2(x))
        return x

    def forward_fn(fn):
        return lambda model: setattr(Block, "forward", fn)

    return [("new", forward_fn(block_forward)), ("inplace", forward_fn(inplace_forward))], forward_fn(block_forward)


def models(dtype: str, rounds: int, profile: bool, ab: str) -> None:
    """Single-kernel timings on a small VM move with the allocator's state (NOTES.md, section 12): decide on whole models.

    ab: "attention" (model.set_attention_impl sdpa vs explicit), "residual" (Block.forward's residual adds new vs in place) or
    "pack" (fp32 Linear layers from their plain weights vs MKL-packed copies, `vitkit.models.layers.linear`) or
    "cls" (the last block on every token vs on the class token alone, `model.last_block_cls_only`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vitkit
    from vitkit.bench import make_step

    variants, restore = _variants(ab)
    (a, install_a), (b, install_b) = variants
    for name in ("vit_s16", "vit_b16"):
        model, x = vitkit.create_model(name), torch.randn(8, 3, 224, 224)
        forward = make_step(model, x, dtype, train=False, compile_=False)
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            forward()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    forward()
            print(name, dtype, "(the default path), 3 forwards of batch 8")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
            continue
        outputs = []
        for install in (install_a, install_b):  # warm both paths (and the allocator) up; compare their outputs
            install(model)
            forward()
            with torch.inference_mode():
                outputs.append(model(x).float())
        diff = (outputs[0] - outputs[1]).abs().max().item()
        times: dict[str, list[float]] = {a: [], b: []}
        for r in range(rounds):
            for key, install in ((a, install_a), (b, install_b)) if r % 2 == 0 else ((b, install_b), (a, install_a)):
                install(model)
                times[key].append(statistics.median(once(forward) for _ in range(3)))
        restore(model)
        ta, tb = statistics.median(times[a]), statistics.median(times[b])
        pairs = " ".join(f"{p / q:.3f}" for p, q in zip(times[a], times[b]))
        print(f"{name} {dtype} batch 8: {a} {8e3 / ta:.2f} img/s, {b} {8e3 / tb:.2f} img/s, {b} / {a} speed "
              f"{ta / tb:.3f} (rounds: {pairs}); max |logit difference| {diff:.2e}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["layouts", "kernels", "models"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="models: fp32, or bf16 autocast")
    ap.add_argument("--rounds", type=int, default=5, help="models: interleaved rounds per path")
    ap.add_argument("--profile", action="store_true", help="models: a torch.profiler table of the default path instead")
    ap.add_argument("--ab", choices=["attention", "residual", "pack", "cls"], default="attention",
                    help="models: A/B of the attention impl (sdpa vs explicit), of Block's residual adds (new vs in place), "
                         "of fp32 Linear layers plain vs MKL-packed, or of the last block on all tokens vs the class token")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    {"layouts": layouts, "kernels": kernels, "models": lambda: models(args.dtype, args.rounds, args.profile, args.ab)}[args.part]()
