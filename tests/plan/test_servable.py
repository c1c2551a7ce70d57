"""What vLLM/SGLang can serve: layer plans pass their runtime checks (group sizes included), a plan's predicted KL
from the profile's layer damage, and the best servable plan at a per-expert plan's size."""

import pytest
import torch

from quant.models import resolve_model
from quant.plan.bitplan import plan_bits
from quant.plan.layer_policy import storage_bits
from quant.plan.runtimes import problems_for
from quant.plan.servable import best_servable, expert_storage, predicted_kl, serving_summary
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from tests.conftest import expert_schemes_by_layer

L, E = 8, 32
DAMAGE = {"w4g128": [14.0, 3.0, 4.5, 3.4, 3.9, 3.2, 3.1, 2.1], "w4g64": [12.9, 2.9, 4.1, 3.1, 3.4, 2.9, 2.7, 1.8],
          "w4g32": [11.2, 2.8, 3.8, 2.8, 3.0, 2.7, 2.4, 1.5], "w8g128": [0.6, 0.1, 0.1, 0.1, 0.1, 0.05, 0.06, 0.01]}


@pytest.fixture(scope="module")
def source(quant_cache):
    return resolve_model("builtin:reference-moe")  # 8 MoE layers x 32 experts, D 256, I 128: groups 32..128 fit


def _profile(damage=DAMAGE) -> RoutingProfile:
    g = torch.Generator().manual_seed(0)
    counts = torch.rand(L, E, generator=g, dtype=torch.float64) * 100
    sens = torch.rand(L, E, generator=g, dtype=torch.float64)
    z = torch.zeros_like(counts)
    return RoutingProfile("fp", "m", list(range(L)), E, 4, 1000, [], counts, counts, z, z, z, sensitivity=sens,
                          layer_damage=None if damage is None else
                          {k: 1e-3 * torch.tensor(v, dtype=torch.float64) for k, v in damage.items()})


LAYER = dict(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=4.75)


def test_layer_plans_with_group_sizes_pass_vllm_and_sglang(source):
    plan = plan_bits(_profile(), source.modules, PlanSpec(**LAYER, layer_group_sizes=(32, 64)), L)
    layers = expert_schemes_by_layer(plan)
    assert len({s for v in layers.values() for s in v}) > 2 and all(len(v) == 1 for v in layers.values())
    assert problems_for(plan, source, "vllm") == [] and problems_for(plan, source, "sglang") == []
    assert problems_for(plan, source, "vllm", ("gptq",)) == []  # per-layer dynamic rules
    assert "one expert scheme" in problems_for(plan, source, "sglang", ("gptq",))[0]
    assert "one scheme" in problems_for(plan, source, "transformers")[0]
    per_expert = plan_bits(_profile(), source.modules, PlanSpec(top_fraction=0.2), L)
    assert "one quantization scheme to all experts" in problems_for(per_expert, source, "vllm")[0]


def test_a_group_size_vllm_kernels_lack_is_rejected(source):
    damage = dict(DAMAGE, w4g16=[0.5] * L)  # so cheap in damage that the knapsack takes it
    plan = plan_bits(_profile(damage), source.modules, PlanSpec(**LAYER, layer_group_sizes=(16,)), L)
    assert (4, 16) in set().union(*expert_schemes_by_layer(plan).values())
    assert "group size 32, 64 or 128" in problems_for(plan, source, "vllm")[0]


def test_equal_average_bits_with_the_per_expert_plan(source):
    prof = _profile()
    per_expert = plan_bits(prof, source.modules, PlanSpec(top_fraction=0.2), L)  # 6 of 32: 4.75 bits
    layer = plan_bits(prof, source.modules, PlanSpec(**LAYER, layer_group_sizes=(32, 64)), L)
    (pe_bits, n), (l_bits, _) = expert_storage(per_expert, source), expert_storage(layer, source)
    assert pe_bits / n == pytest.approx(4.75 + 16 / 128)
    smallest_step = n / L * (storage_bits(4, 64, 256) - storage_bits(4, 128, 256))  # one layer g128 -> g64, bits
    assert pe_bits - smallest_step < l_bits <= pe_bits


