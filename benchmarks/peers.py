"""vitkit against timm and Hugging Face transformers: identical configs and weights, one process, interleaved.

Every case builds the peer's model, writes its weights, loads them into vitkit through `vitkit.load`
(so both run the same numbers), checks the outputs agree, then alternates timed rounds between the
implementations (alternating which goes first) and prints img/s and the vitkit/peer ratio (median of the
rounds, each round timed by its median call).

    python benchmarks/peers.py                      # the default cases (2-core CPU: ~20 minutes)
    python benchmarks/peers.py --cases vit_s16:infer:fp32:1 --rounds 5 --json out.json   # model:mode:dtype[:batch[:img]]
    python benchmarks/peers.py --peers timm --cases dinov2_b14:infer:fp32:8:224 dinov2_b14:infer:bf16:8:224 \
        dinov2_b14:infer:fp32:1:518 dinov2_b14:infer:bf16:1:518      # DINOv2 ViT-B/14 (LayerScale), timm only
    python benchmarks/peers.py --peers timm --cases swin_t:infer:fp32:8 swin_t:train:fp32:16 swin_t:infer:bf16:8 \
        swin_t:train:bf16:16                                          # Swin-T, timm only
    python benchmarks/peers.py --device cuda --cases vit_b16:infer:bf16 vit_l16:train:bf16 \
        --batch-infer 256 --batch-train 64                    # a GPU (bf16 autocast; fp16 adds a grad scaler)

On a GPU every timed call ends with a device synchronisation; both sides of a pair train with the same
optimizer (AdamW, fused on CUDA, foreach on CPU), so only the models differ. `--compile` times both sides
under `torch.compile` (vitkit with `fullgraph=True`; the peers without, so graph breaks are allowed there).
Both sides' % of the matmul peak divide the same FLOPs, the model's (`vitkit.models.stats.count_flops`: every token
through every block), although vitkit's forward runs the last block on the class token alone
(`model.last_block_cls_only`), as the head reads nothing else.
In fp32 on a CPU vitkit runs its Linear layers on the fastest GEMM measured on this machine
(`vitkit.machine.gemm`), inference and training, as `vitkit bench`, `train`, `eval` and `predict` do
(`--no-pack`: PyTorch's own GEMM, as the peers). The `ort` peer is vitkit's own model exported to ONNX
(`vitkit export`'s exporter, dynamic batch) in ONNX Runtime's CPU provider with as many threads: fp32 inference
cases only; `ort-int8` is that export after onnxruntime's dynamic int8 quantization of the weights (`vitkit export
--quantize int8`), its difference from vitkit's fp32 printed as its parity. OpenVINO's own int8 needs NNCF's
post-training quantization with a calibration set; it is not a peer here. The % of peak divides by the fastest GEMM path measured in this process (`vitkit.bench.gemm_rates`),
not by `torch.mm`'s rate. `--lowp-stream` also times vitkit with its bf16/fp16 token stream between blocks (`run.lowp_stream`), as
an extra row, and prints how far its logits are from the fp32 model next to autocast's own error.

Environment. HF transformers works with the CPU build of torch. timm needs torchvision, which loads only
with the CUDA build of torch, so for timm make a separate environment:

    python3 -m venv /tmp/peers
    /tmp/peers/bin/pip install torch torchvision timm transformers safetensors pyyaml matplotlib onnx onnxscript onnxruntime
    /tmp/peers/bin/pip install --no-deps -e .        # vitkit itself, from the repository root
    /tmp/peers/bin/python benchmarks/peers.py

Without timm importable, the timm columns are skipped and the script says so.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.bench import DTYPES, make_step
from vitkit.machine.cpu import cpu_model
from vitkit.machine.gemm import gemm_rates
from vitkit.models.stats import count_flops

SIZES = {"vit_s16": dict(hidden=384, depth=12, heads=6, mlp=1536, timm="vit_small_patch16_224"),
         "vit_b16": dict(hidden=768, depth=12, heads=12, mlp=3072, timm="vit_base_patch16_224"),
         "vit_l16": dict(hidden=1024, depth=24, heads=16, mlp=4096, timm="vit_large_patch16_224"),
         # a later ViT, timm only (transformers' Dinov2Model has no classifier to compare logits with)
         "dinov2_b14": dict(hidden=768, depth=12, heads=12, mlp=3072, timm="vit_base_patch14_dinov2", patch=14),
         # the Swin Transformer, timm only
         "swin_t": dict(timm="swin_tiny_patch4_window7_224", patch=4)}
DEFAULT_CASES = ["vit_s16:infer:fp32:1", "vit_s16:infer:fp32:8", "vit_b16:infer:fp32:1", "vit_b16:infer:fp32:8",
                 "vit_s16:train:fp32", "vit_b16:train:fp32", "vit_s16:infer:bf16", "vit_b16:infer:bf16", "vit_s16:train:bf16"]


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
    torch.nn.init.normal_(model.get_classifier().weight, std=0.02)  # timm zero-initialises ViT heads: a meaningful check
    if "patch" in SIZES[name]:  # LayerScale starts at 1e-5: make the blocks count in the output check too
        for n, p in model.named_parameters():
            if n.endswith("gamma"):
                torch.nn.init.normal_(p, 0.5, 0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / f"timm_{name}.safetensors")
    return model, vitkit.load(tmp / f"timm_{name}.safetensors")


class OrtSession:
    """vitkit's model exported to ONNX (dynamic batch) and run by ONNX Runtime: called as a model is, x -> logits."""

    config = SimpleNamespace(num_classes=1000)

    def __init__(self, model: torch.nn.Module, tmp: Path, name: str, quantize: str | None = None) -> None:
        from vitkit.inference.export import export_model
        from vitkit.machine.engine_probe import import_onnxruntime

        ort = import_onnxruntime()  # its telemetry off, as vitkit's own imports (docs/deploy.md)

        report = export_model(model, tmp / f"{name}{'.int8' if quantize else ''}.onnx", "onnx", dynamic_batch=True,
                              quantize=quantize)  # int8: onnxruntime's dynamic quantization of the weights
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        self.session = ort.InferenceSession(str(report.path), opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input: x.numpy()})[0])


