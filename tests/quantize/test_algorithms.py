"""The algorithm seam: one registry of RTN, GPTQ and AWQ, each declaring its statistics and what sizes its
sub-batches, deciding when partial sums over ranks will do, driving a layer through a LayerJob and providing its
solver; the recipe offers the registry's keys (no module tests an algorithm's name: tests/test_plugin_names.py)."""

from typing import get_args

import pytest
import torch

from quant.algos.rtn import rtn
from quant.errors import QuantError
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.models.layers import layer_weights
from quant.parallel.world import World
from quant.quantize.algorithms import ALGORITHMS, algorithm
from quant.quantize.budgets import search_bytes, solve_bytes
from quant.quantize.layer_job import LayerJob
from quant.quantize.solvers import solve_gptq, solve_rtn
from quant.recipe import QuantizeSpec
from quant.scheme import Scheme


def test_registry_holds_one_object_per_algorithm_with_its_statistics_and_solver():
    assert list(ALGORITHMS) == ["rtn", "gptq", "awq"]
    assert all(algorithm(name).name == name for name in ALGORITHMS)
    rtn_, gptq, awq = (ALGORITHMS[n] for n in ("rtn", "gptq", "awq"))
    assert not rtn_.statistics.hessians and not rtn_.statistics.channel_means
    assert gptq.statistics.hessians and not gptq.statistics.replicated  # each rank its own experts'
    assert awq.statistics.hessians and awq.statistics.channel_means and awq.statistics.replicated
    assert gptq.solve is solve_gptq and rtn_.solve is solve_rtn and awq.solve is solve_rtn  # AWQ rounds the rest
    # the sizes their drivers cut sub-batches by: LayerJob.run_experts' solves, awq_layer's searches
    assert rtn_.sub_batch_bytes is solve_bytes and gptq.sub_batch_bytes is solve_bytes
    assert awq.sub_batch_bytes is search_bytes


def test_the_recipe_offers_the_registered_algorithms():
    assert get_args(QuantizeSpec.model_fields["algorithm"].annotation) == tuple(ALGORITHMS)


def test_an_unknown_algorithm_names_the_valid_ones():
    with pytest.raises(QuantError, match=r"^algorithm 'sparsegpt' is not available; choose one of rtn, gptq, awq$"):
        algorithm("sparsegpt")


@pytest.mark.parametrize("asked", [False, True])
def test_partial_sums_over_ranks_only_where_the_algorithm_allows(asked):
    """GPTQ takes reduced statistics only when every expert's Hessians fit one pass (chunked passes need the ordered
    relay); AWQ (every rank holds every expert's statistics) whenever asked; RTN has none."""
    rtn_, gptq, awq = (ALGORITHMS[n] for n in ("rtn", "gptq", "awq"))
    assert [gptq.reduces_statistics(asked, p) for p in (0, 1, 2)] == [asked, asked, False]
    assert [awq.reduces_statistics(asked, p) for p in (0, 1, 3)] == [asked] * 3
    assert not any(rtn_.reduces_statistics(asked, p) for p in (0, 1, 3))


def test_rtn_drives_a_layer_without_a_pass_and_records_plain_rounding():
    """RTN's layer: no calibration pass (nothing reads the activations), every planned module of the layer rounded
    to nearest as ``algos.rtn`` rounds it, the layer's weights replaced by their dequantized codes."""
    src = resolve_model("builtin:qwen3-moe-tiny")
    lw = Layerwise(src, "float32", "cpu", 2, world=World())
    spec = Scheme(4, 32, True)
    with lw.layer(0) as layer:
        originals = {n: w.clone() for n, w in layer_weights(src, layer, 0).items()}
        modules = {n: spec for n in originals}
        job = LayerJob(src, 0, layer, modules, QuantizeSpec(), World(), ALGORITHMS["rtn"].solve)
        ALGORITHMS["rtn"].run_layer(job, lw, torch.empty(0))  # RTN reads no activations
        after = layer_weights(src, layer, 0)
    assert set(job.results.codes) == set(modules)
    for name, w in originals.items():
        want = rtn(w[None], spec, w.dtype)
        got = job.results.codes[name]
        assert torch.equal(got.scale, want.scale[0]), name
        assert torch.equal(after[name], want.dequantize()[0]), name
    assert job.results.report.solve_seconds > 0 and job.results.report.stats_seconds == 0
