"""The ``joint`` layer policy: each MoE layer's routed experts get one scheme, or two scheme groups (the layer's hot
experts at one scheme, the rest at another), decided for all layers at once within the layer policies' budget.

Dimensions: L MoE layers, E experts per layer, K measured schemes, O options of one layer.

vLLM with quant's plugin (``plan.target_runtime: vllm-quant``) runs one fused-MoE kernel call per scheme group of a
layer, so a split layer costs one more call than a uniform one; no layer gets more than two groups. A layer's
options are its K uniform schemes and, for every ordered pair of schemes (a, b) and hot-group size n (the multiples
of ``ceil(E / HOT_STEPS)`` below E), its n experts ranked highest by ``plan.split_by`` at a and the others at b.
Each option is priced with the profile's measured layer damage ``D[l, k]`` (KL of the output when only layer l's
experts take scheme k, ``quant.profile.layer_damage``), shared over the layer's experts by their weight ``w[l, e]``
(``split_by``: the profile's per-expert W4 sensitivity probe, routed tokens, or routing-weight mass; normalized per
layer):

    damage(l, n, a, b) = W_n · D[l, a] + (1 - W_n) · D[l, b],   W_n = the n largest w[l, e] summed

(the additive model the report's predicted KL uses for a layer that mixes schemes, ``quant.plan.servable``), computed
as ``D[l, a] + R_n · (D[l, b] - D[l, a])`` with ``R_n`` the other experts' weight summed, so a split whose rest
carries no weight (experts the calibration never routed) ties uniform a exactly. Each option has its stored bits
(codes plus one 16-bit scale per group, ``layer_policy.storage_per_expert``). With experts of one size the top-n set
is the best hot group of size n under this model, so no other subset is tried. Options that another option of the
same layer matches or beats on both storage and damage are dropped (a uniform one survives a split one that ties
it: one kernel call instead of two), and ``layer_policy.choose_schemes`` picks one option per layer with the least
summed damage within the budget. Its options include ``layer_sensitivity``'s, so its predicted damage is never
higher; where a layer's experts weigh the same a split only interpolates between two uniform options, taken at most
to spend what whole-layer steps leave unspent.

A layer is split only where the split lowers its predicted damage (``unsplit``): a split the choice took whose
layer has a uniform option of no more damage (dropped above for costing more) takes that option where the budget
left unspent pays for it, the cheapest switches first. So a budget that fits every expert at the least damaging
scheme gets ``layer_sensitivity``'s plan, not W8 on the routed experts and W4 on the never-routed ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.models import ModuleInfo
from quant.plan.layer_policy import (
    LayerGroups,
    budget_bits,
    candidate_schemes,
    choose_schemes,
    needs_damage,
    storage_per_expert,
)
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from quant.scheme import Scheme

HOT_STEPS = 32  # hot-group sizes on offer per layer: at most this many, in equal steps of experts


@dataclass(frozen=True)
class Option:
    """One way to quantize a layer's experts: its ``n_hot`` top-ranked experts at scheme ``hot``, the others at
    ``rest`` (indices into the candidate schemes; ``n_hot`` 0: uniform ``rest``)."""

    n_hot: int
    hot: int
    rest: int
    cost: float
    damage: float


def expert_weights(profile: RoutingProfile, split_by: str) -> torch.Tensor:
    """``[L, E]`` each expert's share of its layer's damage (rows sum to 1; a layer with no weight at all: equal)."""
    if split_by == "sensitivity":
        w = profile.sensitivity if profile.sensitivity is not None else profile.counts
    else:
        w = profile.counts if split_by == "tokens" else profile.weight_mass
    w = w.double().clamp_min(0)
    total = w.sum(dim=1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-300), torch.full_like(w, 1.0 / w.shape[1]))


def hot_sizes(n_experts: int) -> list[int]:
    """Hot-group sizes on offer: multiples of ``ceil(E / HOT_STEPS)`` from it up to below E."""
    step = math.ceil(n_experts / HOT_STEPS)
    return list(range(step, n_experts, step))


def uniform_options(cost: torch.Tensor, damage: torch.Tensor) -> list[Option]:
    """One layer's K uniform options: ``cost [E, K]`` each expert's stored bits per scheme, ``damage [K]``."""
    total = cost.sum(dim=0)
    return [Option(0, k, k, total[k].item(), damage[k].item()) for k in range(cost.shape[1])]


def layer_options(cost: torch.Tensor, damage: torch.Tensor, weight: torch.Tensor) -> list[Option]:
    """One layer's options that nothing of the layer dominates, cheapest first (uniform before split on ties).

    ``cost [E, K]``: each expert's stored bits per scheme, in the order of ``weight [E]`` (descending); ``damage [K]``.
    """
    E, K = cost.shape
    assert damage.shape == (K,) and weight.shape == (E,), (cost.shape, damage.shape, weight.shape)
    cum_cost, total = cost.cumsum(dim=0), cost.sum(dim=0)
    rest_w = weight.flip(0).cumsum(dim=0).flip(0)  # rest_w[n]: experts n.. summed, exactly 0 where they weigh nothing
    options = uniform_options(cost, damage)
    for a in range(K):
        for b in range(K):
            if a == b or not damage[a] < damage[b]:  # the hot group gets the scheme that damages less
                continue
            for n in hot_sizes(E):
                c = (cum_cost[n - 1, a] + total[b] - cum_cost[n - 1, b]).item()
                d = (damage[a] + rest_w[n] * (damage[b] - damage[a])).item()
                options.append(Option(n, a, b, c, d))
    kept, least = [], math.inf
    for o in sorted(options, key=lambda o: (o.cost, o.damage, o.n_hot > 0)):
        if o.damage < least:
            kept.append(o)
            least = o.damage
    return kept


def choose_options(options: list[list[Option]], budget: float) -> list[Option]:
    """Per layer the option of ``options`` (one list per layer) with the least summed damage within ``budget``."""
    width = max(len(o) for o in options)
    costs = torch.tensor([[o.cost for o in opts] + [opts[-1].cost] * (width - len(opts)) for opts in options],
                         dtype=torch.float64)
    damage = torch.tensor([[o.damage for o in opts] + [math.inf] * (width - len(opts)) for opts in options],
                          dtype=torch.float64)
    return [opts[k] for opts, k in zip(options, choose_schemes(costs, damage, budget), strict=True)]


def unsplit(chosen: list[Option], uniform: list[list[Option]], budget: float) -> list[Option]:
    """``chosen`` (one option per layer) with each split layer switched to its cheapest option of ``uniform`` (the
    layer's K uniform ones) that damages no more, where what ``chosen`` leaves of ``budget`` still pays for it (the
    cheapest switches first): a layer stays split only where that lowers its predicted damage."""
    spare = budget * (1 + 1e-12) - sum(o.cost for o in chosen)  # the tolerance of choose_schemes' own check
    switches = []
    for r, o in enumerate(chosen):
        no_worse = [u for u in uniform[r] if u.damage <= o.damage]
        if o.n_hot and no_worse:
            switches.append((min(no_worse, key=lambda u: (u.cost, u.damage)), r))
    out = list(chosen)
    for u, r in sorted(switches, key=lambda s: (s[0].cost - chosen[s[1]].cost, s[1])):
        if u.cost - chosen[r].cost <= spare:
            spare -= u.cost - chosen[r].cost
            out[r] = u
    return out


def joint(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> dict[int, LayerGroups]:
    """MoE layer -> its expert scheme groups (at most two): least summed predicted damage within the budget."""
    damage_by_scheme = needs_damage(profile, "joint")
    names = candidate_schemes(damage_by_scheme, spec)
    parsed = [Scheme.parse(n) for n in names]
    cost = torch.stack([storage_per_expert(modules, profile, s.bits, s.group_size) for s in parsed], dim=2)  # [L, E, K]
    damage = torch.stack([damage_by_scheme[n] for n in names], dim=1)  # [L, K]
    weight = expert_weights(profile, spec.split_by)
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices  # ties: the lower expert index first
    rows = range(len(profile.layers))
    options = [layer_options(cost[r, order[r]], damage[r], weight[r, order[r]]) for r in rows]
    budget = budget_bits(modules, profile, spec)
    chosen = unsplit(choose_options(options, budget), [uniform_options(cost[r, order[r]], damage[r]) for r in rows],
                     budget)
    out = {}
    for r, (layer, o) in enumerate(zip(profile.layers, chosen, strict=True)):
        hot = frozenset(order[r, : o.n_hot].tolist())
        out[layer] = LayerGroups(parsed[o.rest], hot, parsed[o.hot] if hot else None)
    return out


def describe(p: PlanSpec) -> str:
    """The model card's words for ``joint`` (after its name)."""
    groups = ", ".join(str(g) for g in (p.group_size, *p.layer_group_sizes))
    return (f" (per MoE layer one scheme, or its hot experts by `{p.split_by}` at one scheme and the rest at "
            f"another, chosen by measured output damage within {p.budget_avg_bits} average expert bits; group "
            f"sizes {groups})")
