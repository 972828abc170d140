"""Inference on a CPU shared with busy processes (issue 54): eager vitkit, vitkit's compiled engine, ONNX Runtime and
OpenVINO beside 0, 1 and 2 spinning processes, side by side in one run, with vitkit's thread policy off and on.

    python benchmarks/shared_cpu.py                       # ViT-S/16 and B/16, batch 1 and 8, policy off and on
    python benchmarks/shared_cpu.py --models vit_s16 --batches 1 --rounds 5 --json-out shared.json
    python benchmarks/shared_cpu.py --smoke               # a tiny ViT, 2 short rounds: checks the script (< 1 min)

Every engine runs in a process of its own, so that each has its own OpenMP runtime and environment:
- eager: vitkit's eager fp32 (packed GEMM), `policy off` with torch's thread count as it starts; `policy on` as the
  `vitkit` command runs it: a `threads.Governor` stepped before every call, as `predict` and `serve` do (its window
  restarted as each round begins: the time this process waited says nothing of the load to come); both with
  libgomp's default spin, or with the policy on GOMP_SPINCOUNT=N for each N of --spincount (a row each: the A/B
  of benchmarks/NOTES.md section 40);
- compiled: the AOTInductor package `--backend aoti` runs (fp32, compiled once per model and machine, cached under
  VITKIT_HOME), with the policy off and on as eager;
- onnxruntime: vitkit's ONNX export in ONNX Runtime's CPU provider, as many threads as cores (its own pool);
- openvino: the same file in OpenVINO's CPU plugin, INFERENCE_PRECISION_HINT f32 (its own pool).
A busy process is a pure-Python spin loop (`while True: pass`), one thread. Rounds interleave everything: in each
round, for each busy level, the spinners start, 0.3 s pass, every engine runs --round-s seconds in turn (the order
reversed every other round), and the spinners are killed. A rate is the median of the rounds; the share an engine
keeps is its rate beside k busy processes over its own rate beside none. Two fair shares are printed: per thread
(cores / (cores + k): every runnable thread gets the same CPU) and per process (max(cores - k, cores / (k + 1)) /
cores: the spinners, one thread each, get a core each or an equal share, the engine the rest).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("eager", "compiled", "onnx", "openvino")
SMOKE = {"model": "vit_ti16", "kwargs": {"img_size": 64, "depth": 2}}
GAP_S = 0.25  # a worker waits this long (untimed) before its round: the previous engine's threads go idle


# ---- the worker: one engine in a process of its own ------------------------------------------------------------

def _engine_probe():
    """vitkit/machine/engine_probe.py loaded by path: ONNX Runtime and OpenVINO without importing torch."""
    spec = importlib.util.spec_from_file_location("engine_probe", REPO / "vitkit" / "machine" / "engine_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(spec: dict) -> None:
    """Set one engine up, say "ready", then answer "round SECONDS" with "IMAGES ELAPSED THREADS" until stdin ends."""
    engine, batch, policy = spec["engine"], spec["batch"], spec["policy"]
    governor = None
    if engine in ("onnx", "openvino"):
        import numpy as np

        probe = _engine_probe()
        x = np.random.default_rng(0).standard_normal((batch, 3, *spec["size"])).astype(np.float32)
        fn = probe.compile_engine(engine, "fp32", spec["file"], spec["cores"])
        call = lambda: fn(x)  # noqa: E731
        threads = lambda: spec["cores"]  # noqa: E731
    else:
        import torch

        sys.path.insert(0, str(REPO))
        from vitkit.machine import threads as thread_policy

        thread_policy.ADAPT = policy == "on"
        x = torch.randn(batch, 3, *spec["size"], generator=torch.Generator().manual_seed(0))
        if engine == "eager":
            model = seeded_model(spec["model"], spec["kwargs"])
            from vitkit.machine.fast_linear import pack_linears

            pack_linears(model)

            def call():
                with torch.inference_mode():
                    return model(x)
        else:
            from vitkit.machine import aoti

            run, _ = aoti.load_package(spec["file"])
            call = lambda: run(x)  # noqa: E731
        governor = thread_policy.Governor()
        threads = torch.get_num_threads
    for _ in range(3):  # warm-up: one-time costs (GEMM choices, packing, kernels)
        call()
    print("ready", flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        # the engine before this one may still be busy for some milliseconds (ONNX Runtime's pool spins after a run,
        # TBB's workers too): a governor's first window would read that as another process's load and run this
        # round at one thread (seen: B/16 batch 8, 2 of 4 rounds beside "0 busy" at t1, right after ONNX Runtime)
        time.sleep(GAP_S)
        if governor is not None:
            governor.restart()
            governor.step()  # the first decision of the round, from the load now (0.1 s), before the clock starts
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < seconds:
            if governor is not None:
                governor.step()
            call()
            n += 1
        print(n * batch, time.perf_counter() - t0, threads(), flush=True)


def seeded_model(name: str, kwargs: dict):
    """The model with seeded weights (the head drawn too: a fine-tuning head starts at zero)."""
    import torch

    sys.path.insert(0, str(REPO))
    import vitkit

    torch.manual_seed(0)
    m = vitkit.create_model(name, **kwargs).eval()
    head = getattr(m, "head", None)
    if isinstance(head, torch.nn.Linear):
        torch.nn.init.normal_(head.weight, std=0.02)
    return m


# ---- the coordinator -------------------------------------------------------------------------------------------

def _spin() -> None:
    while True:
        pass


class Worker:
    """One engine's process, driven a round at a time."""

    def __init__(self, label: str, spec: dict, env: dict[str, str]) -> None:
        self.label = label
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)

    def ready(self) -> None:
        """Wait until the engine is set up and warm (the workers start together, then wait for their rounds)."""
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"{self.label}: the worker did not start (exit {self.proc.wait()})")

    def round(self, seconds: float) -> tuple[float, int]:
        self.proc.stdin.write(f"round {seconds}\n")
        self.proc.stdin.flush()
        images, elapsed, threads = self.proc.stdout.readline().split()
        return int(images) / float(elapsed), int(threads)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def prepare(name: str, kwargs: dict, batch: int, engines: list[str]) -> dict[str, str]:
    """The files the engines run, made once and cached under VITKIT_HOME as `--backend auto` makes them: the ONNX
    export (onnx, openvino) and the compiled package (compiled)."""
    sys.path.insert(0, str(REPO))
    from vitkit.inference.backends import export_for
    from vitkit.machine import engine as engine_mod

    model = seeded_model(name, kwargs)
    files = {}
    if "compiled" in engines:
        if engine_mod.installed("aoti") is None:
            raise SystemExit("the compiled engine needs a C++ compiler (g++): drop it with --engines")
        print(f"  the compiled package of {name} (compiled once per model and machine, then cached) ...", flush=True)
        files["compiled"] = str(export_for(model, None, "aoti-fp32", batch))
    if {"onnx", "openvino"} & set(engines):
        files["onnx"] = files["openvino"] = str(export_for(model, None, "onnx", batch))
    return files


