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
