"""Policies on hand-made profiles: boundaries, ties, budgets, projections, protections."""

from dataclasses import replace

import pytest
import torch

from quant.errors import PlanError
from quant.models import ModuleInfo
from quant.plan.bitplan import BitPlan, Headline, plan_bits
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec

E, LAYERS = 10, [0, 1, 2]


def _profile(counts, mass=None, sens=None) -> RoutingProfile:
    counts = torch.tensor(counts, dtype=torch.float64)
    z = torch.zeros_like(counts)
    return RoutingProfile("fp", "m", LAYERS[: counts.shape[0]], counts.shape[1], 2, int(counts.sum()), [],
                          counts, counts if mass is None else torch.tensor(mass, dtype=torch.float64), z, z,
                          z if sens is None else z, sensitivity=None if sens is None else torch.tensor(sens, dtype=torch.float64))


def _modules(n_layers=3, n_experts=E, attn=True) -> dict[str, ModuleInfo]:
    out = {}
    for L in range(n_layers):
        if attn:
            for p in ("q", "k", "v", "o"):
                out[f"layers.{L}.attn.{p}"] = ModuleInfo(f"layers.{L}.attn.{p}", f"model.layers.{L}.self_attn.{p}_proj",
                                                         "attn", L, None, 64, 64)
        out[f"layers.{L}.router"] = ModuleInfo(f"layers.{L}.router", f"model.layers.{L}.mlp.gate", "router", L, None, n_experts, 64)
        for e in range(n_experts):
            for p, (o, i) in {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}.items():
                n = f"layers.{L}.experts.{e}.{p}"
                out[n] = ModuleInfo(n, f"model.layers.{L}.mlp.experts.{e}.{p}_proj", "expert", L, e, o, i)
    return out


def _high(plan: BitPlan, layer: int) -> set[int]:
    return {e for e in range(E) if plan.modules[f"layers.{layer}.experts.{e}.up"].bits == 8}


def _spec(**kw) -> PlanSpec:
    return PlanSpec(group_size=32, **kw)


def test_top_fraction_per_layer_picks_most_used():
    counts = [[10, 50, 3, 40, 0, 1, 2, 5, 6, 7], [1] * 9 + [100], list(range(10))]
    plan = plan_bits(_profile(counts), _modules(), _spec(top_fraction=0.2), 3)
    assert _high(plan, 0) == {1, 3}
    assert _high(plan, 1) == {9, 0}  # tie among the 1s goes to the lowest index
    assert _high(plan, 2) == {8, 9}
    assert all(plan.modules[f"layers.0.experts.1.{p}"].bits == 8 for p in ("gate", "up", "down"))
    assert plan.modules["layers.0.experts.4.down"].bits == 4


def test_fraction_boundaries():
    counts = [list(range(10))] * 3
    for frac, n in [(0.1, 1), (0.2, 2), (0.25, 2), (0.35, 4), (1.0, 10)]:
        plan = plan_bits(_profile(counts), _modules(), _spec(top_fraction=frac), 3)
        assert len(_high(plan, 0)) == n, frac


def test_global_ranking_uses_shares():
    counts = [[100] + [0] * 9, [10] * 10, [10] * 10]  # layer 0: one expert takes all traffic
    plan = plan_bits(_profile(counts), _modules(), _spec(top_fraction=0.1, ranking="global"), 3)
    total = sum(len(_high(plan, L)) for L in range(3))
    assert total == 3 and 0 in _high(plan, 0)


def test_inverse_and_random_controls():
    counts = [list(range(10))] * 3
    inv = plan_bits(_profile(counts), _modules(), _spec(policy="inverse"), 3)
    assert _high(inv, 0) == {0, 1}
    r1 = plan_bits(_profile(counts), _modules(), _spec(policy="random", seed=3), 3)
    r2 = plan_bits(_profile(counts), _modules(), _spec(policy="random", seed=3), 3)
    r3 = plan_bits(_profile(counts), _modules(), _spec(policy="random", seed=4), 3)
    assert [_high(r1, L) for L in range(3)] == [_high(r2, L) for L in range(3)]
    assert [_high(r1, L) for L in range(3)] != [_high(r3, L) for L in range(3)]
    assert all(len(_high(r1, L)) == 2 for L in range(3))


def _avg_expert_bits(plan: BitPlan, mods) -> float:
    num = sum(plan.modules[n].bits * m.numel for n, m in mods.items() if m.kind == "expert")
    return num / sum(m.numel for m in mods.values() if m.kind == "expert")


