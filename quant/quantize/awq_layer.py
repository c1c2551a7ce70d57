"""AWQ on one decoder layer: search smoothing factors, fold them where the model allows, quantize.

What is folded where (every fold is exact in real arithmetic; the checkpoint stays plain W4/W8):
- routed experts' down_proj: one ``s`` per expert, searched on that expert's routed activations; the expert's
  up_proj rows are divided by ``s`` (down's input is ``act(gate x) * (up x)``, linear in up's rows).
- routed experts' gate/up (fused): one ``s`` shared by all experts of the layer (their input is the
  post-attention norm's output), searched on all experts' routed tokens at once (token-weighted); the norm
  weight is divided by ``s``, the router's (and a shared-expert gate's) input columns are multiplied by ``s``
  (they stay bf16), and shared experts' gate/up columns are multiplied by ``s`` before they are quantized.
- attention: the linears reading the input norm (q/k/v; DeepSeek's q_a and kv_a) share one ``s`` folded into
  ``input_layernorm``; a dense layer's MLP gate/up share one folded into the post-attention norm.
- everything else (o_proj, MLA's q_b/kv_b, dense/shared down) is round-to-nearest (``s = 1``).
The search needs no stored activations: ``rows = Lᵀ`` with ``L Lᵀ = Σ x xᵀ`` gives AWQ's output error exactly,
and per-channel ``mean |x|`` is accumulated alongside the Hessians. Changed norms and routers are returned so
the checkpoint writer ships them.

Memory: the experts' Hessians are accumulated in chunks that fit ``quantize.hessian_budget_gb`` (one calibration
pass each, as for GPTQ; DeepSeek-V3's 256 experts need 57 GB at once), and each search runs a few experts at a
time within ``quantize.solve_budget_gb``. The shared gate/up search keeps every expert's error at every grid
point across chunks and picks after the last, so the result does not depend on the budgets.
"""

from __future__ import annotations

import logging

import torch

from quant.algos.awq import AWQExtra, awq_search, pick_scales, quantize_scaled, smoothing_grid, trial_errors
from quant.algos.grid import QuantizedWeight, quantize_weight
from quant.diag.hostsync import on_device
from quant.layerwise import Layerwise
from quant.models.layers import smoothing_sites
from quant.models.names import expert_name, parse
from quant.parallel.relay import Relay
from quant.quantize.budgets import search_bytes, sub_batches
from quant.quantize.hessians import ExpertStats, LinearStats, close_linear_stats, linear_stats
from quant.quantize.layer_job import LayerJob
from quant.scheme import Scheme

log = logging.getLogger(__name__)


def rows_from_hessian(H: torch.Tensor) -> torch.Tensor:
    """``[B, I, I]`` second moments -> rows ``Lᵀ [B, I, I]`` with ``L Lᵀ = H`` (tiny damping for rank deficiency)."""
    eye = torch.eye(H.shape[-1], dtype=torch.float32, device=H.device)
    damp = 1e-6 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    L, info = torch.linalg.cholesky_ex(H.float() + damp[:, None, None] * eye)
    if bool((info != 0).any()):  # e.g. all-zero H: no rows, so every α scores 0 and α = 0 (RTN) wins
        L.masked_fill_((info != 0)[:, None, None], 0.0)
    return L.transpose(1, 2)


def _search(w: torch.Tensor, H: torch.Tensor, means: torch.Tensor, spec: Scheme, job: LayerJob):
    """Per-element search (one s per batch element) of ``w [B, O, I]`` given ``H [B, I, I]``."""
    x = rows_from_hessian(H)
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    return awq_search(w, x, mask, spec, w.dtype, n_grid=job.spec.awq_grid, channel_means=means)


def _sub_batches(job: LayerJob, experts: list[int], weights: torch.Tensor) -> list[list[int]]:
    """``experts`` in equal runs whose search working set (``search_bytes`` each) fits ``solve_budget_gb``."""
    return sub_batches(experts, weights.shape[1], weights.shape[2], job.spec.solve_budget_gb, search_bytes)