class OvSession:
    """vitkit's model in OpenVINO's CPU plugin, called as a model is: from vitkit's own ONNX export (`ov`) or from
    `openvino.convert_model` of the module (`ov-pt`), compiled for the case's static shape with
    INFERENCE_PRECISION_HINT f32 or bf16, and that hint read back from the compiled model (OpenVINO computes in bf16
    by default on CPUs with avx512_bf16 unless asked for f32)."""

    config = SimpleNamespace(num_classes=1000)

    def __init__(self, model: torch.nn.Module, tmp: Path, name: str, x: torch.Tensor, dtype: str, source: str) -> None:
        from vitkit.inference.export import export_model
        from vitkit.machine.engine_probe import import_openvino, openvino_core

        ov = import_openvino()  # its usage telemetry off, as vitkit's own imports (docs/deploy.md)

        core = openvino_core()  # one Core per process: freed Cores can leave the main thread's signal stack unmapped
        if source == "ov":
            ovm = core.read_model(str(export_model(model, tmp / f"{name}.onnx", "onnx", dynamic_batch=True).path))
        else:
            ovm = ov.convert_model(model, example_input=x[:1])
        ovm.reshape({ovm.inputs[0]: list(x.shape)})
        want = {"fp32": "f32", "bf16": "bf16"}[dtype]
        self.compiled = core.compile_model(ovm, "CPU", {"INFERENCE_PRECISION_HINT": want,
                                                        "INFERENCE_NUM_THREADS": torch.get_num_threads()})
        got = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        self.precision = got.get_type_name() if hasattr(got, "get_type_name") else str(got)
        if self.precision != want:
            raise RuntimeError(f"OpenVINO compiled with INFERENCE_PRECISION_HINT {self.precision}, not {want}")
        self.request = self.compiled.create_infer_request()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) != tuple(self.compiled.inputs[0].shape):  # the parity check's smaller batch
            return torch.cat([self(x[i:i + 1].expand(self.compiled.inputs[0].shape[0], -1, -1, -1))[:1]
                              for i in range(len(x))])
        return torch.from_numpy(self.request.infer({0: x.numpy()})[0].copy())


