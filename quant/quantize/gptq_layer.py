"""GPTQ on one decoder layer: calibration passes that accumulate Hessians, each followed by the solves they feed.

The planned experts' Hessians come in chunks that fit ``quantize.hessian_budget_gb`` (one calibration pass
each, :meth:`LayerJob.expert_chunks`); the linears' Hessians are taken in the first pass and solved last. With
several ranks each rank accumulates its own experts' Hessians from every rank's batches, in global batch order
(``quant.parallel.relay``), so every Hessian is the one a single process computes; or, when ``quantize.statistics``
asks for it and every expert fits one pass, each rank sums its own batches and the sums are added over ranks once.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from quant.layerwise import Layerwise
from quant.models.layers import ExpertsView
from quant.parallel.relay import Relay
from quant.quantize.hessians import ExpertStats, close_linear_stats, linear_stats
from quant.quantize.layer_job import LayerJob

log = logging.getLogger(__name__)


def _unused(view: ExpertsView | None):
    """The routed experts skip their computation in a statistics pass (its layer output is discarded; the expert
    statistics compute what they need from the routed tokens themselves)."""
    return view.outputs_unused() if view is not None else contextlib.nullcontext()


def run_gptq(job: LayerJob, lw: Layerwise, hidden: torch.Tensor, reduced: bool) -> None:
    """Hessians of ``job``'s planned modules from ``hidden`` through its layer, then their solves: summed over
    ranks once (``reduced``) or relayed in global batch order, one pass per expert chunk."""
    if reduced:
        _run_reduced(job, lw, hidden)
    else:
        _run_ordered(job, lw, hidden)


def _run_ordered(job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
    """Calibration passes with the original weights feeding each expert chunk; linears solved last.

    Solving a chunk changes only those experts, which neither feed the next chunk's gate/up input (the
    post-attention norm output) nor its down input (its own gate/up), so later passes stay exact. Every rank
    makes as many passes as the rank with the most chunks (they run in lockstep). A pass's layer output is
    discarded, so the routed experts skip their computation in it (``ExpertsView.outputs_unused``).
    """
    world, q, timed = job.world, job.spec, job.results.timed
    relay = Relay(world)
    lin_stats = linear_stats(job.linears, relay)  # every rank: the solve groups are shared out afterwards
    chunks = [job.expert_chunks(r) if job.has_experts() else [] for r in job.ranges]
    for i in range(max(1, *map(len, chunks))):
        relay = relay if i == 0 else Relay(world)
        chunk_of = [c[i] if i < len(c) else (0, 0) for c in chunks]
        consumers = {r for r, (_, count) in enumerate(chunk_of) if count}
        exp_stats = None
        if consumers:
            first, count = chunk_of[world.rank]
            exp_stats = ExpertStats(job.view, q.gate_weighted, q.all_experts, first, count, relay=relay,
                                    consumers=consumers)
        with timed("stats_seconds", lw.device), _unused(job.view):
            lw.run(job.layer, hidden, after_step=relay.flush)
            if exp_stats is not None:
                exp_stats.remove()  # the last batch's sums are added here
        if i == 0:
            close_linear_stats(lin_stats, world)
        if exp_stats is not None:
            if exp_stats.count:
                with timed("solve_seconds", lw.device):
                    job.run_experts(exp_stats)
            del exp_stats
    with timed("solve_seconds", lw.device):
        job.run_linears(lin_stats)


def _run_reduced(job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
    """One calibration pass over this rank's own batches for every statistic, summed over ranks once."""
    world, q, timed = job.world, job.spec, job.results.timed
    log.info("layer %d: statistics of each rank's own batches, summed over %d ranks", job.idx, world.size)
    relay = Relay(world, local=True)
    lin_stats = linear_stats(job.linears, relay)
    exp_stats = (ExpertStats(job.view, q.gate_weighted, q.all_experts, relay=relay) if job.has_experts() else None)
    with timed("stats_seconds", lw.device), _unused(job.view):
        lw.run(job.layer, hidden)
        close_linear_stats(lin_stats, world)
        if exp_stats is not None:
            exp_stats.remove()  # the ranks' sums added
            mine = job.ranges[world.rank]
            exp_stats.restrict(mine.start, len(mine))
    with timed("solve_seconds", lw.device):
        if exp_stats is not None and exp_stats.count:
            job.run_experts(exp_stats)
        del exp_stats
        job.run_linears(lin_stats)
