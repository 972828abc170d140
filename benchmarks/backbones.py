"""vitkit against timm on the 2025-26 backbones: DINOv3 ViT-B/16 inference (and, optionally, PE-Core-B/16 or
AIMv2-L/14) with the same weights, one process, interleaved rounds, img/s and the vitkit / timm ratio.

    /tmp/peers/bin/python benchmarks/backbones.py                       # the default cases (2-core CPU: ~7 minutes)
    /tmp/peers/bin/python benchmarks/backbones.py --cases dinov3_b16:fp32:1:256 --rounds 2 --seconds 0.5 --no-save
    /tmp/peers/bin/python benchmarks/backbones.py --profile dinov3_b16:fp32:1:256    # where the time goes, both sides

A case is model:dtype:batch:img. For each model, timm's architecture is created with its own random init (the
LayerScale gammas, 1e-5 at init, redrawn as N(0.5, 0.1) so that the blocks count in the check), written as a timm hub
folder by `timm.models.save_for_hf` and read by `vitkit.load`, so both sides run the same weights. Before any timing
the two outputs (timm's default head: DINOv3 and AIMv2 average the patch tokens, 0 classes; PE-Core pools by
attention and projects; its projection, drawn at std 2e-5 by timm, is redrawn at 0.02) are compared in fp32 at
every image size of the run, and the run stops if they differ by more than 1e-4. Each case then runs both timed
paths once on its own input: vitkit's fp32 path (packed weights) is held to the same 1e-4, and in bf16 both sides'
error against timm's fp32 output is printed (relative to its largest value).

Each call is one inference forward in eval mode under `torch.inference_mode()`, built by `vitkit.bench.make_step`
for both sides, as `benchmarks/peers.py` times its peers: bf16 is `torch.autocast(cpu, bf16)` for both; vitkit runs
its default eager path there (fp32: Linear layers on the fastest GEMM measured on this machine, from packed weights;
bf16: weights cast and packed once; `--no-pack`: PyTorch's own GEMM, as timm). bf16 cases run only where the CPU
computes bf16 natively (avx512_bf16 or amx_bf16, and no ISA cap below them: `vitkit.machine.cpu.bf16_native`);
elsewhere they are skipped and the log says so. Warm-up, then `--rounds` rounds alternating vitkit and timm (the
order reversed every round); a round times one side for `--seconds` (at least 3 calls) and takes its median call.
Reported: the median of the rounds per side, their ratio, and how many rounds vitkit was ahead in.

Results: benchmarks/results/backbones_<cpu>.log and .json (<cpu> e.g. zen4, intel_amx; `--tag` overrides).
torch threads: `--threads` (default 2).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitkit
from vitkit.bench import make_step
from vitkit.machine import gemm
from vitkit.machine.cpu import bf16_native, cpu_info, cpu_model, isa_caps

MODELS = {  # vitkit's name: (timm's architecture, what it is)
    "dinov3_b16": ("vit_base_patch16_dinov3", "DINOv3 ViT-B/16"),
    "pe_core_b16": ("vit_pe_core_base_patch16_224", "PE-Core-B/16"),
    "aimv2_l14": ("aimv2_large_patch14_224", "AIMv2-L/14"),
}
DEFAULT_CASES = [f"dinov3_b16:{d}:{b}:{s}" for d in ("fp32", "bf16") for s in (256, 224) for b in (1, 8)]
DEFAULT_CASES += ["pe_core_b16:fp32:1:224"]
LIMIT = 1e-4
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_tag() -> str:
    """The results' CPU class, as the existing files name it: zen1/zen3/zen4/zen5 for AMD EPYC, intel_amx or intel."""
    info = cpu_info()
    vendor, family, model = info.get("vendor_id", ""), info.get("cpu family", ""), info.get("model", "")
    flags = info.get("flags", "").split()
    if vendor == "AuthenticAMD":
        zen = {("23", None): "zen1", ("25", "1"): "zen3", ("25", "17"): "zen4"}
        tag = zen.get((family, model)) or zen.get((family, None)) or {"26": "zen5"}.get(family)
        tag = tag or f"amd_f{family}_m{model}"
    elif vendor == "GenuineIntel":
        tag = "intel_amx" if "amx_bf16" in flags else "intel"
    else:
        tag = "cpu"
    return tag + ("_capped" if isa_caps() else "")


