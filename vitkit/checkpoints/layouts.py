"""Checkpoint layouts as data: a peer's tensor names -> vitkit's, one ordered table of rules per (source, family),
read forwards when a checkpoint is loaded (`read`) and backwards when a model is exported (`write`), so the inverse of
a mapping is never written a second time.

A rule maps a peer key pattern to a vitkit key pattern. Placeholders capture a part of the key and carry it across:
`{i}` a layer index, `{w}` "weight" or "bias", `{*}` the rest of the key (any text). Beside plain renames a rule can
- fuse several peer tensors into one (`peer` a tuple: transformers' query, key and value Linears -> vitkit's `qkv`),
  or take the present ones under their own names when the others are absent (`partial`: q and v biases without a key
  bias, vitkit's `q_bias` / `v_bias`);
- split one peer tensor into several (`ours` a tuple, in `sizes` shares: DINOv2's packed SwiGLU, SigLIP's `in_proj`);
- reshape one tensor by a named transform with an exact inverse (`TRANSFORMS`: an nn.Embedding's (N, D) table as
  vitkit's (1, N, D) position embedding, ...);
- leave a peer tensor unused (`ours` None: a pooler, a text tower), which export may write as a constant (`default`:
  a mask token of zeros; also a per-layer tensor vitkit lacks, as LayerScale ones);
- make a vitkit tensor the peer does not store (`peer` None: a zero bias, an identity projection, `FILLS`), which
  export checks is still that constant;
- refuse a key with a message saying why (`refuse`).
Rules apply in table order, the first match wins (so a family's special cases come before the shared names);
`when` makes a rule depend on a variant flag of the file or model (a gated MLP, a classifier), and `export=False`
marks a second name that is read but never written. Keys a model class nests under its task prefix (`vit.`,
`vision_model.`) match with or without it; `top` rules (a classifier beside the model) match the key as it is.
What a family adds beyond names (its config.json's facts, a tensor shared by the blocks) stays a small function in
its module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from .io import CheckpointError, fuse

PLACEHOLDERS = {"i": (r"\d+", "i"), "w": ("weight|bias", "w"), "*": (".*", "rest")}


@dataclass(frozen=True)
class Rule:
    """One line of a layout table: `peer` (a key pattern, a tuple of them fused in order, or None) <-> `ours`."""

    peer: str | tuple[str, ...] | None
    ours: str | tuple[str, ...] | None = None
    transform: str | None = None  # a TRANSFORMS name, applied reading, inverted writing
    sizes: tuple[int, ...] | None = None  # a split's shares along dim 0 (None: equal)
    partial: tuple[str | None, ...] | None = None  # a fused group's parts by their own names, those named None absent
    fill: str | None = None  # peer None: the FILLS function making `ours` from the tensor `like`
    like: str | None = None
    default: tuple[str, tuple[int | str, ...]] | None = None  # written where vitkit has no tensor: ("zeros", (1, "D"))
    why: str | None = None  # a fill that is not its constant when written: the refusal
    refuse: str | None = None  # read: refused with this message ({key}: the key)
    top: bool = False  # matched as the file names it, never under a task prefix
    when: str | None = None  # "flag" or "!flag": only with (without) that variant flag
    export: bool = True  # False: a name read but never written


# a fused query/key/value group with a part missing (a `Layout`'s `incomplete` message)
QKV_INCOMPLETE = "layer {i}: the query, key and value projections are all needed: {present} without {missing}"


@dataclass(frozen=True)
class Layout:
    """A (source, family)'s table. `name` and `source` name it in errors ("unexpected Hugging Face ViT key ...")."""

    name: str
    rules: tuple[Rule, ...]
    source: str = "Hugging Face"
    prefixes: tuple[str, ...] = ()  # task-class prefixes before the body's names, removed when reading
    aliases: tuple[tuple[str, str], ...] = ()  # another writer's body prefix -> the table's, read only
    export_prefix: str = ""  # written before the body's names
    incomplete: str = "{present} without {missing}"  # a fused group with parts missing: {i}, {w}, {present}, {missing}


