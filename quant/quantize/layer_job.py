"""One materialized decoder layer's planned modules, solved as batched problems.

A :class:`LayerJob` knows what to quantize in the layer (its planned modules and their specs), how the work is
split (this rank's experts, the Hessian passes, the linear groups) and solves batches with the algorithm's solver;
what the solves produce goes to its :class:`~quant.quantize.results.LayerResults`. The algorithm's layer driver
(``quant.quantize.algorithms``) decides which statistics feed the solves.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import nn

from quant.diag.hostsync import on_device
from quant.models import ModelSource
from quant.models.layers import ExpertsView, experts_of, layer_weights, linears_of
from quant.parallel.world import World, even_ranges
from quant.quantize.budgets import expert_chunks, expert_hessian_bytes, reduce_asked, sub_batches
from quant.quantize.hessians import ExpertStats, LinearStats
from quant.quantize.rank_split import LinearGroup, expert_load, my_linear_groups, share_results
from quant.quantize.results import LayerResults, Rows
from quant.quantize.solvers import Solver, solve_rtn
from quant.recipe import QuantizeSpec
from quant.scheme import Scheme


class LayerJob:
    """Quantizes the planned modules (``modules``: canonical name -> spec, of any layer) of decoder layer ``idx``,
    materialized as ``layer``, with ``solver``; this rank's share in ``world``."""

    def __init__(self, source: ModelSource, idx: int, layer: nn.Module, modules: Mapping[str, Scheme],
                 spec: QuantizeSpec, world: World, solver: Solver):
        self.source, self.idx, self.layer, self.spec, self.world, self.solver = source, idx, layer, spec, world, solver
        prefix = f"layers.{idx}."
        self.modules: dict[str, Scheme] = {n: s for n, s in modules.items() if n.startswith(prefix)}
        self.linears: dict[str, nn.Linear] = {n: m for n, m in linears_of(source, layer, idx).items()
                                              if n in self.modules}
        self.view: ExpertsView | None = experts_of(source, layer, idx)
        self.results = LayerResults(idx)
        n_experts = self.view.n_experts if self.has_experts() else 0
        self.ranges: list[range] = even_ranges(n_experts, world.size)  # each rank's experts

    def experts_planned(self) -> dict[str, Scheme]:
        return {n: s for n, s in self.modules.items() if ".experts." in n}

    def has_experts(self) -> bool:
        """Whether the layer has routed experts and some of them are planned."""
        return self.view is not None and bool(self.experts_planned())

    def expert_chunks(self, experts: range) -> list[tuple[int, int]]:
        """(first, count) ranges of ``experts`` whose fp32 Hessians fit ``hessian_budget_gb`` (one pass each)."""
        v = self.view
        per_expert = expert_hessian_bytes(v.gate_up.shape[2], v.intermediate)
        return expert_chunks(experts, v.n_experts, per_expert, self.spec.hessian_budget_gb)

    def expert_passes(self) -> int:
        """Calibration passes the planned experts' Hessians take (0 without planned experts)."""
        return len(self.expert_chunks(range(self.view.n_experts))) if self.has_experts() else 0

    def reduce_asked(self) -> bool:
        """Whether ``quantize.statistics`` asks for partial sums added over ranks (``budgets.reduce_asked``)."""
        return reduce_asked(self.spec.statistics, self.world.size, self.world.backend)

    def solve(self, w: torch.Tensor, H: torch.Tensor | None, spec: Scheme, rows: Rows,
              solver: Solver | None = None) -> torch.Tensor:
        """Quantize a ``[B, out, in]`` batch whose element ``b`` holds the modules ``rows[b]`` (name, row slice):
        GPTQ treats rows independently given H, so modules sharing an input are solved as one problem.
        Records every module's codes; returns the dequantized batch."""
        qw, repairs, diverged = (solver or self.solver)(w, H, spec, w.dtype, self.spec)
        self.results.report.repairs += [f"{', '.join(n for n, _ in rows[b])}: {why}" for b, why in repairs]
        return self.results.record(qw, rows, w, diverged)

    def run_linears(self, lin_stats: Mapping[str, LinearStats], skip: set[str] = frozenset()) -> None:
        """Linears with identical input statistics (q/k/v, shared gate/up) and one spec are solved together."""
        groups: list[LinearGroup] = []
        for name in self.linears:
            if name in skip:
                continue
            spec, H = self.modules[name], lin_stats[name].hessian() if lin_stats else None
            for g_spec, g_H, names in groups:
                same_input = H is not None and g_H is not None and g_H.shape == H.shape and torch.equal(g_H, H)
                if g_spec == spec and same_input:
                    names.append(name)
                    break
            else:
                groups.append((spec, H, [name]))
        loads = [expert_load(self.view, r, self.spec.solve_budget_gb) for r in self.ranges]
        for spec, H, names in my_linear_groups(groups, self.linears, self.world, loads):
            mods = [self.linears[n] for n in names]
            w = torch.cat([m.weight.data for m in mods], dim=0)[None]
            bounds = list(itertools.accumulate((m.out_features for m in mods), initial=0))
            rows = [[(n, slice(bounds[i], bounds[i + 1])) for i, n in enumerate(names)]]
            deq = self.solve(w, None if H is None else H[None], spec, rows)[0]
            for i, m in enumerate(mods):
                m.weight.data.copy_(deq[bounds[i] : bounds[i + 1]])

    def expert_groups(self, first: int, count: int, counts: torch.Tensor | None) -> dict[tuple, list[int]]:
        """(projection, spec, RTN fallback) -> experts; gate and up of one spec form one 'gate_up' problem."""
        planned = self.experts_planned()
        groups: dict[tuple, list[int]] = {}
        host = None if counts is None else counts.tolist()  # one read, not one per expert
        for e in range(first, first + count):
            p = {proj: planned.get(f"layers.{self.idx}.experts.{e}.{proj}") for proj in ("gate", "up", "down")}
            few = host is not None and host[e - first] < max(self.spec.min_tokens, 1)
            fused = p["gate"] is not None and p["up"] is not None and p["gate"] == p["up"]
            for proj, spec in (("gate_up", p["gate"]),) if fused else (("gate", p["gate"]), ("up", p["up"])):
                if spec is not None:
                    groups.setdefault((proj, spec, few), []).append(e)
            if p["down"] is not None:
                groups.setdefault(("down", p["down"], few), []).append(e)
        return groups

    def run_experts(self, exp_stats: ExpertStats | None) -> None:
        """Quantize the planned experts (this rank's, or the chunk ``exp_stats`` covers), as ``[E', out, in]``
        batches."""
        if not self.experts_planned():
            return
        v = self.view
        I = v.intermediate
        mine = self.ranges[self.world.rank]
        first, count = (exp_stats.first, exp_stats.count) if exp_stats is not None else (mine.start, len(mine))
        H_gu, H_down = exp_stats.hessians() if exp_stats is not None else (None, None)
        counts = exp_stats.counts if exp_stats is not None else None
        views = {"gate_up": (v.gate_up.data, H_gu), "gate": (v.gate_up.data[:, :I], H_gu),
                 "up": (v.gate_up.data[:, I:], H_gu), "down": (v.down.data, H_down)}
        for (proj, spec, fallback), experts in self.expert_groups(first, count, counts).items():
            weights, H = views[proj]
            for sub in sub_batches(experts, weights.shape[1], weights.shape[2], self.spec.solve_budget_gb):
                local = None if H is None or fallback else H[on_device([e - first for e in sub], H.device)]
                self._solve_experts(proj, weights, local, spec, sub, fallback, I)

    def _solve_experts(self, proj: str, weights: torch.Tensor, H: torch.Tensor | None, spec: Scheme,
                       experts: list[int], fallback: bool, I: int) -> None:
        """``H`` is already indexed to ``experts`` (None for RTN or the token-floor fallback)."""
        splits = [("gate", slice(0, I)), ("up", slice(I, 2 * I))] if proj == "gate_up" else [(proj, slice(None))]
        rows = [[(f"layers.{self.idx}.experts.{e}.{p}", r) for p, r in splits] for e in experts]
        sel = on_device(experts, weights.device)
        if fallback:
            self.results.report.rtn_fallbacks += [name for parts in rows for name, _ in parts]
        weights[sel] = self.solve(weights[sel], H, spec, rows, solver=solve_rtn if fallback else None)

    def share(self) -> None:
        """With several ranks: every rank's codes on every rank and in this rank's layer (``rank_split``)."""
        if self.world.distributed:
            share_results(self.results, self.modules, layer_weights(self.source, self.layer, self.idx), self.world)
