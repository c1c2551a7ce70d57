"""Compact, exact regexes naming a set of on-disk module names (for config targets, ignore lists, GPTQ rules).

``model.layers.3.mlp.experts.{0,5}.{gate,up}_proj`` becomes ``^model\\.layers\\.3\\.mlp\\.experts\\.(0|5)\\.(gate_proj|up_proj)$``;
a block covering all experts of a layer uses ``\\d+``; rules identical except the layer number are merged.
Every regex is checked to match exactly the given names within the universe of module names.
"""

from __future__ import annotations

import re
from collections import defaultdict

_LAYER = re.compile(r"^(?P<head>.*?layers)\.(?P<L>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(?P<block>.*?experts)\.(?P<E>\d+)\.(?P<leaf>[^.]+)$")


def _alt(items) -> str:
    items = sorted(items, key=lambda s: (len(s), s))
    return re.escape(items[0]) if len(items) == 1 else "(" + "|".join(re.escape(i) for i in items) + ")"


def _block_patterns(rest_names: set[str], all_experts: set[str]) -> list[str]:
    """Patterns (after ``layers.L.``) for the modules of one layer."""
    experts: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # block -> E -> leaves
    plain: dict[str, set[str]] = defaultdict(set)  # parent -> leaves
    for rest in rest_names:
        m = _EXPERT.match(rest)
        if m:
            experts[m["block"]][m["E"]].add(m["leaf"])
        else:
            parent, _, leaf = rest.rpartition(".")
            plain[parent].add(leaf)
    out = [(re.escape(p) + r"\." if p else "") + _alt(leaves) for p, leaves in plain.items()]
    for block, per_e in experts.items():
        by_leaves: dict[frozenset, list[str]] = defaultdict(list)
        for e, leaves in per_e.items():
            by_leaves[frozenset(leaves)].append(e)
        for leaves, es in by_leaves.items():
            e_pat = r"\d+" if set(es) == all_experts else _alt(es)
            out.append(re.escape(block) + r"\." + e_pat + r"\." + _alt(leaves))
    return out


def name_regexes(names: list[str], universe: list[str]) -> list[str]:
    """Regexes (``re:``-less, anchored) matching exactly ``names`` among ``universe`` (all module names)."""
    chosen = set(names)
    per_layer: dict[tuple[str, str], set[str]] = defaultdict(set)
    flat: list[str] = []
    experts_of_layer: dict[str, set[str]] = defaultdict(set)
    layers_of_head: dict[str, set[str]] = defaultdict(set)
    for n in universe:
        m = _LAYER.match(n)
        if m:
            layers_of_head[m["head"]].add(m["L"])
            e = _EXPERT.match(m["rest"])
            if e:
                experts_of_layer[m["L"]].add(e["E"])
    for n in sorted(chosen):
        m = _LAYER.match(n)
        if m:
            per_layer[(m["head"], m["L"])].add(m["rest"])
        else:
            flat.append("^" + re.escape(n) + "$")
    by_pattern: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (head, L), rests in per_layer.items():
        for pat in _block_patterns(rests, experts_of_layer[L]):
            by_pattern[(head, pat)].append(L)
    for (head, pat), layers in sorted(by_pattern.items()):
        l_pat = r"\d+" if set(layers) == layers_of_head[head] else _alt(layers)
        flat.append("^" + re.escape(head) + r"\." + l_pat + r"\." + pat + "$")
    _verify(flat, chosen, universe)
    return flat


def _verify(patterns: list[str], chosen: set[str], universe: list[str]) -> None:
    compiled = [re.compile(p) for p in patterns]
    matched = {n for n in universe if any(c.match(n) for c in compiled)}
    assert matched == chosen, f"target regexes mismatch: extra {sorted(matched - chosen)[:3]}, missing {sorted(chosen - matched)[:3]}"


# Reading such regexes back (``quant inspect``) without a backtracking engine: a checkpoint's config is input, and
# ``re:^(.*)*(.*)*Z$`` would keep ``re`` busy for hours. The compact form quant writes is a sequence of literal
# characters (a metacharacter escaped with a backslash), ``\d+``, flat groups of alternatives of those, regex
# comments ``(?#...)``, a leading ``^`` and a final ``$``; it is parsed once and matched as a set of positions
# advanced token by token, in time linear in the pattern times the name.
_META = frozenset(".^$*+?{}[]\\|()")
DIGITS = object()  # the token ``\d+``


class NotCompact(ValueError):
    """A pattern outside the compact form (the message says where)."""


def compile_compact(pattern: str) -> tuple[list, bool]:
    """``pattern`` -> (tokens, anchored at the end); tokens are literal strings, ``DIGITS`` or tuples of
    alternatives (each a token list). NotCompact for anything else."""
    tokens, i, end = [], 1 if pattern.startswith("^") else 0, False
    while i < len(pattern):
        if pattern.startswith("(?#", i):
            close = pattern.find(")", i)
            if close < 0:
                raise NotCompact(f"unterminated comment at {i}")
            i = close + 1
            continue
        if end:
            raise NotCompact(f"'$' at {i - 1} is not at the end")
        if pattern[i] == "$":
            end, i = True, i + 1
        elif pattern[i] == "(":
            close = pattern.find(")", i)
            if close < 0:
                raise NotCompact(f"unterminated group at {i}")
            tokens.append(tuple(_sequence(alt, i) for alt in pattern[i + 1 : close].split("|")))
            i = close + 1
        else:
            i = _atom(pattern, i, tokens)
    return tokens, end


def _sequence(text: str, at: int) -> list:
    out: list = []
    i = 0
    while i < len(text):
        if text[i] == "(":
            raise NotCompact(f"nested group at {at + 1 + i}")
        i = _atom(text, i, out)
    return out


def _atom(text: str, i: int, out: list) -> int:
    """Append the literal character or ``\\d+`` at ``text[i]`` to ``out`` (literal runs merged); the next index."""
    c = text[i]
    if c == "\\" and text.startswith("\\d+", i):
        out.append(DIGITS)
        return i + 3
    if c == "\\" and i + 1 < len(text) and not (text[i + 1].isascii() and text[i + 1].isalnum()):
        c, i = text[i + 1], i + 1  # an escaped non-alphanumeric character is itself
    elif c in _META:
        raise NotCompact(f"{text[i:i + 2]!r} at {i}")
    if out and isinstance(out[-1], str):
        out[-1] += c
    else:
        out.append(c)
    return i + 1


def compact_match(compiled: tuple[list, bool], name: str) -> bool:
    """``re.match(pattern, name)`` for a compiled compact pattern."""
    tokens, end = compiled
    ends = _advance(tokens, {0}, name)
    if not end:
        return bool(ends)
    return len(name) in ends or (name.endswith("\n") and len(name) - 1 in ends)


def _advance(tokens: list, starts: set[int], name: str) -> set[int]:
    for tok in tokens:
        if not starts:
            break
        if isinstance(tok, tuple):
            starts = set().union(*(_advance(alt, starts, name) for alt in tok))
        elif tok is DIGITS:
            starts = {e for s in starts for e in _digit_run_ends(name, s)}
        else:
            starts = {s + len(tok) for s in starts if name.startswith(tok, s)}
    return starts


def _digit_run_ends(name: str, start: int) -> range:
    e = start
    while e < len(name) and name[e].isdecimal():
        e += 1
    return range(start + 1, e + 1)
