"""The `vitkit` command line: each subcommand is a typed function whose docstring is its help."""
from __future__ import annotations

import argparse
import json
import sys

from ._cli_util import add_function
from .demo import demo


def models(pattern: str | None = None, num_classes: int = 1000, json_out: bool = False) -> list[dict]:
    """List every registered model: name, paper name, params, GFLOPs, tokens, resolution.

    GFLOPs are counted with torch.utils.flop_counter on one image at the model's default resolution;
    a multiply-add counts as 2 FLOPs. Only matmuls, convolutions and attention are counted.

    Args:
        pattern: only names matching this glob, e.g. "vit_*".
        num_classes: classes of the head used for the parameter count (Table 1 uses 1000 here).
        json_out: print JSON instead of a table.
    """
    from .models import get_entry, list_models
    from .stats import model_stats

    rows = [model_stats(get_entry(n), num_classes) for n in list_models(pattern)]
    if json_out:
        print(json.dumps(rows, indent=1))
        return rows
    head = f"{'name':<13} {'paper name':<14} {'params (M)':>10} {'GFLOPs':>8} {'tokens':>6} {'res':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        tokens = "-" if r["tokens"] is None else str(r["tokens"])
        print(f"{r['name']:<13} {r['paper_name']:<14} {r['params_m']:>10.2f} {r['gflops']:>8.2f} {tokens:>6} {r['resolution']:>5}")
    print(f"\nGFLOPs: forward pass of one image, torch.utils.flop_counter, multiply-add = 2 FLOPs; {num_classes} classes.")
    return rows


def info(checkpoint: str, num_heads: int | None = None, json_out: bool = False) -> dict:
    """Describe a checkpoint: its format, the inferred config, the parameter count and keys left unused.

    Args:
        checkpoint: a checkpoint file, a Hugging Face folder or a catalog name.
        num_heads: for formats that do not store it (timm, torchvision) and a non-standard width.
        json_out: print JSON.
    """
    from .checkpoints import inspect_checkpoint, resolve

    hints = {"num_heads": num_heads} if num_heads else {}
    r = inspect_checkpoint(resolve(checkpoint), **hints)
    if json_out:
        print(json.dumps(r, indent=1, default=str))
        return r
    c = r["config"]
    print(f"{r['path']}\n  format: {r['format']}\n  params: {r['params']:,} ({r['params'] / 1e6:.2f} M)")
    keys = ["img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "classifier", "pos_embed",
            "representation_size", "hybrid_layers", "hybrid_width", "act", "norm_eps", "num_classes"]
    if c["arch"] == "resnetv2":
        keys = ["layers", "channels", "stem_width", "img_size", "num_classes"]
    for k in keys:
        print(f"  {k}: {c[k]}")
    print(f"  unused keys: {', '.join(r['unused']) or 'none'}")
    if r["missing"]:
        print(f"  missing keys: {', '.join(r['missing'])}")
    return r


def convert(src: str, dst: str, to: str = "vitkit", num_heads: int | None = None) -> None:
    """Convert a checkpoint between formats; converting out and back in gives the identical output.

    Args:
        src: any checkpoint vitkit can load (official .npz, timm, HF folder, torchvision, vitkit) or a catalog name.
        dst: the output path (a folder for --to hf).
        to: vitkit | timm | hf | npz.
        num_heads: for source formats that do not store it.
    """
    from .checkpoints import convert as _convert

    hints = {"num_heads": num_heads} if num_heads else {}
    out = _convert(src, dst, to, **hints)
    print(f"wrote {out} ({to})")


COMMANDS = {"models": models, "demo": demo, "info": info, "convert": convert}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitkit", description="Vision Transformers (arXiv 2010.11929) in PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn in COMMANDS.items():
        add_function(sub, name, fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    fn = args.pop("_fn")
    args.pop("command")
    try:
        fn(**args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"vitkit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
