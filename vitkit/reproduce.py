"""The paper's findings at laptop scale, one command each: `vitkit reproduce NAME [--seeds 3] [--smoke]`.

Every study trains small models on the data this machine has (Fashion-MNIST, scikit-learn's digits), with several
seeds, and writes a markdown table (mean ± std over seeds) and a plot to docs/reproductions/NAME.md (.png, .json).
Models are chosen so that a full study takes at most ~30 minutes on a 2-core CPU, `--smoke` ~2 minutes:

- posemb       Table 8: no / learned 1-D / learned 2-D / relative / sin-cos 2-D position embedding
- pooling      App. D.3, Fig. 9: the class token against global average pooling, each at several learning rates
- data-scale   Fig. 3-5 in shape: ViT, hybrid and BiT ResNet pre-trained on growing subsets of an upstream task
               (Fashion-MNIST's classes 0-4), few-shot on classes never seen upstream (classes 5-9) and on digits
- mpp          Sec. 4.6: masked-patch pre-training then fine-tuning, against training from scratch, same budget
- distill      DeiT: a ViT student with and without a convolutional teacher, same budget
- swin         ViT, the hybrid and Swin at matched FLOPs, on all of Fashion-MNIST and on a tenth of it: accuracy
               and throughput (training and inference img/s, fp32, on this machine)

"Fine-tuned" accuracy is the test accuracy of the trained model on its own task; few-shot is `vitkit.evaluation.
fewshot` (5 shots, several draws) on frozen features of a task the model did not train on. Final-epoch numbers
only: nothing is selected on the test set.
"""
from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .cache import atomic_write
from .errors import UsageError
from .checkpoints import load
from .data.datasets import load_dataset
from .evaluation.fewshot import fewshot
from .machine.fast_linear import pack_linears
from .training import apply_overrides, run_config
from .training import train
import torch

OUT = Path("docs/reproductions")


@dataclass
class Scale:
    """How big a study runs: full (the documented numbers) or smoke (a check that everything runs)."""

    smoke: bool
    epochs: float  # of the upstream training, on the full Fashion-MNIST train set
    subset: int | None
    test_subset: int | None
    draws: int

    @classmethod
    def of(cls, smoke: bool) -> "Scale":
        return cls(True, 1, 1024, 1000, 2) if smoke else cls(False, 2, None, None, 5)


def _vit(**extra) -> dict:
    """The studies' ViT: 28x28 grey images in 4x4 patches (7x7 = 49 tokens), D 96, 4 layers, 4 heads."""
    return {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 96, "depth": 4, "num_heads": 4, "mlp_dim": 192,
            "hybrid_layers": None, "classifier": "token", **extra}


def _config(out: Path, seed: int, scale: Scale, *, name: str = "vit_ti16", overrides: dict | None = None, **settings):
    base = {"model.name": name, "model.overrides": overrides if overrides is not None else _vit(),
            "data.subset": scale.subset, "data.test_subset": scale.test_subset, "aug.random_erasing": 0.0,
            "schedule.epochs": scale.epochs, "schedule.warmup_epochs": min(0.3, scale.epochs / 4),
            "run.out_dir": str(out), "run.seed": seed, "run.progress": False, "run.log_every": 50, "run.eval_every": 1000,
            "run.tta": "none", "run.ckpt_every": 10**9, "optim.lr": 1e-3}
    base.update(settings)
    cfg, _ = run_config("fashion-mnist")
    cfg.model.overrides = {}  # the studies' model replaces the preset's, without the notice a user's change gets
    return apply_overrides(cfg, base)


def _fewshot(checkpoint: Path, data: str, scale: Scale, classes: list[int] | None = None, seed: int = 0) -> float:
    """5-shot linear accuracy of a trained model's frozen features on `data` (its `classes` only)."""
    model = load(checkpoint)
    spec = load_dataset(data)
    train, test = spec.train.with_classes(classes), spec.test.with_classes(classes)
    if scale.smoke:
        train, test = train.subset(400), test.subset(300)
    elif len(train) > 5000:  # the shots and the held-out images come from 5,000 training images: plenty for 5 shots
        train = train.subset(5000)
    return fewshot(model, train, test, shots=(5,), draws=scale.draws, seed=seed).mean[5]


@dataclass
class Study:
    name: str
    title: str
    paper: str  # what the paper reports
    variants: list[str]
    run: Callable  # (variant, seed, scale, workdir) -> {metric: value}
    metrics: list[str]
    plot: str = "bars"  # "bars" over variants, or "lines" over a numeric part of the variant name
    xlabel: str = ""  # the lines' x axis
    epochs: float = 2  # the full study's training length (upstream epochs of Fashion-MNIST)
    notes: Callable[[dict], str] = field(default=lambda agg: "")