def test_predicted_kl_sums_layers_and_weights_mixed_layers_by_expert_error(source):
    prof = _profile()
    uniform = plan_bits(prof, source.modules, PlanSpec(policy="uniform", low_bits=4, high_bits=4), L)
    assert predicted_kl(uniform, source, prof) == pytest.approx(1e-3 * sum(DAMAGE["w4g128"]))
    per_expert = plan_bits(prof, source.modules, PlanSpec(top_fraction=0.2), L)
    share = prof.sensitivity / prof.sensitivity.sum(dim=1, keepdim=True)
    want = 0.0
    for layer in range(L):
        for e in range(E):
            s = "w8g128" if per_expert.modules[f"layers.{layer}.experts.{e}.up"].bits == 8 else "w4g128"
            want += share[layer, e].item() * 1e-3 * DAMAGE[s][layer]
    assert predicted_kl(per_expert, source, prof) == pytest.approx(want)
    g16 = plan_bits(prof, source.modules, PlanSpec(policy="uniform", low_bits=4, high_bits=4, group_size=16), L)
    assert predicted_kl(g16, source, prof) is None  # w4g16 was not measured


def test_best_servable_alternative_of_a_per_expert_plan(source):
    prof = _profile()
    per_expert = plan_bits(prof, source.modules, PlanSpec(top_fraction=0.2), L)
    alt = best_servable(per_expert, source, prof)
    layer = plan_bits(prof, source.modules, PlanSpec(**LAYER, layer_group_sizes=(32, 64)), L)
    assert {int(k): v for k, v in alt["layers"].items()} == {
        i: "w{}g{}".format(*next(iter(s))) for i, s in expert_schemes_by_layer(layer).items()}
    assert alt["predicted_kl"] == pytest.approx(predicted_kl(layer, source, prof))
    assert alt["expert_storage_bits"] <= 4.75 + 16 / 128 + 1e-12
    summary = serving_summary(per_expert, source, prof, ("compressed-tensors",))
    assert summary["problems"]["vllm"] and summary["best_servable"] == alt and summary["damage_measured"]
    assert summary["predicted_kl"] == pytest.approx(predicted_kl(per_expert, source, prof))
    bare = _profile(damage=None)
    summary = serving_summary(per_expert, source, bare, ("compressed-tensors",))
    assert summary["best_servable"] is None and summary["predicted_kl"] is None and not summary["damage_measured"]


def test_quants_vllm_plugin_serves_per_expert_plans_vllm_refuses(source):
    """``vllm-quant``: vLLM with quant's plugin. Experts of one layer may differ, within what the Marlin MoE kernel
    runs (4 and 8 bits, 8 bits symmetric, groups 32/64/128, widths it tiles); from the compressed-tensors export."""
    from quant.plan.runtimes import PLUGIN_NEEDS_CT

    per_expert = plan_bits(_profile(), source.modules, PlanSpec(top_fraction=0.2), L)
    assert problems_for(per_expert, source, "vllm")  # stock vLLM: one scheme per fused layer
    assert problems_for(per_expert, source, "vllm-quant") == []
    assert problems_for(per_expert, source, "vllm-quant", ("compressed-tensors", "gptq")) == []
    assert problems_for(per_expert, source, "vllm-quant", ("gptq",)) == [PLUGIN_NEEDS_CT]
    asym8 = plan_bits(_profile(), source.modules, PlanSpec(top_fraction=0.2, symmetric=False), L)
    assert "symmetric int8" in problems_for(asym8, source, "vllm-quant")[0]
    per_layer = plan_bits(_profile(), source.modules, PlanSpec(**LAYER, layer_group_sizes=(32, 64)), L)
    assert problems_for(per_layer, source, "vllm-quant") == problems_for(per_layer, source, "vllm") == []


