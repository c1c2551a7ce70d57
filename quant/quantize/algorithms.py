"""The quantization algorithms the engine runs, behind one protocol: ``ALGORITHMS = {"rtn", "gptq", "awq"}``.

An algorithm declares what statistics its layer needs (:class:`Statistics`), when it accepts partial sums added
over ranks instead of the ordered relay, what one element of its batched solves or searches is estimated to hold
(which sizes their sub-batches), drives one layer (statistics passes, then solves, through its
:class:`~quant.quantize.layer_job.LayerJob`) and provides the solver its batches go through. ``quant estimate``
reads the same declarations and decisions to forecast a run (its time and working-set models of each algorithm:
``quant.forecast.algorithm_costs``, under the same names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from quant.errors import QuantError
from quant.layerwise import Layerwise
from quant.quantize.awq_layer import run_awq
from quant.quantize.budgets import search_bytes, solve_bytes
from quant.quantize.gptq_layer import run_gptq
from quant.quantize.layer_job import LayerJob
from quant.quantize.solvers import Solver, solve_gptq, solve_rtn


@dataclass(frozen=True)
class Statistics:
    """What an algorithm accumulates from the calibration passes of a layer."""

    hessians: bool = False  # Σ x xᵀ of every planned module's input (per linear, per expert)
    channel_means: bool = False  # Σ |x| per input channel (AWQ's smoothing grid)
    replicated: bool = False  # every rank holds every expert's statistics (else each rank its own experts')


class Algorithm(Protocol):
    name: str
    statistics: Statistics
    solve: Solver

    def sub_batch_bytes(self, out_f: int, in_f: int) -> int:
        """One element's estimated working set in the algorithm's batched solves or searches of ``[out_f, in_f]``
        weights: what its driver sizes their sub-batches by (``budgets.sub_batches``)."""
        ...

    def reduces_statistics(self, asked: bool, expert_passes: int) -> bool:
        """Whether the layer's statistics are each rank's own batches summed over ranks, given that
        ``quantize.statistics`` asks for it (``budgets.reduce_asked``) and the planned experts' Hessians take
        ``expert_passes`` calibration passes (0: no planned experts)."""
        ...

    def run_layer(self, job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
        """Quantize ``job``'s planned modules, ``hidden`` (this rank's calibration activations) feeding the layer:
        this rank's share of the codes (and changed kept parameters) into ``job.results``."""
        ...


class RTN:
    """Round to nearest: no statistics, no calibration pass."""

    name = "rtn"
    statistics = Statistics()
    solve = staticmethod(solve_rtn)
    sub_batch_bytes = staticmethod(solve_bytes)  # LayerJob.run_experts' default

    def reduces_statistics(self, asked: bool, expert_passes: int) -> bool:
        return False

    def run_layer(self, job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
        with job.results.timed("solve_seconds", lw.device):
            job.run_linears({})
            job.run_experts(None)


class GPTQ:
    """GPTQ on Hessians (``quantize/gptq_layer``): each rank accumulates its own experts' Hessians, in expert chunks
    that fit the Hessian budget."""

    name = "gptq"
    statistics = Statistics(hessians=True)
    solve = staticmethod(solve_gptq)
    sub_batch_bytes = staticmethod(solve_bytes)

    def reduces_statistics(self, asked: bool, expert_passes: int) -> bool:
        """Reduced only when every expert's Hessians fit one pass: chunked passes need the ordered relay (each
        rank receives its experts' routed tokens in global batch order)."""
        return asked and expert_passes <= 1

    def run_layer(self, job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
        run_gptq(job, lw, hidden, self.reduces_statistics(job.reduce_asked(), job.expert_passes()))


class AWQ:
    """AWQ (``quantize/awq_layer``): searched smoothing factors folded into the model, then round to nearest. Every
    rank holds every expert's statistics (the shared gate/up search needs all experts); the searches are
    divided over ranks."""

    name = "awq"
    statistics = Statistics(hessians=True, channel_means=True, replicated=True)
    solve = staticmethod(solve_rtn)  # the modules no search covers are rounded to nearest
    sub_batch_bytes = staticmethod(search_bytes)  # awq_layer's search sub-batches

    def reduces_statistics(self, asked: bool, expert_passes: int) -> bool:
        return asked

    def run_layer(self, job: LayerJob, lw: Layerwise, hidden: torch.Tensor) -> None:
        reduced = self.reduces_statistics(job.reduce_asked(), job.expert_passes())
        with job.results.timed("solve_seconds", lw.device):
            job.results.params = run_awq(job, lw, hidden, reduced)


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (RTN(), GPTQ(), AWQ())}


def algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name`` (QuantError naming the valid ones otherwise)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise QuantError(f"algorithm '{name}' is not available; choose one of {', '.join(ALGORITHMS)}") from None