class PeerLogits(torch.nn.Module):
    """A peer's model called as vitkit's are: images in, logits out (HF takes `pixel_values=`, returns `.logits`)."""

    config = SimpleNamespace(num_classes=1000)

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits if self.kind == "hf" else self.model(x)


def runner(model, kind: str, x: torch.Tensor, dtype: str, train: bool, compile_: bool = False, pack: bool = True):
    """One call = one inference forward or one training step: `vitkit.bench.make_step` for every implementation
    (the same autocast, optimizer and scaler), vitkit compiled with a full graph, the peers without. In fp32
    CPU inference vitkit runs its Linear layers from MKL-packed weights unless `pack` is off (a peer model has
    no vitkit Linear, so make_step's packing changes nothing there)."""
    if kind in ("ort", "ort-int8", "ov", "ov-pt"):
        return lambda: model(x)
    if kind != "vitkit":
        model = PeerLogits(model, kind)
    return make_step(model, x, dtype, train, compile_, fullgraph=kind == "vitkit", pack=pack)


def measure(fn, batch: int, seconds: float, device: torch.device) -> float:
    """img/s from the median time per call (each ended by a device sync): robust to the odd slow call."""
    times = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="model:infer|train:fp32|bf16|fp16")
    ap.add_argument("--peers", nargs="*", default=["timm", "hf", "ort"], choices=["timm", "hf", "ort", "ort-int8", "ov", "ov-pt"])
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-infer", type=int, default=8)
    ap.add_argument("--batch-train", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0, help="per implementation per round")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--compile", action="store_true", help="torch.compile both sides")
    ap.add_argument("--lowp-stream", action="store_true", help="also time vitkit with its low-precision token stream")
    ap.add_argument("--no-pack", action="store_true",
                    help="fp32 on a CPU: vitkit's Linear layers on PyTorch's own GEMM, not the fastest measured here")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    peers = list(args.peers)
    from vitkit.machine.engine_probe import import_onnxruntime, import_openvino  # the peers' telemetry off

    if "timm" in peers:
        try:
            import timm  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"timm not importable ({type(e).__name__}: {e}); skipping it. See this script's docstring.")
            peers.remove("timm")
    if {"ort", "ort-int8"} & set(peers):
        try:
            import_onnxruntime()
        except ImportError as e:
            print(f"onnxruntime not importable ({e}); skipping it. See this script's docstring.")
            peers = [p for p in peers if p not in ("ort", "ort-int8")]
    if {"ov", "ov-pt"} & set(peers):
        try:
            import_openvino()
        except ImportError as e:
            print(f"openvino not importable ({e}); skipping it (pip install openvino).")
            peers = [p for p in peers if p not in ("ov", "ov-pt")]
    torch.manual_seed(0)
    dtypes = sorted({c.split(":")[2] for c in args.cases})
    rates = {d: gemm_rates(d, device) for d in dtypes}
    peak = {d: max(r.values()) for d, r in rates.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()}, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} on {name}; the GEMM paths measured here (1024^3), GFLOP/s: "
          + "; ".join(f"{d}: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in r.items()) for d, r in rates.items()))
    rows = []
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for case in args.cases:
            model_name, mode, dtype, *b = case.split(":")
            train = mode == "train"
            batch = int(b[0]) if b else args.batch_train if train else args.batch_infer
            img = int(b[1]) if len(b) > 1 else args.img_size
            x = torch.randn(batch, 3, img, img, device=device)
            for peer in peers:
                if "patch" in SIZES[model_name] and peer != "timm":
                    continue
                if peer in ("ort", "ort-int8") and (train or dtype != "fp32" or device.type != "cpu" or args.compile):
                    continue  # ONNX Runtime: fp32 CPU inference
                if peer in ("ov", "ov-pt") and (train or dtype not in ("fp32", "bf16") or device.type != "cpu"
                                                or args.compile):
                    continue  # OpenVINO: CPU inference in f32 or bf16
                engine = peer in ("ort", "ort-int8", "ov", "ov-pt")
                if engine:  # vitkit's own model (timm's or HF's weights), exported or converted
                    _, ours = build_timm(model_name, img, tmp) if "timm" in peers else build_hf(model_name, img, tmp)
                    ours = ours.eval()
                    ref = OrtSession(ours, tmp, model_name, "int8" if peer == "ort-int8" else None) \
                        if peer.startswith("ort") else \
                        OvSession(ours, tmp, model_name, x, dtype, peer)
                else:
                    ref, ours = (build_hf if peer == "hf" else build_timm)(model_name, img, tmp)
                    ref, ours = ref.to(device), ours.to(device)
                peer_logits = ref if engine else PeerLogits(ref, peer)
                with torch.no_grad():
                    if not engine:
                        ref.eval()
                    ours.eval()
                    diff = (peer_logits(x[:2]) - ours(x[:2])).abs().max().item()  # against vitkit in fp32
                impls = {"vitkit": ours, peer: ref}
                if args.lowp_stream:
                    lp = copy.deepcopy(ours)
                    lp.lowp_stream = True
                    impls = {"vitkit": ours, "vitkit-lowp": lp, peer: ref}
                    with torch.no_grad():  # the price of the low-precision stream, next to autocast's own
                        lp.eval()
                        exact = peer_logits(x[:8]).float()
                        with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "fp32"):
                            amp_peer, amp_lp = peer_logits(x[:8]).float(), lp(x[:8]).float()
                        print(f"  relative error of the logits against {peer} in fp32: {peer} under {dtype} autocast "
                              f"{(amp_peer - exact).norm() / exact.norm():.1e}, vitkit-lowp "
                              f"{(amp_lp - exact).norm() / exact.norm():.1e}")
                fns = {k: runner(m, "vitkit" if k.startswith("vitkit") else peer, x, dtype, train, args.compile,
                                 not args.no_pack)
                       for k, m in impls.items()}
                speeds: dict[str, list[float]] = {k: [] for k in fns}
                for fn in fns.values():  # warm-up: compilation, first-call allocations and kernel selection
                    measure(fn, batch, 1.0, device)
                order = list(fns)
                for _ in range(args.rounds):
                    for k in order:  # interleaved: drifts in machine speed hit both
                        speeds[k].append(measure(fns[k], batch, args.seconds, device))
                    order.reverse()  # and neither always goes first
                med = {k: statistics.median(v) for k, v in speeds.items()}
                flops = count_flops(ours, (img,) * 2) * (3 if train else 1)
                for k in [k for k in fns if k.startswith("vitkit")]:
                    row = {"case": case, "impl": k, "peer": peer, "device": name, "batch": batch, "img_size": img,
                           "compiled": args.compile,
                           "vitkit_img_s": med[k], "peer_img_s": med[peer], "ratio": med[k] / med[peer],
                           "vitkit_fraction_of_peak": flops * med[k] / peak[dtype],
                           "peer_fraction_of_peak": flops * med[peer] / peak[dtype], "max_abs_output_diff": diff,
                           "round_ratios": [a / b for a, b in zip(speeds[k], speeds[peer])]}
                    ahead = sum(r > 1 for r in row["round_ratios"])
                    rows.append(row)
                    print(f"{case:<21}{' compiled' if args.compile else ''} {k:<11} vs {peer:<4} batch {batch:>3}: "
                          f"{med[k]:8.2f} vs {med[peer]:8.2f} img/s, ratio {row['ratio']:.3f}, ahead in {ahead}/"
                          f"{args.rounds} rounds  ({k} "
                          f"{row['vitkit_fraction_of_peak']:.0%} / {peer} {row['peer_fraction_of_peak']:.0%} of the fastest {dtype} "
                          f"GEMM; outputs agree to {diff:.1e})", flush=True)
                del ref, ours, impls, fns
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "peak": peak,
                                               "gemm_rates": rates, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
