"""The registry sweeps' tables (issue 42): vitkit against the peers' own outputs for every architecture timm
registers in the families vitkit reads and every transformers class it reads (tests/fixtures/registry, made by
tests/fixtures/make_registry_sweep.py), per family: how many load, how many are refused, and the worst
max |vitkit - peer| at the native size and at a non-square one (each format's own resampling).

    .venv/bin/python benchmarks/registry_sweep.py
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import vitkit
from vitkit.checkpoints.api import describe_folder
from vitkit.checkpoints.io import CheckpointError
from vitkit.models import build_model

REG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "registry"
FAMILIES = [("NaFlexVit", r"^naflexvit_"), ("EVA-02", r"^eva02_"), ("EVA", r"^eva_"), ("DeiT-III", r"^deit3_"),
            ("DeiT", r"^deit_"), ("DINOv2", r"dinov2"), ("SigLIP", r"siglip"), ("CLIP", r"_clip_|_clip$"),
            ("BiT", r"^resnetv2_.*_bit$"), ("ResNetV2 (not BiT)", r"^resnetv2_"), ("hybrid", r"_r\d+_|_r_s16|resnet"),
            ("DINOv3 / PE / RoPE / AIMv2", r"dinov3|^vit_pe_|_rope_|^aimv2_|lingbot"), ("ViT", r".")]


def family(name: str) -> str:
    return next(f for f, pat in FAMILIES if re.search(pat, name))


def _reason(e: Exception) -> str:
    """A refusal's reason without the file's and the architecture's names (one line per kind)."""
    text = re.sub(r"^\S+: ", "", str(e)).split("\n")[0]
    return re.sub(r"timm's \S+ ", "it ", re.sub(r"\(first keys: .*", "", text))[:110]


def timm_rows() -> dict:
    idx = json.loads((REG / "timm" / "index.json").read_text())
    wide = tuple(idx["versions"]["wide"])
    x = torch.from_numpy(np.load(REG / "timm" / "input.npy"))
    xw = torch.from_numpy(np.load(REG / "timm" / "input_wide.npy"))
    rows: dict = defaultdict(lambda: {"archs": 0, "loaded": 0, "refused": 0, "shapes": 0, "native": 0.0, "wide": 0.0,
                                      "reasons": set()})
    tmp = Path(tempfile.mkdtemp())
    for name, r in sorted(idx["archs"].items()):
        row = rows[family(name)]
        row["archs"] += 1
        if r["status"] == "shapes":  # the registered size: timm's config.json, names and shapes (meta tensors)
            d = REG / "timm" / "_shapes" / name
            raw = {k: torch.empty(v, device="meta") for k, v in json.loads((d / "shapes.json").read_text()).items()}
            try:
                config, sd = describe_folder(raw, json.loads((d / "config.json").read_text()), name)
                with torch.device("meta"):
                    own = {k: tuple(v.shape) for k, v in build_model(config).state_dict().items()}
                row["shapes"] += own == {k: tuple(v.shape) for k, v in sd.items()}
            except CheckpointError as e:
                row["refused"] += 1
                row["reasons"].add(_reason(e))
            continue
        d = tmp / name
        d.mkdir()
        (d / "model.safetensors").symlink_to(REG / "timm" / r["group"] / "model.safetensors")
        shutil.copy(REG / "timm" / r["group"] / "configs" / f"{name}.json", d / "config.json")
        try:
            m = vitkit.load(d)
            mw = vitkit.load(d, img_size=wide)
        except CheckpointError as e:
            row["refused"] += 1
            row["reasons"].add(_reason(e))
            continue
        with torch.no_grad():
            row["native"] = max(row["native"], (m(x) - torch.from_numpy(np.load(REG / "timm" / r["group"] / "logits.npy"))).abs().max().item())
            row["wide"] = max(row["wide"], (mw(xw) - torch.from_numpy(np.load(REG / "timm" / r["group"] / "logits_wide.npy"))).abs().max().item())
        row["loaded"] += 1
    shutil.rmtree(tmp)
    return rows


def hf_rows() -> dict:
    idx = json.loads((REG / "hf" / "index.json").read_text())
    wide = tuple(idx["versions"]["wide"])
    x = torch.from_numpy(np.load(REG / "hf" / "input.npy"))
    xw = torch.from_numpy(np.load(REG / "hf" / "input_wide.npy"))
    rows = {}
    for name in sorted(idx["classes"]):
        d = REG / "hf" / name
        try:
            out = []
            for tag, inp, kw in (("", x, {}), ("_wide", xw, {"img_size": wide})):
                m = vitkit.load(d, **kw)
                if (d / f"logits{tag}.npy").exists():
                    ref = np.load(d / f"logits{tag}.npy")
                elif name == "ViTModel":  # its pooler is left unused: the output is the normed class token
                    ref = np.load(d / f"hidden{tag}.npy")[:, 0]
                else:
                    ref = np.load(d / f"pooled{tag}.npy")
                with torch.no_grad():
                    out.append((m(inp) - torch.from_numpy(ref)).abs().max().item())
            rows[name] = {"native": out[0], "wide": out[1], "resample": m.config.pos_resample}
        except CheckpointError as e:
            rows[name] = {"refused": re.sub(r"^.*?: ", "", str(e)).split("\n")[0][:100]}
    return rows


def main() -> None:
    import platform

    print(f"vitkit {vitkit.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    timm_idx = json.loads((REG / "timm" / "index.json").read_text())["versions"]
    print(f"\ntimm {timm_idx['timm']}: every registered architecture of vision_transformer, vision_transformer_hybrid, "
          f"deit, eva, naflexvit, resnetv2 (native {tuple(timm_idx['native'])}, wide {tuple(timm_idx['wide'])})\n")
    print("| family | architectures | loaded | refused | full size: same tensors as timm | max abs native | max abs wide |")
    print("|---|---|---|---|---|---|---|")
    rows = timm_rows()
    for fam, _ in FAMILIES:
        if fam in rows:
            r = rows[fam]
            num = (lambda v: f"{v:.1e}") if r["loaded"] else (lambda v: "-")
            print(f"| {fam} | {r['archs']} | {r['loaded']} | {r['refused']} | {r['shapes']} | {num(r['native'])} | "
                  f"{num(r['wide'])} |")
    print("\nrefusals (reasons):")
    for fam, r in rows.items():
        for why in sorted(r["reasons"]):
            print(f"  {fam}: {why}")
    hf_idx = json.loads((REG / "hf" / "index.json").read_text())["versions"]
    print(f"\ntransformers {hf_idx['transformers']}: each class at its size and, with interpolate_pos_encoding, at "
          f"{tuple(hf_idx['wide'])}\n")
    print("| class | max abs native | max abs wide | resampling recorded |")
    print("|---|---|---|---|")
    for name, r in hf_rows().items():
        if "refused" in r:
            print(f"| {name} | refused: {r['refused']} | | |")
        else:
            print(f"| {name} | {r['native']:.1e} | {r['wide']:.1e} | {r['resample']} |")


if __name__ == "__main__":
    sys.exit(main())
