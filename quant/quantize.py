"""Apply a BitPlan layer by layer: statistics -> algorithm -> codes written, weights replaced, inputs propagated.

For each decoder layer: load it (layerwise), run the calibration activations through it with hooks that
accumulate Hessians (GPTQ), quantize every planned module — experts of one projection and one spec as a single
``[E, out, in]`` problem — write the codes to ``quantized/layer_XXXXX.safetensors``, put the dequantized
weights into the layer and propagate the activations through the *quantized* layer, so later layers calibrate
on what they will see at inference. A layer whose file exists is not recomputed (resume after a crash).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quant.algos.grid import QuantizedWeight, QuantSpec
from quant.algos.rtn import rtn
from quant.calibration import CalibrationSet
from quant.errors import QuantError
from quant.hessians import ExpertStats, LinearStats
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.layers import ExpertsView, experts_of, linears_of
from quant.plan import BitPlan, ModulePlan
from quant.qstore import dequantize_2d, layer_file, read_layer, split_batch, write_layer
from quant.recipe import QuantizeSpec

log = logging.getLogger(__name__)
PROJ_ROWS = {"gate": (0, 1), "up": (1, 2)}  # halves of gate_up_proj [E, 2I, D]


def _solve_rtn(w, H, spec, scale_dtype, q: QuantizeSpec) -> tuple[QuantizedWeight, list[str]]:
    return rtn(w, spec, scale_dtype), []


def _solve_gptq(w, H, spec, scale_dtype, q: QuantizeSpec) -> tuple[QuantizedWeight, list[str]]:
    from quant.algos.gptq import gptq

    res = gptq(w, H, spec, scale_dtype, dampening=q.dampening, block_size=q.block_size, act_order=q.act_order)
    return res.weight, [f"batch element {b}: {why}" for b, why in res.repairs]


ALGORITHMS = {"rtn": _solve_rtn, "gptq": _solve_gptq}
NEEDS_HESSIAN = {"rtn": False, "gptq": True}


@dataclass
class LayerReport:
    layer: int
    n_modules: int = 0
    n_experts: int = 0
    mean_bits: float = 0.0
    worst_rel_error: float = 0.0
    worst_module: str = ""
    seconds: float = 0.0
    rtn_fallbacks: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    resumed: bool = False


def _spec_of(p: ModulePlan) -> QuantSpec:
    return QuantSpec(p.bits, p.group_size, p.symmetric)


def _rel_error(w: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``[B]`` relative Frobenius error of a batch."""
    d = qw.dequantize().float() - w.float()
    return d.flatten(1).norm(dim=1) / w.float().flatten(1).norm(dim=1).clamp_min(1e-12)


