"""Single-op choices on a CPU (NOTES.md, sections 8, 20, 44 to 48, 63): the patch embedding's op, foreach vs fused AdamW,
Muon's cost in a step, the GEMM paths for the Linear shapes, attention's fused kernel against explicit matmuls, the
evaluation's batch, the hybrid's ResNet stages at 14x14, the parts of a training step, a batch split over two
Python threads, token dropping, and the compiled step against this CPU's GEMM peak.

    python benchmarks/ops.py patch-embed   # conv (kernel = stride = P) vs unfold-by-reshape + matmul, fwd / fwd+bwd
    python benchmarks/ops.py adamw         # one AdamW step over ViT-S/16 and ViT-B/16 parameters: single-tensor, foreach, fused
    python benchmarks/ops.py muon          # the fashion-mnist presets' training step (batch 128) with AdamW and with Muon
    python benchmarks/ops.py gemm          # GFLOP/s of every GEMM path (vitkit.machine.gemm) on S/16 and B/16 shapes
    python benchmarks/ops.py attention     # fp32/bf16 attention core: F.scaled_dot_product_attention vs matmul-softmax-matmul
    python benchmarks/ops.py eval-batch    # the 10-view evaluation (flip-shift) at batch 64 to 1000 (NOTES 45)
    python benchmarks/ops.py stem-pool     # fashion-mnist-fast's training step with ResNet stages at 14x14 (NOTES 46)
    python benchmarks/ops.py step-parts    # fashion-mnist-fast's step: forward+backward, + clipping, + Muon or AdamW (NOTES 47)
    python benchmarks/ops.py split-batch   # its forward+backward at 1 and 2 threads, and as two Python threads of one (NOTES 47)
    python benchmarks/ops.py patch-drop    # its whole step with token dropping (patch_drop_rate 0 to 0.75) and at batch 256 (NOTES 48)
    python benchmarks/ops.py roofline      # its compiled step's GEMMs, convolutions and the rest against this CPU's GEMM peak (NOTES 63)

Rounds alternate between the candidates; each number is the median over rounds, in ms (eval-batch: views/s).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, n: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def compare(fns: dict, rounds: int = 5, n: int = 10) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[k].append(timed(fns[k], n))
    return {k: statistics.median(v) for k, v in times.items()}


def patch_embed() -> None:
    """The same linear map two ways: F.conv2d, and the image cut into patches by reshape/permute, then a matmul."""
    P = 16
    for B, D, dtype, train in [(8, 384, torch.float32, False), (8, 768, torch.float32, False), (16, 384, torch.float32, True),
                               (8, 768, torch.bfloat16, False), (16, 384, torch.bfloat16, True)]:
        x = torch.randn(B, 3, 224, 224)  # images need no gradient
        w = torch.randn(D, 3, P, P, requires_grad=train)
        b = torch.randn(D, requires_grad=train)

        def conv():
            return F.conv2d(x, w, b, stride=P).flatten(2).transpose(1, 2)  # (B, D, 14, 14) -> (B, 196, D)

        def matmul():
            p = x.view(B, 3, 14, P, 14, P).permute(0, 2, 4, 1, 3, 5).reshape(B, 196, 3 * P * P)  # (B, 196, 3*P*P)
            return F.linear(p, w.view(D, -1), b)  # (B, 196, D)

        assert torch.allclose(conv(), matmul(), atol=1e-3, rtol=1e-3)

        def run(f):
            def go():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), torch.set_grad_enabled(train):
                    y = f()
                if train:
                    y.float().sum().backward()
            return go

        res = compare({"conv": run(conv), "matmul": run(matmul)})
        print(f"B {B:>2} D {D} {str(dtype)[6:]:>8} {'fwd+bwd' if train else 'fwd':>7}: conv {res['conv']:6.2f} ms, "
              f"patches + matmul {res['matmul']:6.2f} ms", flush=True)


def adamw() -> None:
    import vitkit

    for name in ["vit_s16", "vit_b16"]:
        model = vitkit.create_model(name, num_classes=1000)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        # single: neither, torch.optim.AdamW's default on a CPU (what timm's create_optimizer_v2 builds there)
        kernels = {"single": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        opts = {mode: torch.optim.AdamW(params, lr=1e-6, **kw) for mode, kw in kernels.items()}
        res = compare({mode: opt.step for mode, opt in opts.items()}, n=5)
        print(f"{name} ({sum(p.numel() for p in params) / 1e6:.0f}M params): AdamW step single-tensor "
              f"{res['single']:.1f} ms, foreach {res['foreach']:.1f} ms, fused {res['fused']:.1f} ms", flush=True)


def _fast_overrides() -> dict:
    """fashion-mnist-fast's model overrides at 28 px, one channel, 10 classes. Since NOTES section 51 its ResNet has
    BatchNorm (`hybrid_norm="batch"`); sections 45-50 measured the GroupNorm model (`hybrid_norm="group"`)."""
    from vitkit.training.presets import get_preset

    return {**get_preset("fashion-mnist-fast").model.overrides, "img_size": 28, "in_chans": 1, "num_classes": 10}


def training_step(model, opt, x, y):
    """One optimizer step of `model` on the batch (x, y), as a function to time."""
    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def muon() -> None:
    """The whole training step (forward, backward, optimizer) of the fashion-mnist presets' model at batch 128, with
    the long preset's fused AdamW and with fashion-mnist-fast's Muon: what Muon's Newton-Schulz iterations cost."""
    import vitkit
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer

    o = _fast_overrides()
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    steps = {}
    for name, lr in (("adamw", 2e-3), ("muon", 4e-3)):
        model = vitkit.create_model("r26_vit_s32", **o)
        steps[name] = training_step(model, build_optimizer(model, OptimConfig(name=name, lr=lr)), x, y)
    res = compare(steps, rounds=6, n=10)
    print(f"training step, batch 128: AdamW {res['adamw']:.1f} ms ({128e3 / res['adamw']:.0f} img/s), Muon "
          f"{res['muon']:.1f} ms ({128e3 / res['muon']:.0f} img/s): Muon's step {res['adamw'] / res['muon']:.2f}x")