def build(name: str, tmp: Path, seed: int = 0):
    """timm's model (its random init, LayerScales redrawn) and vitkit's, loaded from the timm folder it writes."""
    import timm
    from timm.models import save_for_hf

    torch.manual_seed(seed)
    ref = timm.create_model(MODELS[name][0], pretrained=False).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith(("gamma", "gamma_1", "gamma_2")):
                p.normal_(0.5, 0.1)
        head = ref.get_classifier() if hasattr(ref, "get_classifier") else None
        if isinstance(head, torch.nn.Linear):  # timm draws PE-Core's projection at std 2e-5: make the check count
            head.weight.normal_(0, 0.02)
    folder = tmp / name
    save_for_hf(ref, folder, safe_serialization=True)
    ours = vitkit.load(folder).eval()
    return ref, ours


def measure(fn, batch: int, seconds: float) -> float:
    """img/s from the median call of a round (at least 3 calls)."""
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def parse(case: str) -> tuple[str, str, int, int]:
    name, dtype, batch, img = case.split(":")
    if name not in MODELS or dtype not in ("fp32", "bf16"):
        raise SystemExit(f"bad case {case!r}: model one of {sorted(MODELS)}, dtype fp32|bf16")
    return name, dtype, int(batch), int(img)


def profile(case: str, pack: bool, tmp: Path, calls: int = 5) -> None:
    """torch.profiler's table of both sides for one case: the ops sorted by their own CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    name, dtype, batch, img = parse(case)
    ref, ours = build(name, tmp)
    x = torch.randn(batch, 3, img, img)
    for side, model in (("vitkit", ours), ("timm", ref)):
        fn = make_step(model, x, dtype, False, False, pack=pack and side == "vitkit")
        for _ in range(2):
            fn()
        with prof(activities=[ProfilerActivity.CPU], record_shapes=False) as p:
            for _ in range(calls):
                fn()
        print(f"\n== {side}, {case}, {calls} calls ==")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="model:fp32|bf16:batch:img")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="per side per round")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds per side before the rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pack", action="store_true", help="vitkit on PyTorch's own GEMM, as timm")
    ap.add_argument("--tag", default=None, help="the results' file suffix (default: the CPU class, e.g. zen4)")
    ap.add_argument("--no-save", action="store_true", help="print only; write no results")
    ap.add_argument("--note", default="", help="a line for the log, e.g. what else ran on the machine")
    ap.add_argument("--keep-cache", action="store_true",
                    help="use $VITKIT_HOME's cached GEMM choices (default: a fresh cache, measured in this run)")
    ap.add_argument("--profile", metavar="CASE", default=None, help="print torch.profiler tables for CASE and stop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import timm

    fresh = None
    if not args.keep_cache:  # vitkit's fp32 GEMM paths measured now, not read from a cache made under other load
        fresh = tempfile.TemporaryDirectory(prefix="vitkit-home-")
        os.environ["VITKIT_HOME"] = fresh.name

    lines: list[str] = []

    def out(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        if args.profile:
            profile(args.profile, not args.no_pack, tmp)
            return
        native = bf16_native()
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = cpu_model()
        out(f"{date.today()}  {cpu} ({cpu_tag()}), {torch.get_num_threads()} torch threads; bf16 native: {native}"
            f"{'; ISA caps ' + isa_caps() if isa_caps() else ''}")
        out(f"torch {torch.__version__}, timm {timm.__version__}, vitkit {getattr(vitkit, '__version__', '?')}; "
            f"rounds {args.rounds} x {args.seconds} s per side, warm-up {args.warmup} s; vitkit "
            f"{'on torch GEMM (--no-pack)' if args.no_pack else 'default eager path (packed fastest GEMM)'}; "
            f"GEMM choices {'from $VITKIT_HOME' if args.keep_cache else 'measured in this run (fresh cache)'}")
        load = os.getloadavg()[0]
        out(f"load average at start {load:.2f}" + (f"; {args.note}" if args.note else ""))
        cases = [parse(c) for c in args.cases]
        rows, diffs = [], {}
        for name in dict.fromkeys(c[0] for c in cases):  # one build per model, its sizes checked before timing
            ref, ours = build(name, tmp)
            nparams = sum(p.numel() for p in ours.parameters())
            for img in sorted({c[3] for c in cases if c[0] == name}, reverse=True):
                x = torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(img))
                with torch.inference_mode():
                    a, b = ref(x), ours(x)
                diff = (a - b).abs().max().item()
                diffs[(name, img)] = diff
                out(f"{MODELS[name][1]} ({MODELS[name][0]}, {nparams / 1e6:.1f} M params) at {img}: fp32 outputs "
                    f"{tuple(a.shape)} agree to {diff:.1e} (limit {LIMIT:.0e}; max |out| {a.abs().max().item():.2f}, "
                    f"relative {diff / a.abs().max().item():.1e})")
                if not diff <= LIMIT:
                    raise SystemExit(f"{name} at {img}: vitkit and timm differ by {diff:.2e} > {LIMIT:.0e}; no timing")
            for case, (n, dtype, batch, img) in zip(args.cases, cases):
                if n != name:
                    continue
                if dtype == "bf16" and not native:
                    out(f"{case}: skipped (no native bf16 on this CPU)")
                    continue
                x = torch.randn(batch, 3, img, img)
                fns = {"vitkit": make_step(ours, x, dtype, False, False, pack=not args.no_pack),
                       "timm": make_step(ref, x, dtype, False, False, pack=False)}
                with torch.inference_mode():  # the timed path's own outputs (packed weights, autocast) on x
                    exact = ref(x)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                        got = {"vitkit": ours(x).float(), "timm": ref(x).float() if dtype == "bf16" else exact}
                err = {k: ((v - exact).abs().max() / exact.abs().max()).item() for k, v in got.items()}
                if dtype == "fp32" and not (got["vitkit"] - exact).abs().max().item() <= LIMIT:
                    raise SystemExit(f"{case}: vitkit's timed path differs from timm by more than {LIMIT:.0e}")
                for fn in fns.values():
                    measure(fn, batch, args.warmup)
                speeds: dict[str, list[float]] = {k: [] for k in fns}
                order = list(fns)
                for _ in range(args.rounds):
                    for k in order:
                        speeds[k].append(measure(fns[k], batch, args.seconds))
                    order.reverse()
                med = {k: statistics.median(v) for k, v in speeds.items()}
                rr = [a / b for a, b in zip(speeds["vitkit"], speeds["timm"])]
                row = {"case": case, "model": name, "timm_arch": MODELS[name][0], "dtype": dtype, "batch": batch,
                       "img_size": img, "vitkit_img_s": med["vitkit"], "timm_img_s": med["timm"],
                       "ratio": med["vitkit"] / med["timm"], "round_ratios": rr,
                       "vitkit_rounds": speeds["vitkit"], "timm_rounds": speeds["timm"],
                       "ahead": sum(r > 1 for r in rr), "fp32_max_abs_diff": diffs[(name, img)],
                       "timed_path_rel_error": err}
                rows.append(row)
                out(f"{case:<24} vitkit {med['vitkit']:7.2f}  timm {med['timm']:7.2f} img/s  ratio {row['ratio']:.3f}"
                    f"  (rounds' ratios {min(rr):.2f}-{max(rr):.2f}, vitkit ahead in {row['ahead']}/{args.rounds}; "
                    + (f"timed path vs timm fp32: vitkit {err['vitkit']:.1e}, timm {err['timm']:.1e} of max |out|)"
                       if dtype == "bf16" else f"timed path vs timm {err['vitkit']:.1e} of max |out|)"))
            del ref, ours
        load_end = os.getloadavg()[0]
        out(f"load average at end {load_end:.2f}")
        picks = gemm.choices()
        if picks:
            out("vitkit's fp32 GEMM paths: " + "; ".join(f"{k.split(',')[0]}: {v['path']}" for k, v in picks.items()))
        out()
        out("| model | dtype | batch | px | vitkit img/s | timm img/s | vitkit / timm | ahead |")
        out("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            out(f"| {MODELS[r['model']][1]} | {r['dtype']} | {r['batch']} | {r['img_size']} | {r['vitkit_img_s']:.2f} "
                f"| {r['timm_img_s']:.2f} | {r['ratio']:.2f} | {r['ahead']}/{args.rounds} |")
    if args.no_save:
        return
    tag = args.tag or cpu_tag()
    RESULTS.mkdir(exist_ok=True)
    command = shlex.join(["/tmp/peers/bin/python", "benchmarks/backbones.py", *sys.argv[1:]])
    (RESULTS / f"backbones_{tag}.log").write_text(f"$ {command}\n" + "\n".join(lines) + "\n")
    (RESULTS / f"backbones_{tag}.json").write_text(json.dumps({
        "command": command, "date": str(date.today()), "cpu": cpu, "cpu_tag": tag,
        "lscpu_model_name": next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                                  if ln.startswith("Model name")), None),
        "lscpu_cpu_family": next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                                  if ln.startswith("CPU family")), None),
        "bf16_native": native, "isa_caps": isa_caps(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "timm": timm.__version__, "rounds": args.rounds, "seconds": args.seconds,
        "pack": not args.no_pack, "load_start": load, "load_end": load_end, "note": args.note,
        "fp32_max_abs_diff": {f"{k[0]}:{k[1]}": v for k, v in diffs.items()}, "gemm_choices": picks,
        "rows": rows}, indent=1))
    print(f"wrote {RESULTS / f'backbones_{tag}.log'} and .json")


if __name__ == "__main__":
    main()
