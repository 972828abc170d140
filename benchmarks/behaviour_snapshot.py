"""Record what every registered model and a seeded training run compute, to prove a refactor changed nothing.

    python benchmarks/behaviour_snapshot.py save  /tmp/before      # before the change
    python benchmarks/behaviour_snapshot.py save  /tmp/after       # after it
    python benchmarks/behaviour_snapshot.py compare /tmp/before /tmp/after

(`save DIR --models-only` skips the training runs.)

`save` builds every model of `vitkit.list_models()` at the test suite's small size (tests/conftest.py `tiny_kwargs`),
seeded, and records its outputs on a seeded input: eval logits, train-mode logits (drop-path on), `forward_features`,
`forward_intermediates`, and where the model has them the packed (NaFlex) forward and the masked-patch-prediction
loss. It then runs `vitkit train <preset> --smoke --max-steps 20 run.seed=0` for three presets and keeps the final
weights. `compare` prints one row per model and run with the largest absolute difference (0 means bitwise equal).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_kwargs

import vitkit

PRESETS = ["fashion-mnist", "fashion-mnist-mpp", "fashion-mnist-naflex"]


def model_outputs(name: str, **extra) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    kw = dict(tiny_kwargs(name), **extra)
    model = vitkit.create_model(name, drop_path_rate=0.1, **kw) if _has_drop_path(name) \
        else vitkit.create_model(name, **kw)
    with torch.no_grad():  # the zero-initialised head would hide everything behind it
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.02)
    c = model.config
    size = c.img_size if isinstance(c.img_size, tuple) else (c.img_size, c.img_size)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, c.in_chans, *size, generator=g)
    out = {}
    model.eval()
    with torch.no_grad():
        out["eval"] = model(x)
        if hasattr(model, "forward_features"):
            out["features"] = model.forward_features(x)
        if hasattr(model, "forward_intermediates"):
            try:
                out.update(_flat("intermediates", model.forward_intermediates(x)))
            except Exception as e:  # noqa: BLE001 -- recorded, so a change in what raises shows too
                out["intermediates_error"] = torch.tensor([len(type(e).__name__)])
        if getattr(c, "naflex", False):
            from vitkit.models.layers.packing import pack

            p = c.patch_size if isinstance(c.patch_size, tuple) else (c.patch_size, c.patch_size)
            imgs = [torch.randn(c.in_chans, p[0], 2 * p[1], generator=g), x[0]]
            try:
                out["packed"] = model.forward_packed(pack(imgs, p, length=16))
            except Exception as e:  # noqa: BLE001
                out["packed_error"] = torch.tensor([len(type(e).__name__)])
    model.train()
    torch.manual_seed(2)
    out["train"] = model(x).detach()
    if hasattr(model, "forward_mpp"):
        try:
            model.add_mpp()
            torch.manual_seed(3)
            logits, target = model.forward_mpp(x, x, torch.Generator().manual_seed(4))
            out["mpp_logits"], out["mpp_target"] = logits.detach(), target
        except Exception as e:  # noqa: BLE001
            out["mpp_error"] = torch.tensor([len(type(e).__name__)])
    return {k: v.detach().clone().contiguous() for k, v in out.items() if isinstance(v, torch.Tensor)}


def _flat(prefix: str, value) -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples, by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {k: t for key, v in items for k, t in _flat(f"{prefix}_{key}", v).items()}


def _has_drop_path(name: str) -> bool:
    return vitkit.models.get_entry(name).arch == "vit"


def save(dest: Path, runs: bool = True) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in vitkit.list_models():
        save_file(model_outputs(name), dest / f"model-{name}.safetensors")
        if _has_drop_path(name):
            try:  # the same model as a NaFlex one: the packed path
                save_file(model_outputs(name, naflex=True), dest / f"model-{name}+naflex.safetensors")
            except vitkit.errors.VitkitError:
                pass
    for preset in PRESETS if runs else ():
        out = dest / f"run-{preset}"
        subprocess.run([sys.executable, "-m", "vitkit", "train", preset, "--smoke", "--max-steps", "20", "--no-resume",
                        f"run.out_dir={out}", "run.seed=0"], check=True, capture_output=True)
    print(f"saved {len(vitkit.list_models())} models and {len(PRESETS) if runs else 0} runs under {dest}")


def _diff(a: dict, b: dict) -> tuple[float, str]:
    if a.keys() != b.keys():
        return float("inf"), f"outputs differ: {sorted(a.keys() ^ b.keys())}"
    worst = 0.0
    for k in a:
        if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype:
            return float("inf"), f"{k}: shape/dtype {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        if not torch.equal(a[k], b[k]):
            worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst, f"{len(a)} tensors"


def compare(before: Path, after: Path) -> int:
    rows, bad = [], 0
    for f in sorted(before.glob("model-*.safetensors")):
        d, what = _diff(load_file(f), load_file(after / f.name)) if (after / f.name).exists() else (float("inf"), "missing")
        rows.append((f.stem.removeprefix("model-"), d, what))
    for preset in PRESETS if (before / f"run-{PRESETS[0]}").exists() else ():
        a, b = before / f"run-{preset}" / "final.safetensors", after / f"run-{preset}" / "final.safetensors"
        d, what = _diff(load_file(a), load_file(b))
        rows.append((f"train {preset} --smoke --max-steps 20", d, what + " (final weights)"))
    for name, d, what in rows:
        bad += d != 0
        print(f"| {name} | {d:.3g} | {what} |")
    print(json.dumps({"rows": len(rows), "bitwise_equal": len(rows) - bad, "different": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), runs="--models-only" not in sys.argv)
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