def _in_chunk(experts: list[int], stats: ExpertStats) -> list[int]:
    return [e for e in experts if stats.first <= e < stats.first + stats.count]


def _mine(job: LayerJob, experts: list[int]) -> list[int]:
    """The experts this rank searches and quantizes (its range of ``job.ranges``; all of them in a world of one)."""
    r = job.ranges[job.world.rank]
    return [e for e in experts if r.start <= e < r.stop]


def _local(experts: list[int], stats: ExpertStats) -> torch.Tensor:
    return on_device([e - stats.first for e in experts], stats.weight_sum.device)


def _experts_down(job: LayerJob, stats: ExpertStats, groups: dict) -> None:
    """Per-expert s for the chunk's down_proj of this rank's experts, folded into that expert's up rows."""
    v, I = job.view, job.view.intermediate
    for (proj, spec, _few), experts in groups.items():
        if proj != "down":
            continue
        for sub in _sub_batches(job, _mine(job, _in_chunk(experts, stats)), v.down):
            sel, local = on_device(sub, v.down.device), _local(sub, stats)
            denom = stats.weight_sum[local].clamp_min(1e-12).float()
            H = stats.sum_down[local] / denom[:, None, None]
            w = v.down.data[sel]
            res = _search(w, H, stats.abs_down[local] / denom[:, None], spec, job)
            v.down.data[sel] = res.weight.dequantize().to(v.down.dtype)
            v.gate_up.data[sel, I:] = (v.gate_up.data[sel, I:].float() / res.scales[:, :, None]).to(v.gate_up.dtype)
            job.results.record(res.weight, [[(expert_name(job.idx, e, "down"), slice(None))] for e in sub],
                               w.float() * res.scales[:, None, :])  # the weight the codes store: W · s


class _GateUpSearch:
    """One s for every routed expert's gate/up (token-weighted), searched over expert chunks.

    The α grid comes from every expert's mean |x| (``totals``, the first pass); each chunk adds its experts'
    trial errors, computed from their token-weighted Hessian sums (not normalized per expert: the shared search
    weighs experts by tokens) with the chunk's down folds already in the up rows; the pick and the quantization
    follow the last chunk. An expert's errors depend on that expert alone and the tables are joined in expert
    order, so the result is the one a search over all experts at once gives. The largest (spec, experts) group is
    searched, the second counts in the loss with its own spec (a shared s, as for the shared expert's extra), a
    third spec is quantized with the s found, unsearched. With several ranks each rank computes its own experts'
    errors (``job.ranges``) and the tables are gathered in expert order before the pick, the same on every rank;
    each rank then quantizes its own experts.
    """

    def __init__(self, job: LayerJob, totals: ExpertStats, groups: dict):
        self.job = job
        fused = sorted(((spec, e) for (proj, spec, _f), e in groups.items() if proj == "gate_up"),
                       key=lambda t: -len(t[1]))
        self.searched, self.rest = fused[:2], fused[2:]
        mean = (totals.abs_gu.sum(0) / totals.weight_sum.sum().clamp_min(1e-12).float())[None]
        self.s_grid = smoothing_grid(mean, job.spec.awq_grid)[1]  # [n_grid, 1, D]
        self.tables: list[list[torch.Tensor]] = [[] for _ in self.searched]

    def add(self, stats: ExpertStats) -> None:
        v = self.job.view
        for table, (spec, experts) in zip(self.tables, self.searched, strict=True):
            for sub in _sub_batches(self.job, _mine(self.job, _in_chunk(experts, stats)), v.gate_up):
                x = rows_from_hessian(stats.sum_gu[_local(sub, stats)])
                part = AWQExtra(v.gate_up.data[on_device(sub, x.device)], x,
                                torch.ones(x.shape[:2], dtype=torch.bool, device=x.device), spec)
                table.append(trial_errors(part, self.s_grid, v.gate_up.dtype, shared=True))

    def finish(self) -> torch.Tensor:
        """Pick s ``[D]``, quantize every planned gate/up with it; returns s (ones when none is planned)."""
        v = self.job.view
        if not self.searched:
            return torch.ones(v.gate_up.shape[2], device=v.gate_up.device)
        s = pick_scales(self._gathered(), self.s_grid, shared=True)[0]  # [1, D]
        for spec, experts in self.searched + self.rest:
            for sub in _sub_batches(self.job, _mine(self.job, experts), v.gate_up):
                w = v.gate_up.data[on_device(sub, s.device)]
                _write_gate_up(self.job, sub, quantize_scaled(w, s, spec, v.gate_up.dtype),
                               v.intermediate, w.float() * s[:, None, :])
        return s[0]

    def _gathered(self) -> list[torch.Tensor]:
        """Each searched group's errors ``[n_grid, experts]`` of every rank, in expert order (ranks own ascending
        ranges), identical on every rank."""
        n_grid = self.s_grid.shape[0]
        mine = [torch.cat(t, dim=1) if t else torch.zeros(n_grid, 0, device=self.s_grid.device) for t in self.tables]
        world = self.job.world
        if not world.distributed:
            return mine
        parts = world.all_gather_object([t.cpu() for t in mine])
        return [torch.cat([rank[i] for rank in parts], dim=1).to(self.s_grid.device) for i in range(len(mine))]