def eval_batch() -> None:
    """The fashion-mnist presets' model evaluated as a trainer with `run.tta=flip-shift` does where it computes in fp32
    (`vitkit.evaluation.metrics.tta_log_probs`, 10 views: flips and one-pixel shifts, no grad), on 1,000 random
    images (the test set has 10,000) at evaluation batches of 64 to 1000 (1000: `data.eval_batch_size`'s old
    default, 256 its new)."""
    import vitkit
    from vitkit.evaluation.metrics import tta_log_probs

    o = _fast_overrides()
    model, x = vitkit.create_model("r26_vit_s32", **o).eval(), torch.randn(1000, 1, 28, 28)

    def pass_at(bs):
        def go():
            with torch.no_grad():
                for i in range(0, len(x), bs):
                    tta_log_probs(model, x[i:i + bs], "flip-shift")
        return go
    res = compare({bs: pass_at(bs) for bs in (64, 128, 256, 500, 1000)}, rounds=3, n=1)
    for bs, ms in res.items():
        print(f"evaluation batch {bs:>4}: {len(x) * 10e3 / ms:6.0f} views/s ({ms / 1e3:.1f} s for 1,000 images x 10 views)")


def stem_pool() -> None:
    """fashion-mnist-fast's training step (batch 128, Muon) with its ResNet stage at 7x7 (the stem's max-pool: the
    preset) against stages at 14x14 (`hybrid_stem_pool=False`, half the width, a stride-2 stage or a 2x2 embedding
    down to the same 7x7 token grid)."""
    import vitkit
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer

    base = _fast_overrides()
    variants = {
        "preset: pool, stage (4,) at 7x7": {},
        "no pool, stages (1, 2), width 0.5": dict(hybrid_stem_pool=False, hybrid_layers=(1, 2), hybrid_width=0.5),
        "no pool, stages (2, 2), width 0.5": dict(hybrid_stem_pool=False, hybrid_layers=(2, 2), hybrid_width=0.5),
        "no pool, stages (1, 3), width 0.5": dict(hybrid_stem_pool=False, hybrid_layers=(1, 3), hybrid_width=0.5),
        "no pool, stage (4,) at 14x14, width 0.5": dict(hybrid_stem_pool=False, hybrid_layers=(4,), hybrid_width=0.5),
    }
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    steps, params = {}, {}
    for name, o in variants.items():
        model = vitkit.create_model("r26_vit_s32", **{**base, **o})
        params[name] = sum(p.numel() for p in model.parameters())
        steps[name] = training_step(model, build_optimizer(model, OptimConfig(name="muon", lr=4e-3)), x, y)
    res = compare(steps, rounds=4, n=5)
    first = next(iter(res.values()))
    for name, ms in res.items():
        print(f"{name:<42} {params[name] / 1e6:.2f}M parameters: {ms:6.1f} ms a step, {128e3 / ms:4.0f} img/s, "
              f"{first / ms:.2f}x the preset's speed")


