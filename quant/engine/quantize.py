"""Apply a BitPlan layer by layer: statistics -> algorithm -> codes written, weights replaced, inputs propagated.

For each decoder layer: load it (layerwise), run the calibration activations through it with hooks that
accumulate Hessians (GPTQ), quantize every planned module — experts of one projection and one spec as a single
``[E, out, in]`` problem — write the codes to ``quantized/layer_XXXXX.safetensors``, put the dequantized
weights into the layer and propagate the activations through the *quantized* layer, so later layers calibrate
on what they will see at inference. A layer whose file exists is not recomputed (resume after a crash).

With several ranks (``lw.world``) each rank owns a contiguous range of a layer's experts, and the layer's other
modules (solved in groups that share an input) go to ranks by estimated solve time (``dist.assign``, longest
first onto the least-loaded rank). Calibration batches run data-parallel and ``quant.dist.relay`` hands each owner its
experts' routed tokens (and every rank the other modules' inputs) in global batch order, so every Hessian, and
so every code, is the one a single process computes. Owners exchange codes (``World.exchange_tensors``), every
rank puts the dequantized layer together and propagates its own batches; only the writer writes the layer file.
With ``quantize.statistics: reduce`` each rank instead sums its own batches and the sums are all-reduced once a
layer. AWQ: every rank holds every expert's statistics (every batch in order, or its own batches summed over ranks
after each pass), searches and quantizes its own experts (the shared gate/up search's error tables are gathered in
expert order before the pick), and the codes are exchanged as GPTQ's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quant.algos.gptq import diverged_message
from quant.algos.grid import QuantizedWeight, QuantSpec
from quant.algos.rtn import rtn
from quant.calibration import CalibrationSet
from quant.diag.hostsync import on_device
from quant.dist.relay import Relay
from quant.dist.world import SINGLE, World, even_ranges
from quant.engine.awq_layer import run_awq
from quant.engine.hessians import ExpertStats, close_linear_stats, linear_stats
from quant.engine.layerwise import Layerwise
from quant.engine.qstore import (
    LayerWriter,
    codes_numel,
    layer_file,
    load_into_layer,
    pack_codes,
    packs,
    read_report,
)
from quant.engine.rank_split import my_linear_groups, share_results, sub_batches
from quant.errors import NumericalError, QuantError
from quant.models import ModelSource
from quant.models.layers import ExpertsView, experts_of, linears_of
from quant.plan.bitplan import BitPlan, ModulePlan
from quant.progress import step
from quant.recipe import QuantizeSpec

log = logging.getLogger(__name__)


# A solver: (w, H, spec, scale dtype, QuantizeSpec) -> (weight, repairs [(batch index, why)], diverged [B] or None:
# a flag tensor the caller reads with its own checks)
Solved = tuple[QuantizedWeight, list[tuple[int, str]], torch.Tensor | None]


def _solve_rtn(w, H, spec, scale_dtype, q: QuantizeSpec) -> Solved:
    return rtn(w, spec, scale_dtype), [], None


def _solve_gptq(w, H, spec, scale_dtype, q: QuantizeSpec) -> Solved:
    from quant.algos.gptq import gptq

    res = gptq(w, H, spec, scale_dtype, dampening=q.dampening, block_size=q.block_size, act_order=q.act_order,
               with_loss=False, check_diverged=False)
    return res.weight, list(res.repairs), res.diverged


ALGORITHMS = {"rtn": _solve_rtn, "gptq": _solve_gptq, "awq": _solve_rtn}  # awq: smooth.run_awq, then RTN
NEEDS_HESSIAN = {"rtn": False, "gptq": True, "awq": True}


@dataclass
class LayerReport:
    """One layer's quantize record. ``mean_bits``: code bits per weight over the layer's quantized weights (all
    kinds, weighted by size). ``worst_rel_error``: the largest relative weight error ``‖Ŵ − W‖ / ‖W‖`` over the
    layer's quantized modules (``worst_module``), every kind and every algorithm alike, ``W`` being the full-precision
    weight the codes store (AWQ's: after its smoothing scales). A weight error, not an output error: GPTQ trades a
    larger one for a smaller output error."""

    layer: int
    n_modules: int = 0
    n_experts: int = 0
    mean_bits: float = 0.0
    worst_rel_error: float = 0.0
    worst_module: str = ""
    seconds: float = 0.0
    load_seconds: float = 0.0
    stats_seconds: float = 0.0
    solve_seconds: float = 0.0
    forward_seconds: float = 0.0
    rtn_fallbacks: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    resumed: bool = False
    rank_solve_seconds: list[float] = field(default_factory=list)  # several ranks: each rank's solve time


@contextlib.contextmanager
def _timed(report: LayerReport, field_name: str, device: torch.device):
    """Add the block's wall time (after a device sync) to ``report.<field_name>``; under torch.profiler the block
    is a range named ``quant.<field_name>`` (its host and device totals per phase)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"quant.{field_name}"):
        yield
    sync()
    setattr(report, field_name, getattr(report, field_name) + time.perf_counter() - t0)


