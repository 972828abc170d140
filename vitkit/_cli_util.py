"""Typed functions -> argparse subcommands: the signature gives the flags, the docstring's Args: the help."""
from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from typing import Any, Callable, Literal, get_args, get_origin


def parse_docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """(summary, {arg: help}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].strip()
    helps: dict[str, str] = {}
    m = re.search(r"^Args:\n(.*?)(?:^\S|\Z)", doc, re.S | re.M)
    if m:
        current = None
        for line in m.group(1).splitlines():
            hit = re.match(r"^\s{2,4}(\w+)(?: \(.*?\))?:\s*(.*)$", line)
            if hit:
                current = hit.group(1)
                helps[current] = hit.group(2)
            elif current and line.strip():
                helps[current] += " " + line.strip()
    return summary, helps


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _literal(text: str) -> str:
    """A docstring's text as argparse help, which %-formats it (`%(default)s`): a bare "5%" would crash --help."""
    return text.replace("%", "%%")


def add_function(sub: argparse._SubParsersAction, name: str, fn: Callable) -> argparse.ArgumentParser:
    summary, helps = parse_docstring(fn)
    summary, helps = _literal(summary), {k: _literal(v) for k, v in helps.items()}
    p = sub.add_parser(name, help=summary, description=inspect.getdoc(fn).split("\nArgs:")[0] if fn.__doc__ else None,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        tp = _unwrap_optional(hints.get(pname, str))
        kw: dict[str, Any] = {"help": helps.get(pname, " ")}
        origin = get_origin(tp)
        if origin is Literal:
            kw["choices"] = list(get_args(tp))
            kw["type"] = type(get_args(tp)[0])
        elif origin in (list, tuple):
            kw["type"] = get_args(tp)[0] if get_args(tp) else str
            kw["nargs"] = "+" if param.default is inspect.Parameter.empty else "*"
            if param.default == ():  # an empty-tuple default marks a trailing positional list
                p.add_argument(pname, default=[], **kw)
                continue
        elif tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = tp
        if param.default is inspect.Parameter.empty:
            p.add_argument(pname, **kw)
        else:
            p.add_argument("--" + pname.replace("_", "-"), dest=pname, default=param.default, **kw)
    p.set_defaults(_fn=fn)
    return p
