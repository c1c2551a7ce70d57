"""The forecast's side of the algorithm seam: one cost model per registered algorithm, and a forecast that asks the
registered objects (the engine's algorithm, the forecast's cost) instead of testing an algorithm's name, so an
algorithm registered in both places is forecast without an edit to ``layer_costs`` or ``estimate``."""

import dataclasses

import pytest

from quant.errors import QuantError
from quant.forecast import estimate, layer_costs
from quant.forecast.algorithm_costs import AWQ_FACTOR, COSTS, SOLVE_FACTOR, AlgorithmCost, algorithm_cost
from quant.models import resolve_model
from quant.models.headers import dims
from quant.quantize.algorithms import ALGORITHMS, GPTQ
from quant.quantize.budgets import search_bytes, solve_bytes, sub_batch_cap
from quant.recipe import parse_recipe


def test_every_registered_algorithm_has_one_cost_model():
    assert list(COSTS) == list(ALGORITHMS)
    assert algorithm_cost("awq").working_set_factor == AWQ_FACTOR
    assert algorithm_cost("gptq").working_set_factor == algorithm_cost("rtn").working_set_factor == SOLVE_FACTOR


def test_an_algorithm_without_a_cost_model_names_the_known_ones():
    with pytest.raises(QuantError, match=r"no cost model for algorithm 'sparsegpt'; it knows rtn, gptq, awq$"):
        algorithm_cost("sparsegpt")


def test_awq_solves_only_the_linear_groups_reading_the_hidden_state():
    groups = ((64, 192), (128, 64), (64, 96))  # q/k/v read D=64, o reads heads x head_dim
    assert algorithm_cost("awq").solved_groups(groups, 64) == [(64, 192), (64, 96)]
    assert algorithm_cost("gptq").solved_groups(groups, 64) == list(groups)


class _Searching(GPTQ):
    """An algorithm registered for the test: GPTQ's statistics, AWQ-sized sub-batches."""

    name = "searching"
    sub_batch_bytes = staticmethod(search_bytes)


def test_a_registered_algorithm_is_forecast_from_its_registrations(monkeypatch):
    """Sub-batches sized by the engine algorithm's ``sub_batch_bytes``, the working set scaled by its cost model's
    factor, its solves timed by its cost model over the groups it solves, its ranks note printed: nothing keyed on
    the names ``gptq`` or ``awq``."""
    seen = []

    def seconds(layer, problems, run):
        seen.append(problems)
        return 123.0

    monkeypatch.setitem(ALGORITHMS, "searching", _Searching())
    monkeypatch.setitem(COSTS, "searching", AlgorithmCost(2.5, seconds, "searches shared out", hidden_inputs_only=True))
    src = resolve_model("builtin:deepseek-v3-tiny")
    recipe = parse_recipe({"name": "x"}, model="builtin:deepseek-v3-tiny", overrides=("quantize.algorithm=gptq",))
    plan, _ = estimate.plan_for(recipe, src)
    run = dataclasses.replace(layer_costs.workload_of(recipe, 1), algorithm="searching", solve_budget_gb=1e-5)
    d = dims(src.config_dict)
    layer = layer_costs.layer_shapes(src, plan, run.dtype_bytes, src.top_k)[min(src.moe_layers())]
    D, I = layer.expert_in
    largest = max(min(layer.n_experts, sub_batch_cap(o, i, 1e-5, search_bytes)) * search_bytes(o, i)
                  for o, i in ((2 * I, D), (D, I)))
    assert largest != max(min(layer.n_experts, sub_batch_cap(o, i, 1e-5, solve_bytes)) * solve_bytes(o, i)
                          for o, i in ((2 * I, D), (D, I)))  # the sizing tells the two apart
    assert layer_costs.quantize_memory(layer, run, d)["solve working set"] == pytest.approx(2.5 * largest)
    base = layer_costs.quantize_seconds(layer, dataclasses.replace(run, algorithm="gptq"), d)
    assert layer_costs.quantize_seconds(layer, run, d) > 123.0 > base
    solved = [(1, o, i) for i, o in layer.linear_groups if i == d.hidden]
    assert 0 < len(solved) < len(layer.linear_groups) and seen[0][-len(solved):] == solved
    searching = recipe.model_copy(update={"quantize": recipe.quantize.model_copy(update={"algorithm": "searching"})})
    text = estimate.render(estimate.forecast(searching, src, gpus=2), searching)
    assert "assumes: searches shared out, every rank holds the layer" in text
