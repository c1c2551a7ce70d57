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
"""

from __future__ import annotations

import torch

from quant.algos.awq import AWQExtra, awq_search
from quant.algos.grid import QuantSpec
from quant.hessians import ExpertStats, LinearStats, agree_leaders, linear_stats
from quant.models.layers import smoothing_sites
from quant.relay import Relay


def rows_from_hessian(H: torch.Tensor) -> torch.Tensor:
    """``[B, I, I]`` second moments -> rows ``Lᵀ [B, I, I]`` with ``L Lᵀ = H`` (tiny damping for rank deficiency)."""
    eye = torch.eye(H.shape[-1], dtype=torch.float32, device=H.device)
    damp = 1e-6 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    L, info = torch.linalg.cholesky_ex(H.float() + damp[:, None, None] * eye)
    if bool((info != 0).any()):  # e.g. all-zero H: no rows, so every α scores 0 and α = 0 (RTN) wins
        L.masked_fill_((info != 0)[:, None, None], 0.0)
    return L.transpose(1, 2)


def _search(w, H, means, spec, job, shared=False, extra=None):
    x = rows_from_hessian(H)
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    O, I = w.shape[1], w.shape[2]
    per_element = 4 * (2 * I * I + O * I + 3 * I * O)  # x / s, rows, Q(W·s), and x Wᵀ / y / diff [I, O]
    chunk = max(1, int(job.spec.solve_budget_gb * 1e9) // per_element)
    return awq_search(w, x, mask, spec, w.dtype, n_grid=job.spec.awq_grid, share_across_batch=shared,
                      extra=extra, channel_means=means, batch_chunk=chunk)


def _take(t: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """``t[experts]``, without a copy when ``experts`` is every index in order."""
    return t if experts == list(range(t.shape[0])) else t[torch.tensor(experts, device=t.device)]


def _experts_down(job, stats: ExpertStats, groups: dict) -> None:
    """Per-expert s for down_proj, folded into that expert's up rows."""
    v, I = job.view, job.view.intermediate
    H_down = stats.hessians()[1]
    mean_down = stats.mean_abs()[1]
    for (proj, spec, _few), experts in groups.items():
        if proj != "down":
            continue
        sel = torch.tensor(experts, device=v.down.device)
        res = _search(v.down.data[sel], _take(H_down, experts), mean_down[sel], spec, job)
        v.down.data[sel] = res.weight.dequantize().to(v.down.dtype)
        v.gate_up.data[sel, I:] = (v.gate_up.data[sel, I:].float() / res.scales[:, :, None]).to(v.gate_up.dtype)
        job.record(res.weight, [[(f"layers.{job.idx}.experts.{e}.down", slice(None))] for e in experts])


def _experts_gate_up(job, stats: ExpertStats, groups: dict, params: dict) -> torch.Tensor:
    """One s for every routed expert's gate/up (token-weighted), folded into the post-attention norm."""
    v, I = job.view, job.view.intermediate
    H = stats.sum_gu  # token-weighted sums (not normalized per expert: the shared search weighs experts by tokens)
    mean = (stats.abs_gu.sum(0) / stats.weight_sum.sum().clamp_min(1e-12).float())[None]
    fused = sorted(((spec, e) for (proj, spec, _f), e in groups.items() if proj == "gate_up"), key=lambda t: -len(t[1]))
    if not fused:
        return torch.ones(v.gate_up.shape[2], device=v.gate_up.device)
    (spec, experts), rest = fused[0], fused[1:]
    sel = torch.tensor(experts, device=v.gate_up.device)
    extra = None
    if rest:
        e_spec, e_exp = rest[0]
        e_sel = torch.tensor(e_exp, device=sel.device)
        x = rows_from_hessian(H[e_sel])
        extra = AWQExtra(v.gate_up.data[e_sel], x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device), e_spec)
    res = _search(v.gate_up.data[sel], _take(H, experts), mean, spec, job, shared=True, extra=extra)
    s = res.scales
    _write_gate_up(job, experts, res.weight, I)
    if rest:
        _write_gate_up(job, rest[0][1], res.extra_weight, I)
    for r_spec, r_exp in rest[1:]:  # a third spec among the experts: quantize with the shared s, unsearched
        from quant.algos.grid import quantize_weight

        r_sel = torch.tensor(r_exp, device=sel.device)
        _write_gate_up(job, r_exp, quantize_weight(v.gate_up.data[r_sel].float() * s, r_spec, v.gate_up.dtype), I)
    return s


