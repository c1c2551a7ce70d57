"""quant estimate's per-layer costs take the engine's own decisions: on a real layer, the forecast's Hessian passes
and its choice of reduced statistics are the ones the layer's job makes."""

import pytest

from quant.forecast import estimate, layer_costs
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.parallel.world import World
from quant.quantize.algorithms import ALGORITHMS
from quant.quantize.layer_job import LayerJob
from quant.quantize.solvers import solve_gptq
from quant.recipe import QuantizeSpec, parse_recipe


@pytest.mark.parametrize("hessian_budget_gb", [0.00001, 0.00006, 1.0])
def test_the_forecast_takes_the_engines_expert_passes(hessian_budget_gb):
    """On a real MoE layer the forecast's Hessian passes (their expert counts) are the ones the layer's job makes,
    and so is its choice between reduced and ordered statistics (GPTQ on 2 GPUs, where auto means reduce)."""
    src = resolve_model("builtin:deepseek-v3-tiny")
    recipe = parse_recipe({"name": "x"}, model="builtin:deepseek-v3-tiny", overrides=(
        "quantize.algorithm=gptq", f"quantize.hessian_budget_gb={hessian_budget_gb:f}"))
    plan, _ = estimate.plan_for(recipe, src)
    work = layer_costs.workload_of(recipe, 1)
    layer_idx = min(src.moe_layers())
    shape = layer_costs.layer_shapes(src, plan, work.dtype_bytes, src.top_k)[layer_idx]
    lw = Layerwise(src, "float32", "cpu", 2, world=World())
    with lw.layer(layer_idx) as layer:
        job = LayerJob(src, layer_idx, layer, plan.quantized_schemes(), recipe.quantize, World(), solve_gptq)
        engine_passes = [count for _, count in job.expert_chunks(range(job.view.n_experts))]
        two_ranks = LayerJob(src, layer_idx, layer, plan.quantized_schemes(), QuantizeSpec(
            algorithm="gptq", hessian_budget_gb=hessian_budget_gb, statistics="reduce"), World(0, 2), solve_gptq)
        engine_reduced = ALGORITHMS["gptq"].reduces_statistics(two_ranks.reduce_asked(), two_ranks.expert_passes())
    assert layer_costs.expert_pass_sizes(shape, work) == engine_passes
    assert layer_costs.statistics_reduced(shape, layer_costs.workload_of(recipe, 2)) == engine_reduced
    assert len(engine_passes) > 1 or hessian_budget_gb == 1.0
