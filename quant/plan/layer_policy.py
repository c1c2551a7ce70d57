"""Layer policies: the expert schemes of each MoE layer, chosen within a storage budget. ``layer_sensitivity`` gives
each layer one scheme (what vLLM and SGLang serve); ``quant.plan.joint_policy`` may split a layer in two scheme groups.

``layer_sensitivity`` reads the profile's per-layer damage (``quant.profile.layer_damage``: KL of the model output when
only that layer's experts take a scheme) and solves the multiple-choice knapsack

    minimize  sum_l damage[l, k_l]   subject to   sum_l storage[l, k_l] <= budget

exactly by dynamic programming over the budget in integer units: the costs' common divisor in bits when that
cuts the budget into at most ``GRID`` units (costs are whole bits: numel x (bits + 16 / group)), else
``budget / GRID`` with every cost rounded up, so the result never exceeds the budget and the rounding leaves at
most ``L / GRID`` of it unspent. Summing single-layer KLs
assumes the layers' damages add up, which holds to first order for small perturbations (the study checks it).

Storage counts what the checkpoint holds per weight: code bits plus one 16-bit scale per group, so a smaller
group is paid for from the same budget as more bits. ``plan.budget_avg_bits`` is read as average code bits at
``plan.group_size`` (what a per-expert plan with that average stores), converted to storage the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.algos.grid import effective_group_size, shared_group_size
from quant.errors import PlanError
from quant.models import ModuleInfo
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from quant.scheme import Scheme

SCALE_BITS = 16  # one bf16/fp16 scale per group
GRID = 100_000


@dataclass(frozen=True)
class LayerGroups:
    """What a layer policy gives one MoE layer's routed experts: ``rest`` for each, except the ``hot`` experts, which
    get ``hot_scheme`` (no hot experts: one scheme for the layer)."""

    rest: Scheme
    hot: frozenset[int] = frozenset()
    hot_scheme: Scheme | None = None

    def __post_init__(self):
        assert bool(self.hot) == (self.hot_scheme is not None and self.hot_scheme != self.rest), self

    @property
    def uniform(self) -> bool:
        return not self.hot

    def of(self, expert: int) -> tuple[Scheme, str]:
        """(scheme, role) of one expert: role ``hot`` / ``rest`` in a split layer, ``""`` in a uniform one."""
        if expert in self.hot:
            return self.hot_scheme, "hot"
        return self.rest, "" if self.uniform else "rest"


def storage_bits(bits: float, group_size: int, in_features: int, symmetric: bool = True) -> float:
    """Stored bits per weight of one module: codes + scales (+ zero points) at its effective group size."""
    g = effective_group_size(group_size, in_features)
    return bits + SCALE_BITS / g + (0.0 if symmetric else bits / g)


def _units(costs: torch.Tensor, budget: float) -> tuple[torch.Tensor, int]:
    """Costs in integer units and the budget's capacity in them: exact when the costs are whole numbers (bits)
    whose common divisor cuts the budget into at most ``GRID`` units, else ``budget / GRID`` units, rounded up."""
    finite = costs[torch.isfinite(costs)]
    if len(finite) and bool((finite == finite.round()).all()) and finite.max().item() < 2**53:
        g = 0
        for c in finite.long().unique().tolist():
            g = math.gcd(g, c)
        if g > 0 and budget / g <= GRID:
            return (costs / g).round().long(), int(budget // g)
    unit = budget / GRID
    return torch.ceil(costs / unit - 1e-9).long().clamp_min(0), GRID


def choose_schemes(costs: torch.Tensor, damage: torch.Tensor, budget: float) -> list[int]:
    """``costs, damage [L, K]`` (inf damage: not allowed) -> per layer the index of its scheme, minimizing total
    damage with total cost <= ``budget``. Ties go to the lower index. Raises PlanError when nothing fits."""
    L, K = costs.shape
    cheapest = costs.masked_fill(torch.isinf(damage), math.inf).min(dim=1)
    if cheapest.values.sum().item() > budget * (1 + 1e-12):
        raise PlanError(f"the budget ({budget:.4g} bits) is below the cheapest allowed layer schemes "
                        f"({cheapest.values.sum().item():.4g} bits); raise plan.budget_avg_bits")
    units, cap = _units(costs, budget)
    assert K < 2**15, K
    best = torch.zeros(cap + 1, dtype=torch.float64)  # best[c]: least damage of the layers so far within c units
    choice = torch.zeros(L, cap + 1, dtype=torch.int16)
    for layer in range(L):  # a running minimum over the layer's choices: memory O(cap), not O(K cap)
        new = torch.full((cap + 1,), math.inf, dtype=torch.float64)
        for k in range(K):
            u = int(units[layer, k])
            if u > cap or math.isinf(damage[layer, k].item()):
                continue
            cand = best[: cap + 1 - u] + damage[layer, k].item()
            better = cand < new[u:]  # strict: ties keep the lower index
            new[u:] = torch.where(better, cand, new[u:])
            choice[layer, u:][better] = k
        best = new
    if math.isinf(best[cap].item()):  # only the rounding stands in the way: the cheapest choice fits exactly
        return cheapest.indices.tolist()
    picks, c = [0] * L, cap
    for layer in reversed(range(L)):
        picks[layer] = int(choice[layer, c])
        c -= int(units[layer, picks[layer]])
    return picks


def candidate_schemes(measured: dict[str, torch.Tensor], spec: PlanSpec) -> list[str]:
    """Measured schemes the plan may use: bits in {low, high}, group in {group_size} + layer_group_sizes; the two
    base schemes first (cheapest first), so ties go to them."""
    groups = (spec.group_size, *spec.layer_group_sizes)
    ok = [n for n in measured
          if Scheme.parse(n).bits in (spec.low_bits, spec.high_bits) and Scheme.parse(n).group_size in groups]
    base = [Scheme(b, spec.group_size).label for b in sorted({spec.low_bits, spec.high_bits})]
    lacking = [b for b in base if b not in ok]
    if lacking:
        raise PlanError(f"the profile's layer damage lacks {', '.join(lacking)}; add it to "
                        f"profile.layer_sensitivity.schemes and re-run `quant profile`")
    return base + sorted((n for n in ok if n not in base), key=Scheme.parse)


def storage_per_expert(modules: dict[str, ModuleInfo], profile: RoutingProfile, bits: float, group: int) -> torch.Tensor:
    """``[L, E]`` stored bits of each routed expert (all its projections) at (bits, requested group), the group
    resolved per MoE layer as the plan does (one group size for all the layer's projections)."""
    numel = torch.zeros(len(profile.layers), profile.n_experts, dtype=torch.float64)
    widths: dict[int, set[int]] = {}
    for m in modules.values():
        if m.kind == "expert":
            numel[profile.row(m.layer), m.expert] += m.numel
            widths.setdefault(profile.row(m.layer), set()).add(m.in_features)
    per_weight = torch.tensor([bits + SCALE_BITS / shared_group_size(group, widths.get(r, {group}))
                               for r in range(len(profile.layers))], dtype=torch.float64)
    return numel * per_weight.unsqueeze(1)


def layer_storage(modules: dict[str, ModuleInfo], profile: RoutingProfile, bits: float, group: int) -> torch.Tensor:
    """``[L]`` stored bits of every MoE layer's routed experts at (bits, requested group) (``storage_per_expert``)."""
    return storage_per_expert(modules, profile, bits, group).sum(dim=1)


def needs_damage(profile: RoutingProfile, policy: str) -> dict[str, torch.Tensor]:
    """The profile's per-layer damage, which a layer policy prices its choices with."""
    if profile.layer_damage is None:
        raise PlanError(f"plan.policy '{policy}' needs per-layer damage in the profile; set "
                        "profile.layer_sensitivity and re-run `quant profile`")
    return profile.layer_damage


def budget_bits(modules: dict[str, ModuleInfo], profile: RoutingProfile, spec: PlanSpec) -> float:
    """The layer policies' storage budget: every routed expert at ``plan.budget_avg_bits`` code bits and
    ``plan.group_size`` (what a per-expert plan with that average stores)."""
    return layer_storage(modules, profile, spec.budget_avg_bits, spec.group_size).sum().item()


def layer_sensitivity(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> dict[int, LayerGroups]:
    """MoE layer -> the one (bits, group size) of its experts: least summed damage within the storage budget."""
    damage_by_scheme = needs_damage(profile, "layer_sensitivity")
    names = candidate_schemes(damage_by_scheme, spec)
    parsed = [Scheme.parse(n) for n in names]
    costs = torch.stack([layer_storage(modules, profile, s.bits, s.group_size) for s in parsed], dim=1)
    damage = torch.stack([damage_by_scheme[n] for n in names], dim=1)
    picks = choose_schemes(costs, damage, budget_bits(modules, profile, spec))
    return {layer: LayerGroups(parsed[picks[row]]) for row, layer in enumerate(profile.layers)}


def describe(p: PlanSpec) -> str:
    """The model card's words for ``layer_sensitivity`` (after its name)."""
    groups = ", ".join(str(g) for g in (p.group_size, *p.layer_group_sizes))
    return (f" (one scheme per MoE layer, chosen by measured output damage within {p.budget_avg_bits} average "
            f"expert bits; group sizes {groups})")
