"""The joint policy: its knapsack over (MoE layer, hot group, schemes) against brute force over every assignment with
at most two schemes per layer, the budget, monotonicity in the budget, the per-layer plan when splitting cannot pay,
and the runtime checks (vLLM with quant's plugin serves a split plan, stock vLLM refuses it)."""

import itertools
from dataclasses import replace

import pytest
import torch

from quant.errors import PlanError
from quant.models import ModuleInfo, resolve_model
from quant.plan.bitplan import plan_bits
from quant.plan.joint_policy import expert_weights, hot_sizes, layer_options, uniform_options, unsplit
from quant.plan.layer_policy import GRID, storage_bits
from quant.plan.runtimes import problems_for
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from tests.conftest import expert_schemes_by_layer
from tests.plan.test_layer_policy import INTER, D, moe_modules

SCHEMES = {"w4g128": (4, 128), "w8g128": (8, 128), "w4g32": (4, 32)}


def _modules(n_layers: int, n_experts: int) -> dict[str, ModuleInfo]:
    return moe_modules(list(range(n_layers)), n_experts)


def _profile(damage: dict[str, list[float]], sensitivity: torch.Tensor, counts: torch.Tensor | None = None):
    L, E = sensitivity.shape
    counts = torch.ones(L, E, dtype=torch.float64) if counts is None else counts
    z = torch.zeros_like(counts)
    return RoutingProfile("fp", "m", list(range(L)), E, 2, 100, [], counts, counts, z, z, z, sensitivity=sensitivity,
                          layer_damage={k: torch.tensor(v, dtype=torch.float64) for k, v in damage.items()})


def _random_case(seed: int, n_layers: int, n_experts: int):
    g = torch.Generator().manual_seed(seed)
    w4 = torch.rand(n_layers, generator=g, dtype=torch.float64) * 10 + 0.5
    damage = {"w4g128": w4.tolist(), "w4g32": (w4 * (0.5 + 0.4 * torch.rand(n_layers, generator=g))).tolist(),
              "w8g128": (w4 * 0.05 * torch.rand(n_layers, generator=g)).tolist()}
    sens = torch.rand(n_layers, n_experts, generator=g, dtype=torch.float64) ** 3  # a few experts carry most
    return _profile(damage, sens)


def _spec(budget: float, **kw) -> PlanSpec:
    return PlanSpec(**{"policy": "joint", "budget_avg_bits": budget, "layer_group_sizes": (32,), **kw})


def _expert_scheme(plan, layer: int, expert: int) -> tuple[int, int]:
    schemes = {(plan.modules[f"layers.{layer}.experts.{expert}.{p}"].bits,
                plan.modules[f"layers.{layer}.experts.{expert}.{p}"].group_size) for p in ("gate", "up", "down")}
    assert len(schemes) == 1, schemes  # an expert's projections share one scheme
    return schemes.pop()


def _stored(plan, mods) -> float:
    """Average stored bits per routed-expert weight (codes and scales)."""
    num = sum(storage_bits(plan.modules[n].bits, plan.modules[n].group_size, m.in_features) * m.numel
              for n, m in mods.items() if m.kind == "expert")
    return num / sum(m.numel for m in mods.values() if m.kind == "expert")


def _damage(plan, prof: RoutingProfile) -> float:
    """The policy's additive model, computed from the plan's modules: each expert's weight share x its scheme's
    measured damage in its layer."""
    w = prof.sensitivity / prof.sensitivity.sum(dim=1, keepdim=True)
    names = {v: k for k, v in SCHEMES.items()}
    return sum(w[r, e].item() * prof.layer_damage[names[_expert_scheme(plan, layer, e)]][r].item()
               for r, layer in enumerate(prof.layers) for e in range(prof.n_experts))


