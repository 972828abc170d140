"""The package's structure in numbers: import cycles, imports that climb the declared layers, function-local
imports, the biggest files and the block loops of the model file.

    python benchmarks/structure.py            # a table
    python benchmarks/structure.py --edges    # every import between units, and where it is

Reads the source with `ast` (no import runs), function-local imports included. A unit is a subpackage of vitkit
(vitkit.models, vitkit.data, ...) or a top-level module (vitkit.cli). The layer order is the one `pyproject.toml`
declares for import-linter ([tool.importlinter]); this script reads it from there.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vitkit"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return module
    sub = PKG / parts[1]
    return ".".join(parts[:2]) if sub.is_dir() or len(parts) > 2 else ".".join(parts[:2])


def imports(path: Path):
    """(target module, line, function-local?, under TYPE_CHECKING?, names) for each import in `path`."""
    tree = ast.parse(path.read_text())
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node, local: bool, typing_only: bool):
        for child in ast.iter_child_nodes(node):
            loc = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            tc = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, loc, tc, ()) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.startswith("vitkit"):  # `from . import x` may name a module
                    for a in child.names:
                        sub = f"{target}.{a.name}"
                        is_mod = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or \
                            (ROOT / Path(*sub.split("."))).is_dir()
                        out.append((sub if is_mod else target, child.lineno, loc, tc, () if is_mod else (a.name,)))
                else:
                    out.append((target, child.lineno, loc, tc, tuple(a.name for a in child.names)))
            visit(child, loc, tc)

    visit(tree, False, False)
    return out


def layers() -> list[list[str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get("importlinter", {})
    for c in cfg.get("contracts", []):
        if c.get("type") == "layers":
            prefix = f"{c['containers'][0]}." if c.get("containers") else ""
            return [[prefix + u.strip() for u in layer.replace("(", "").replace(")", "").replace(":", "|").split("|")]
                    for layer in c["layers"]]
    return []


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            strong(v)
    return out


def measure() -> dict:
    files = sorted(PKG.rglob("*.py"))
    unit_edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    module_graph: dict[str, set[str]] = defaultdict(set)
    local_all, local_vitkit, private = set(), set(), []
    for f in files:
        src = module_name(f)
        for target, line, local, typing_only, names in imports(f):
            if local:
                local_all.add((f, line))
            if not target.startswith("vitkit"):
                continue
            if local:
                local_vitkit.add((f, line))
            if unit_of(src) != unit_of(target) and any(n.startswith("_") and not n.startswith("__") for n in names):
                private.append(f"{f.relative_to(ROOT)}:{line} {target}.{','.join(names)}")
            if typing_only:
                continue
            module_graph[src].add(target)
            a, b = unit_of(src), unit_of(target)
            if a != b and b != "vitkit":
                unit_edges[(a, b)].append(f"{f.relative_to(ROOT)}:{line}{' (local)' if local else ''}")
    unit_graph: dict[str, set[str]] = defaultdict(set)
    for a, b in unit_edges:
        unit_graph[a].add(b)
    order = layers()
    rank = {u: i for i, layer in enumerate(order) for u in layer}
    # layers are listed highest first: an import climbs when its target is listed before (above) its source
    climbing = [(a, b, where) for (a, b), where in unit_edges.items()
                if a in rank and b in rank and rank[b] < rank[a]]
    unranked = sorted({u for e in unit_edges for u in e} - set(rank) - {"vitkit"}) if order else []
    sizes = sorted(((len(f.read_text().splitlines()), str(f.relative_to(ROOT))) for f in files), reverse=True)
    vit = (PKG / "models" / "vit.py").read_text()
    loops = sum(1 for n in ast.walk(ast.parse(vit)) if isinstance(n, (ast.For, ast.comprehension))
                and "blocks" in ast.unparse(n.iter))
    return dict(
        modules=len(files), lines=sum(s for s, _ in sizes),
        unit_cycles=sccs(unit_graph), module_cycles=sccs(module_graph),
        climbing_imports=sum(len(w) for _, _, w in climbing), climbing=[(a, b, w) for a, b, w in climbing],
        unranked_units=unranked,
        function_local_imports=len(local_all), function_local_vitkit_imports=len(local_vitkit),
        private_across_units=private,
        biggest=sizes[:5], vit_block_loops=loops, vit_lines=len(vit.splitlines()),
        edges={f"{a} -> {b}": w for (a, b), w in sorted(unit_edges.items())},
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edges", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = measure()
    if args.json:
        print(json.dumps({k: v for k, v in m.items() if k != "edges"}, indent=1))
        sys.exit()
    if args.edges:
        for e, where in m["edges"].items():
            print(f"{e}: {', '.join(where)}")
    print(f"modules {m['modules']}, lines {m['lines']}")
    print(f"unit-level cycles: {len(m['unit_cycles'])} {m['unit_cycles']}")
    print(f"module-level cycles: {len(m['module_cycles'])} (largest {max(map(len, m['module_cycles']), default=0)} modules)")
    print(f"climbing imports: {m['climbing_imports']}")
    for a, b, w in m["climbing"]:
        print(f"  {a} -> {b}: {', '.join(w)}")
    if m["unranked_units"]:
        print(f"units no layer names: {m['unranked_units']}")
    print(f"function-local import statements: {m['function_local_imports']} (of vitkit modules: "
          f"{m['function_local_vitkit_imports']})")
    print(f"private names imported across units: {len(m['private_across_units'])} {m['private_across_units']}")
    print("biggest files: " + ", ".join(f"{p} {n}" for n, p in m["biggest"]))
    print(f"models/vit.py: {m['vit_lines']} lines, {m['vit_block_loops']} loops over the blocks")
