"""LoRA against full fine-tuning on Fashion-MNIST: trainable parameters, a training step's speed and peak memory, and
the final epoch's test accuracy over 3 seeds, with each arm's learning rate chosen on held-out training images.

    python benchmarks/lora.py [--tag zen4] [--seeds 0 1 2] [--out-dir runs/lora-bench] [--threads 1] [--smoke]
    python benchmarks/lora.py --tag zen4 --steps-only [--rounds 7]   # the speeds again, the runs kept

1. Upstream: a plain ViT (patch 4 on 28x28: 49 tokens + the class token, D 96, depth 4, 4 heads, MLP 192) trained
   from scratch on classes 0-4 (T-shirt, trouser, pullover, dress, coat; 30,000 images, 3 epochs, the fashion-mnist
   preset's recipe: flips, random erasing, label smoothing), its head then removed: the backbone.
2. Downstream: classes 5-9 (sandal, shirt, sneaker, bag, ankle boot), 10,000 of their training images, 2 epochs,
   from the backbone with a new head, in three arms: LoRA rank 8 on the query and value rows of the fused qkv (the
   LoRA paper's choice), LoRA rank 8 on qkv, proj and the MLP, and full fine-tuning.
3. Each arm's learning rate: the best of three on 10% of the downstream training images held out (data.val_split,
   seed 0); the test set is not looked at. Then 3 seeds per arm on all 10,000 images; the test top-1 of the final
   weights (the last epoch, not the best), mean +- std (sample std) over the seeds.
4. Per arm, in child processes: trainable parameters; img/s of the trainer's own training step (`loop.train_step`:
   augmentation, forward, backward, clipping, AdamW; median of 5 rounds of 20 steps, the arms' rounds alternating,
   and the median of each round's ratio to full fine-tuning's step, as the machine's load drifts between rounds);
   the step's peak memory: the growth of resident memory (VmHWM, reset before the step) over one step after two
   warm-up steps, in a child whose glibc serves every block over 128 KiB by mmap so that resident memory follows
   the live tensors (as benchmarks/train_step.py measures it); the optimizer's state, counted. Each training run's
   peak RSS (the whole process: Python, torch, the data set in memory) is reported too. The same for a larger
   model (--size-model, default ViT-S/16 at 224 px, batch 8, random images), where the parameters' share shows.
5. The merged export: a seed-0 LoRA run's unmerged model (rebuilt from its step folder) against its final weights
   (merged) in vitkit, and the same weights exported to a timm folder and read by timm itself (/tmp/peers/bin/python,
   timm; skipped where that interpreter is missing).

Every run is fp32 (run.precision=fp32) and eager (run.compile=off), so that the arms compute alike; run.threads
sets the CPU threads (default 1: on a shared 2-core machine one thread per run measured faster than two).
Results: benchmarks/results/lora_<tag>.json and .log.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

MODEL = {"img_size": 28, "patch_size": 4, "embed_dim": 96, "depth": 4, "num_heads": 4, "mlp_dim": 192,
         "classifier": "token"}
COMMON = ["model.name=vit_ti16", "run.precision=fp32", "run.compile=off", "run.tta=none", "run.progress=false",
          "run.log_every=10", "run.eval_every=0"]
UPSTREAM = ["data.classes=[0,1,2,3,4]", "data.batch_size=256", "schedule.epochs=3", "schedule.warmup_epochs=0.3",
            "optim.lr=2e-3", "model.overrides=" + json.dumps(MODEL)]
DOWNSTREAM = ["data.classes=[5,6,7,8,9]", "data.subset=10000", "data.batch_size=128", "schedule.epochs=2",
              "schedule.warmup_epochs=0.2", "model.overrides={}"]
ARMS = {
    "lora-qv": ["model.lora=8", "model.lora_targets=[q,v]"],
    "lora-all": ["model.lora=8", "model.lora_targets=[qkv,proj,mlp]"],
    "full": [],
}
LRS = {"lora-qv": [1e-3, 3e-3, 1e-2], "lora-all": [1e-3, 3e-3, 1e-2], "full": [3e-4, 1e-3, 3e-3]}
PEERS = Path("/tmp/peers/bin/python")


class Log:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "a")

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def run_train(out: Path, overrides: list[str], threads: int) -> dict:
    """One `vitkit train` in a child process: its result.json, wall time, peak RSS and the logged step speeds."""
    cmd = [sys.executable, "-m", "vitkit", "train", "fashion-mnist", *COMMON, f"run.threads={threads}", *overrides,
           f"run.out_dir={out}", "--no-resume"]
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(out.parent / f'{out.name}.stderr').read_text()[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ips = [r["img_per_s"] for r in logged if "img_per_s" in r]
    ips = ips[1:] or ips  # the first log interval holds the warm-up
    return {**res, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "logged_img_per_s": statistics.median(ips)}


def step_child(arm: str, backbone: str, lr: float, threads: int, what: str) -> dict:
    """In this (child) process: the arm's run set up as the trainer does it (`setup.prepare_run`), then its
    training step timed (`what`="speed") or its peak memory measured ("memory")."""
    from vitkit.data.datasets import iterate_batches
    from vitkit.training import apply_overrides, get_preset
    from vitkit.training.distributed import Dist
    from vitkit.training.loop import train_step
    from vitkit.training.setup import prepare_run

    cfg = get_preset("fashion-mnist")
    cfg.model.overrides = {}
    over = dict(a.split("=", 1) for a in COMMON + DOWNSTREAM + ARMS[arm])
    over.update({"model.checkpoint": backbone, "optim.lr": lr, "run.threads": threads, "run.out_dir": "/nonexistent"})
    apply_overrides(cfg, over)
    torch.set_num_threads(threads)
    run = prepare_run(cfg, Dist())
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in run.model.parameters())
    batches = iterate_batches(run.data.train, cfg.data.batch_size, seed=0, epoch=0, num_workers=0, device=run.device)
    g = torch.Generator()
    run.net.train()
    step = 0

    def one() -> None:
        nonlocal step
        train_step(run, batches, step, g)
        step += 1

    one(), one()  # warm-up: packed weights, the optimizer's state
    out = {"arm": arm, "trainable_params": trainable, "total_params": total, **state_mb(run.model, run.opt)}
    return {**out, **_measure(one, what, 20, cfg.data.batch_size)}


def _measure(one, what: str, steps: int, batch: int) -> dict:
    """One step's peak memory ("memory"), or img/s over `steps` steps of `batch` images."""
    from vitkit.bench import PeakMemory

    if what == "memory":
        with PeakMemory(torch.device("cpu")) as mem:
            one()
        return {"step_peak_mb": mem.peak / 2**20}
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    return {"img_per_s": steps * batch / (time.perf_counter() - t0)}


