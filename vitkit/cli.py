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


COMMANDS = {"models": models, "demo": demo}


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
    except (ValueError, FileNotFoundError) as e:
        print(f"vitkit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