class _LayerJob:
    """Quantizes the planned modules of one materialized layer."""

    def __init__(self, source: ModelSource, plan: BitPlan, spec: QuantizeSpec, idx: int, layer: nn.Module):
        self.plan, self.spec, self.idx, self.layer = plan, spec, idx, layer
        prefix = f"layers.{idx}."
        self.mods = {n: p for n, p in plan.quantized().items() if n.startswith(prefix)}
        self.linears = {n: m for n, m in linears_of(source, layer, idx).items() if n in self.mods}
        self.view: ExpertsView | None = experts_of(layer)
        self.results: dict[str, QuantizedWeight] = {}
        self.report = LayerReport(idx)

    def experts_planned(self) -> dict[str, ModulePlan]:
        return {n: p for n, p in self.mods.items() if ".experts." in n}

    def collect(self, lw: Layerwise, hidden: torch.Tensor) -> tuple[dict, ExpertStats | None]:
        """One pass with the original weights, accumulating Hessians (outputs discarded)."""
        lin_stats = {n: LinearStats(m) for n, m in self.linears.items()}
        exp_stats = None
        if self.view is not None and self.experts_planned():
            exp_stats = ExpertStats(self.view, self.spec.gate_weighted, self.spec.all_experts)
        lw.run(self.layer, hidden)
        for s in lin_stats.values():
            s.handle.remove()
        if exp_stats is not None:
            exp_stats.remove()
        return lin_stats, exp_stats

    def solve(self, w: torch.Tensor, H: torch.Tensor | None, spec: QuantSpec, names: list[str]) -> torch.Tensor:
        """Quantize a ``[B, out, in]`` batch; record results; return the dequantized batch."""
        solver = ALGORITHMS[self.plan.algorithm]
        qw, repairs = solver(w, H, spec, w.dtype, self.spec)
        self.report.repairs += [f"{names[0]}…: {r}" for r in repairs]
        errs = _rel_error(w, qw)
        worst = int(errs.argmax())
        if errs[worst].item() >= self.report.worst_rel_error:
            self.report.worst_rel_error, self.report.worst_module = errs[worst].item(), names[worst]
        self.results.update(zip(names, split_batch(qw), strict=True))
        return qw.dequantize()

    def run_linears(self, lin_stats: dict) -> None:
        for name, mod in self.linears.items():
            H = lin_stats[name].hessian()[None] if lin_stats else None
            deq = self.solve(mod.weight.data[None], H, _spec_of(self.mods[name]), [name])
            mod.weight.data.copy_(deq[0])

    def run_experts(self, exp_stats: ExpertStats | None) -> None:
        planned = self.experts_planned()
        if not planned:
            return
        v = self.view
        I = v.intermediate
        H_gu, H_down = exp_stats.hessians() if exp_stats is not None else (None, None)
        counts = exp_stats.counts if exp_stats is not None else None
        for proj in ("gate", "up", "down"):
            if proj == "down":
                weights, H = v.down.data, H_down
            else:
                lo, hi = PROJ_ROWS[proj]
                weights, H = v.gate_up.data[:, lo * I : hi * I], H_gu
            groups: dict[tuple, list[int]] = {}
            for e in range(v.n_experts):
                p = planned.get(f"layers.{self.idx}.experts.{e}.{proj}")
                if p is None:
                    continue
                fallback = H is not None and counts is not None and int(counts[e]) < max(self.spec.min_tokens, 1)
                groups.setdefault((_spec_of(p), fallback), []).append(e)
            for (spec, fallback), experts in groups.items():
                self._solve_experts(proj, weights, H, spec, experts, fallback)
        self.report.n_experts = len({n.split(".")[3] for n in planned})

    def _solve_experts(self, proj, weights, H, spec, experts, fallback) -> None:
        names = [f"layers.{self.idx}.experts.{e}.{proj}" for e in experts]
        sel = torch.tensor(experts, device=weights.device)
        if fallback:
            self.report.rtn_fallbacks += names
            qw, _ = _solve_rtn(weights[sel], None, spec, weights.dtype, self.spec)
            self.results.update(zip(names, split_batch(qw), strict=True))
            weights[sel] = qw.dequantize()
            return
        weights[sel] = self.solve(weights[sel], None if H is None else H[sel], spec, names)

    def finish_report(self, seconds: float) -> LayerReport:
        r = self.report
        r.n_modules = len(self.results)
        numel = {n: q.q.numel() for n, q in self.results.items()}
        total = sum(numel.values())
        r.mean_bits = sum(self.results[n].spec.bits * k for n, k in numel.items()) / max(total, 1)
        r.seconds = seconds
        return r


def _apply_stored(job: _LayerJob, stored: dict[str, QuantizedWeight]) -> None:
    """Put previously stored dequantized weights into the layer (resume path)."""
    I = job.view.intermediate if job.view is not None else 0
    for name, qw in stored.items():
        deq = dequantize_2d(qw)
        if name in job.linears:
            job.linears[name].weight.data.copy_(deq)
            continue
        e, proj = int(name.split(".")[3]), name.split(".")[4]
        if proj == "down":
            job.view.down.data[e].copy_(deq)
        else:
            lo, hi = PROJ_ROWS[proj]
            job.view.gate_up.data[e, lo * I : hi * I].copy_(deq)
    job.results = stored
    missing = set(job.mods) - set(stored)
    if missing:
        raise QuantError(f"stored layer {job.idx} lacks {sorted(missing)[:3]}; remove it and rerun with --force quantize")


def quantize_model(source: ModelSource, calib: CalibrationSet, plan: BitPlan, spec: QuantizeSpec,
                   lw: Layerwise, out_dir: Path) -> list[LayerReport]:
    """Quantize every layer into ``out_dir`` (existing complete layer files are reused)."""
    if plan.algorithm not in ALGORITHMS:
        raise QuantError(f"algorithm '{plan.algorithm}' is not available; choose one of {', '.join(ALGORITHMS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden = lw.embed(calib.tokens)
    reports = []
    for idx in range(source.n_layers):
        t0 = time.perf_counter()
        with lw.layer(idx) as layer:
            job = _LayerJob(source, plan, spec, idx, layer)
            path = layer_file(out_dir, idx)
            if path.is_file():
                _apply_stored(job, read_layer(path, lw.device))
                job.report.resumed = True
            else:
                lin_stats, exp_stats = job.collect(lw, hidden) if NEEDS_HESSIAN[plan.algorithm] else ({}, None)
                job.run_linears(lin_stats)
                job.run_experts(exp_stats)
                write_layer(path, job.results)
            hidden = lw.forward(layer, hidden, out=hidden)
        report = job.finish_report(time.perf_counter() - t0)
        reports.append(report)
        log.info("layer %d: %d modules (%d experts), mean %.2f bits, worst rel err %.4f (%s), %.2fs%s",
                 idx, report.n_modules, report.n_experts, report.mean_bits, report.worst_rel_error,
                 report.worst_module, report.seconds, " (resumed)" if report.resumed else "")
    (out_dir / "layers.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return reports