def _fast_model():
    """fashion-mnist-fast's model at 28 px, one random batch of 128 and its labels."""
    import vitkit

    torch.manual_seed(0)
    return vitkit.create_model("r26_vit_s32", **_fast_overrides()), torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))


def step_parts() -> None:
    """fashion-mnist-fast's training step (batch 128, eager, torch's thread count) built up: forward and backward,
    then gradient clipping, then Muon's step (with its AdamW half for the vectors) or fused AdamW's; the differences
    are what each part costs. Not in it: the augmentation, the loss's checks and logging, the compiled step."""
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer

    model, x, y = _fast_model()
    opts = {name: build_optimizer(model, OptimConfig(name=name, lr=lr, weight_decay=0.05))
            for name, lr in (("muon", 4e-3), ("adamw", 1e-6))}

    def part(opt_name, clip):
        def go():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if opt_name:
                opts[opt_name].step()
        return go
    res = compare({"forward + backward": part(None, False), "+ clipping": part(None, True),
                   "+ clipping + Muon": part("muon", True), "+ clipping + AdamW": part("adamw", True)}, n=6)
    for name, ms in res.items():
        print(f"{name:<20} {ms:6.1f} ms, {128e3 / ms:4.0f} img/s")


def split_batch() -> None:
    """fashion-mnist-fast's forward and backward (batch 128, eager, gradients by `torch.autograd.grad`) at 2 threads,
    at 1, and as two Python threads of one torch thread each, a half batch each, their gradients summed (checked equal
    to the whole batch's first): whether the 1.4x of two one-thread processes (NOTES 45) is in the forward and
    backward. torch's kernels run without the GIL; the modules' Python code takes turns."""
    import threading

    model, x, y = _fast_model()
    params = list(model.parameters())
    halves, out = [(x[:64], y[:64]), (x[64:], y[64:])], [None, None]

    def plain(threads):
        def go():
            torch.set_num_threads(threads)
            torch.autograd.grad(F.cross_entropy(model(x), y), params)
        return go

    def half(i):
        torch.set_num_threads(1)  # this Python thread's torch thread count
        xi, yi = halves[i]
        out[i] = torch.autograd.grad(F.cross_entropy(model(xi), yi) * 0.5, params)

    def split():
        out[:] = [None, None]
        torch.set_num_threads(1)
        t = threading.Thread(target=half, args=(1,))
        t.start()
        half(0)
        t.join()
        assert out[1] is not None, "the second thread failed"
        return torch._foreach_add(list(out[0]), list(out[1]))
    threads = torch.get_num_threads()
    try:
        model.eval()  # no drop-path: the two ways must give the same gradient
        whole = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(whole, split()))
        model.train()
        res = compare({"2 threads": plain(2), "1 thread": plain(1), "2 Python threads x 1": split}, n=6)
    finally:
        torch.set_num_threads(threads)
    for name, ms in res.items():
        print(f"{name:<22} {ms:6.1f} ms, {128e3 / ms:4.0f} img/s")


def muon_step(model, x, y, lr: float = 4e-3):
    """fashion-mnist-fast's whole eager step on (x, y) as a function to time: forward, backward, clipping, Muon."""
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer

    opt = build_optimizer(model, OptimConfig(name="muon", lr=lr, weight_decay=0.05))

    def go():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return go


def patch_drop() -> None:
    """fashion-mnist-fast's whole step (batch 128, eager, Muon) with token dropping (`patch_drop_rate` 0 to 0.75: the
    one ViT layer sees that share of its 49 tokens fewer; the ResNet stage before it computes every position), and
    at batch 256 (the step's fixed costs, Muon's above all, over twice the images): img/s and the speed against the
    preset's."""
    import vitkit

    x, y = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
    steps = {}
    for rate in (0.0, 0.25, 0.5, 0.75):
        torch.manual_seed(0)
        model = vitkit.create_model("r26_vit_s32", **{**_fast_overrides(), "patch_drop_rate": rate})
        steps[f"patch_drop_rate {rate}"] = (muon_step(model, x[:128], y[:128]), 128)
    torch.manual_seed(0)
    steps["batch 256"] = (muon_step(vitkit.create_model("r26_vit_s32", **_fast_overrides()), x, y), 256)
    res = compare({k: f for k, (f, _) in steps.items()}, n=4)
    base = 128e3 / res["patch_drop_rate 0.0"]
    for name, ms in res.items():
        ips = steps[name][1] * 1e3 / ms
        print(f"{name:<22} {ms:6.1f} ms a step, {ips:4.0f} img/s, {ips / base:.2f}x")


