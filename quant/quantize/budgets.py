"""How a layer's work is cut to fit its memory budgets, and whether its statistics are summed over ranks.

Plain functions of shapes, budgets and the world's size: the engine decides with them, and ``quant estimate``
forecasts with the same functions (``quant.forecast.estimate``), so a forecast cannot drift from what a run does.

- Expert Hessians come in passes of as many experts as fit ``quantize.hessian_budget_gb`` (:func:`expert_chunks`).
- Batched solves and searches come in equal sub-batches whose working set fits ``quantize.solve_budget_gb``
  (:func:`sub_batches`, at most :func:`sub_batch_cap` elements each, sized by :func:`solve_bytes` for GPTQ and RTN,
  :func:`search_bytes` for AWQ).
- ``quantize.statistics`` asks for partial sums added over ranks (:func:`reduce_asked`); an algorithm takes the
  offer when its statistics allow it (``quant.quantize.algorithms``).
"""

from __future__ import annotations

from collections.abc import Callable

GB = 1e9  # the budgets' gigabyte


def expert_hessian_bytes(hidden: int, intermediate: int) -> int:
    """fp32 Hessians of one expert: gate/up share ``[D, D]``, down ``[I, I]``."""
    return 4 * (hidden**2 + intermediate**2)


def expert_chunks(experts: range, n_experts: int, per_expert_bytes: int,
                  budget_gb: float) -> list[tuple[int, int]]:
    """(first, count) ranges of ``experts`` (of a layer's ``n_experts``) whose Hessians (``per_expert_bytes`` each)
    fit ``budget_gb``: one calibration pass each. At least one expert a pass, whatever the budget."""
    count = max(1, min(n_experts, int(budget_gb * GB) // per_expert_bytes))
    return [(f, min(count, experts.stop - f)) for f in range(experts.start, experts.stop, count)]


def reduce_asked(mode: str, n_ranks: int, backend: str | None) -> bool:
    """Whether ``quantize.statistics`` (``mode``) asks each rank to sum its own batches, the sums then added over
    ranks: ``reduce``, or ``auto`` on NCCL (GPUs, where the solves' sub-batches already make codes differ at
    rounding level between world sizes); never in a world of one. ``ordered`` (and ``auto`` on gloo, CPUs) relays
    each batch to its consumers in global batch order: the one-process sums bit for bit."""
    return n_ranks > 1 and (mode == "reduce" or (mode == "auto" and backend == "nccl"))


def solve_bytes(out_f: int, in_f: int) -> int:
    """One expert's estimated fp32 solve working set (weights + ~3 Hessian-sized buffers)."""
    return 4 * (2 * out_f * in_f + 3 * in_f * in_f)


def search_bytes(out_f: int, in_f: int) -> int:
    """One element's estimated fp32 AWQ search working set: the rows and ``x / s`` ``2 I²``, ``Q(W · s)`` ``O I``,
    and ``x Wᵀ``, ``y`` and their difference ``3 I O``."""
    return 4 * (2 * in_f * in_f + out_f * in_f + 3 * in_f * out_f)


def sub_batch_cap(out_f: int, in_f: int, budget_gb: float,
                  per_expert: Callable[[int, int], int] = solve_bytes) -> int:
    """The most elements one solve takes: as many as their working set (``per_expert(out_f, in_f)`` each) fits
    ``budget_gb``, at least one."""
    return max(1, int(budget_gb * GB) // per_expert(out_f, in_f))


def sub_batches(experts: list[int], out_f: int, in_f: int, budget_gb: float,
                per_expert: Callable[[int, int], int] = solve_bytes) -> list[list[int]]:
    """Split a batch into equal parts of at most :func:`sub_batch_cap` elements (one solve's fp32 working set,
    ``per_expert(out_f, in_f)`` each, GPTQ's ``solve_bytes`` by default, fits the budget)."""
    cap = sub_batch_cap(out_f, in_f, budget_gb, per_expert)
    n = -(-len(experts) // -(-len(experts) // cap)) if experts else 1
    return [experts[i : i + n] for i in range(0, len(experts), n)]