def _brute(prof: RoutingProfile, budget_bits_per_weight: float) -> float:
    """Least additive damage over every assignment of the schemes to experts with at most two schemes per layer
    (any subsets, not only top-ranked ones), within the stored-bits budget (experts are the same size)."""
    per_weight = {k: (2 * storage_bits(b, g, D) + storage_bits(b, g, INTER)) / 3 for k, (b, g) in SCHEMES.items()}
    w = prof.sensitivity / prof.sensitivity.sum(dim=1, keepdim=True)
    E, names = prof.n_experts, list(SCHEMES)
    layer_choices = []
    for r in range(len(prof.layers)):
        opts = []
        for a in itertools.product(names, repeat=E):
            if len(set(a)) <= 2:
                opts.append((sum(per_weight[s] for s in a) / E,
                             sum(w[r, e].item() * prof.layer_damage[s][r] for e, s in enumerate(a))))
        layer_choices.append(opts)
    best = float("inf")
    for combo in itertools.product(*layer_choices):
        cost = sum(c for c, _ in combo) / len(combo)
        if cost <= budget_bits_per_weight + 1e-12:
            best = min(best, sum(d for _, d in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_matches_brute_force_over_two_scheme_assignments(seed):
    prof = _random_case(seed, n_layers=2, n_experts=4)
    mods = _modules(2, 4)
    budget = 4.2 + 0.5 * seed  # average code bits at g128
    plan = plan_bits(prof, mods, _spec(budget), 2)
    assert _stored(plan, mods) <= budget + 16 / 128 + 1e-9
    want = _brute(prof, budget + 16 / 128)
    got = _damage(plan, prof)
    # the budget grid rounds costs up by < 1 unit each: optimal up to choices within L units of the budget
    assert got == pytest.approx(want) or got <= _brute(prof, (budget + 16 / 128) * (1 + 2 / GRID)) + 1e-12
    assert got >= want - 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_budget_respected_monotone_and_at_most_two_groups_per_layer(seed):
    n_layers, n_experts = 4, 16
    prof, mods = _random_case(seed, n_layers, n_experts), _modules(n_layers, n_experts)
    w = expert_weights(prof, "sensitivity")
    last = float("inf")
    for budget in (4.0, 4.3, 4.6, 4.75, 5.0, 5.5, 6.5, 8.0):
        plan = plan_bits(prof, mods, _spec(budget), n_layers)
        assert _stored(plan, mods) <= budget + 16 / 128 + 1e-9
        damage = _damage(plan, prof)
        assert damage <= last + 1e-12  # more budget never predicts more damage
        last = damage
        for layer in range(n_layers):
            schemes = {_expert_scheme(plan, layer, e) for e in range(n_experts)}
            assert len(schemes) <= 2
            roles = {e: plan.modules[f"layers.{layer}.experts.{e}.up"].reason.split(":")[1] for e in range(n_experts)}
            hot = [e for e, r in roles.items() if r == "hot"]
            assert bool(hot) == (len(schemes) == 2)  # a split layer names its hot group, a uniform one none
            if hot:  # the hot group is the layer's top-weighted experts, at the less damaging scheme
                rest = [e for e, r in roles.items() if r == "rest"]
                assert len(hot) + len(rest) == n_experts and min(w[layer, hot]) >= max(w[layer, rest])
                name = {v: k for k, v in SCHEMES.items()}
                hot_d, rest_d = (prof.layer_damage[name[_expert_scheme(plan, layer, es[0])]][layer] for es in (hot, rest))
                assert hot_d < rest_d
    assert last == pytest.approx(sum(prof.layer_damage["w8g128"]))  # 8 bits on average: every expert at W8


def test_uniform_weights_give_the_per_layer_plan():
    """Every expert weighs the same, so a split only interpolates between two uniform schemes; with the budget exactly
    one W8 layer and the most damaged layer also the one with the steepest gain, nothing pays for a split."""
    damage = {"w4g128": [1.0, 8.0, 2.0, 3.0], "w8g128": [0.05, 0.1, 0.05, 0.05]}
    prof, mods = _profile(damage, torch.ones(4, 8, dtype=torch.float64)), _modules(4, 8)
    joint = plan_bits(prof, mods, _spec(5.0, layer_group_sizes=()), 4)
    layer = plan_bits(prof, mods, PlanSpec(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=5.0),
                      4)
    assert expert_schemes_by_layer(joint) == expert_schemes_by_layer(layer) == {
        0: {(4, 128)}, 1: {(8, 128)}, 2: {(4, 128)}, 3: {(4, 128)}}
    assert joint.modules["layers.1.experts.0.up"].reason == "joint:w8g128"  # a uniform layer: no hot/rest role


def test_concentrated_sensitivity_splits_layers_and_beats_the_per_layer_plan():
    damage = {"w4g128": [1.0, 8.0, 2.0, 3.0], "w8g128": [0.05, 0.1, 0.05, 0.05]}
    sens = torch.full((4, 8), 0.01, dtype=torch.float64)
    sens[:, :2] = 1.0  # two experts per layer carry almost all of its damage
    prof, mods = _profile(damage, sens), _modules(4, 8)
    joint = plan_bits(prof, mods, _spec(5.0, layer_group_sizes=()), 4)
    layer = plan_bits(prof, mods, PlanSpec(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=5.0),
                      4)
    split = [lay for lay, s in expert_schemes_by_layer(joint).items() if len(s) == 2]
    assert len(split) >= 2 and _damage(joint, prof) < 0.5 * _damage(layer, prof)
    assert _stored(joint, mods) <= 5.0 + 16 / 128 + 1e-9
    hot = joint.modules[f"layers.{split[0]}.experts.0.up"]
    assert (hot.bits, hot.reason) == (8, "joint:hot:w8g128")
    assert joint.modules[f"layers.{split[0]}.experts.5.up"].reason == "joint:rest:w4g128"


def _never_routed_case():
    """4 layers x 8 experts; experts 5-7 of every layer never routed in calibration (no tokens, no sensitivity)."""
    damage = {"w4g128": [1.0, 8.0, 2.0, 3.0], "w8g128": [0.05, 0.1, 0.05, 0.05]}
    sens = torch.linspace(1.0, 0.2, 8, dtype=torch.float64).repeat(4, 1)
    sens[:, 5:] = 0.0
    counts = torch.ones(4, 8, dtype=torch.float64)
    counts[:, 5:] = 0.0
    return _profile(damage, sens, counts), _modules(4, 8)


def test_never_routed_experts_are_not_split_off_when_every_expert_fits_at_w8():
    """A split of the routed experts at W8 and the never-routed ones at W4 predicts the damage of all-W8 for less
    storage; it lowers no damage, so where all-W8 fits every layer takes it, as ``layer_sensitivity`` does."""
    prof, mods = _never_routed_case()
    joint = plan_bits(prof, mods, _spec(8.0), 4)
    layer = plan_bits(prof, mods, PlanSpec(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=8.0),
                      4)
    experts = [n for n, m in mods.items() if m.kind == "expert"]
    assert {(joint.modules[n].bits, joint.modules[n].group_size) for n in experts} == {(8, 128)}
    assert {n: (joint.modules[n].bits, joint.modules[n].group_size) for n in joint.modules} == {
        n: (layer.modules[n].bits, layer.modules[n].group_size) for n in layer.modules}
    assert {joint.modules[n].reason for n in experts} == {"joint:w8g128"}  # no layer names a hot group


def test_never_routed_experts_are_still_split_off_where_that_lowers_damage():
    """Below all-W8 the budget cannot buy every layer W8; W4 on the never-routed experts frees the storage that buys
    W8 for routed ones elsewhere, so the split layers predict less damage than any per-layer plan."""
    prof, mods = _never_routed_case()
    joint = plan_bits(prof, mods, _spec(6.5), 4)
    layer = plan_bits(prof, mods, PlanSpec(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=6.5),
                      4)
    split = {lay: s for lay, s in expert_schemes_by_layer(joint).items() if len(s) == 2}
    assert split and _damage(joint, prof) < _damage(layer, prof)
    assert _stored(joint, mods) <= 6.5 + 16 / 128 + 1e-9
    for lay in split:
        assert {e for e in range(8) if _expert_scheme(joint, lay, e) == (8, 128)} == set(range(5))


def test_split_by_tokens_ranks_experts_by_routed_tokens():
    damage = {"w4g128": [5.0, 5.0], "w8g128": [0.1, 0.1]}
    counts = torch.ones(2, 8, dtype=torch.float64)
    counts[:, 6:] = 50.0  # experts 6, 7 take most tokens; the sensitivity probe says experts 0, 1 matter
    sens = torch.full((2, 8), 0.01, dtype=torch.float64)
    sens[:, :2] = 1.0
    prof, mods = _profile(damage, sens, counts), _modules(2, 8)
    by_tokens = plan_bits(prof, mods, _spec(5.0, layer_group_sizes=(), split_by="tokens"), 2)
    by_sens = plan_bits(prof, mods, _spec(5.0, layer_group_sizes=()), 2)
    assert {e for e in range(8) if _expert_scheme(by_tokens, 0, e) == (8, 128)} == {6, 7}
    assert {e for e in range(8) if _expert_scheme(by_sens, 0, e) == (8, 128)} == {0, 1}


def test_layer_options_drop_dominated_ones_and_keep_uniform_on_ties():
    cost = torch.tensor([[4.0, 8.0]] * 4, dtype=torch.float64)  # 4 experts, schemes (W4, W8)
    equal = layer_options(cost, torch.tensor([4.0, 0.0], dtype=torch.float64), torch.full((4,), 0.25))
    assert [(o.n_hot, o.cost, o.damage) for o in equal] == [(0, 16.0, 4.0), (1, 20.0, 3.0), (2, 24.0, 2.0),
                                                            (3, 28.0, 1.0), (0, 32.0, 0.0)]
    # W8 damages more than W4 here: the hot group never gets it, and uniform W8 is dominated by uniform W4
    worse = layer_options(cost, torch.tensor([1.0, 2.0], dtype=torch.float64), torch.full((4,), 0.25))
    assert [(o.n_hot, o.rest) for o in worse] == [(0, 0)]
    assert hot_sizes(8) == list(range(1, 8)) and hot_sizes(256) == list(range(8, 256, 8))


def test_a_split_whose_rest_weighs_nothing_ties_the_uniform_option_and_is_undone_where_that_fits():
    cost = torch.tensor([[4.0, 8.0]] * 4, dtype=torch.float64)  # 4 experts, schemes (W4, W8)
    damage = torch.tensor([4.0, 1.0], dtype=torch.float64)
    weight = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64)  # summed left to right: 0.9999999999999999
    kept = layer_options(cost, damage, weight)
    split = kept[-1]  # experts 0-2 at W8, the weightless one at W4: uniform W8's damage for less storage
    assert (split.n_hot, split.hot, split.rest, split.cost, split.damage) == (3, 1, 0, 28.0, 1.0)
    assert (0, 1, 1) not in [(o.n_hot, o.hot, o.rest) for o in kept]  # uniform W8: dominated by the split
    uniform = uniform_options(cost, damage)
    assert unsplit([split], [uniform], 32.0) == [uniform[1]]  # all-W8 fits: the same damage in one group
    assert unsplit([split], [uniform], 31.0) == [split]  # it does not: the split is what the budget buys
    lower = kept[-2]  # experts 0-1 at W8: no uniform option fits 28 bits with damage as low
    assert lower.n_hot == 2 and unsplit([lower], [uniform], 28.0) == [lower]


def test_joint_needs_measured_damage():
    prof = replace(_random_case(0, 2, 4), layer_damage=None)
    with pytest.raises(PlanError, match="plan.policy 'joint' needs per-layer damage"):
        plan_bits(prof, _modules(2, 4), _spec(4.75), 2)


@pytest.fixture(scope="module")
def reference(quant_cache):
    return resolve_model("builtin:reference-moe")  # 8 MoE layers x 32 experts, D 256, I 128: Marlin tiles it


def test_the_plugin_serves_a_split_plan_stock_vllm_refuses_it(reference):
    g = torch.Generator().manual_seed(1)
    sens = torch.rand(8, 32, generator=g, dtype=torch.float64) ** 4
    damage = {"w4g128": [12.0, 2.4, 3.7, 3.3, 3.4, 2.8, 2.5, 1.9], "w4g64": [10.8, 2.2, 3.5, 2.9, 2.9, 2.5, 2.3, 1.6],
              "w4g32": [9.5, 2.1, 3.2, 2.4, 2.6, 2.2, 1.9, 1.4], "w8g128": [0.6, 0.2, 0.1, 0.1, 0.1, 0.07, 0.04, 0.01]}
    prof = _profile(damage, sens)
    plan = plan_bits(prof, reference.modules, _spec(4.75, layer_group_sizes=(32, 64), target_runtime="vllm-quant"),
                     8)
    layers = expert_schemes_by_layer(plan)
    assert any(len(s) == 2 for s in layers.values()) and all(len(s) <= 2 for s in layers.values())
    assert problems_for(plan, reference, "vllm-quant", ("compressed-tensors",)) == []
    refused = problems_for(plan, reference, "vllm", ("compressed-tensors",))
    assert refused and "plan.policy joint splits" in refused[0] and "vllm-quant" in refused[0]
    assert problems_for(plan, reference, "sglang")
    # a budget that buys no split leaves every layer uniform: stock vLLM serves that plan
    floor = plan_bits(prof, reference.modules, _spec(4.0, layer_group_sizes=()), 8)
    assert all(s == {(4, 128)} for s in expert_schemes_by_layer(floor).values())
    assert problems_for(floor, reference, "vllm") == []