def worker_env(policy: str, spincount: str) -> dict[str, str]:
    """The environment an engine's process starts with: libgomp's defaults, or (policy on) GOMP_SPINCOUNT=spincount
    where one is given."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    if policy == "on" and spincount:
        env["GOMP_SPINCOUNT"] = spincount
    return env


def fair(cores: int, k: int) -> tuple[float, float]:
    """(per thread, per process) fair share of a process that can use every core beside k one-thread spinners."""
    return cores / (cores + k), max(cores - k, cores / (k + 1)) / cores


def measure(name: str, kwargs: dict, batch: int, engines: list[str], policies: list[str], busy: list[int],
            rounds: int, round_s: float, spincounts: list[str]) -> dict:
    size = tuple(kwargs.get("img_size", (224, 224))) if isinstance(kwargs.get("img_size"), (list, tuple)) else \
        (kwargs.get("img_size", 224),) * 2
    files = prepare(name, kwargs, batch, engines)
    cores = len(os.sched_getaffinity(0))
    configs = []  # (label, engine, policy, spincount)
    for e in engines:
        for pol in (policies if e in ("eager", "compiled") else ["-"]):
            if pol == "on" and len(spincounts) > 1:  # an A/B of the spin: a row per count
                configs += [(f"{e} (policy on, spin {n})", e, pol, n) for n in spincounts]
            else:
                configs.append((f"{e}{'' if pol == '-' else ' (policy ' + pol + ')'}", e, pol, spincounts[0]))
    workers = {}
    try:
        for label, e, pol, spin in configs:
            spec = {"engine": e, "batch": batch, "policy": pol, "model": name, "kwargs": kwargs, "size": list(size),
                    "file": files.get(e), "cores": cores}
            workers[label] = Worker(label, spec, worker_env(pol, spin))
            # one at a time: a worker's warm-up measures its GEMM paths, which a neighbour's warm-up would load (the
            # policy's LoadWatch then keeps a choice made under that load for the run, uncached, as it should)
            workers[label].ready()
        rates: dict[tuple[str, int], list[float]] = {(label, k): [] for label in workers for k in busy}
        used: dict[tuple[str, int], list[int]] = {(label, k): [] for label in workers for k in busy}
        order = list(workers)
        for r in range(rounds):
            for k in busy:
                spinners = [mp.Process(target=_spin, daemon=True) for _ in range(k)]
                for s in spinners:
                    s.start()
                time.sleep(0.3)
                try:
                    for label in (order if r % 2 == 0 else order[::-1]):
                        rate, threads = workers[label].round(round_s)
                        rates[label, k].append(rate)
                        used[label, k].append(threads)
                finally:
                    for s in spinners:
                        s.kill()
                        s.join()
            print(f"  round {r + 1}/{rounds} done", flush=True)
    finally:
        for w in workers.values():
            w.close()
    table = {}
    for label in workers:
        base = statistics.median(rates[label, busy[0]]) if busy[0] == 0 else None
        table[label] = {str(k): {"img_per_s": statistics.median(rates[label, k]),
                                 "share": statistics.median(rates[label, k]) / base if base else None,
                                 "rounds": rates[label, k], "threads": used[label, k]} for k in busy}
    return {"model": name, "kwargs": kwargs, "batch": batch, "cores": cores, "table": table,
            "fair": {str(k): dict(zip(("per_thread", "per_process"), fair(cores, k))) for k in busy}}


def report(res: dict, cpu: str, busy: list[int]) -> str:
    lines = [f"{res['model']} batch {res['batch']}, {cpu}, {res['cores']} cores: img/s (share of its own 0-busy rate; "
             f"threads torch ran, median)"]
    w = max(22, *(len(label) + 1 for label in res["table"]))
    head = f"{'engine':<{w}}" + "".join(f"{str(k) + ' busy':>22}" for k in busy)
    lines.append(head)
    for label, row in res["table"].items():
        cells = []
        for k in busy:
            c = row[str(k)]
            share = f" ({c['share']:.0%})" if c["share"] is not None and k else ""
            t = f" t{statistics.median(c['threads']):g}" if label.startswith(("eager", "compiled")) else ""
            cells.append(f"{c['img_per_s']:.2f}{share}{t}")
        lines.append(f"{label:<{w}}" + "".join(f"{cell:>22}" for cell in cells))
    f = res["fair"]
    lines.append(f"{'fair share per thread':<{w}}" + "".join(f"{f[str(k)]['per_thread']:>22.0%}" for k in busy))
    lines.append(f"{'fair share per process':<{w}}" + "".join(f"{f[str(k)]['per_process']:>22.0%}" for k in busy))
    for e in ("eager", "compiled"):
        off = res["table"].get(f"{e} (policy off)")
        for label, on in res["table"].items():
            if off and label.startswith(f"{e} (policy on") and busy[0] == 0:
                lines.append(f"{label} / off beside 0 busy processes (on a quiet machine: what the policy costs): "
                             f"{on['0']['img_per_s'] / off['0']['img_per_s']:.2f}x")
    return "\n".join(lines)


def cpu_name() -> str:
    """`lscpu`'s model name, CPU family and model."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if ":" in line:
                k, v = line.split(":", 1)
                info.setdefault(k.strip(), v.strip())
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["vit_s16", "vit_b16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--policy", choices=("off", "on", "both"), default="both",
                   help="vitkit's thread policy for eager and compiled (ONNX Runtime and OpenVINO keep their own)")
    p.add_argument("--busy", nargs="+", type=int, default=[0, 1, 2], help="busy processes beside the engine")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-s", type=float, default=1.0, help="seconds each engine runs in a round")
    p.add_argument("--spincount", nargs="+", default=None,
                   help="GOMP_SPINCOUNT with the policy on (default: libgomp's own; several: a row for each)")
    p.add_argument("--smoke", action="store_true", help="a tiny ViT, batch 1, 2 rounds of 0.3 s: checks the script")
    p.add_argument("--json-out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    spincounts = args.spincount or [""]
    policies = ["off", "on"] if args.policy == "both" else [args.policy]
    busy = sorted(set(args.busy))
    cases = [(m, {}, b) for m in args.models for b in args.batches]
    rounds, round_s = args.rounds, args.round_s
    if args.smoke:
        cases, rounds, round_s = [(SMOKE["model"], SMOKE["kwargs"], 1)], 2, 0.3
    cpu = cpu_name()
    spin = f"GOMP_SPINCOUNT={'/'.join(spincounts)}" if args.spincount else "libgomp's default spin"
    print(f"{cpu}, {len(os.sched_getaffinity(0))} cores; policy on: the governor, {spin}; "
          f"load average before: {open('/proc/loadavg').read().split()[0]}", flush=True)
    results = []
    for name, kwargs, batch in cases:
        print(f"{name} batch {batch}:", flush=True)
        res = measure(name, kwargs, batch, args.engines, policies, busy, rounds, round_s, spincounts)
        results.append(res)
        print(report(res, cpu, busy), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu, "spincount": spincounts, "results": results}, indent=1))


if __name__ == "__main__":
    main()
