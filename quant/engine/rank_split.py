"""How one layer's quantization is shared among ranks and put back together.

Experts are split into contiguous ranges (``dist.even_ranges``, decided before the calibration passes because
each rank accumulates only its experts' statistics); the layer's other modules, solved in groups that share an
input, go to ranks once their Hessians exist (``dist.assign``: longest estimated solve first onto the least
loaded rank, counting each rank's experts). Afterwards every rank's codes reach every rank
(``World.exchange_tensors``), other ranks' modules are dequantized into the local copy of the layer, and the
per-rank reports are merged. In a world of one every function here is the identity.
"""

from __future__ import annotations

from collections.abc import Callable

from quant.algos.grid import QuantizedWeight, QuantSpec
from quant.dist.world import assign
from quant.engine.qstore import dequantize_2d
from quant.models.layers import layer_weights


def solve_cost(n_out: int, n_in: int, batch: float = 1.0) -> float:
    """Rough GPTQ time of one ``[batch, out, in]`` solve: its column loop runs ``in`` steps whose cost is launch
    latency until the batch's rows (``batch * out``) are many tens of thousands."""
    return n_in * (1.0 + batch * n_out / 65536)


def solve_bytes(out_f: int, in_f: int) -> int:
    """One expert's estimated fp32 solve working set (weights + ~3 Hessian-sized buffers); quant estimate uses it."""
    return 4 * (2 * out_f * in_f + 3 * in_f * in_f)


def sub_batches(experts: list[int], out_f: int, in_f: int, budget_gb: float,
                per_expert: Callable[[int, int], int] = solve_bytes) -> list[list[int]]:
    """Split a batch into equal parts so one solve's fp32 working set (``per_expert(out_f, in_f)`` each, GPTQ's
    ``solve_bytes`` by default) fits the budget."""
    cap = max(1, int(budget_gb * 1e9) // per_expert(out_f, in_f))
    n = -(-len(experts) // -(-len(experts) // cap)) if experts else 1
    return [experts[i : i + n] for i in range(0, len(experts), n)]


def expert_load(job, experts: range) -> float:
    """Estimated solve time of ``experts`` (gate/up and down sub-batches at ``solve_budget_gb``)."""
    budget = job.spec.solve_budget_gb
    return sum(solve_cost(w.shape[1], w.shape[2], len(sub)) for w in (job.view.gate_up, job.view.down)
               for sub in sub_batches(list(experts), w.shape[1], w.shape[2], budget)) if experts else 0.0


def my_linear_groups(job, groups: list) -> list:
    """The linear solve groups ``(spec, H, names)`` this rank solves: all of them in a world of one, else an
    assignment by estimated solve time on top of each rank's expert load."""
    if not job.world.distributed:
        return groups
    costs = [solve_cost(sum(job.linears[n].out_features for n in names), job.linears[names[0]].in_features)
             for _, _, names in groups]
    owner = assign(costs, [expert_load(job, r) for r in job.ranges])
    return [g for g, r in zip(groups, owner, strict=True) if r == job.world.rank]


def share_results(job) -> None:
    """Every rank's codes on every rank; other ranks' modules are dequantized into this rank's layer, and the
    layer's report merged."""
    if not job.world.distributed:
        return
    mine = {}
    for name, qw in job.results.items():
        mine[name + ".q"], mine[name + ".scale"] = qw.q, qw.scale
        if qw.zero is not None:
            mine[name + ".zero"] = qw.zero
    everything = job.world.exchange_tensors(mine)
    weights = layer_weights(job.source, job.layer, job.idx)
    for name, p in job.mods.items():
        if name in job.results or name + ".q" not in everything:
            continue
        qw = QuantizedWeight(everything[name + ".q"], everything[name + ".scale"], everything.get(name + ".zero"),
                             QuantSpec(p.bits, p.group_size, p.symmetric))
        job.results[name] = qw
        weights[name].copy_(dequantize_2d(qw).to(weights[name].device))
    merge_reports(job.report, job.world)


def merge_reports(r, world) -> None:
    """The layer's report from every rank's part: the worst error over ranks, every repair and fallback, the
    slowest rank's times and each rank's solve time."""
    parts = world.all_gather_object((r.worst_rel_error, r.worst_module, r.repairs, r.rtn_fallbacks,
                                     r.stats_seconds, r.solve_seconds))
    r.worst_rel_error, r.worst_module = max(parts, key=lambda p: p[0])[:2]
    r.repairs = [x for p in parts for x in p[2]]
    r.rtn_fallbacks = [x for p in parts for x in p[3]]
    r.stats_seconds, r.solve_seconds = max(p[4] for p in parts), max(p[5] for p in parts)
    r.rank_solve_seconds = [round(p[5], 3) for p in parts]