def _train(cfg) -> dict:

    return train(cfg, resume=False)


# ---- the studies ------------------------------------------------------------------------------------------

def _posemb(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    res = _train(_config(work, seed, scale, overrides=_vit(pos_embed=variant)))
    return {"fine-tuned": res["acc1"], "5-shot digits": _fewshot(work / "final.safetensors", "digits", scale, seed=seed)}


def _pooling(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    pool, lr = variant.split(" lr ")
    res = _train(_config(work, seed, scale, overrides=_vit(classifier=pool), **{"optim.lr": float(lr)}))
    return {"fine-tuned": res["acc1"]}


UPSTREAM, DOWNSTREAM = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
# a small BiT ResNet-v2 (3 stages of one unit each); ResNet-v2 takes 32 px at least: the 28-px images are resized
BIT = {"img_size": 32, "in_chans": 1, "layers": (1, 1, 1), "channels": (128, 256, 512), "stem_width": 32}


def _data_scale(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    arch, n = variant.rsplit(" ", 1)
    n = int(n) if not scale.smoke else min(int(n), 512)
    models = {
        "ViT": ("vit_ti16", _vit()),
        "hybrid": ("r26_vit_s32", _vit(hybrid_layers=(1,), hybrid_width=0.5, depth=3)),
        "BiT": ("bit_r50x1", BIT),
    }
    name, ov = models[arch]
    # the same number of steps whatever the upstream size: only the data grows
    steps_epochs = (scale.epochs * 60_000 * 0.5) / n if not scale.smoke else 2 * 1024 / n
    cfg = _config(work, seed, scale, name=name, overrides=ov, **{"data.classes": UPSTREAM, "data.subset": n,
                                                                 "schedule.epochs": steps_epochs, "data.batch_size": min(256, n // 2)})
    res = _train(cfg)
    ck = work / "final.safetensors"
    return {"upstream": res["acc1"], "5-shot unseen classes": _fewshot(ck, "fashion-mnist", scale, DOWNSTREAM, seed),
            "5-shot digits": _fewshot(ck, "digits", scale, seed=seed)}


def _mpp(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    total = scale.epochs * 2
    if variant == "from scratch":
        res = _train(_config(work, seed, scale, **{"schedule.epochs": total}))
    else:  # half the budget masked-patch pre-training, half fine-tuning
        pre = _train(_config(work / "pre", seed, scale, **{"model.objective": "mpp", "schedule.epochs": total / 2, "optim.lr": 2e-3}))
        res = _train(_config(work, seed, scale, **{"model.checkpoint": str(work / "pre" / "final.safetensors"),
                                                   "schedule.epochs": total / 2}))
    out = {"fine-tuned": res["acc1"], "5-shot digits": _fewshot(work / "final.safetensors", "digits", scale, seed=seed)}
    if variant != "from scratch":  # in the JSON rows: the pre-training's own score (corrupted patches' colour codes)
        out["mpp patch accuracy"] = pre["acc1"]
    return out


def _distill(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    teacher = work.parent / f"teacher-s{seed}"
    if not (teacher / "final.safetensors").exists():  # a BiT ResNet, trained once per seed for the students
        _train(_config(teacher, seed, scale, name="bit_r50x1", overrides=BIT))
    settings = {} if variant == "no teacher" else {"distill.teacher": str(teacher / "final.safetensors"), "distill.kind": variant.split()[0]}
    res = _train(_config(work, seed, scale, overrides=_vit(distilled=variant != "no teacher"), **settings))

    return {"student": res["acc1"], "teacher": json.loads((teacher / "result.json").read_text())["acc1"],
            "params (M)": sum(p.numel() for p in load(work / "final.safetensors").parameters()) / 1e6}


# The swin study's three models, at matched FLOPs (~30 MFLOPs per image; `vitkit.models.stats.count_flops`): the studies'
# ViT (33.5), the hybrid of data-scale (28.6), and a 3-stage Swin on 32 px in 2x2 patches (32.2): maps 16, 8, 4,
# 4x4 windows, shifted windows in the first two stages.
SWIN = {"img_size": 32, "patch_size": 2, "in_chans": 1, "window_size": 4, "embed_dim": 28, "depths": (2, 2, 2),
        "num_heads": (1, 2, 4), "drop_path_rate": 0.0}
SWIN_MODELS = {"ViT": ("vit_ti16", _vit()), "hybrid": ("r26_vit_s32", _vit(hybrid_layers=(1,), hybrid_width=0.5, depth=3)),
               "Swin": ("swin_t", SWIN)}


def _infer_speed(checkpoint: Path, batch: int = 128, rounds: int = 5) -> float:
    """Inference img/s of a trained model, fp32, on this machine's fast GEMM: the median of `rounds` timed batches."""
    model = load(checkpoint).eval()
    pack_linears(model)
    x = torch.randn(batch, model.config.in_chans, *model.config.img_size, generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        model(x)  # warm-up: the GEMM choice, allocations
        for _ in range(rounds):
            t = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def _swin(variant: str, seed: int, scale: Scale, work: Path) -> dict:
    arch, data = variant.split(", ")
    name, ov = SWIN_MODELS[arch]
    settings = {"run.precision": "fp32"}  # one precision for all three: their img/s compare
    if data == "6k images":  # a tenth of the data, the same number of steps
        settings.update({"data.subset": 6000 if not scale.smoke else 256, "schedule.epochs": scale.epochs * 10})
    cfg = _config(work, seed, scale, name=name, overrides=ov, **settings)
    res = _train(cfg)
    ck = work / "final.safetensors"
    # training img/s over the whole run (its one final evaluation included); inference on a batch of 128
    return {"accuracy": res["acc1"], "5-shot digits": _fewshot(ck, "digits", scale, seed=seed),
            "train img/s": res["step"] * cfg.data.batch_size / res["time_s"], "infer img/s": _infer_speed(ck)}


STUDIES = {
    "posemb": Study("posemb", "Position embeddings (Table 8)",
                    "Table 8 (ViT-B/16, JFT pre-training, 5-shot ImageNet linear): none 61.4, 1-D 64.2, 2-D 64.0, relative 64.0",
                    ["none", "learned_1d", "learned_2d", "relative", "sincos_2d"], _posemb, ["fine-tuned", "5-shot digits"],
                    epochs=4),
    "pooling": Study("pooling", "Class token against global average pooling (App. D.3, Fig. 9)",
                     "Fig. 9: both reach the same accuracy, but need different learning rates (GAP fails at the class token's)",
                     [f"{p} lr {lr}" for p in ("token", "gap") for lr in ("3e-4", "1e-3", "3e-3")], _pooling, ["fine-tuned"], "lines", "peak learning rate",
                     epochs=3),
    "data-scale": Study("data-scale", "ViT, hybrid and ResNet as the upstream data grows (Fig. 3-5 in shape)",
                        "Fig. 3-4: ResNets (BiT) win on small pre-training sets, ViT overtakes as the data grows; Fig. 5: "
                        "hybrids beat ViT at small budgets, the gap closes with scale",
                        [f"{a} {n}" for a in ("ViT", "hybrid", "BiT") for n in (1000, 5000, 30000)], _data_scale,
                        ["upstream", "5-shot unseen classes", "5-shot digits"], "lines", "upstream training images"),
    "mpp": Study("mpp", "Masked patch prediction (Sec. 4.6)",
                 "Sec. 4.6: MPP pre-training on JFT then fine-tuning: 79.9% on ImageNet, +2% over training from scratch, "
                 "4% below supervised pre-training", ["from scratch", "mpp + fine-tune"], _mpp, ["fine-tuned", "5-shot digits"],
                 epochs=4),
    "distill": Study("distill", "DeiT distillation: a ViT student with and without a convolutional teacher",
                     "DeiT (Touvron et al. 2021): a convnet teacher and the hard distillation token improve ViT trained on "
                     "ImageNet-1k alone (DeiT-B 81.8 -> 83.4)", ["no teacher", "hard teacher", "soft teacher"], _distill,
                     ["student", "teacher", "params (M)"], epochs=3),
    "swin": Study("swin", "ViT, the hybrid and Swin at matched FLOPs (Swin, Liu et al. 2021)",
                  "Swin (Table 1, ImageNet-1k from scratch at 224): Swin-T 81.3% against DeiT-S 79.8% at 4.5 GFLOPs, i.e. "
                  "locality and hierarchy help where data is limited and no large pre-training is available",
                  [f"{a}, {d}" for d in ("60k images", "6k images") for a in SWIN_MODELS], _swin,
                  ["accuracy", "5-shot digits", "train img/s", "infer img/s"], epochs=2),
}


def reproduce(name: str, seeds: int = 3, smoke: bool = False, out: str | Path = OUT, workdir: str | Path = "runs/reproduce") -> dict:
    """Run one study (`STUDIES`): every variant with every seed; write NAME.md, NAME.png and NAME.json to `out`."""
    if name not in STUDIES:
        raise UsageError(f"unknown study {name!r}; choose one of {', '.join(STUDIES)}")
    study, scale = STUDIES[name], Scale.of(smoke)
    if not smoke:
        scale.epochs = study.epochs
    work = Path(workdir) / (name + ("-smoke" if smoke else ""))
    shutil.rmtree(work, ignore_errors=True)
    rows, t0 = [], time.time()
    for seed in range(seeds):
        for variant in study.variants:
            t = time.time()
            metrics = study.run(variant, seed, scale, work / f"{variant.replace(' ', '_')}-s{seed}")
            rows.append({"variant": variant, "seed": seed, "seconds": time.time() - t, **metrics})
            print(f"{name}: {variant}, seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
    agg = {v: {m: _mean_std([r[m] for r in rows if r["variant"] == v]) for m in study.metrics} for v in study.variants}
    result = {"study": name, "seeds": seeds, "smoke": smoke, "minutes": (time.time() - t0) / 60, "rows": rows, "mean_std": agg}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = name + ("-smoke" if smoke else "")
    atomic_write(out / f"{stem}.json", lambda p: p.write_text(json.dumps(result, indent=1)))
    _plot(study, agg, out / f"{stem}.png")
    atomic_write(out / f"{stem}.md", lambda p: p.write_text(_markdown(study, result, stem)))
    return result


def replot(name: str, out: str | Path = OUT, smoke: bool = False) -> dict:
    """Write NAME.md and NAME.png again from NAME.json (no training): after a change to the table or the plot."""
    study, stem = STUDIES[name], name + ("-smoke" if smoke else "")
    result = json.loads((Path(out) / f"{stem}.json").read_text())
    _plot(study, result["mean_std"], Path(out) / f"{stem}.png")
    atomic_write(Path(out) / f"{stem}.md", lambda p: p.write_text(_markdown(study, result, stem)))
    return result


def _mean_std(values: list[float]) -> tuple[float, float]:
    return (statistics.mean(values), statistics.pstdev(values) if len(values) > 1 else 0.0)


def _fmt(metric: str, ms: tuple[float, float]) -> str:
    m, s = ms
    if metric.endswith("img/s"):
        return f"{m:.0f} ± {s:.0f}"
    return f"{m:.2f}" if metric.startswith("params") else f"{100 * m:.2f} ± {100 * s:.2f}"


def _scale_of(metric: str) -> float:
    """Plotted as %, except throughputs (img/s)."""
    return 1.0 if metric.endswith("img/s") else 100.0


def _markdown(study: Study, result: dict, stem: str) -> str:
    agg = result["mean_std"]
    lines = [f"# {study.title}", "",
             f"`vitkit reproduce {study.name} --seeds {result['seeds']}{' --smoke' if result['smoke'] else ''}`: "
             f"{result['minutes']:.1f} minutes. Mean ± std over {result['seeds']} seed(s), % (final epoch; nothing chosen "
             f"on the test set).", "", f"The paper: {study.paper}.", "",
             "| variant | " + " | ".join(study.metrics) + " |", "|---|" + "---:|" * len(study.metrics)]
    for v in study.variants:
        lines.append(f"| {v} | " + " | ".join(_fmt(m, agg[v][m]) for m in study.metrics) + " |")
    lines += ["", f"![{study.name}]({stem}.png)", ""]
    return "\n".join(lines)


def _plot(study: Study, agg: dict, path: Path) -> None:
    import matplotlib  # matplotlib: its import costs start-up time, and only figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: its import costs start-up time, and only figures need it

    metrics = [m for m in study.metrics if not m.startswith("params")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        if study.plot == "lines":  # variants "<group> <x>": one line per group over x
            groups: dict[str, list] = {}
            for v in study.variants:
                g, x = v.rsplit(" ", 1)
                groups.setdefault(g, []).append((float(x), *agg[v][m]))
            for g, pts in groups.items():
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, [100 * y for y in ys], yerr=[100 * e for e in es], marker="o", capsize=3,
                            label=g.removesuffix(" lr"))
            ax.set_xscale("log")
            ticks = sorted({float(v.rsplit(" ", 1)[1]) for v in study.variants})
            ax.minorticks_off()
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=8)
            ax.set_xlabel(study.xlabel, fontsize=9)
            ax.legend(fontsize=8)
        else:
            k = _scale_of(m)
            ys = [k * agg[v][m][0] for v in study.variants]
            es = [k * agg[v][m][1] for v in study.variants]
            ax.bar(range(len(ys)), ys, yerr=es, capsize=3, color="#4c78a8")
            ax.set_xticks(range(len(ys)), study.variants, rotation=25, ha="right", fontsize=8)
            lo = min(y - e for y, e in zip(ys, es))
            if k == 100.0:
                ax.set_ylim(max(0, lo - 5), min(100, max(y + e for y, e in zip(ys, es)) + 2))
        ax.set_title(m, fontsize=10)
        ax.set_ylabel("%" if _scale_of(m) == 100.0 else "img/s")
    fig.suptitle(study.title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