def _unused(view: ExpertsView | None):
    """The routed experts skip their computation in a statistics pass (its layer output is discarded; the expert
    statistics compute what they need from the routed tokens themselves)."""
    return view.outputs_unused() if view is not None else contextlib.nullcontext()


def expert_hessian_bytes(hidden: int, intermediate: int) -> int:
    """fp32 Hessians of one expert: gate/up share ``[D, D]``, down ``[I, I]``."""
    return 4 * (hidden**2 + intermediate**2)


def _spec_of(p: ModulePlan) -> QuantSpec:
    return QuantSpec(p.bits, p.group_size, p.symmetric)


class _LayerJob:
    """Quantizes the planned modules of one materialized layer."""

    def __init__(self, source: ModelSource, plan: BitPlan, spec: QuantizeSpec, idx: int, layer: nn.Module,
                 world: World = SINGLE):
        self.source, self.plan, self.spec, self.idx, self.layer, self.world = source, plan, spec, idx, layer, world
        self.params: dict[str, torch.Tensor] = {}
        prefix = f"layers.{idx}."
        self.mods = {n: p for n, p in plan.quantized().items() if n.startswith(prefix)}
        self.linears = {n: m for n, m in linears_of(source, layer, idx).items() if n in self.mods}
        self.view: ExpertsView | None = experts_of(source, layer, idx)
        self.results: dict[str, QuantizedWeight] = {}
        self.report = LayerReport(idx)
        n_experts = self.view.n_experts if self.view is not None and self.experts_planned() else 0
        self.ranges = even_ranges(n_experts, world.size)

    def experts_planned(self) -> dict[str, ModulePlan]:
        return {n: p for n, p in self.mods.items() if ".experts." in n}

    def expert_chunks(self, experts: range) -> list[tuple[int, int]]:
        """(first, count) ranges of ``experts`` whose fp32 Hessians fit ``hessian_budget_gb`` (one pass each)."""
        v = self.view
        per_expert = expert_hessian_bytes(v.gate_up.shape[2], v.intermediate)
        count = max(1, min(v.n_experts, int(self.spec.hessian_budget_gb * 1e9) // per_expert))
        return [(f, min(count, experts.stop - f)) for f in range(experts.start, experts.stop, count)]

    def run_with_statistics(self, lw: Layerwise, hidden: torch.Tensor) -> None:
        """Calibration passes with the original weights feeding each expert chunk; linears solved last.

        Solving a chunk changes only those experts, which neither feed the next chunk's gate/up input (the
        post-attention norm output) nor its down input (its own gate/up), so later passes stay exact. Every rank
        makes as many passes as the rank with the most chunks (they run in lockstep). A pass's layer output is
        discarded, so the routed experts skip their computation in it (``ExpertsView.outputs_unused``).
        """
        has_experts = self.view is not None and bool(self.experts_planned())
        if self.reduces_statistics(has_experts):
            self._run_reduced(lw, hidden, has_experts)
            return
        relay = Relay(self.world)
        lin_stats = linear_stats(self.linears, relay)  # every rank: the solve groups are shared out afterwards
        chunks = [self.expert_chunks(r) if has_experts else [] for r in self.ranges]
        for i in range(max(1, *map(len, chunks))):
            relay = relay if i == 0 else Relay(self.world)
            chunk_of = [c[i] if i < len(c) else (0, 0) for c in chunks]
            consumers = {r for r, (_, count) in enumerate(chunk_of) if count}
            exp_stats = None
            if consumers:
                first, count = chunk_of[self.world.rank]
                exp_stats = ExpertStats(self.view, self.spec.gate_weighted, self.spec.all_experts, first, count,
                                        relay=relay, consumers=consumers)
            with _timed(self.report, "stats_seconds", lw.device), _unused(self.view):
                lw.run(self.layer, hidden, after_step=relay.flush)
                if exp_stats is not None:
                    exp_stats.remove()  # the last batch's sums are added here
            if i == 0:
                close_linear_stats(lin_stats, self.world)
            if exp_stats is not None:
                if exp_stats.count:
                    with _timed(self.report, "solve_seconds", lw.device):
                        self.run_experts(exp_stats)
                del exp_stats
        with _timed(self.report, "solve_seconds", lw.device):
            self.run_linears(lin_stats)

    def reduces_statistics(self, has_experts: bool) -> bool:
        """``quantize.statistics``: ``reduce`` (each rank sums its own batches, one all-reduce per layer; no
        activations move between ranks) when every expert's Hessians fit one pass (``hessian_budget_gb``), else the
        ``ordered`` relay (each rank receives its experts' routed tokens in global batch order: the one-process
        sums bit for bit). ``auto``: reduce on GPUs (NCCL), where the solves' sub-batches already make codes differ
        at rounding level between world sizes, ordered on CPUs (gloo)."""
        if not self.reduce_asked():
            return False
        return not has_experts or len(self.expert_chunks(range(self.view.n_experts))) == 1

    def reduce_asked(self) -> bool:
        """Whether ``quantize.statistics`` asks for partial sums added over ranks (``reduce``, or ``auto`` on
        NCCL), in a world of several ranks."""
        mode = self.spec.statistics
        return self.world.distributed and (mode == "reduce" or (mode == "auto" and self.world.backend == "nccl"))

    def _run_reduced(self, lw: Layerwise, hidden: torch.Tensor, has_experts: bool) -> None:
        """One calibration pass over this rank's own batches for every statistic, summed over ranks once."""
        log.info("layer %d: statistics of each rank's own batches, summed over %d ranks", self.idx, self.world.size)
        relay = Relay(self.world, local=True)
        lin_stats = linear_stats(self.linears, relay)
        exp_stats = (ExpertStats(self.view, self.spec.gate_weighted, self.spec.all_experts, relay=relay)
                     if has_experts else None)
        with _timed(self.report, "stats_seconds", lw.device), _unused(self.view):
            lw.run(self.layer, hidden)
            close_linear_stats(lin_stats, self.world)
            if exp_stats is not None:
                exp_stats.remove()  # the ranks' sums added
                mine = self.ranges[self.world.rank]
                exp_stats.restrict(mine.start, len(mine))
        with _timed(self.report, "solve_seconds", lw.device):
            if exp_stats is not None and exp_stats.count:
                self.run_experts(exp_stats)
            del exp_stats
            self.run_linears(lin_stats)

    def spec_of(self, name: str) -> QuantSpec:
        return _spec_of(self.mods[name])

    def solve(self, w: torch.Tensor, H: torch.Tensor | None, spec: QuantSpec,
              rows: list[list[tuple[str, slice]]], algorithm: str | None = None) -> torch.Tensor:
        """Quantize a ``[B, out, in]`` batch whose element ``b`` holds the modules ``rows[b]`` (name, row slice):
        GPTQ treats rows independently given H, so modules sharing an input are solved as one problem.
        Records every module's codes; returns the dequantized batch."""
        solver = ALGORITHMS[algorithm or self.plan.algorithm]
        qw, repairs, diverged = solver(w, H, spec, w.dtype, self.spec)
        self.report.repairs += [f"{', '.join(n for n, _ in rows[b])}: {why}" for b, why in repairs]
        return self.record(qw, rows, w, diverged)

    def record(self, qw: QuantizedWeight, rows: list[list[tuple[str, slice]]], w: torch.Tensor | None = None,
               diverged: torch.Tensor | None = None):
        """Store each module's codes from a batched result; track the worst relative weight error vs ``w``.
        Non-finite source weights or quantized values, or a solve that diverged (``diverged [B]``, the solver's
        unread flags), are a NumericalError naming the module. Every module's checks come back to the host in one
        read (a read per module stalled the GPU hundreds of times a layer)."""
        deq = qw.dequantize()
        bad = ~torch.isfinite(deq).all(dim=2)  # [B, out]
        if w is not None:
            bad |= ~torch.isfinite(w).all(dim=2)
        parts = [(b, name, r) for b, part in enumerate(rows) for name, r in part]
        per_row = [bad.double()]  # [B, out] each: summed over each module's row slice below
        if w is not None:
            per_row += [(deq.float() - w.float()).pow(2).sum(dim=2).double(), w.float().pow(2).sum(dim=2).double()]
        if diverged is not None:
            per_row.append(diverged[:, None].expand_as(bad).double())
        sums = _slice_sums(torch.stack(per_row), [(b, r) for b, _, r in parts]).tolist()  # [P][K]: the one read
        # codes kept until the layer is written: two a byte where the store packs them (half the GPU memory; the
        # batch's int8 codes are freed with it: 11.3 -> 5.7 GB at a DeepSeek-V3 layer's end)
        codes = pack_codes(qw.q, qw.spec) if packs(qw.spec, qw.q.shape[-1]) else qw.q
        for (b, name, r), vals in zip(parts, sums, strict=True):
            if diverged is not None and vals[-1] > 0:
                raise NumericalError(f"{name}: {diverged_message()}")
            if vals[0] > 0:
                raise _non_finite(name, w[b, r] if w is not None else None)
            if w is not None:
                err = math.sqrt(vals[1] / max(vals[2], 1e-24))
                if err >= self.report.worst_rel_error:
                    self.report.worst_rel_error, self.report.worst_module = err, name
            z = None if qw.zero is None else qw.zero[b, r]
            self.results[name] = QuantizedWeight(codes[b, r], qw.scale[b, r], z, qw.spec)
        return deq

    def run_linears(self, lin_stats: dict, skip: set[str] = frozenset()) -> None:
        """Linears with identical input statistics (q/k/v, shared gate/up) and one spec are solved together."""
        groups: list[tuple[QuantSpec, torch.Tensor | None, list[str]]] = []
        for name in self.linears:
            if name in skip:
                continue
            spec, H = _spec_of(self.mods[name]), lin_stats[name].hessian() if lin_stats else None
            for g_spec, g_H, names in groups:
                same_input = H is not None and g_H is not None and g_H.shape == H.shape and torch.equal(g_H, H)
                if g_spec == spec and same_input:
                    names.append(name)
                    break
            else:
                groups.append((spec, H, [name]))
        for spec, H, names in my_linear_groups(self, groups):
            mods = [self.linears[n] for n in names]
            w = torch.cat([m.weight.data for m in mods], dim=0)[None]
            bounds = list(itertools.accumulate((m.out_features for m in mods), initial=0))
            rows = [[(n, slice(bounds[i], bounds[i + 1])) for i, n in enumerate(names)]]
            deq = self.solve(w, None if H is None else H[None], spec, rows)[0]
            for i, m in enumerate(mods):
                m.weight.data.copy_(deq[bounds[i] : bounds[i + 1]])

    def expert_groups(self, first: int, count: int, counts) -> dict[tuple, list[int]]:
        """(projection, spec, RTN fallback) -> experts; gate and up of one spec form one 'gate_up' problem."""
        planned = self.experts_planned()
        groups: dict[tuple, list[int]] = {}
        host = None if counts is None else counts.tolist()  # one read, not one per expert
        for e in range(first, first + count):
            p = {proj: planned.get(f"layers.{self.idx}.experts.{e}.{proj}") for proj in ("gate", "up", "down")}
            few = host is not None and host[e - first] < max(self.spec.min_tokens, 1)
            fused = p["gate"] is not None and p["up"] is not None and _spec_of(p["gate"]) == _spec_of(p["up"])
            for proj, plan in (("gate_up", p["gate"]),) if fused else (("gate", p["gate"]), ("up", p["up"])):
                if plan is not None:
                    groups.setdefault((proj, _spec_of(plan), few), []).append(e)
            if p["down"] is not None:
                groups.setdefault(("down", _spec_of(p["down"]), few), []).append(e)
        return groups

    def run_experts(self, exp_stats: ExpertStats | None) -> None:
        """Quantize the planned experts (this rank's, or the chunk ``exp_stats`` covers), as ``[E', out, in]``
        batches."""
        planned = self.experts_planned()
        if not planned:
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

    def _solve_experts(self, proj, weights, H, spec, experts, fallback, I) -> None:
        """``H`` is already indexed to ``experts`` (None for RTN or the token-floor fallback)."""
        splits = [("gate", slice(0, I)), ("up", slice(I, 2 * I))] if proj == "gate_up" else [(proj, slice(None))]
        rows = [[(f"layers.{self.idx}.experts.{e}.{p}", r) for p, r in splits] for e in experts]
        sel = on_device(experts, weights.device)
        if fallback:
            self.report.rtn_fallbacks += [name for parts in rows for name, _ in parts]
        weights[sel] = self.solve(weights[sel], H, spec, rows, algorithm="rtn" if fallback else None)

    def finish_report(self, seconds: float) -> LayerReport:
        r = self.report
        r.n_modules = len(self.results)
        r.n_experts = len({n.split(".")[3] for n in self.results if ".experts." in n})
        numel = {n: codes_numel(q) for n, q in self.results.items()}
        total = sum(numel.values())
        r.mean_bits = sum(self.results[n].spec.bits * k for n, k in numel.items()) / max(total, 1)
        r.seconds = seconds
        return r


def _slice_sums(values: torch.Tensor, parts: list[tuple[int, slice]]) -> torch.Tensor:
    """``values [K, B, out]``, parts ``(b, row slice)`` -> ``[P, K]``: each part's sum over its rows, from one
    cumulative sum (no host read)."""
    assert all(isinstance(r, slice) and r.step in (None, 1) for _, r in parts), parts
    K, B, n = values.shape
    c = torch.nn.functional.pad(values.cumsum(dim=2), (1, 0))  # [K, B, out + 1]
    idx = on_device([[b, *r.indices(n)[:2]] for b, r in parts], values.device).view(-1, 3)
    b, lo, hi = idx.unbind(1)
    return (c[:, b, hi] - c[:, b, lo]).T


def _non_finite(name: str, w: torch.Tensor | None) -> NumericalError:
    if w is not None and not bool(torch.isfinite(w).all()):
        n = int((~torch.isfinite(w)).sum())
        return NumericalError(f"{name}: {n} source weight(s) are NaN or infinite; the model folder is damaged (or "
                              "was saved from a diverged training run): re-download or repair it")
    return NumericalError(f"{name}: quantization produced NaN or infinite scales or weights (values too large for "
                          "the model dtype?); keep this module (plan.protect) or use model.dtype float32")


def _apply_stored(job: _LayerJob, path: Path, device) -> None:
    """Put previously stored dequantized weights (and changed kept parameters) into the layer, and its stored
    report (worst error, fallbacks, repairs, solve times) into ``job.report`` (resume path)."""
    job.results, job.params = load_into_layer(job.source, job.layer, job.idx, path, device)
    missing = set(job.mods) - set(job.results)
    if missing:
        raise QuantError(f"stored layer {job.idx} lacks {sorted(missing)[:3]}; remove it and rerun with --force quantize")
    stored = read_report(path)
    keep = ("worst_rel_error", "worst_module", "stats_seconds", "solve_seconds", "rtn_fallbacks", "repairs")
    for k in keep:
        if k in stored:
            setattr(job.report, k, stored[k])


def _quantize_layer(job: _LayerJob, lw: Layerwise, hidden: torch.Tensor, path: Path, writer: LayerWriter) -> None:
    """Compute this layer's codes (this rank's share, then exchanged) and put them into the layer."""
    if job.plan.algorithm == "awq":
        with _timed(job.report, "solve_seconds", lw.device):
            job.params = run_awq(job, lw, hidden)
    elif NEEDS_HESSIAN[job.plan.algorithm]:
        job.run_with_statistics(lw, hidden)
    else:
        with _timed(job.report, "solve_seconds", lw.device):
            job.run_linears({})
            job.run_experts(None)
    share_results(job)
    job.results = {n: job.results[n] for n in job.mods if n in job.results}  # plan order: the same file at any size
    if job.world.is_writer:
        writer.submit(path, job.results, job.params, asdict(job.report))  # the report too: a resumed run shows it


def quantize_model(source: ModelSource, calib: CalibrationSet, plan: BitPlan, spec: QuantizeSpec,
                   lw: Layerwise, out_dir: Path) -> list[LayerReport]:
    """Quantize every layer into ``out_dir`` (existing complete layer files are reused). In a world of several
    ranks (``lw.world``) every rank calls this; only the writer writes ``out_dir``."""
    if plan.algorithm not in ALGORITHMS:
        raise QuantError(f"algorithm '{plan.algorithm}' is not available; choose one of {', '.join(ALGORITHMS)}")
    world = lw.world
    if world.is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    hidden = lw.embed(calib.tokens)
    reports = []
    writer = LayerWriter(background=lw.device.type == "cuda")
    log.info("quantize: %d layers, algorithm %s", source.n_layers, plan.algorithm,
             extra=step("quantize", 0, source.n_layers))
    try:
        for idx in range(source.n_layers):
            reports.append(_one_layer(source, plan, spec, lw, out_dir, idx, hidden, writer))
            if idx + 1 < source.n_layers:
                world.raise_if_stopped(f"layer {idx} of {source.n_layers}")
    finally:
        writer.wait()  # the layer in hand reaches the disk before any exit
    if world.is_writer:
        (out_dir / "layers.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return reports


def _one_layer(source, plan, spec, lw: Layerwise, out_dir: Path, idx: int, hidden: torch.Tensor,
               writer: LayerWriter) -> LayerReport:
    """Quantize (or reload) layer ``idx`` and propagate ``hidden`` through it in place."""
    world, t0 = lw.world, time.perf_counter()
    with lw.layer(idx) as layer:
        job = _LayerJob(source, plan, spec, idx, layer, world)
        job.report.load_seconds = time.perf_counter() - t0
        path = layer_file(out_dir, idx)
        if world.broadcast_object(path.is_file() if world.is_writer else None):
            _apply_stored(job, path, lw.device)
            job.report.resumed = True
        else:
            _quantize_layer(job, lw, hidden, path, writer)
        with _timed(job.report, "forward_seconds", lw.device):
            lw.forward(layer, hidden, out=hidden)
    report = job.finish_report(time.perf_counter() - t0)
    _log_layer(report, source.n_layers, spec.min_tokens)
    return report


def _log_layer(report: LayerReport, n_layers: int, min_tokens: int) -> None:
    idx = report.layer
    for repair in report.repairs:
        log.warning("layer %d: numerical repair: %s", idx, repair)
    if report.rtn_fallbacks and min_tokens > 1:
        log.warning("layer %d: %d expert projections of experts routed fewer than %d calibration tokens "
                    "(quantize.min_tokens) fell back to RTN", idx, len(report.rtn_fallbacks), min_tokens)
    elif report.rtn_fallbacks:  # no statistics at all: the floor of one token holds whatever min_tokens says
        log.info("layer %d: %d expert projections of experts routed no calibration token were rounded to nearest "
                 "(RTN)", idx, len(report.rtn_fallbacks))
    log.info("layer %d: %d modules (%d experts), layer bits %.2f, worst rel err %.4f (%s), %.2fs%s",
             idx, report.n_modules, report.n_experts, report.mean_bits, report.worst_rel_error,
             report.worst_module, report.seconds, " (resumed)" if report.resumed else "",
             extra=step("quantize", idx + 1, n_layers))
