"""Time to accuracy on Fashion-MNIST (issue 55): each preset trained by the whole `vitkit train` command, seed by
seed, its test top-1 at every evaluation against the run's clock, the final one against the command's wall time;
then the table (preset, CPU, precision, seconds, top-1 mean +- std over the seeds) and the plot (test top-1 against
wall clock, a line per preset) with the CPU named.

    python benchmarks/time_to_accuracy.py run [--presets fashion-mnist fashion-mnist-long] [--seeds 0 1 2]
                                              [--tag intel207] [--out-dir runs/tta] [-- KEY=VALUE ...]
    python benchmarks/time_to_accuracy.py report --tag intel207 [amd26 ...] [--plot docs/figures/time_to_accuracy.png]
    python benchmarks/time_to_accuracy.py report --tag xeon167+xeon167bn   # two files of one CPU: one table, one panel
    python benchmarks/time_to_accuracy.py run --smoke        # a few steps per preset: checks the plumbing

What is measured, and how:
- The time is the whole command (`vitkit train PRESET run.seed=S ...` in a child process: interpreter start, data
  loading from the local copy, the precision probe, training, the evaluations, saving), install and download
  excluded (the data set is read once before the first run). One run at a time: nothing else should run beside it.
- The evaluations are the preset's own (`run.eval_every`, its test-time augmentation), on the test set: the points
  of the plot are those evaluations, at the run's own clock (`time` of each evaluation in metrics.jsonl), and the
  last point is the final evaluation at the command's wall time. The final number is the weights the preset saves as
  final.safetensors (the EMA's where the preset keeps one: `ema_acc1`, else `acc1`), evaluated once: no choice is
  made on the test set. Recipes are chosen elsewhere, on a held-out split (`data.val_split`; benchmarks/NOTES.md).
- Each row names the CPU (`lscpu` model name and family; the ISA caps where the runs had them, `ONEDNN_MAX_CPU_ISA=AVX2
  MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2`: a CPU without bf16) and the precision the run took
  (`run.precision=auto` decides per machine; the run's log says which).

Results: benchmarks/results/time_to_accuracy_<tag>.json (every run's points, seconds, final top-1), and the plot. A
run's optional `label` (written by hand where a preset changed after the run: "fashion-mnist-fast (GroupNorm)")
names its row and line in place of the preset.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import textwrap
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vitkit.machine import cpu  # noqa: E402
from vitkit.machine.cpu import cpu_model  # noqa: E402
from vitkit.machine.threads import allowed_cpus  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PRESETS = ("fashion-mnist", "fashion-mnist-long")


def _vitkit() -> list[str]:
    exe = Path(sys.executable).with_name("vitkit")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vitkit"]


def final_top1(points: list[dict]) -> float:
    """The final evaluation's top-1 of the weights the run saves as final (the EMA's where there is one)."""
    last = points[-1]
    return last.get("ema_acc1", last["acc1"])


def one_run(preset: str, seed: int, out: Path, extra: list[str], smoke: bool) -> dict:
    """`vitkit train PRESET run.seed=SEED run.out_dir=OUT ...` in a child process: its wall time, the precision it
    took, and its test evaluations (top-1, the EMA's, the run's clock)."""
    cmd = [*_vitkit(), "train", preset, *(["--smoke"] if smoke else []), "--no-resume", f"run.seed={seed}",
           f"run.out_dir={out}", "run.progress=false", *extra]  # a fresh run: its time is the whole command's
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    points = [{k: r[k] for k in ("epoch", "acc1", "ema_acc1", "time") if k in r} for r in rows
              if r.get("split") == "test"]
    m = re.search(r"precision auto -> (\w+)|precision (\w+)", proc.stderr)
    precision = next((g for g in (m.groups() if m else ()) if g), "?")
    return {"preset": preset, "seed": seed, "seconds": wall, "precision": precision, "points": points,
            "top1": final_top1(points), "command": " ".join(cmd[1:])}


def isa_caps() -> str:
    """The instruction-set caps this process runs under (the runs inherit them), as the CPU's name says them: a CPU
    with bf16 capped to AVX2 stands for one without it."""
    caps = cpu.isa_caps()
    return f" (capped: {caps.replace(',', ' ')})" if caps else ""


def machine() -> tuple[str, int]:
    """This machine as a results file names it: the CPU (with any ISA caps) and the cores this process may use."""
    return cpu_model() + isa_caps(), len(allowed_cpus())


def results_doc(path: Path, fresh: bool) -> dict:
    """The results file at `path` to add this machine's runs to (a new one if `fresh` or absent). A file, and the
    plot's panel drawn from it, is one CPU with one core count: a file with runs of another machine (or other caps or
    cores), or runs whose machine it does not name, is refused rather than relabelled."""
    here, cores = machine()
    if fresh or not path.exists():
        return {"runs": [], "cpu": here, "cores": cores}
    doc = json.loads(path.read_text())
    runs = doc.get("runs", [])
    names = {doc.get("cpu")} | {r.get("cpu", doc.get("cpu")) for r in runs}  # a run without one is the file's
    if runs and (names != {here} or doc.get("cores") != cores):
        raise SystemExit(f"{path} holds runs on {sorted(map(str, names))} with {doc.get('cores')} cores, and this "
                         f"machine is {here!r} with {cores}: pass another --tag")
    return {**doc, "runs": runs, "cpu": here, "cores": cores}


def run(args: argparse.Namespace) -> None:
    from vitkit.data.datasets import load_dataset  # the data set read once, before any run is timed

    path = RESULTS / f"time_to_accuracy_{args.tag}.json"
    doc = results_doc(path, fresh=args.smoke)  # before any download or run
    load_dataset("fashion-mnist")
    for preset in args.presets:
        for seed in args.seeds:
            if any(r["preset"] == preset and r["seed"] == seed for r in doc["runs"]):
                continue  # done in an earlier call: the file keeps it
            r = one_run(preset, seed, Path(args.out_dir) / f"{args.tag}-{preset}-s{seed}", args.extra, args.smoke)
            r["cpu"] = doc["cpu"]
            doc["runs"].append(r)
            print(f"{preset} seed {seed}: {r['top1']:.4f} in {r['seconds']:.0f} s ({r['precision']})", flush=True)
            if not args.smoke:
                path.write_text(json.dumps(doc, indent=1))
    print(table(doc))


def table(doc: dict) -> str:
    """The markdown table: preset, CPU, precision, seconds and top-1 (mean +- sample std over the seeds)."""
    lines = ["| preset | CPU | precision | seeds | seconds | test top-1 |", "|---|---|---|---:|---:|---:|"]
    for preset in dict.fromkeys(_label(r) for r in doc["runs"]):
        rs = [r for r in doc["runs"] if _label(r) == preset]
        acc, sec = [100 * r["top1"] for r in rs], [r["seconds"] for r in rs]
        sd = f" +- {statistics.stdev(acc):.2f}" if len(acc) > 1 else ""
        sd_s = f" +- {statistics.stdev(sec):.0f}" if len(sec) > 1 else ""
        cpu = " / ".join(sorted({r.get("cpu", doc["cpu"]) for r in rs}))
        lines.append(f"| {preset} | {cpu} | {'/'.join(sorted({r['precision'] for r in rs}))} | {len(rs)} | "
                     f"{statistics.mean(sec):.0f}{sd_s} | {statistics.mean(acc):.2f}{sd} |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    return r.get("label", r["preset"])


def joined(tags: str) -> dict:
    """The result files `tags` names ("a+b": the runs of both, one CPU's sessions), as one document."""
    docs = [json.loads((RESULTS / f"time_to_accuracy_{t}.json").read_text()) for t in tags.split("+")]
    if len({d["cpu"] for d in docs}) > 1:
        raise SystemExit(f"{tags}: the files name different CPUs ({sorted({d['cpu'] for d in docs})}): a panel is one CPU")
    return {**docs[0], "runs": [r for d in docs for r in d["runs"]], "tag": tags}


def plot(docs: list[dict], out: Path) -> None:
    """Test top-1 against wall clock, a panel per result file (a CPU and its session): each run's evaluations (its
    own clock) and its final point (the command's wall time), a colour per preset, the CPU and precision named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(docs))  # at most three panels a row
    rows = -(-len(docs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), sharex=True, sharey=True, squeeze=False)
    for ax in axes.flat[len(docs):]:
        ax.set_visible(False)
    colours: dict[str, str] = {}
    for ax, doc in zip(axes.flat, docs):
        for r in doc["runs"]:
            c = colours.setdefault(_label(r), f"C{len(colours)}")
            xs = [p.get("time", 0) / 60 for p in r["points"][:-1]] + [r["seconds"] / 60]
            ys = [100 * p.get("ema_acc1", p["acc1"]) for p in r["points"]]
            ax.plot(xs, ys, "o-", color=c, alpha=0.8, label=_label(r) if r["seed"] == min(
                x["seed"] for x in doc["runs"] if _label(x) == _label(r)) else None)
        ax.axhline(94, color="grey", lw=0.8, ls="--")
        ax.axvline(30, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("wall clock (minutes; the last point: the whole vitkit train command)")
        precision = "/".join(sorted({r["precision"] for r in doc["runs"]}))
        cores = f", {doc['cores']} cores" if doc.get("cores") else ""
        tag = f" [{doc['tag']}]" if doc.get("tag") else ""  # the result files: one CPU's sessions apart
        ax.set_title(textwrap.fill(f"{doc['cpu']}{cores}, {precision}{tag}", 70), fontsize=9)  # a capped name is long
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    # every panel (sharex) to the longest run: without it the shared axis keeps the first panel's own range
    axes[0][0].set_xlim(0, 1.03 * max(r["seconds"] / 60 for doc in docs for r in doc["runs"]))
    for row in axes:
        row[0].set_ylabel("Fashion-MNIST test top-1 (%)")
    fig.suptitle("Time to accuracy", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--presets", nargs="+", default=list(PRESETS))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--tag", default="local")
    r.add_argument("--out-dir", default="runs/time-to-accuracy")
    r.add_argument("--smoke", action="store_true")
    r.add_argument("extra", nargs="*", help="KEY=VALUE overrides for every run (after --)")
    rep = sub.add_parser("report")
    rep.add_argument("--tag", nargs="+", default=["local"],
                     help="one or more result files (a+b: two files of one CPU as one); the plot has a panel each")
    rep.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        docs = [joined(tag) for tag in args.tag]
        for tag, doc in zip(args.tag, docs):
            print(f"{tag}:\n{table(doc)}")
        if args.plot:
            plot(docs, args.plot)
            print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
