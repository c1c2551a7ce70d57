"""Canonical module names, the only names used outside ``models/``, built and taken apart in one place.

``layers.L.attn.<proj>``, ``layers.L.experts.E.{gate,up,down}``, ``layers.L.shared.{gate,up,down}``,
``layers.L.mlp.{gate,up,down}`` (dense MLP layers), ``layers.L.router``, ``layers.L.shared_gate``, ``embed``,
``lm_head`` (``families.py`` translates them to and from each family's on-disk names). Other packages call these
functions instead of formatting or splitting the strings themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

PROJ = ("gate", "up", "down")  # the projections of an expert, a shared expert and a dense MLP
_KINDS = {"attn": "attn", "experts": "expert", "shared": "shared", "mlp": "dense_mlp"}


@dataclass(frozen=True)
class Name:
    """A canonical name taken apart. ``layers.3.experts.17.up``: layer 3, block ``experts``, expert 17, leaf ``up``;
    ``layers.3.attn.q``: block ``attn``, leaf ``q``; ``layers.3.router``: no block, leaf ``router``; ``embed``: no
    layer, leaf ``embed``."""

    layer: int | None
    block: str | None
    expert: int | None
    leaf: str

    @property
    def kind(self) -> str:
        """One of attn, expert, shared, dense_mlp, router, embed, lm_head (the planner's rule classes)."""
        if self.layer is None:
            return self.leaf
        return _KINDS.get(self.block, "router")


def parse(name: str) -> Name:
    """``name`` taken apart (see ``Name``)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return Name(None, None, None, name)
    layer = int(parts[1])
    if len(parts) == 3:
        return Name(layer, None, None, parts[2])
    if parts[2] == "experts":
        return Name(layer, "experts", int(parts[3]), parts[4])
    return Name(layer, parts[2], None, parts[3])


def layer_prefix(layer: int) -> str:
    """What every canonical name of decoder layer ``layer`` starts with (``layers.3.``)."""
    return f"layers.{layer}."


def block_name(layer: int, block: str) -> str:
    """A block of one decoder layer (``layers.3.attn``, ``layers.3.experts``: every routed expert of the layer)."""
    return f"layers.{layer}.{block}"


def expert_name(layer: int, expert: int, proj: str) -> str:
    """The canonical name of one routed expert's projection (``layers.3.experts.17.up``)."""
    return f"layers.{layer}.experts.{expert}.{proj}"


def module_kind(name: str) -> str:
    """One of attn, expert, shared, dense_mlp, router, embed, lm_head (the planner's rule classes)."""
    return parse(name).kind


def layer_of(name: str) -> int | None:
    return parse(name).layer


def expert_of(name: str) -> int | None:
    return parse(name).expert