def _write_gate_up(job, experts: list[int], qw, I: int) -> None:
    v = job.view
    sel = torch.tensor(experts, device=v.gate_up.device)
    v.gate_up.data[sel] = qw.dequantize().to(v.gate_up.dtype)
    job.record(qw, [[(f"layers.{job.idx}.experts.{e}.gate", slice(0, I)), (f"layers.{job.idx}.experts.{e}.up",
                                                                         slice(I, 2 * I))] for e in experts])


def _fold_norm(norm_name: str, norm, s: torch.Tensor, params: dict) -> None:
    norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    params[norm_name] = norm.weight.data


def _smooth_linears(job, names: list[str], lin_stats: dict[str, LinearStats], s: torch.Tensor | None) -> torch.Tensor:
    """Linears sharing one input: search s (or apply the given one), quantize; returns s."""
    mods = [job.linears[n] for n in names]
    specs = {job.spec_of(n) for n in names}
    if len(specs) > 1 or any(n not in lin_stats for n in names):
        return torch.ones(mods[0].in_features, device=mods[0].weight.device)
    spec: QuantSpec = specs.pop()
    w = torch.cat([m.weight.data for m in mods], dim=0)[None]
    bounds = [0]
    for m in mods:
        bounds.append(bounds[-1] + m.out_features)
    if s is None:
        st = lin_stats[names[0]]
        res = _search(w, st.hessian()[None], st.mean_abs()[None], spec, job)
        s, qw = res.scales[0], res.weight
    else:
        from quant.algos.grid import quantize_weight

        qw = quantize_weight(w.float() * s, spec, w.dtype)
    deq = qw.dequantize()[0]
    for i, m in enumerate(mods):
        m.weight.data.copy_(deq[bounds[i] : bounds[i + 1]])
    job.record(qw, [[(n, slice(bounds[i], bounds[i + 1])) for i, n in enumerate(names)]])
    return s


def run_awq(job, lw, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ for the planned modules of ``job``'s layer; returns the changed kept parameters."""
    sites = smoothing_sites(job.source, job.layer, job.idx, set(job.mods))
    relay = Relay(lw.world)  # every rank consumes every batch: AWQ runs replicated
    lin_stats = linear_stats(job.linears, relay)
    stats = None
    if job.view is not None and job.experts_planned():
        stats = ExpertStats(job.view, False, job.spec.all_experts, relay=relay)
    lw.run(job.layer, hidden, after_step=relay.flush)
    for st in lin_stats.values():
        st.remove()
    agree_leaders(lin_stats, lw.world)
    params: dict[str, torch.Tensor] = {}
    if stats is not None:
        stats.remove()
        groups = job.expert_groups(0, job.view.n_experts, stats.counts)
        _experts_down(job, stats, groups)
        s = _experts_gate_up(job, stats, groups, params)
        _fold_norm(sites.mlp_norm[0], sites.mlp_norm[1], s, params)
        for name, weight in sites.mlp_readers:
            weight.data = (weight.data.float() * s).to(weight.dtype)
            params[name] = weight.data
        shared = [n for n in job.linears if ".shared." in n and n.rsplit(".", 1)[1] in ("gate", "up")]
        if shared:
            _smooth_linears(job, shared, lin_stats, s)
        for local, mod in sites.kept_mlp_inputs:  # kept (bf16) shared-expert gate/up also read the norm
            mod.weight.data = (mod.weight.data.float() * s).to(mod.weight.dtype)
            params[local + ".weight"] = mod.weight.data
    attn = [n for n in sites.attn_linears if n in job.linears]
    if attn:
        s_attn = _smooth_linears(job, attn, lin_stats, None)
        _fold_norm(sites.attn_norm[0], sites.attn_norm[1], s_attn, params)
    dense_in = [n for n in job.linears if ".mlp." in n and n.rsplit(".", 1)[1] in ("gate", "up")]
    if dense_in and stats is None:
        s_mlp = _smooth_linears(job, dense_in, lin_stats, None)
        _fold_norm(sites.mlp_norm[0], sites.mlp_norm[1], s_mlp, params)
    job.run_linears({}, skip=set(job.results))  # the rest: round-to-nearest
    return params