# Named reshapes: (reading, writing), each the other's exact inverse. `ctx` holds what a reshape needs from the file's
# config (in_chans).
TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    # nn.Embedding's table (N, D) <-> vitkit's position embedding (1, N, D)
    "embedding": (lambda t, ctx: t[None], lambda t, ctx: t[0]),
    # CLIP's class embedding, a vector (D,) <-> vitkit's class token (1, 1, D)
    "class_vector": (lambda t, ctx: t.reshape(1, 1, -1), lambda t, ctx: t.reshape(-1)),
    # SigLIP 2's patch embedding, a Linear over (ph, pw, C)-ordered patches (D, ph * pw * C) <-> a conv (D, C, ph, pw)
    "linear_patches": (lambda t, ctx: _linear_to_conv(t, ctx.get("in_chans", 3), ctx.get("patch_size")),
                       lambda t, ctx: t.permute(0, 2, 3, 1).reshape(t.shape[0], -1)),
    # MobileCLIP's position embedding (1, 1, N, D) <-> vitkit's (1, N, D)
    # (only a leading (1, 1): any other shape refused by name, never sliced)
    "lead_one": (lambda t, ctx: t[0] if t.ndim == 4 and tuple(t.shape[:2]) == (1, 1) else (_ for _ in ()).throw(
        CheckpointError(f"a position embedding of shape {tuple(t.shape)}: MobileCLIP's is (1, 1, N, D)")),
        lambda t, ctx: t[None]),
    # a projection stored (in, out) (MobileCLIP's `classifier.proj`) <-> a Linear's weight (out, in)
    "transposed": (lambda t, ctx: t.t(), lambda t, ctx: t.t()),
}


def _linear_to_conv(t: torch.Tensor, in_chans: int, patch_size: int | None = None) -> torch.Tensor:
    if t.ndim != 2:
        return t  # already a conv's
    if isinstance(patch_size, (list, tuple)):
        patch_size = patch_size[0]
    p = int(patch_size) if patch_size is not None else round((t.shape[1] / in_chans) ** 0.5)
    if p * p * in_chans != t.shape[1]:
        raise CheckpointError(f"the linear patch embedding has {t.shape[1]} inputs, not patch_size * patch_size * "
                              f"num_channels = {p} * {p} * {in_chans} = {p * p * in_chans} (config.json)")
    return t.reshape(t.shape[0], p, p, in_chans).permute(0, 3, 1, 2)  # (D, ph*pw*C) -> (D, C, ph, pw)


# Tensors vitkit has where the peer stores none, made from another tensor `like` (its dtype kept)
FILLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "zeros_rows": lambda like: torch.zeros(like.shape[0], dtype=like.dtype),  # a Linear's absent bias
    "zeros_last": lambda like: torch.zeros(like.shape[-1], dtype=like.dtype),
    "eye_last": lambda like: torch.eye(like.shape[-1], dtype=like.dtype),  # a projection used as the identity
}
_CONSTANTS = {"zeros": torch.zeros, "ones": torch.ones}


@lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern:
    """A key pattern as a regular expression whose groups are its placeholders."""
    parts = re.split(r"\{(i|w|\*)\}", pattern)
    out = []
    for j, part in enumerate(parts):
        if j % 2 == 0:
            out.append(re.escape(part))
        else:
            expr, group = PLACEHOLDERS[part]
            out.append(f"(?P<{group}>{expr})" if f"(?P<{group}>" not in "".join(out) else f"(?P={group})")
    return re.compile("".join(out) + r"\Z")


def _fill_in(pattern: str, caps: dict[str, str]) -> str:
    return re.sub(r"\{(i|w|\*)\}", lambda m: caps[PLACEHOLDERS[m.group(1)][1]], pattern)


def _active(rule: Rule, flags: frozenset[str]) -> bool:
    if rule.when is None:
        return True
    return rule.when[1:] not in flags if rule.when.startswith("!") else rule.when in flags


