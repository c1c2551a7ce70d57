"""Layer policies: the knapsack against brute force, storage accounting, and layer_sensitivity plans (one scheme per
MoE layer, group sizes paid from the budget, equal average bits)."""

import itertools
from dataclasses import replace

import pytest
import torch

from quant.errors import PlanError
from quant.models import ModuleInfo
from quant.plan.bitplan import plan_bits
from quant.plan.layer_policy import GRID, choose_schemes, storage_bits
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from tests.conftest import expert_schemes_by_layer

E, D, INTER = 8, 256, 128
LAYERS = [0, 1, 2, 3]


def _brute(costs, damage, budget):
    best = None
    for picks in itertools.product(range(costs.shape[1]), repeat=costs.shape[0]):
        c = sum(costs[i, k].item() for i, k in enumerate(picks))
        d = sum(damage[i, k].item() for i, k in enumerate(picks))
        if c <= budget and (best is None or d < best[0] - 1e-12):
            best = (d, picks)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    costs = torch.rand(4, 3, generator=g, dtype=torch.float64) * 10 + 1
    damage = torch.rand(4, 3, generator=g, dtype=torch.float64)
    budget = costs.min(dim=1).values.sum().item() + torch.rand(1, generator=g).item() * 12
    picks = choose_schemes(costs, damage, budget)
    spent = sum(costs[i, k].item() for i, k in enumerate(picks))
    got = sum(damage[i, k].item() for i, k in enumerate(picks))
    want, _ = _brute(costs, damage, budget)
    assert spent <= budget + 1e-9
    # the grid rounds costs up by < 1 unit each: optimal up to choices within L units of the budget
    assert got == pytest.approx(want) or _brute(costs, damage, budget * (1 - 4 / GRID))[0] == pytest.approx(got)