def _expert_passes(job: LayerJob, lw: Layerwise, hidden: torch.Tensor, lin_stats: dict[str, LinearStats],
                   relay: Relay) -> torch.Tensor:
    """One calibration pass per expert chunk (``job.expert_chunks``: their Hessians fit ``hessian_budget_gb``);
    the first pass (on ``relay``, which the linears' statistics use) also takes the linears' statistics and every
    expert's counts and gate/up ``Σ |x|`` (the plan's token floor and the shared search's grid need all experts).
    Every rank consumes every batch of every pass (the statistics are replicated); it searches, folds and writes
    its own experts (``job.ranges``), the other ranks' arrive with the codes exchange. Folds and writes the routed experts;
    returns the gate/up s, still to be folded into the norm and the routed experts' readers.

    Folding a chunk changes only its experts, which feed neither another chunk's gate/up input (the
    post-attention norm's output, folded last) nor its down input (its own gate/up), so later passes stay exact."""
    v, chunks = job.view, job.expert_chunks(range(job.view.n_experts))
    for i, (first, count) in enumerate(chunks):
        relay = relay if i == 0 else Relay(lw.world, local=relay.local)
        stats = ExpertStats(v, False, job.spec.all_experts, first, count, relay=relay)
        if i == 0:  # every expert's counts and Σ |x|: this chunk's stats when it is the only one
            totals = stats if len(chunks) == 1 else ExpertStats(v, False, job.spec.all_experts, relay=relay,
                                                                 hessians=False)
        with v.outputs_unused():
            lw.run(job.layer, hidden, after_step=relay.flush)
        stats.remove()
        if i == 0:
            if totals is not stats:
                totals.remove()
            close_linear_stats(lin_stats, lw.world)
            groups = job.expert_groups(0, v.n_experts, totals.counts)
            search = _GateUpSearch(job, totals, groups)
            del totals  # (a name still bound to chunk i's sums kept two chunks alive: 14.6 GB on DeepSeek-V3)
        _experts_down(job, stats, groups)
        search.add(stats)
        del stats
    return search.finish()


def _write_gate_up(job: LayerJob, experts: list[int], qw: QuantizedWeight, I: int, scaled: torch.Tensor) -> None:
    """``scaled``: the weights ``qw`` encodes (``W · s``), for the layer's error report."""
    v = job.view
    sel = on_device(experts, v.gate_up.device)
    v.gate_up.data[sel] = qw.dequantize().to(v.gate_up.dtype)
    job.results.record(qw, [[(expert_name(job.idx, e, "gate"), slice(0, I)), (expert_name(job.idx, e, "up"),
                                                                              slice(I, 2 * I))] for e in experts],
                       scaled)