def _as_tuple(p: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if p is None else p if isinstance(p, tuple) else (p,)


def body(layout: Layout, key: str) -> str:
    """A key without its task prefix, in the table's names (aliases applied)."""
    key = next((key[len(p):] for p in layout.prefixes if key.startswith(p)), key)
    return next((new + key[len(old):] for old, new in layout.aliases if key.startswith(old)), key)


def _match_peer(layout: Layout, rules: list[Rule], key: str) -> tuple[Rule, int, dict[str, str]] | None:
    """The first rule reading `key` (top rules on the key as it is, then the others on its body), which of its
    peer patterns matched and what the placeholders captured."""
    stripped = body(layout, key)
    for top in (True, False):
        for rule in rules:
            if rule.top != top:
                continue
            for j, pattern in enumerate(_as_tuple(rule.peer)):
                if m := _regex(pattern).match(key if top else stripped):
                    return rule, j, m.groupdict()
    return None


def read(layout: Layout, w: dict[str, torch.Tensor], flags=frozenset(), ctx: dict | None = None
         ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A peer's tensors in vitkit's names by the table read forwards: (state dict, the keys left unused). A key no
    rule reads is refused, naming it: a tensor that could change the output is never dropped in silence."""
    flags, ctx = frozenset(flags), ctx or {}
    rules = [r for r in layout.rules if _active(r, flags)]
    sd: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    groups: dict[tuple[int, tuple], dict[int, tuple[str, torch.Tensor]]] = {}
    source: dict[str, str] = {}  # each vitkit tensor's peer key: two keys landing on one tensor are refused

    def put(name: str, t: torch.Tensor, k: str) -> None:
        if name in source:
            raise CheckpointError(f"{layout.source} {layout.name} keys {source[name]!r} and {k!r} both read into "
                                  f"{name!r}: the file holds the tensor twice (under two names)")
        source[name], sd[name] = k, t

    for k, v in w.items():
        hit = _match_peer(layout, rules, k)
        if hit is None:
            raise CheckpointError(f"unexpected {layout.source} {layout.name} key {k!r}")
        rule, j, caps = hit
        if rule.refuse is not None:
            raise CheckpointError(rule.refuse.format(key=k, name=layout.name))
        if rule.ours is None:
            unused.append(k)
        elif isinstance(rule.peer, tuple):  # one part of a fused group: fused once all are read
            slots = groups.setdefault((rules.index(rule), tuple(sorted(caps.items()))), {})
            if j in slots:
                raise CheckpointError(f"{layout.source} {layout.name} keys {slots[j][0]!r} and {k!r} both read as "
                                      f"{_fill_in(rule.peer[j], caps)!r}: the file holds the tensor twice")
            slots[j] = (k, v)
        elif isinstance(rule.ours, tuple):
            for name, piece in zip(rule.ours, _split(k, v, len(rule.ours), rule.sizes)):
                put(_fill_in(name, caps), piece, k)
        else:
            put(_fill_in(rule.ours, caps), TRANSFORMS[rule.transform][0](v, ctx) if rule.transform else v, k)
    for (index, caps), parts in groups.items():
        rule, caps = rules[index], dict(caps)
        if len(parts) == len(rule.peer):
            put(_fill_in(rule.ours, caps), fuse({parts[j][0]: parts[j][1] for j in range(len(rule.peer))}),
                parts[0][0])
        elif rule.partial and {j for j, name in enumerate(rule.partial) if name is not None} == set(parts):
            for j, (k, v) in sorted(parts.items()):
                put(_fill_in(rule.partial[j], caps), v, k)
        else:
            present = [parts[j][0] for j in sorted(parts)]
            missing = [_fill_in(p, caps) for j, p in enumerate(rule.peer) if j not in parts]
            raise CheckpointError(layout.incomplete.format(**{"i": caps.get("i"), "w": caps.get("w")},
                                                           present=", ".join(present), missing=", ".join(missing)))
    for rule in rules:
        if rule.peer is None and rule.ours not in sd and rule.like in sd:
            sd[rule.ours] = FILLS[rule.fill](sd[rule.like])
    return sd, unused


def _split(key: str, v: torch.Tensor, n: int, sizes: tuple[int, ...] | None) -> list[torch.Tensor]:
    """One tensor cut along dim 0 into n pieces in the shares `sizes` (equal without)."""
    shares = sizes or (1,) * n
    unit, rest = divmod(v.shape[0], sum(shares))
    if rest:
        raise CheckpointError(f"{key}: {v.shape[0]} rows do not split in the shares {shares}")
    return list(v.split([unit * s for s in shares]))


def _match_ours(rules: list[Rule], key: str) -> tuple[Rule, int | None, dict[str, str]] | None:
    """The first rule writing vitkit's `key`: which of its vitkit names matched (None: `ours` itself, j: the j-th
    of a split's or of `partial`'s names)."""
    for rule in rules:
        names = [(None, rule.ours)] if isinstance(rule.ours, str) else list(enumerate(_as_tuple(rule.ours)))
        names += [(("partial", j), name) for j, name in enumerate(rule.partial or ()) if name is not None]
        for which, pattern in names:
            if m := _regex(pattern).match(key):
                return rule, which, m.groupdict()
    return None


def write(layout: Layout, sd: dict[str, torch.Tensor], flags=frozenset(), ctx: dict | None = None,
          prefix: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """vitkit's tensors in the peer's names by the same table read backwards: (peer state dict, vitkit keys no
    rule writes). `ctx` holds the sizes the constants are made in: D (the width), depth."""
    flags, ctx = frozenset(flags), ctx or {}
    prefix = layout.export_prefix if prefix is None else prefix
    rules = [r for r in layout.rules if _active(r, flags) and r.export and r.refuse is None]
    out: dict[str, torch.Tensor] = {}
    left: list[str] = []
    done: set[str] = set()

    def put(rule: Rule, pattern: str, caps: dict[str, str], t: torch.Tensor) -> None:
        out[("" if rule.top else prefix) + _fill_in(pattern, caps)] = t

    for k, v in sd.items():
        if k in done:
            continue
        hit = _match_ours(rules, k)
        if hit is None:
            left.append(k)
            continue
        rule, which, caps = hit
        if rule.peer is None:  # vitkit's own tensor the peer does not store: it must still be the constant
            if rule.like not in sd or not torch.equal(v, FILLS[rule.fill](sd[rule.like])):
                raise CheckpointError(rule.why or f"{k} is not what {layout.source} {layout.name} implies")
            continue
        if isinstance(which, tuple):  # a partial group's part: its own peer name
            put(rule, rule.peer[which[1]], caps, v)
        elif isinstance(rule.ours, tuple):  # the pieces of one peer tensor, joined again
            names = [_fill_in(n, caps) for n in rule.ours]
            if not all(n in sd for n in names):
                left.append(k)
                continue
            done.update(names)
            put(rule, rule.peer, caps, torch.cat([sd[n] for n in names]))
        elif isinstance(rule.peer, tuple):  # one fused tensor, as the peer's separate ones
            for pattern, piece in zip(rule.peer, v.chunk(len(rule.peer))):
                put(rule, pattern, caps, piece)
        else:
            put(rule, rule.peer, caps, TRANSFORMS[rule.transform][1](v, ctx) if rule.transform else v)
    for rule in rules:
        if rule.default is None:
            continue
        kind, shape = rule.default
        size = tuple(ctx[s] if isinstance(s, str) else s for s in shape)
        for i in range(ctx.get("depth", 0)) if "{i}" in rule.peer else [None]:
            caps = {} if i is None else {"i": str(i)}
            if rule.ours is None or _fill_in(rule.ours, caps) not in sd:
                put(rule, rule.peer, caps, _CONSTANTS[kind](size))
    return out, left
