"""vitkit against timm and Hugging Face transformers: identical configs and weights, one process, interleaved.

Every case builds the peer's model, writes its weights, loads them into vitkit through `vitkit.load`
(so both run the same numbers), checks the outputs agree, then alternates timed rounds between the
implementations (alternating which goes first) and prints img/s and the vitkit/peer ratio (median of the
rounds, each round timed by its median call).

    python benchmarks/peers.py                      # the default cases (2-core CPU: a few minutes)
    python benchmarks/peers.py --cases vit_s16:infer:fp32 --rounds 5 --json out.json

Environment. HF transformers works with the CPU build of torch. timm needs torchvision, which loads only
with the CUDA build of torch, so for timm make a separate environment:

    python3 -m venv /tmp/peers
    /tmp/peers/bin/pip install torch torchvision timm transformers safetensors pyyaml matplotlib
    /tmp/peers/bin/pip install --no-deps -e .        # vitkit itself, from the repository root
    /tmp/peers/bin/python benchmarks/peers.py

Without timm importable, the timm columns are skipped and the script says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit  # noqa: E402
from vitkit.bench import matmul_peak  # noqa: E402
from vitkit.stats import count_flops  # noqa: E402

SIZES = {"vit_s16": dict(hidden=384, depth=12, heads=6, mlp=1536, timm="vit_small_patch16_224"),
         "vit_b16": dict(hidden=768, depth=12, heads=12, mlp=3072, timm="vit_base_patch16_224")}
DEFAULT_CASES = ["vit_s16:infer:fp32", "vit_s16:infer:bf16", "vit_b16:infer:fp32", "vit_b16:infer:bf16",
                 "vit_s16:train:fp32", "vit_s16:train:bf16"]


def build_hf(name: str, img: int, tmp: Path):
    import transformers

    s = SIZES[name]
    cfg = transformers.ViTConfig(hidden_size=s["hidden"], num_hidden_layers=s["depth"], num_attention_heads=s["heads"],
                                 intermediate_size=s["mlp"], image_size=img, patch_size=16, num_labels=1000)
    model = transformers.ViTForImageClassification(cfg)
    torch.nn.init.normal_(model.classifier.weight, std=0.02)  # a non-zero head, so that the output check means something
    model.save_pretrained(tmp / f"hf_{name}")
    return model, vitkit.load(tmp / f"hf_{name}")


def build_timm(name: str, img: int, tmp: Path):
    import timm
    from safetensors.torch import save_file

    model = timm.create_model(SIZES[name]["timm"], pretrained=False, img_size=img, num_classes=1000)
    torch.nn.init.normal_(model.head.weight, std=0.02)  # timm zero-initialises the head: make the output check meaningful
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / f"timm_{name}.safetensors")
    return model, vitkit.load(tmp / f"timm_{name}.safetensors")


def runner(model, kind: str, x: torch.Tensor, dtype: str, train: bool):
    """One call = one inference forward or one training step, in the peer's own calling convention."""
    amp = dtype == "bf16"

    def fwd():
        out = model(pixel_values=x) if kind == "hf" else model(x)
        return out.logits if kind == "hf" else out

    if not train:
        model.eval()

        def infer():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                fwd()

        return infer
    model.train()
    y = torch.randint(0, 1000, (x.shape[0],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(fwd().float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(fn, batch: int, seconds: float) -> float:
    """img/s from the median time per call: robust to the odd call a busy neighbour slows down."""
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="model:infer|train:fp32|bf16")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-infer", type=int, default=8)
    ap.add_argument("--batch-train", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0, help="per implementation per round")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    try:
        import timm  # noqa: F401

        peers = ["timm", "hf"]
    except Exception as e:  # noqa: BLE001
        print(f"timm not importable ({type(e).__name__}: {e}); measuring HF transformers only. See this script's docstring.")
        peers = ["hf"]
    torch.manual_seed(0)
    peak = {d: matmul_peak(d) for d in ("fp32", "bf16")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; measured matmul peak: "
          f"fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for case in args.cases:
            name, mode, dtype = case.split(":")
            train = mode == "train"
            batch = args.batch_train if train else args.batch_infer
            x = torch.randn(batch, 3, args.img_size, args.img_size)
            for peer in peers:
                ref, ours = (build_hf if peer == "hf" else build_timm)(name, args.img_size, tmp)
                with torch.no_grad():
                    ref.eval(), ours.eval()
                    a = ref(pixel_values=x[:2]).logits if peer == "hf" else ref(x[:2])
                    diff = (a - ours(x[:2])).abs().max().item()
                fns = {"vitkit": runner(ours, "vitkit", x, dtype, train), peer: runner(ref, peer, x, dtype, train)}
                speeds: dict[str, list[float]] = {k: [] for k in fns}
                for fn in fns.values():  # warm-up: first-call allocations and kernel selection
                    measure(fn, batch, 1.0)
                order = list(fns)
                for _ in range(args.rounds):
                    for k in order:  # interleaved: drifts in machine speed hit both
                        speeds[k].append(measure(fns[k], batch, args.seconds))
                    order.reverse()  # and neither always goes first
                med = {k: statistics.median(v) for k, v in speeds.items()}
                flops = count_flops(ours, (args.img_size,) * 2) * (3 if train else 1)
                row = {"case": case, "peer": peer, "batch": batch, "vitkit_img_s": med["vitkit"], "peer_img_s": med[peer],
                       "ratio": med["vitkit"] / med[peer], "vitkit_fraction_of_peak": flops * med["vitkit"] / peak[dtype],
                       "peer_fraction_of_peak": flops * med[peer] / peak[dtype], "max_abs_output_diff": diff}
                rows.append(row)
                print(f"{case:<22} vs {peer:<4} batch {batch:>2}: vitkit {med['vitkit']:7.2f} img/s, {peer} {med[peer]:7.2f} img/s, "
                      f"ratio {row['ratio']:.3f}  (vitkit {row['vitkit_fraction_of_peak']:.0%} / {peer} "
                      f"{row['peer_fraction_of_peak']:.0%} of the {dtype} matmul peak; outputs agree to {diff:.1e})", flush=True)
                del ref, ours, fns
    if args.json:
        Path(args.json).write_text(json.dumps({"peak": peak, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