def gemm_paths() -> None:
    """Every path for the Linear shapes of S/16 and B/16 (qkv, proj, fc1, fc2) at batch 1 and 8 (197 tokens), and for
    a training step's dW at batch 16: GFLOP/s, best of interleaved rounds (`gemm.measure`)."""
    from vitkit.machine import gemm

    for name, d in (("S/16", 384), ("B/16", 768)):
        for kind, rows in (("linear", 197), ("linear", 8 * 197), ("wgrad", 16 * 197)):
            for k, n, what in ((d, 3 * d, "qkv"), (d, d, "proj"), (d, 4 * d, "fc1"), (4 * d, d, "fc2")):
                rates = gemm.measure(k, n, rows, seconds=0.6, kind=kind)
                best = max(rates, key=rates.get)
                print(f"{name} {what:<4} {'dW of ' if kind == 'wgrad' else ''}{rows:>4} x {k} x {n}: "
                      + ", ".join(f"{p} {r:.0f}" for p, r in rates.items()) + f" GFLOP/s; fastest {best} "
                      f"({rates[best] / rates['mkl']:.2f}x mkl)", flush=True)


def attention() -> None:
    """The attention core of S/16 and B/16 (197 tokens, head dim 64): the fused kernel against q k^T, softmax, @ v."""
    for B, H, dtype, train in [(1, 6, torch.float32, False), (8, 6, torch.float32, False), (8, 12, torch.float32, False),
                               (16, 6, torch.float32, True), (16, 12, torch.float32, True), (8, 12, torch.bfloat16, False),
                               (16, 6, torch.bfloat16, True)]:
        T, hd = 197, 64
        q, k, v = (torch.randn(B, H, T, hd, dtype=dtype, requires_grad=train) for _ in range(3))

        def fused():
            return F.scaled_dot_product_attention(q, k, v)

        def explicit():
            return ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v

        def run(f):
            def go():
                if train:
                    f().sum().backward()
                else:
                    with torch.no_grad():
                        f()
            return go

        res = compare({"fused": run(fused), "explicit": run(explicit)})
        print(f"B {B:>2} H {H:>2} {str(dtype)[6:]:>8} {'fwd+bwd' if train else 'fwd':>7}: fused {res['fused']:6.2f} ms, "
              f"explicit {res['explicit']:6.2f} ms", flush=True)