def test_knapsack_is_exact_for_whole_bit_costs():
    costs = torch.tensor([[33.0, 65.0]] * 4, dtype=torch.float64) * 1_000_003  # whole bits, a prime factor
    damage = torch.tensor([[1.0, 0.0], [8.0, 0.1], [2.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    budget = (3 * 33 + 65) * 1_000_003.0  # exactly one upgrade
    assert choose_schemes(costs, damage, budget) == [0, 1, 0, 0]
    assert choose_schemes(costs, damage, budget - 1) == [0, 0, 0, 0]


def test_knapsack_respects_disallowed_and_infeasible_budgets():
    costs = torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    damage = torch.tensor([[5.0, 0.0], [5.0, float("inf")]], dtype=torch.float64)
    assert choose_schemes(costs, damage, 10.0) == [1, 0]
    assert choose_schemes(costs, damage, 2.0) == [0, 0]  # exactly the cheapest choice
    with pytest.raises(PlanError, match="below the cheapest"):
        choose_schemes(costs, damage, 1.9)


def test_storage_bits_counts_scales_and_zero_points():
    assert storage_bits(4, 128, 256) == 4 + 16 / 128
    assert storage_bits(4, 32, 256) == 4.5
    assert storage_bits(8, 128, 64) == 8 + 16 / 64  # group clamped to the input width
    assert storage_bits(4, 32, 256, symmetric=False) == 4 + 16 / 32 + 4 / 32


def moe_modules(layers: list[int], n_experts: int) -> dict[str, ModuleInfo]:
    """Each layer's attention q, router and experts' gate/up/down at hidden D, intermediate INTER."""
    out = {}
    for L in layers:
        out[f"layers.{L}.attn.q"] = ModuleInfo(f"layers.{L}.attn.q", "x", "attn", L, None, D, D)
        out[f"layers.{L}.router"] = ModuleInfo(f"layers.{L}.router", "x", "router", L, None, n_experts, D)
        for e in range(n_experts):
            for p, (o, i) in {"gate": (INTER, D), "up": (INTER, D), "down": (D, INTER)}.items():
                out[f"layers.{L}.experts.{e}.{p}"] = ModuleInfo(f"layers.{L}.experts.{e}.{p}", "x", "expert", L, e, o, i)
    return out


def _modules() -> dict[str, ModuleInfo]:
    return moe_modules(LAYERS, E)


def _profile(damage: dict[str, list[float]]) -> RoutingProfile:
    counts = torch.ones(len(LAYERS), E, dtype=torch.float64)
    z = torch.zeros_like(counts)
    return RoutingProfile("fp", "m", LAYERS, E, 2, 100, [], counts, counts, z, z, z,
                          layer_damage={k: torch.tensor(v, dtype=torch.float64) for k, v in damage.items()})


def _spec(**kw) -> PlanSpec:
    return PlanSpec(**{"policy": "layer_sensitivity", "granularity": "per_layer", "budget_avg_bits": 4.75, **kw})


def _avg_storage(plan, mods) -> float:
    num = sum(storage_bits(plan.modules[n].bits, plan.modules[n].group_size, m.in_features) * m.numel
              for n, m in mods.items() if m.kind == "expert")
    return num / sum(m.numel for m in mods.values() if m.kind == "expert")


DAMAGE = {"w4g128": [1.0, 8.0, 2.0, 3.0], "w8g128": [0.05, 0.1, 0.05, 0.05],
          "w4g64": [0.8, 5.0, 1.5, 2.9], "w4g32": [0.7, 4.0, 1.2, 2.8]}


def test_layer_sensitivity_gives_high_bits_to_the_most_damaged_layer_within_budget():
    mods = _modules()
    plan = plan_bits(_profile(DAMAGE), mods, _spec(budget_avg_bits=5.0), 4)
    schemes = expert_schemes_by_layer(plan)
    assert all(len(s) == 1 for s in schemes.values())  # one scheme per MoE layer
    assert schemes[1] == {(8, 128)} and schemes[0] == schemes[2] == schemes[3] == {(4, 128)}
    assert plan.modules["layers.1.experts.3.down"].reason == "layer_sensitivity:w8g128"
    assert plan.modules["layers.0.attn.q"].bits == 8 and plan.modules["layers.0.router"].keep
    assert _avg_storage(plan, mods) == pytest.approx(5.0 + 16 / 128)  # 1 of 4 layers at W8: the whole budget
    # 4.75 bits cannot pay for a W8 layer (5.0): all layers stay at W4 rather than exceed the budget
    all_w4 = plan_bits(_profile(DAMAGE), mods, _spec(), 4)
    assert all(s == {(4, 128)} for s in expert_schemes_by_layer(all_w4).values())


def _total_damage(plan) -> float:
    schemes = sorted(expert_schemes_by_layer(plan).items())
    return sum(DAMAGE[f"w{b}g{g}"][i] for i, (b, g) in enumerate(next(iter(s)) for _, s in schemes))


def test_group_size_knob_spends_the_rest_of_the_budget_optimally():
    mods = _modules()
    plan = plan_bits(_profile(DAMAGE), mods, _spec(budget_avg_bits=5.25, layer_group_sizes=(32, 64)), 4)
    schemes = expert_schemes_by_layer(plan)
    assert all(len(s) == 1 for s in schemes.values()) and schemes[1] == {(8, 128)}
    assert {(4, 32), (4, 64)} & set().union(*schemes.values())  # the rest of the budget buys smaller groups
    assert _avg_storage(plan, mods) <= 5.25 + 16 / 128 + 1e-12
    # optimal over every per-layer choice (layers are the same size: storage per layer in layer units)
    names = list(DAMAGE)
    unit = {"w4g128": 4.125, "w8g128": 8.125, "w4g64": 4.25, "w4g32": 4.5}
    best = min(sum(DAMAGE[n][i] for i, n in enumerate(c)) for c in itertools.product(names, repeat=4)
               if sum(unit[n] for n in c) <= 4 * (5.25 + 0.125))
    assert _total_damage(plan) == pytest.approx(best)
    no_knob = plan_bits(_profile(DAMAGE), mods, _spec(budget_avg_bits=5.25), 4)
    assert _total_damage(plan) < _total_damage(no_knob)


def test_equal_average_bits_to_the_per_expert_plan():
    """At the per-expert plan's average bits the layer plan stores no more than the per-expert plan does."""
    mods = _modules()
    prof = _profile(DAMAGE)
    per_expert = plan_bits(prof, mods, PlanSpec(top_fraction=0.25), 4)
    layer = plan_bits(prof, mods, _spec(budget_avg_bits=4 + 4 * 0.25, layer_group_sizes=(32, 64)), 4)
    assert _avg_storage(layer, mods) <= _avg_storage(per_expert, mods) + 1e-12
    assert _avg_storage(per_expert, mods) - _avg_storage(layer, mods) < 0.375 / 4 + 1e-9  # within one g32 upgrade


def test_layer_sensitivity_needs_measured_damage_and_base_schemes():
    mods = _modules()
    prof = replace(_profile(DAMAGE), layer_damage=None)
    with pytest.raises(PlanError, match="profile.layer_sensitivity"):
        plan_bits(prof, mods, _spec(), 4)
    with pytest.raises(PlanError, match="lacks w8g128"):
        plan_bits(_profile({"w4g128": DAMAGE["w4g128"]}), mods, _spec(), 4)


def test_protection_rules_still_win():
    plan = plan_bits(_profile(DAMAGE), _modules(), _spec(protect={"first_layers": 1, "edge_layer_bits": "keep"}),
                     4)
    assert plan.modules["layers.0.experts.0.up"].keep