def _fold_norm(norm_name: str, norm, s: torch.Tensor, params: dict) -> None:
    norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    params[norm_name] = norm.weight.data


def _smooth_linears(job: LayerJob, names: list[str], lin_stats: dict[str, LinearStats],
                    s: torch.Tensor | None) -> torch.Tensor:
    """Linears sharing one input: search s (or apply the given one), quantize; returns s."""
    mods = [job.linears[n] for n in names]
    specs = {job.modules[n] for n in names}
    if len(specs) > 1 or any(n not in lin_stats for n in names):
        return torch.ones(mods[0].in_features, device=mods[0].weight.device)
    spec: Scheme = specs.pop()
    w = torch.cat([m.weight.data for m in mods], dim=0)[None]
    bounds = [0]
    for m in mods:
        bounds.append(bounds[-1] + m.out_features)
    if s is None:
        st = lin_stats[names[0]]
        res = _search(w, st.hessian()[None], st.mean_abs()[None], spec, job)
        s, qw = res.scales[0], res.weight
    else:
        qw = quantize_weight(w.float() * s, spec, w.dtype)
    deq = qw.dequantize()[0]
    for i, m in enumerate(mods):
        m.weight.data.copy_(deq[bounds[i] : bounds[i + 1]])
    job.results.record(qw, [[(n, slice(bounds[i], bounds[i + 1])) for i, n in enumerate(names)]], w.float() * s)
    return s


def run_awq(job: LayerJob, lw: Layerwise, hidden: torch.Tensor, reduced: bool) -> dict[str, torch.Tensor]:
    """AWQ for the planned modules of ``job``'s layer; returns the changed kept parameters. Every rank holds every
    statistic: from every batch in order (the relay), or (``reduced``) from its own batches, summed over ranks after
    each pass."""
    sites = smoothing_sites(job.source, job.layer, job.idx, set(job.modules))
    relay = Relay(lw.world, local=reduced)
    if relay.local:
        log.info("layer %d: statistics of each rank's own batches, summed over %d ranks", job.idx, lw.world.size)
    lin_stats = linear_stats(job.linears, relay)
    params: dict[str, torch.Tensor] = {}
    routed = job.has_experts()
    if routed:
        s = _expert_passes(job, lw, hidden, lin_stats, relay)
        _fold_norm(sites.mlp_norm[0], sites.mlp_norm[1], s, params)
        for name, weight in sites.mlp_readers:
            weight.data = (weight.data.float() * s).to(weight.dtype)
            params[name] = weight.data
        shared = [n for n in job.linears if parse(n).block == "shared" and parse(n).leaf in ("gate", "up")]
        if shared:
            _smooth_linears(job, shared, lin_stats, s)
        for local, mod in sites.kept_mlp_inputs:  # kept (bf16) shared-expert gate/up also read the norm
            mod.weight.data = (mod.weight.data.float() * s).to(mod.weight.dtype)
            params[local + ".weight"] = mod.weight.data
    else:
        lw.run(job.layer, hidden, after_step=relay.flush)
        close_linear_stats(lin_stats, lw.world)
    attn = [n for n in sites.attn_linears if n in job.linears]
    if attn:
        s_attn = _smooth_linears(job, attn, lin_stats, None)
        _fold_norm(sites.attn_norm[0], sites.attn_norm[1], s_attn, params)
    dense_in = [n for n in job.linears if parse(n).block == "mlp" and parse(n).leaf in ("gate", "up")]
    if dense_in and not routed:
        s_mlp = _smooth_linears(job, dense_in, lin_stats, None)
        _fold_norm(sites.mlp_norm[0], sites.mlp_norm[1], s_mlp, params)
    job.run_linears({}, skip=set(job.results.codes))  # the rest: round-to-nearest
    return params