def test_the_plugin_refuses_widths_its_kernel_cannot_tile(quant_cache):
    tiny = resolve_model("builtin:qwen3-moe-tiny")  # hidden 64: below the Marlin MoE tile
    counts = torch.ones(tiny.n_layers, 16, dtype=torch.float64)
    counts[:, :3] = 10.0
    z = torch.zeros_like(counts)
    prof = RoutingProfile("fp", "m", list(range(tiny.n_layers)), 16, 4, 1000, [], counts, counts, z, z, z)
    plan = plan_bits(prof, tiny.modules, PlanSpec(top_fraction=0.2, group_size=32), tiny.n_layers)
    assert "hidden size 64" in problems_for(plan, tiny, "vllm-quant")[0]


@pytest.mark.parametrize("runtime, bits, group, symmetric, hidden, inter, served", [
    ("vllm", 4, 32, True, 64, 32, True),  # Marlin cannot (hidden 64): vLLM's Triton MoE kernel takes it
    ("vllm", 8, 32, True, 64, 32, True),
    ("vllm", 4, 32, False, 64, 32, False),  # the Triton fallback takes symmetric experts only
    ("vllm", 4, 64, True, 64, 64, False),  # per channel (group = hidden) off Marlin: not group-wise
    ("vllm", 4, 128, True, 2048, 768, True),  # Qwen3-30B-A3B
    ("vllm", 4, 128, False, 7168, 2048, True),  # DeepSeek-V3, zero points on Marlin
    ("sglang", 4, 32, True, 64, 32, False),  # Marlin MoE only: hidden ÷ 128, intermediate ÷ 64
    ("sglang", 4, 32, True, 128, 32, False),
    ("sglang", 4, 64, True, 128, 64, True),
    ("sglang", 8, 128, True, 2048, 768, True),
    ("vllm-quant", 4, 32, True, 64, 32, False),  # a mixed layer runs on Marlin MoE
    ("vllm-quant", 8, 128, True, 7168, 2048, True),
])
def test_the_moe_kernels_width_rules(runtime, bits, group, symmetric, hidden, inter, served):
    from quant.plan.runtimes import moe_width_problem

    assert (moe_width_problem(runtime, bits, group, symmetric, hidden, inter) is None) == served


def _tiny_layer_plan(tiny):
    counts = torch.ones(tiny.n_layers, 16, dtype=torch.float64)
    z = torch.zeros_like(counts)
    damage = {k: 1e-3 * torch.tensor([v] * tiny.n_layers, dtype=torch.float64)
              for k, v in (("w4g32", 3.0), ("w4g64", 3.5), ("w8g32", 0.1))}
    prof = RoutingProfile("fp", "m", list(range(tiny.n_layers)), 16, 4, 1000, [], counts, counts, z, z, z,
                          layer_damage=damage)
    return prof, plan_bits(prof, tiny.modules, PlanSpec(**dict(LAYER, budget_avg_bits=5.0), group_size=32),
                           tiny.n_layers)


def test_every_claim_about_a_narrow_model_goes_through_the_width_rules(quant_cache):
    """builtin:qwen3-moe-tiny (hidden 64, expert intermediate 32): a per-layer plan was claimed servable by SGLang,
    whose Marlin MoE kernel cannot tile it; vLLM falls back to its Triton MoE kernel for symmetric experts only. The
    plan's serving summary, and the best plan it names, follow the same rules."""
    tiny = resolve_model("builtin:qwen3-moe-tiny")
    prof, plan = _tiny_layer_plan(tiny)
    assert problems_for(plan, tiny, "vllm") == [] and problems_for(plan, tiny, "vllm-quant") == []
    assert "hidden size a multiple of 128" in problems_for(plan, tiny, "sglang")[0]
    summary = serving_summary(plan, tiny, prof, ("compressed-tensors",))
    assert summary["problems"]["sglang"] and summary["best_servable"]["runtimes"] == ["vllm"]
    asym = plan_bits(prof, tiny.modules, PlanSpec(policy="uniform", low_bits=4, high_bits=4, group_size=32,
                                                  symmetric=False), tiny.n_layers)
    assert "Triton MoE kernel" in problems_for(asym, tiny, "vllm")[0]

