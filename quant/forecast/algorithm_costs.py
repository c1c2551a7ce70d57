"""What each algorithm's solves cost in ``quant estimate``, registered under the engine's names (``COSTS``: the keys
of ``quant.quantize.algorithms.ALGORITHMS``): the memory they allocate beyond their estimated working set, the linear
groups they solve with statistics, their time, and how a run on several GPUs divides them.

What the engine decides stays with the engine's algorithm (its statistics, when it sums them over ranks, what one
element of a sub-batch holds: ``Algorithm.sub_batch_bytes``); here is what only the forecast knows: allocation
factors fit to measured peaks and the time models of ``quant.forecast.throughputs``. A problem is one sub-batch,
``(elements, out_features, in_features)``; ``run`` is the forecast's ``layer_costs.Workload``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quant.errors import QuantError
from quant.forecast.throughputs import THROUGHPUTS, awq_search_seconds, gptq_solve_seconds

Problem = tuple[int, int, int]  # (elements, out_features, in_features) of one sub-batch

SOLVE_FACTOR = 1.4  # allocated / sub_batches' estimate, fit to the fused solve's Qwen3-30B-A3B GPTQ peak (10.6 GB)
# allocated / search_bytes at the peak of a trial (rows, x / s, x Wᵀ, Q(W · s), y, y - x Wᵀ and its square), counted
# from smooth's code (DeepSeek-V3 gate/up 1.13, down 1.22) with room for the quantizer's temporaries; the measured
# peaks it forecasts: Qwen3-30B-A3B 10.7 GB (8.7 measured), DeepSeek-V3 58.2 GB (54.1)
AWQ_FACTOR = 1.4


@dataclass(frozen=True)
class AlgorithmCost:
    """One algorithm in the forecast: ``solve_seconds(layer, problems, run)`` is the time of a layer's solves
    (``layer``: a ``layer_costs.LayerShape``), ``ranks`` what a run on several GPUs divides, as ``quant estimate``
    says it."""

    working_set_factor: float  # allocated bytes / the sub-batch's estimate (Algorithm.sub_batch_bytes) at its peak
    solve_seconds: Callable[[Any, list[Problem], Any], float]
    ranks: str
    hidden_inputs_only: bool = False  # solves only the linear groups that read the hidden state, rounds the others

    def solved_groups(self, groups: tuple[tuple[int, int], ...], hidden: int) -> list[tuple[int, int]]:
        """The ``(in_features, out_features)`` linear groups whose solves take statistics."""
        return [g for g in groups if not self.hidden_inputs_only or g[0] == hidden]


def _rounding_seconds(layer, problems: list[Problem], run) -> float:
    """Round to nearest: the layer's weights at the measured rounding rate (no statistics, no solves)."""
    return layer.weight_bytes / THROUGHPUTS["rtn_bytes_per_s"]


def _gptq_seconds(layer, problems: list[Problem], run) -> float:
    """GPTQ's column solves at the engine's kernel (``run.solve_kernel``); the busiest rank solves its experts' and
    every linear group."""
    return gptq_solve_seconds(problems, run.solve_kernel)


def _awq_seconds(layer, problems: list[Problem], run) -> float:
    """AWQ's grid searches (``run.awq_grid`` points), each rank searching its share."""
    return awq_search_seconds(problems, run.awq_grid) / run.gpus


EXPERTS_DIVIDED = "experts divided over ranks"
COSTS: dict[str, AlgorithmCost] = {
    "rtn": AlgorithmCost(SOLVE_FACTOR, _rounding_seconds, EXPERTS_DIVIDED),
    "gptq": AlgorithmCost(SOLVE_FACTOR, _gptq_seconds, EXPERTS_DIVIDED),
    # AWQ searches the groups reading the hidden state (attention or dense MLP inputs: their s folds into a norm;
    # counted also for a shared expert, which reuses the experts' s) and rounds the rest
    "awq": AlgorithmCost(AWQ_FACTOR, _awq_seconds,
                         "AWQ searches divided over ranks, its statistics replicated on every rank",
                         hidden_inputs_only=True),
}


def algorithm_cost(name: str) -> AlgorithmCost:
    """The forecast's cost of algorithm ``name`` (QuantError naming the ones it knows otherwise)."""
    try:
        return COSTS[name]
    except KeyError:
        raise QuantError(f"quant estimate has no cost model for algorithm '{name}'; it knows "
                         f"{', '.join(COSTS)}") from None