@pytest.mark.parametrize("target", [4.3, 4.8, 5.5, 7.9])
def test_budget_met_within_one_expert(target):
    counts = torch.rand(3, E, generator=torch.Generator().manual_seed(0)).mul(100).tolist()
    mods = _modules()
    plan = plan_bits(_profile(counts), mods, _spec(policy="budget", budget_avg_bits=target), 3)
    avg = _avg_expert_bits(plan, mods)
    one_expert = 4 * (2 * 32 * 64 + 64 * 32) / sum(m.numel for m in mods.values() if m.kind == "expert")
    assert target - one_expert - 1e-9 <= avg <= target + 1e-9


def test_budget_prefers_high_scores():
    counts = [[1000, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10, [1] * 10]
    plan = plan_bits(_profile(counts), _modules(), _spec(policy="budget", budget_avg_bits=4.14), 3)
    assert _high(plan, 0) == {0}


def test_per_layer_projection_keeps_budget():
    counts = [[50, 40] + [1] * 8, [10] * 10, [30, 30, 30] + [1] * 7]
    mods = _modules()
    per_expert = plan_bits(_profile(counts), mods, _spec(top_fraction=0.3, ranking="global"), 3)
    per_layer = plan_bits(_profile(counts), mods, _spec(top_fraction=0.3, ranking="global", granularity="per_layer"),
                          3)
    assert _avg_expert_bits(per_layer, mods) == pytest.approx(_avg_expert_bits(per_expert, mods), abs=4 / 3 / 2 + 1e-9)
    for L in range(3):
        assert len(_high(per_layer, L)) in (0, E)  # whole layers
    assert len(_high(per_layer, 2)) == E  # the layer whose top experts carry the most traffic


def test_protections_win_over_scores():
    counts = [list(range(10))] * 3
    spec = _spec(protect={"attention": "keep", "first_layers": 1, "edge_layer_bits": 8})
    plan = plan_bits(_profile(counts), _modules(), spec, 3)
    assert plan.modules["layers.1.attn.q"].keep and plan.modules["layers.0.router"].keep
    assert _high(plan, 0) == set(range(10))  # first layer fully protected
    assert _high(plan, 1) == {8, 9}


def test_super_experts_protected():
    counts = [list(range(1, 11))] * 3
    absmax = torch.ones(3, E)
    absmax[1, 4] = 500.0
    prof = replace(_profile(counts), down_out_absmax=absmax)
    plan = plan_bits(prof, _modules(), _spec(protect={"super_experts": "keep"}), 3)
    assert plan.modules["layers.1.experts.4.down"].keep
    assert not plan.modules["layers.1.experts.5.down"].keep


def test_sensitivity_policy_needs_scores_and_uses_them():
    counts = [list(range(10))] * 3
    with pytest.raises(PlanError, match="sensitivity"):
        plan_bits(_profile(counts), _modules(), _spec(policy="sensitivity"), 3)
    sens = [[0, 0, 0, 9, 0, 0, 0, 0, 8, 0]] * 3
    plan = plan_bits(_profile(counts, sens=sens), _modules(), _spec(policy="sensitivity"), 3)
    assert _high(plan, 0) == {3, 8}


def test_group_size_must_divide_in_features():
    mods = _modules()
    mods["layers.0.experts.0.down"] = ModuleInfo("layers.0.experts.0.down", "x", "expert", 0, 0, 64, 48)
    with pytest.raises(PlanError, match="not divisible by plan.group_size"):
        plan_bits(_profile([list(range(10))] * 3), mods, _spec(), 3)


def test_group_size_fits_every_projection_of_an_expert():
    """A 128 request on experts whose down projection is 32 wide: gate/up/down all get 32 (one scheme per expert
    and per fused MoE layer), not 64/64/32; attention keeps its own fit (64)."""
    plan = plan_bits(_profile([list(range(10))] * 3), _modules(), PlanSpec(group_size=128), 3)
    for L in range(3):
        groups = {plan.modules[f"layers.{L}.experts.{e}.{p}"].group_size for e in range(E) for p in ("gate", "up", "down")}
        assert groups == {32}
    assert plan.modules["layers.0.attn.q"].group_size == 64
    assert "128" in plan.group_rule and "experts of one MoE layer" in plan.group_rule


def test_gptq_export_gives_each_block_one_group_size():
    """With GPTQ export an attention block (one dynamic rule) shares one group size across different widths."""
    mods = _modules()
    mods["layers.0.attn.o"] = ModuleInfo("layers.0.attn.o", "model.layers.0.self_attn.o_proj", "attn", 0, None, 64, 16)
    ct = plan_bits(_profile([list(range(10))] * 3), mods, PlanSpec(group_size=128), 3)
    assert ct.modules["layers.0.attn.q"].group_size == 64 and ct.modules["layers.0.attn.o"].group_size == 16
    both = plan_bits(_profile([list(range(10))] * 3), mods, PlanSpec(group_size=128), 3,
                     ("compressed-tensors", "gptq"))
    assert {both.modules[f"layers.0.attn.{p}"].group_size for p in ("q", "k", "v", "o")} == {16}
    assert both.modules["layers.1.attn.q"].group_size == 64


def test_group_size_per_channel_and_kept_modules():
    mods = _modules()
    plan = plan_bits(_profile([list(range(10))] * 3), mods, PlanSpec(group_size=-1), 3)
    assert plan.modules["layers.0.experts.0.up"].group_size == 64 and plan.modules["layers.0.experts.0.down"].group_size == 32
    # a kept module's width never blocks a plan
    mods["layers.0.attn.o"] = ModuleInfo("layers.0.attn.o", "model.layers.0.self_attn.o_proj", "attn", 0, None, 64, 200)
    kept = plan_bits(_profile([list(range(10))] * 3), mods, PlanSpec(group_size=64, protect={"attention": "keep"}), 3)
    assert kept.modules["layers.0.attn.o"].keep


def test_plan_roundtrip(tmp_path):
    plan = plan_bits(_profile([list(range(10))] * 3), _modules(), _spec(), 3)
    assert plan.headline is None  # the plan stage adds it
    headline = Headline(avg_bits_experts=4.8, avg_bits_all=6.1, size_gb=0.0012, expert_pct_by_bits={4: 80.0, 8: 20.0},
                        traffic_share_by_bits={4: 0.35, 8: 0.65}, traffic_weighted_bits=6.6)
    plan = replace(plan, headline=headline, serving={"predicted_kl": 0.01})
    plan.save(tmp_path / "plan.json")
    again = BitPlan.load(tmp_path / "plan.json")
    assert again == plan and again.headline.expert_pct_by_bits == {4: 80.0, 8: 20.0}  # int keys back from JSON
    assert again.group_rule == plan.group_rule != ""


def test_budget_gb_below_every_expert_at_low_bits_is_refused():
    counts = [[1] * E] * 3
    expert_gb = sum(m.numel for m in _modules().values() if m.kind == "expert") * 4 / 8e9
    with pytest.raises(PlanError, match="plan.budget_gb .* is below the size of every expert at 4 bits"):
        plan_bits(_profile(counts), _modules(), _spec(policy="budget", budget_gb=expert_gb * 0.9), 3)
    plan = plan_bits(_profile(counts), _modules(), _spec(policy="budget", budget_gb=expert_gb * 1.01), 3)
    assert _avg_expert_bits(plan, _modules()) == 4.0


def test_layer_schemes_pin_every_expert_of_a_layer_whatever_the_policy():
    counts = [list(range(10))] * 3
    spec = PlanSpec(group_size=32, layer_schemes={"0": "w8g32", "2": "w4g32"})
    plan = plan_bits(_profile(counts), _modules(), spec, 3)
    for e in range(E):
        for p in ("gate", "up", "down"):
            assert (plan.modules[f"layers.0.experts.{e}.{p}"].bits, plan.modules[f"layers.0.experts.{e}.{p}"].group_size) == (8, 32)
            assert (plan.modules[f"layers.2.experts.{e}.{p}"].bits, plan.modules[f"layers.2.experts.{e}.{p}"].group_size) == (4, 32)
    assert _high(plan, 1) == {8, 9}  # the policy decides the layers not pinned (top 20 % at 8 bits)
    assert plan.modules["layers.0.attn.q"].bits == 8  # protection rules still decide attention


def test_layer_schemes_must_name_moe_layers_and_schemes():
    counts = [list(range(10))] * 3
    with pytest.raises(PlanError, match="layer 5, which has no routed experts"):
        plan_bits(_profile(counts), _modules(), PlanSpec(group_size=32, layer_schemes={"5": "w4g32"}), 3)
    for bad in ({"0": "w4"}, {"0": "w5g32"}, {"-1": "w4g32"}, {"x": "w4g32"}, {"0": "w4g48"}):
        with pytest.raises(ValueError, match="layer_schemes"):
            PlanSpec(group_size=32, layer_schemes=bad)
