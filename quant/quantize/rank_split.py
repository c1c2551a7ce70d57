"""How one layer's quantization is shared among ranks and put back together.

Experts are split into contiguous ranges (``dist.even_ranges``, decided before the calibration passes because
each rank accumulates only its experts' statistics); the layer's other modules, solved in groups that share an
input, go to ranks once their Hessians exist (``dist.assign``: longest estimated solve first onto the least
loaded rank, counting each rank's experts). Afterwards every rank's codes reach every rank
(``World.exchange_tensors``), other ranks' modules are dequantized into the local copy of the layer, and the
per-rank reports are merged. In a world of one there is nothing to share: the caller skips it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from quant.algos.grid import QuantizedWeight
from quant.models.layers import ExpertsView
from quant.parallel.world import World, assign
from quant.quantize.budgets import sub_batches
from quant.quantize.qstore import dequantize_2d
from quant.quantize.results import LayerReport, LayerResults
from quant.scheme import Scheme

# a solve group: (spec, the shared input's Hessian or None, the names of the linears solved together)
LinearGroup = tuple[Scheme, torch.Tensor | None, list[str]]


def solve_cost(n_out: int, n_in: int, batch: float = 1.0) -> float:
    """Rough GPTQ time of one ``[batch, out, in]`` solve: its column loop runs ``in`` steps whose cost is launch
    latency until the batch's rows (``batch * out``) are many tens of thousands."""
    return n_in * (1.0 + batch * n_out / 65536)


def expert_load(view: ExpertsView | None, experts: range, budget_gb: float) -> float:
    """Estimated solve time of ``experts`` (gate/up and down sub-batches at ``budget_gb``, the solve budget)."""
    if view is None or not experts:
        return 0.0
    return sum(solve_cost(w.shape[1], w.shape[2], len(sub)) for w in (view.gate_up, view.down)
               for sub in sub_batches(list(experts), w.shape[1], w.shape[2], budget_gb))


def my_linear_groups(groups: list[LinearGroup], linears: Mapping[str, nn.Linear], world: World,
                     expert_loads: list[float]) -> list[LinearGroup]:
    """The linear solve groups this rank solves: all of them in a world of one, else an assignment by estimated
    solve time on top of each rank's expert load (``expert_loads``, one per rank)."""
    if not world.distributed:
        return groups
    costs = [solve_cost(sum(linears[n].out_features for n in names), linears[names[0]].in_features)
             for _, _, names in groups]
    owner = assign(costs, expert_loads)
    return [g for g, r in zip(groups, owner, strict=True) if r == world.rank]


def share_results(results: LayerResults, modules: Mapping[str, Scheme], weights: Mapping[str, torch.Tensor],
                  world: World) -> None:
    """Every rank's codes on every rank (a world of several ranks): other ranks' planned ``modules`` go into
    ``results`` and, dequantized, into the layer's ``weights`` (canonical name -> the tensor the layer computes
    with); the report is merged."""
    mine = {}
    for name, qw in results.codes.items():
        mine[name + ".q"], mine[name + ".scale"] = qw.q, qw.scale
        if qw.zero is not None:
            mine[name + ".zero"] = qw.zero
    everything = world.exchange_tensors(mine)
    for name, spec in modules.items():
        if name in results.codes or name + ".q" not in everything:
            continue
        qw = QuantizedWeight(everything[name + ".q"], everything[name + ".scale"], everything.get(name + ".zero"),
                             spec)
        results.codes[name] = qw
        weights[name].copy_(dequantize_2d(qw).to(weights[name].device))
    merge_reports(results.report, world)


def merge_reports(r: LayerReport, world: World) -> None:
    """The layer's report from every rank's part: the worst error over ranks, every repair and fallback, the
    slowest rank's times and each rank's solve time."""
    parts = world.all_gather_object((r.worst_rel_error, r.worst_module, r.repairs, r.rtn_fallbacks,
                                     r.stats_seconds, r.solve_seconds))
    r.worst_rel_error, r.worst_module = max(parts, key=lambda p: p[0])[:2]
    r.repairs = [x for p in parts for x in p[2]]
    r.rtn_fallbacks = [x for p in parts for x in p[3]]
    r.stats_seconds, r.solve_seconds = max(p[4] for p in parts), max(p[5] for p in parts)
    r.rank_solve_seconds = [round(p[5], 3) for p in parts]