def roofline() -> None:
    """fashion-mnist-fast's compiled forward and backward (batch 128, the ResNet channels-last as it runs itself,
    torch's thread count) against this CPU's float32 GEMM peak (the fastest of `mm` at 2048^3 and at the model's
    Linear shapes, timed in the same run: the VM's speed drifts). torch.profiler's self time of 5 steps is grouped as
    the Linear GEMMs, the convolutions, attention, the rest (Inductor's fused element-wise kernels, by name; copies)
    and the wrappers (the compiled graphs' calls, autograd's nodes, buffer allocation), each with the FLOPs it does
    in one forward and backward as `vitkit models` counts them (torch's FlopCounterMode: a conv's padding taps
    included, 18% of a 3x3 conv's at 7x7; attention's backward 2.5x its forward). Then the optimizer's step (Muon
    and its AdamW half), whose Newton-Schulz products are FLOPs of their own (NOTES 63). Under Inductor's
    `conv_1x1_as_mm` or `max_autotune` 1x1 convs would move into the GEMMs' row: refused."""
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from vitkit.models.stats import CPU_FLOPS
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer, muon_names

    if inductor_config.conv_1x1_as_mm or inductor_config.max_autotune:
        raise SystemExit("roofline groups 1x1 convs as convolutions: not under conv_1x1_as_mm or max_autotune")

    def gemm_rate(m, k, n):
        a, b = torch.randn(m, k), torch.randn(k, n)
        ms = compare({"mm": lambda: a @ b}, rounds=3, n=max(3, int(2e10 / (2 * m * k * n))))["mm"]
        return 2 * m * k * n / ms / 1e6

    rates = {"2048 x 2048 x 2048": gemm_rate(2048, 2048, 2048)}
    rows = 128 * 49
    for k, n, what in ((192, 576, "qkv"), (192, 192, "proj"), (192, 384, "fc1"), (384, 192, "fc2"), (64, 64, "64 -> 64")):
        rates[f"{rows} x {k} x {n} ({what})"] = gemm_rate(rows, k, n)
    peak = max(rates.values())  # this VM's speed drifts: the best rate of this run, not a nominal one
    print(f"float32 GEMM peak (the fastest mm of this run): {peak:.0f} GFLOP/s")
    for what, r in rates.items():
        print(f"  mm {what}: {r:.0f} GFLOP/s")

    model, x, y = _fast_model()
    model.train()
    # FLOPs as `vitkit models` counts them (torch's FlopCounterMode with vitkit's CPU kernels), over one eager forward
    # and backward; eager CPU calls embed the hybrid's patches as a matmul of proj's weight, compiled proj runs as a
    # conv: its FLOPs move to the convolutions
    with FlopCounterMode(display=False, custom_mapping=CPU_FLOPS) as counter:
        F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
    per = counter.get_flop_counts()
    ops_of = {"Linear GEMMs": ("aten.mm", "aten.addmm", "aten.bmm"),
              "convolutions": ("aten.convolution", "aten.convolution_backward"),
              "attention": ("aten._scaled_dot_product_flash_attention_for_cpu",
                            "aten._scaled_dot_product_flash_attention_for_cpu_backward")}

    def total(scope: str, group: str) -> float:
        return sum(v for op, v in per.get(scope, {}).items() if str(op) in ops_of[group])

    flops = {g: total("Global", g) for g in ops_of}
    pe = f"{type(model).__name__}.patch_embed"
    moved = total(pe, "Linear GEMMs") - total(f"{pe}.backbone", "Linear GEMMs")
    flops["Linear GEMMs"] -= moved
    flops["convolutions"] += moved
    inductor_config.cpp.enable_kernel_profile = True  # the fused kernels by name in the profile, not inside the graph's call
    compiled = torch.compile(model)

    def fb():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(x), y, label_smoothing=0.1).backward()

    for _ in range(3):
        fb()
    whole = compare({"step": fb}, rounds=3, n=5)["step"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fb()
    groups = {"Linear GEMMs": ("aten::mm", "aten::addmm"),
              "convolutions": ("aten::mkldnn_convolution", "aten::convolution_backward"),
              "attention": ("flash_attention",)}
    ms = dict.fromkeys([*groups, "the rest", "the wrappers"], 0.0)
    for ev in prof.key_averages():
        if ev.key.startswith(("## Call", "Torch-Compiled", "CompiledFunction", "autograd::", "TorchDynamo")):
            group = "the wrappers"  # their self time: the graphs' Python calls, buffer allocation, guards, autograd
        else:
            group = next((g for g, keys in groups.items() if any(k in ev.key for k in keys)), "the rest")
        ms[group] += ev.self_cpu_time_total / 1e3 / 5
    print(f"compiled forward + backward, batch 128: {whole:.1f} ms a step unprofiled, the rows' sum "
          f"{sum(ms.values()):.1f} ms profiled ({sum(flops.values()) / 1e9:.1f} GFLOP)")
    for g, t in ms.items():
        f = flops.get(g)
        rate = f"{f / 1e9:5.2f} GFLOP, {f / t / 1e6:4.0f} GFLOP/s ({f / t / 1e6 / peak:.0%} of the peak)" if f else ""
        print(f"  {g:<14} {t:6.1f} ms {rate}")
    ideal = sum(flops.values()) / peak / 1e6
    print(f"  every FLOP at the peak: {ideal:.0f} ms ({ideal / whole:.0%} of the step)")

    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-9, weight_decay=0.0))
    names, ns = muon_names(model), 0
    steps = next(g["ns_steps"] for g in opt.param_groups if g["muon"])
    for n, p in model.named_parameters():
        if n in names:
            a, b = sorted((p.shape[0], p.numel() // p.shape[0]))
            ns += steps * 2 * (2 * a * a * b + a ** 3)  # each iteration: x x^T, gram @ gram, (.) @ x
    fb()  # gradients to step on (without them Muon skips every parameter)
    t = compare({"opt": opt.step}, rounds=3, n=10)["opt"]
    print(f"the optimizer's step (Muon and its AdamW half): {t:.1f} ms; Muon's {steps} Newton-Schulz iterations "
          f"{ns / 1e9:.2f} GFLOP ({ns / 1e6 / peak:.0f} ms at the peak)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["patch-embed", "adamw", "muon", "gemm", "attention", "eval-batch", "stem-pool",
                                        "step-parts", "split-batch", "patch-drop", "roofline"])
    args = ap.parse_args()
    from vitkit.machine.cpu import cpu_model

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}")
    {"patch-embed": patch_embed, "adamw": adamw, "muon": muon, "gemm": gemm_paths, "attention": attention,
     "eval-batch": eval_batch, "stem-pool": stem_pool, "step-parts": step_parts, "split-batch": split_batch,
     "patch-drop": patch_drop, "roofline": roofline}[args.what]()