def state_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What a run holds between steps, counted: the weights, and the optimizer's state (AdamW: two moments per
    trained parameter)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    return {"weights_mb": weights / 2**20, "optimizer_state_mb": moments / 2**20}


def size_child(arm: str, name: str, batch: int, threads: int, what: str) -> dict:
    """A larger model's step (random images at 224 px, AdamW on what trains): where LoRA's savings show, in the
    weight gradients and the optimizer's state that scale with the parameters."""
    import torch.nn.functional as F

    import vitkit
    from vitkit.machine.fast_linear import pack_linears
    from vitkit.models.lora import apply_lora, mark_only_lora_trainable
    from vitkit.training.config import OptimConfig
    from vitkit.training.optim import build_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = vitkit.create_model(name, num_classes=10).train()
    if arm != "full":
        targets = dict(a.split("=", 1) for a in ARMS[arm])["model.lora_targets"].strip("[]").split(",")
        apply_lora(model, 8, targets=targets)
        mark_only_lora_trainable(model, keep=("head.",))
    pack_linears(model, training=True)
    opt = build_optimizer(model, OptimConfig(lr=1e-4))
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 10, (batch,))

    def one() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one(), one()
    out = {"arm": arm, "model": name, "batch": batch, **state_mb(model, opt),
           "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "total_params": sum(p.numel() for p in model.parameters())}
    return {**out, **_measure(one, what, 3, batch)}


def child(arm: str, backbone: Path, lr: float, threads: int, what: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)} if what.endswith("memory") else dict(os.environ)
    res = subprocess.run([sys.executable, __file__, "--child", what, arm, str(backbone), str(lr), "--threads",
                          str(threads)], env=env, capture_output=True, text=True, cwd=REPO)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def merged_export_check(run_dir: Path, backbone: Path, lr: float, threads: int, tmp: Path) -> dict:
    """The seed-0 lora-qv run: its unmerged LoRA model (rebuilt from its last step folder as a resume does) against
    its final.safetensors (merged) in vitkit, and against that file exported to a timm folder and run by timm."""
    import numpy as np

    import vitkit
    from vitkit.training import apply_overrides, checkpoint, get_preset
    from vitkit.training.distributed import Dist
    from vitkit.training.setup import prepare_run

    cfg = get_preset("fashion-mnist")
    cfg.model.overrides = {}
    over = dict(a.split("=", 1) for a in COMMON + DOWNSTREAM + ARMS["lora-qv"])
    over.update({"model.checkpoint": str(backbone), "optim.lr": lr, "run.threads": threads, "run.out_dir": str(run_dir)})
    apply_overrides(cfg, over)
    run = prepare_run(cfg, Dist())
    checkpoint.load(checkpoint.latest(run_dir), run.model, run.opt, run.ema)
    lora_model = run.model.eval()
    merged = vitkit.load(run_dir / "final.safetensors")
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = lora_model(x), merged(x)
    out = {"merged_vs_lora_max_abs": float((got - ref).abs().max()), "max_abs_logit": float(ref.abs().max()),
           "merged_keys_with_lora": sum("lora" in k for k in merged.state_dict())}
    folder = tmp / "timm_export"
    vitkit.export(merged, folder, to="timm")
    np.save(tmp / "x.npy", x.numpy())
    if not PEERS.exists():
        out["timm"] = f"skipped: {PEERS} missing"
        return out
    script = ("import sys, numpy as np, torch, timm; m = timm.create_model('local-dir:' + sys.argv[1], pretrained=True)"
              ".eval(); x = torch.from_numpy(np.load(sys.argv[2]));\nwith torch.no_grad(): y = m(x)\n"
              "np.save(sys.argv[3], y.numpy()); print(timm.__version__, type(m).__name__)")
    res = subprocess.run([str(PEERS), "-c", script, str(folder), str(tmp / "x.npy"), str(tmp / "timm_y.npy")],
                         capture_output=True, text=True)
    if res.returncode:
        out["timm"] = f"failed: {res.stderr[-500:]}"
        return out
    y = torch.from_numpy(np.load(tmp / "timm_y.npy"))
    out.update(timm=res.stdout.strip(), timm_vs_lora_max_abs=float((y - ref).abs().max()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default=None, help="the results' name: benchmarks/results/lora_TAG (default: the CPU)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out-dir", default="runs/lora-bench")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size-model", default="vit_s16", help="the larger model whose step is measured too")
    p.add_argument("--size-batch", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="a minute's check of the script itself: tiny runs, no results")
    p.add_argument("--steps-only", action="store_true", help="measure the steps, the larger model and the export "
                   "again, keeping the runs of benchmarks/results/lora_TAG.json (a quieter machine's speeds)")
    p.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        UPSTREAM[2], DOWNSTREAM[1], DOWNSTREAM[3] = "schedule.epochs=0.05", "data.subset=1000", "schedule.epochs=0.3"
        for arm in LRS:
            LRS[arm] = LRS[arm][1:2]
        args.seeds, args.rounds, args.tag, args.out_dir = args.seeds[:2], 1, "smoke", "runs/lora-bench-smoke"
        args.size_model, args.size_batch = "vit_ti16", 2
    if args.child:
        what, arm, backbone, lr = args.child
        if what.startswith("size-"):  # backbone: the model's name, lr: the batch
            print(json.dumps(size_child(arm, backbone, int(lr), args.threads, what[5:])))
        else:
            print(json.dumps(step_child(arm, backbone, float(lr), args.threads, what)))
        return

    from vitkit.machine.cpu import cpu_model

    import vitkit

    cpu = cpu_model()
    tag = args.tag or "".join(c if c.isalnum() else "_" for c in cpu.lower())
    results = REPO / "benchmarks" / "results"
    log = Log(results / f"lora_{tag}.log")
    json_path = results / f"lora_{tag}.json"
    out = REPO / args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    record: dict = {"cpu": cpu, "torch": torch.__version__, "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
                    "command": "python " + " ".join(sys.argv), "model": MODEL, "upstream": UPSTREAM,
                    "downstream": DOWNSTREAM, "arms": ARMS, "lr_grid": LRS}
    log(f"== {record['date']}: {cpu}, torch {torch.__version__}, run.threads={args.threads}; load average "
        f"{os.getloadavg()[0]:.2f} at the start (other jobs share the CPU)")

    if args.steps_only:
        kept = json.loads(json_path.read_text())
        record.update({k: kept[k] for k in ("upstream_result", "tuning", "lr", "runs")}, runs_date=kept["date"])
        backbone, chosen, runs = out / "backbone.safetensors", kept["lr"], kept["runs"]
        log(f"the runs of {kept['date']} kept; steps, the larger model and the export measured again")
    else:
        up = run_train(out / "upstream", UPSTREAM, args.threads)
        record["upstream_result"] = up
        log(f"upstream (classes 0-4, from scratch): test top-1 {up['acc1']:.4f} in {up['wall_s']:.0f} s "
            f"({up['logged_img_per_s']:.0f} img/s logged)")
        m = vitkit.load(out / "upstream" / "final.safetensors")
        m.reset_classifier(0)  # the backbone: downstream fine-tuning puts a new head on it
        backbone = out / "backbone.safetensors"
        vitkit.save(m, backbone)
        base = [f"model.checkpoint={backbone}", *DOWNSTREAM]

        chosen, tuning = {}, {}
        for arm, extra in ARMS.items():
            tuning[arm] = {}
            for lr in LRS[arm]:
                r = run_train(out / f"tune-{arm}-{lr:g}", [*base, *extra, f"optim.lr={lr}", "data.val_split=0.1",
                                                           "run.seed=0"], args.threads)
                tuning[arm][lr] = r["val_acc1"]
                log(f"tuning {arm:<8} lr {lr:<6g} val top-1 {r['val_acc1']:.4f} ({r['wall_s']:.0f} s)")
            chosen[arm] = max(tuning[arm], key=tuning[arm].get)
            log(f"  {arm}: lr {chosen[arm]:g}")
        record.update(tuning=tuning, lr=chosen)
        json_path.write_text(json.dumps(record, indent=1))

        runs: dict = {arm: [] for arm in ARMS}
        for seed in args.seeds:
            for arm, extra in ARMS.items():
                r = run_train(out / f"{arm}-s{seed}", [*base, *extra, f"optim.lr={chosen[arm]}", f"run.seed={seed}"],
                              args.threads)
                runs[arm].append({"seed": seed, **r})
                log(f"{arm:<8} seed {seed}: test top-1 {r['acc1']:.4f} (final epoch), {r['wall_s']:.0f} s, peak RSS "
                    f"{r['peak_rss_mb']:.0f} MB, {r['logged_img_per_s']:.0f} img/s logged")
                record["runs"] = runs
                json_path.write_text(json.dumps(record, indent=1))

    steps: dict = {arm: {"img_per_s": []} for arm in ARMS}
    for arm in ARMS:
        mem = child(arm, backbone, chosen[arm], args.threads, "memory")
        steps[arm].update({k: mem[k] for k in ("trainable_params", "total_params", "step_peak_mb", "weights_mb",
                                                "optimizer_state_mb")})
    for rnd in range(args.rounds):
        for arm in (list(ARMS) if rnd % 2 == 0 else list(ARMS)[::-1]):
            steps[arm]["img_per_s"].append(child(arm, backbone, chosen[arm], args.threads, "speed")["img_per_s"])
        log(f"round {rnd + 1}: " + ", ".join(f"{arm} {steps[arm]['img_per_s'][-1]:.0f} img/s" for arm in ARMS))
    record["steps"] = steps
    sizes = {}
    for arm in ARMS:
        mem = child(arm, args.size_model, args.size_batch, args.threads, "size-memory")
        mem["img_per_s"] = child(arm, args.size_model, args.size_batch, args.threads, "size-speed")["img_per_s"]
        sizes[arm] = mem
        log(f"{args.size_model} batch {args.size_batch}, {arm}: {json.dumps(mem)}")
    record["sizes"] = sizes

    rows = []
    for arm in ARMS:
        accs = [r["acc1"] for r in runs[arm]]
        s = steps[arm]
        row = {"arm": arm, "lr": chosen[arm], "trainable_params": s["trainable_params"],
               "trainable_pct": 100 * s["trainable_params"] / s["total_params"],
               "step_img_per_s": statistics.median(s["img_per_s"]), "step_peak_mb": s["step_peak_mb"],
               # the load drifts between rounds: each round's ratio to full fine-tuning's step in the same round
               "step_vs_full": statistics.median(a / f for a, f in zip(s["img_per_s"], steps["full"]["img_per_s"])),
               "weights_mb": s["weights_mb"], "optimizer_state_mb": s["optimizer_state_mb"],
               "run_peak_rss_mb": max(r["peak_rss_mb"] for r in runs[arm]),
               "acc1_mean": statistics.mean(accs), "acc1_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
               "acc1": accs, "run_s_mean": statistics.mean(r["wall_s"] for r in runs[arm])}
        rows.append(row)
    record["rows"] = rows
    json_path.write_text(json.dumps(record, indent=1))

    record["export_check"] = merged_export_check(out / "lora-qv-s0", backbone, chosen["lora-qv"], args.threads, out)
    record["total_s"] = time.perf_counter() - t_all
    json_path.write_text(json.dumps(record, indent=1))

    log(f"\n{cpu}; torch {torch.__version__}; run.threads={args.threads}; fp32, eager")
    log(f"{'arm':<9} {'lr':>6} {'trainable':>10} {'%':>6} {'step img/s':>10} {'vs full':>7} {'step peak MB':>12} {'opt MB':>6} "
        f"{'run RSS MB':>10} {'test top-1 (final epoch, ' + str(len(args.seeds)) + ' seeds)':>34}")
    for r in rows:
        log(f"{r['arm']:<9} {r['lr']:>6g} {r['trainable_params']:>10,} {r['trainable_pct']:>6.2f} "
            f"{r['step_img_per_s']:>10.0f} {r['step_vs_full']:>6.2f}x {r['step_peak_mb']:>12.1f} {r['optimizer_state_mb']:>6.2f} "
            f"{r['run_peak_rss_mb']:>10.0f} {100 * r['acc1_mean']:>27.2f} +- {100 * r['acc1_std']:.2f}")
    for arm, r in sizes.items():
        log(f"{args.size_model} batch {args.size_batch} at 224 px, {arm:<8}: {r['trainable_params']:>11,} trainable, "
            f"{r['img_per_s']:.1f} img/s, step peak {r['step_peak_mb']:.0f} MB, optimizer state "
            f"{r['optimizer_state_mb']:.1f} MB (weights {r['weights_mb']:.0f} MB)")
    log(f"merged export: {json.dumps(record['export_check'])}")
    log(f"total {record['total_s']:.0f} s")


if __name__ == "__main__":
    main()
