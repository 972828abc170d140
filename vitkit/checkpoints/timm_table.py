"""The table of timm's names (docs/timm.md, `vitkit models --timm`): every architecture of timm's ViT modules, timm's
parameter count as `timm.create_model(name)` builds it, and whether vitkit builds it (`timm_names`) or why not.

    python -m vitkit.checkpoints.timm_table --markdown                        # the table in docs/timm.md
    python -m vitkit.checkpoints.timm_table --markdown --update docs/timm.md  # written between its markers
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

from ..errors import UsageError
from . import timm
from .timm_names import OTHER_FAMILIES, family, refusal


def rows(pattern: str | None = None) -> list[dict]:
    """Every timm name of the table: its module and class, timm's classes and parameters as `timm.create_model(name)`
    builds it, and whether vitkit builds it (else the family and reason)."""
    out = []
    for arch, entry in sorted(timm.registered_archs().items()):
        if pattern and not fnmatch.fnmatch(arch, pattern):
            continue
        built = entry.get("built", {})
        reason = refusal(arch)
        out.append({"name": arch, "module": entry["module"], "class": entry["class"],
                    "num_classes": built.get("num_classes"), "params": built.get("params"),
                    "params_0": built.get("params_0"), "tags": _tags(built),
                    "builds": reason is None, "refused": None if reason is None else (family(arch) or reason)})
    return out


def _tags(built: dict) -> list[str]:
    """The pretrained tags, timm's default (what the name alone loads) first."""
    default = built.get("default_tag")
    return sorted(built.get("tags", {}), key=lambda t: (t != default, t))


def markdown() -> str:
    """docs/timm.md's table of timm's names: those vitkit builds, with timm's parameter counts, and those it refuses,
    by family."""
    all_rows = rows()
    ok = [r for r in all_rows if r["builds"]]
    modules = sorted({e["module"] for e in timm.registered_archs().values()})
    lines = [f"timm {timm_version()}: {len(all_rows)} architectures in the modules {', '.join(modules[:-1])} and "
             f"{modules[-1]}; vitkit builds {len(ok)}, each with timm's "
             f"parameter count (`tests/test_timm_names.py`). Params: `timm.create_model(name)` with its default "
             f"tag's head (classes), and with `num_classes=0`. Made by `python -m vitkit.checkpoints.timm_table "
             f"--markdown`.", "", "| timm's name | classes | params | params (no head) | tags (the default first) |",
             "|---|---:|---:|---:|---|"]
    for r in ok:
        tags = ", ".join(r["tags"][:4]) + (f", ... ({len(r['tags'])})" if len(r["tags"]) > 4 else "")
        lines.append(f"| `{r['name']}` | {r['num_classes']} | {r['params']:,} | {r['params_0']:,} | {tags} |")
    lines += ["", "Refused (a UsageError naming the family and reason):", "", "| family: why | timm's names |",
              "|---|---|"]
    groups: dict[str, list[str]] = {}
    for r in all_rows:
        if not r["builds"]:
            groups.setdefault(r["refused"], []).append(r["name"])
    for why, names in groups.items():
        lines.append(f"| {why} | {', '.join(f'`{n}`' for n in names)} |")
    lines += ["", "timm's families outside those modules, refused by name:", "",
              "| names (regular expression) | what they add |", "|---|---|"]
    for pat, why in OTHER_FAMILIES:
        lines.append(f"| `{pat}` | {why} |")
    return "\n".join(lines) + "\n"


def timm_version() -> str:
    return json.loads(timm.ARCHS_FILE.read_text())["timm_version"]


MARKERS = ("<!-- timm_table.markdown() -->\n", "<!-- end timm_table.markdown() -->")


def update(path: str) -> None:
    """Write `markdown()` into a file between its MARKERS (docs/timm.md)."""
    text = Path(path).read_text()
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    if start < 0 or end < start:
        raise UsageError(f"{path} has no {MARKERS[0].strip()} ... {MARKERS[1]} to write the table between")
    Path(path).write_text(text[: start + len(MARKERS[0])] + markdown() + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitkit.checkpoints.timm_table", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/timm.md's table")
    parser.add_argument("--update", metavar="FILE", help="with --markdown: write it into FILE between its markers")
    parser.add_argument("--pattern", help="only names matching this glob")
    ns = parser.parse_args(argv)
    if ns.markdown and ns.update:
        update(ns.update)
        return 0
    if ns.markdown:
        sys.stdout.write(markdown())
        return 0
    for r in rows(ns.pattern):
        status = "builds" if r["builds"] else f"refused: {r['refused']}"
        print(f"{r['name']:<48} {r['params']:>15,} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
