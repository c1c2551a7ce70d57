"""Routing profile: which experts the router picks, layer by layer, measured on calibration tokens.

Per MoE layer × expert: routed token count, routing-weight mass (the normalized gate weights actually applied),
top-1 count, max |activation| at the down-projection input and output (the super-expert detector), and the
counts per calibration domain. Collected through ``ExpertsView.on_route``, which hands over the tokens entering the
experts and the routing the MoE block applies, ``(x [T, D], top_idx [T, k], top_w [T, k])``, in either experts
layout (transformers' fused experts or a remote-code per-expert ModuleList).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quant.algos.grid import effective_group_size, quantize_weight
from quant.calibration import CalibrationSet
from quant.diag.hostsync import on_device
from quant.errors import ModelError
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.layers import ExpertsView, experts_of
from quant.parallel.relay import Relay
from quant.progress import step
from quant.quantize.routing import (
    chunk_budget,
    count_ids,
    expert_intermediate,
    expert_output,
    load_buckets,
    sort_by_expert,
    with_zero_row,
)
from quant.scheme import Scheme

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
_STATS = ("counts", "weight_mass", "top1", "down_in_absmax", "down_out_absmax")
SENSITIVITY_BITS, SENSITIVITY_GROUP = 4, 128  # the probe: this expert alone at W4 g128 RTN
# The probe's token subset: per expert and calibration batch, at most this many of its routed tokens, evenly
# strided over the batch, each scaled by (routed / probed). Rank agreement with probing every token: Spearman
# >= 0.99 per layer on builtin:reference-moe at 1/4 of the tokens (tests/profile/test_profile.py); the probe's extra
# expert pass then costs a fraction of the layer's forward (an 8 x 2048-token batch routes ~1k tokens to each of
# 128 experts: 1/16 of them are probed).
PROBE_TOKENS = 64
PROBE_CHUNK_BYTES = 1 << 30  # fp32 working set while the probe's RTN weights are made, a few experts at a time


def usage_ratio(counts: torch.Tensor) -> torch.Tensor:
    """The most used expert's routed tokens over the least used one's, per row of ``counts [..., E]``; inf when an
    expert is unused. The one definition the profile's log lines and the report print (``ratio_text``)."""
    c = counts.double()
    return c.max(dim=-1).values / c.min(dim=-1).values


def ratio_text(ratio: float) -> str:
    return f"{ratio:.1f}" if math.isfinite(ratio) else "inf (an expert unused)"


def cold(counts: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """Which experts of ``counts [..., E]`` are cold: routed fewer than ``profile.min_tokens`` tokens (at least
    one: an unused expert is always cold)."""
    return counts < max(min_tokens, 1)


@dataclass(frozen=True)
class RoutingProfile:
    """Stats are ``[L, E]`` tensors over the MoE layers listed in ``layers`` (model layer indices). Frozen: a stage
    that adds a measurement (``layer_damage``) makes a new profile with ``dataclasses.replace``."""

    model_fingerprint: str
    model: str
    layers: list[int]
    n_experts: int
    top_k: int
    n_tokens: int
    sample_ids: list[str]
    counts: torch.Tensor
    weight_mass: torch.Tensor
    top1: torch.Tensor
    down_in_absmax: torch.Tensor
    down_out_absmax: torch.Tensor
    domain_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    sensitivity: torch.Tensor | None = None
    # scheme name ("w4g128") -> [L] KL per token when only that MoE layer's experts take the scheme (RTN);
    # None when profile.layer_sensitivity was not set (see quant.profile.layer_damage)
    layer_damage: dict[str, torch.Tensor] | None = None
    schema_version: int = SCHEMA_VERSION

    def share(self) -> torch.Tensor:
        """Fraction of a layer's routed assignments each expert received ``[L, E]`` (rows sum to 1)."""
        return self.counts / self.counts.sum(dim=1, keepdim=True).clamp_min(1)

    def row(self, layer: int) -> int:
        return self.layers.index(layer)

    def entropy(self) -> torch.Tensor:
        """Routing entropy per layer, normalized to [0, 1] by log(E)."""
        p = self.share()
        h = -(p * torch.log(p.clamp_min(1e-12))).sum(dim=1)
        return h / math.log(self.n_experts)

    def super_experts(self, ratio: float) -> list[tuple[int, int]]:
        """(layer, expert) whose max |down output| exceeds ``ratio`` × the median over all routed experts."""
        vals = self.down_out_absmax
        med = vals[vals > 0].median() if (vals > 0).any() else torch.tensor(0.0)
        hits = (vals > ratio * med).nonzero().tolist()
        return [(self.layers[r], e) for r, e in hits]

    def cold_experts(self, min_tokens: int) -> list[tuple[int, int]]:
        """(layer, expert) of the cold experts (``cold``)."""
        return [(self.layers[r], e) for r, e in cold(self.counts, min_tokens).nonzero().tolist()]

    def max_min_ratio(self) -> torch.Tensor:
        """Per layer: ``usage_ratio`` of its counts."""
        return usage_ratio(self.counts)

    def rank_stability(self, fraction: float = 0.2) -> dict[str, dict[str, float]]:
        """For each pair of calibration domains: mean over layers of the Spearman correlation of expert counts
        and of the overlap of their top-``fraction`` expert sets (1 = the same hot experts)."""
        names = sorted(self.domain_counts)
        n_top = max(1, round(fraction * self.n_experts))
        out = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ca, cb = self.domain_counts[a], self.domain_counts[b]
                rho = [_spearman(ca[r], cb[r]) for r in range(ca.shape[0])]
                top_a, top_b = ca.topk(n_top, dim=1).indices, cb.topk(n_top, dim=1).indices
                overlap = [len(set(top_a[r].tolist()) & set(top_b[r].tolist())) / n_top for r in range(ca.shape[0])]
                out[f"{a}~{b}"] = {"spearman": sum(rho) / len(rho), "top_overlap": sum(overlap) / len(overlap)}
        return out

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("schema_version", "model_fingerprint", "model", "layers", "n_experts",
                                            "top_k", "n_tokens", "sample_ids")}
        d.update({k: getattr(self, k).tolist() for k in _STATS})
        d["domain_counts"] = {k: v.tolist() for k, v in self.domain_counts.items()}
        d["sensitivity"] = None if self.sensitivity is None else self.sensitivity.tolist()
        d["layer_damage"] = None if self.layer_damage is None else {k: v.tolist() for k, v in self.layer_damage.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> RoutingProfile:
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"profile schema_version {d.get('schema_version')} != {SCHEMA_VERSION}")
        kw = {k: d[k] for k in ("model_fingerprint", "model", "layers", "n_experts", "top_k", "n_tokens", "sample_ids")}
        kw.update({k: torch.tensor(d[k], dtype=torch.float64) for k in _STATS})
        kw["domain_counts"] = {k: torch.tensor(v, dtype=torch.float64) for k, v in d["domain_counts"].items()}
        if d.get("sensitivity") is not None:
            kw["sensitivity"] = torch.tensor(d["sensitivity"], dtype=torch.float64)
        if d.get("layer_damage") is not None:
            kw["layer_damage"] = {k: torch.tensor(v, dtype=torch.float64) for k, v in d["layer_damage"].items()}
        return cls(**kw)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> RoutingProfile:
        return cls.from_json(json.loads(path.read_text()))


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (average ranks for ties)."""
    def ranks(v: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v, dtype=torch.float64)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in torch.unique(v):  # average the ranks of ties
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = (rx.norm() * ry.norm()).item()
    return float((rx @ ry).item() / denom) if denom > 0 else 0.0


_SUMMED = ("counts", "weight_mass", "top1", "sensitivity")  # rows of a batch's stats, summed over batches
_MAXED = ("down_in_absmax", "down_out_absmax")  # then these, maxima over batches; then one row per domain


class _LayerStats:
    """One MoE layer's statistics: each batch's are computed by the routing callback as one ``[R, E]`` float64
    tensor (rows ``_SUMMED``, ``_MAXED``, then the domains), which a relay hands to :meth:`add` in global batch
    order, so the totals are the same at any world size."""

    def __init__(self, n_experts: int, domains: list[str], device, probe_tokens: int | None = PROBE_TOKENS,
                 kernel: str = "auto"):
        assert kernel in ("auto", "grouped", "buckets"), kernel
        self.n_experts, self.domains, self.probe_tokens, self.kernel = n_experts, domains, probe_tokens, kernel
        self.total = torch.zeros(len(_SUMMED) + len(_MAXED) + len(domains), n_experts, dtype=torch.float64,
                                 device=device)
        self.token_domain: torch.Tensor | None = None  # [T] domain index of the batch's tokens
        self._probe: tuple[torch.Tensor, torch.Tensor] | None = None

    def release(self) -> None:
        """Drop what only the layer's batches need (the probe's weights, the batch's domains); keep the totals."""
        self._probe, self.token_domain = None, None

    def _probe_weights(self, view: ExpertsView) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's experts round-to-nearest at the probe precision (made once per layer, a few experts at a
        time so the fp32 working set stays small on layers with 256 large experts)."""
        if self._probe is None:
            self._probe = tuple(_rtn_probe(w.detach()) for w in (view.gate_up, view.down))
        return self._probe

    @torch.no_grad()
    def batch(self, view: ExpertsView, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This batch's ``[R, E]`` statistics."""
        E = view.n_experts
        out = torch.zeros_like(self.total)
        s = {key: out[i] for i, key in enumerate(_SUMMED + _MAXED)}
        grouped = self.kernel == "grouped" or (self.kernel == "auto" and grouped_mm_ok(view, x.dtype))
        if grouped:
            token, weight, counts, host = sort_by_expert(idx, w, E)
        else:
            counts, buckets = load_buckets(idx, w, E, width=max(view.gate_up.shape[1], view.gate_up.shape[2]),
                                           max_elems=chunk_budget(x.device))
        s["counts"] += counts.double()
        s["weight_mass"].index_add_(0, idx.reshape(-1), w.reshape(-1).double())
        s["top1"] += count_ids(idx.gather(1, w.argmax(dim=1, keepdim=True)), E).double()
        if self.token_domain is not None:  # one count over (domain, expert) pairs, no host read
            pair = self.token_domain[:, None] * E + idx
            out[len(_SUMMED) + len(_MAXED):] += count_ids(pair, len(self.domains) * E).view(len(self.domains), E).double()
        gu_q, down_q = self._probe_weights(view)
        if grouped:
            self._grouped(view, x, token, weight, counts, host, s, gu_q, down_q)
            return out
        x_padded = with_zero_row(x)
        for b in buckets:
            xg = b.gather(x_padded)
            a = expert_intermediate(xg, b.take(view.gate_up), view.act)
            y = expert_output(a, b.take(view.down))
            for key, t in (("down_in_absmax", a), ("down_out_absmax", y)):  # extreme values: every routed token
                lo, hi = torch.aminmax(t.flatten(1), dim=1)
                s[key][b.experts] = torch.maximum(s[key][b.experts], torch.maximum(hi, -lo).double())
            pos, scale = _probe_slots(b.mask, self.probe_tokens or b.mask.shape[1])
            y_q = expert_output(expert_intermediate(_slots(xg, pos), b.take(gu_q), view.act), b.take(down_q))
            err = _probe_error(_slots(y, pos), y_q, b.weight.gather(1, pos), scale)
            b.add_to(s["sensitivity"], err.sum(dim=1).double())
        return out

    def _grouped(self, view: ExpertsView, x: torch.Tensor, token: torch.Tensor, weight: torch.Tensor,
                 counts: torch.Tensor, host: list[int], s: dict[str, torch.Tensor], gu_q: torch.Tensor,
                 down_q: torch.Tensor) -> None:
        """Maxima and probe over the routed assignments sorted by expert (``routing.sort_by_expert``, the order the
        load buckets use), one grouped GEMM per projection over a contiguous expert range (no padding, no copy of
        the experts' weights: a range of them is a view), the ranges cut so that ``rows x width`` stays within the
        device's chunk budget. The same statistics as the load buckets' padded batched GEMMs, from the same rows:
        the probe takes the same evenly strided slots."""
        E = view.n_experts
        starts = list(itertools.accumulate(host, initial=0))  # host row offsets: expert e's rows start at starts[e]
        ends = torch.cumsum(counts, 0)
        width = max(view.gate_up.shape[1], view.gate_up.shape[2])
        for e0, e1 in _expert_ranges(host, width, chunk_budget(x.device)):
            r0, r1 = starts[e0], starts[e1]
            if r0 == r1:
                continue
            offs = (ends[e0:e1] - r0).to(torch.int32)
            experts = torch.repeat_interleave(torch.arange(e0, e1, device=x.device), counts[e0:e1],
                                              output_size=r1 - r0)
            xs = x[token[r0:r1]]
            a = _grouped_intermediate(xs, view.gate_up[e0:e1], offs, view.act)
            y = _gmm(a, view.down[e0:e1], offs)
            for key, t in (("down_in_absmax", a), ("down_out_absmax", y)):  # extreme values: every routed token
                lo, hi = torch.aminmax(t, dim=1)
                peak = torch.zeros(E, device=t.device).scatter_reduce_(0, experts, torch.maximum(hi, -lo).float(),
                                                                       "amax")
                s[key].copy_(torch.maximum(s[key], peak.double()))
            c = counts[e0:e1]
            n_probe = self.probe_tokens or max(host[e0:e1])
            probed = c.clamp(max=n_probe)
            n_rows = sum(min(h, n_probe) for h in host[e0:e1])  # sizes from the host counts: no read back
            offs_p = torch.cumsum(probed, 0)
            which = torch.repeat_interleave(torch.arange(e1 - e0, device=x.device), probed, output_size=n_rows)
            i = torch.arange(n_rows, device=x.device) - (offs_p - probed)[which]  # slot within its expert
            per = probed.clamp_min(1)[which]
            rows = (ends[e0:e1] - c - r0)[which] + i * c[which] // per
            scale = (c[which].double() / per).float()
            offs_p = offs_p.to(torch.int32)
            a_q = _grouped_intermediate(xs[rows], gu_q[e0:e1], offs_p, view.act)
            y_q = _gmm(a_q, down_q[e0:e1], offs_p)
            err = _probe_error(y[rows], y_q, weight[r0:r1][rows], scale)
            s["sensitivity"].index_add_(0, experts[rows], err.double())

    def add(self, batch: torch.Tensor) -> None:
        n_sum, n_max = len(_SUMMED), len(_MAXED)
        self.total[:n_sum] += batch[:n_sum]
        self.total[n_sum : n_sum + n_max] = torch.maximum(self.total[n_sum : n_sum + n_max], batch[n_sum : n_sum + n_max])
        self.total[n_sum + n_max :] += batch[n_sum + n_max :]

    def stat(self, key: str) -> torch.Tensor:
        return self.total[(_SUMMED + _MAXED).index(key)]

    def domain(self, name: str) -> torch.Tensor:
        return self.total[len(_SUMMED) + len(_MAXED) + self.domains.index(name)]


def _probe_error(y: torch.Tensor, y_q: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each probed slot's routing-weighted squared output error times its slot weight (``y``, ``y_q`` ``[..., D]``;
    ``weight``, ``scale`` ``[...]``). The difference is taken in the activation dtype (rounding 2^-9 relative: a
    ranking signal) and squared in fp32."""
    err = torch.linalg.vector_norm(y - y_q, dim=-1, dtype=torch.float32).pow(2)
    return err * weight.float().pow(2) * scale


def _expert_ranges(load: list[int], width: int, max_elems: int) -> list[tuple[int, int]]:
    """Contiguous expert ranges ``[e0, e1)`` whose routed rows x ``width`` stay within ``max_elems`` (an expert
    alone may exceed it)."""
    out, e0, rows = [], 0, 0
    for e, c in enumerate(load):
        if e > e0 and (rows + c) * width > max_elems:
            out.append((e0, e))
            e0, rows = e, 0
        rows += c
    out.append((e0, len(load)))
    return out


def _grouped_intermediate(xs: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, act) -> torch.Tensor:
    """``xs [N, D]`` sorted by expert (group ends ``offs``), ``gate_up [n, 2I, D]`` -> ``act(gate) * up [N, I]``."""
    gate, up = _gmm(xs, gate_up, offs).chunk(2, dim=-1)
    return act(gate) * up


def _gmm(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``xs [N, in]`` sorted by group (ends ``offs``) times each group's ``w [n, out, in]`` transposed -> ``[N, out]``."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(xs, w.transpose(1, 2), offs=offs)


_GROUPED_OK: dict[tuple, bool] = {}


def grouped_mm_ok(view: ExpertsView, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts' two projections on their device in ``dtype`` (CUDA's
    kernel takes bf16 with 16-byte aligned rows; the CPU's any float dtype from torch 2.9): tried once per device,
    dtype and shape on tiny groups, an empty one included; else the profile keeps its load buckets."""
    D, I = view.gate_up.shape[2], view.intermediate
    key = (view.gate_up.device.type, view.gate_up.device.index, dtype, D, I)
    if key not in _GROUPED_OK:
        size = torch.finfo(dtype).bits // 8
        ok = ((hasattr(torch, "_grouped_mm") or hasattr(torch.nn.functional, "grouped_mm"))
              and view.gate_up.dtype == dtype and view.down.dtype == dtype
              # every expert's slice 16-byte aligned (older CPU kernels require it; safetensors memory maps)
              and view.gate_up.data_ptr() % 16 == 0 and view.down.data_ptr() % 16 == 0 and (D * I * size) % 16 == 0)
        if ok:
            try:
                dev, n = view.gate_up.device, min(view.n_experts, 3)
                offs = on_device([1, 1, 2][-n:], dev, torch.int32)
                a = _grouped_intermediate(torch.zeros(2, D, dtype=dtype, device=dev), view.gate_up[:n], offs, view.act)
                _gmm(a, view.down[:n], offs)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def _rtn_probe(w: torch.Tensor) -> torch.Tensor:
    """``w [E, out, in]`` round-to-nearest at the probe's precision, dequantized, in ``w``'s dtype."""
    spec = Scheme(SENSITIVITY_BITS, effective_group_size(SENSITIVITY_GROUP, w.shape[2]))
    out = torch.empty_like(w)
    step = max(1, PROBE_CHUNK_BYTES // (4 * w[0].numel()))
    for i in range(0, w.shape[0], step):
        out[i : i + step] = quantize_weight(w[i : i + step], spec, w.dtype).dequantize()
    return out


def _slots(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos [n, k]`` of each expert's block ``t [n, C, d]`` -> ``[n, k, d]``."""
    return t.gather(1, pos[..., None].expand(-1, -1, t.shape[-1]))


def _probe_slots(mask: torch.Tensor, n_probe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's probe subset: for ``mask [n, C]`` (an expert's routed tokens first), slots ``[n, k]`` evenly
    strided over each expert's ``c`` routed tokens (``k = min(C, n_probe)``; all of them when ``c <= k``) and the
    weight of each slot ``[n, k]``: ``c / min(c, k)``, 0 for slots past ``c``."""
    n, C = mask.shape
    k = min(C, n_probe)
    count = mask.sum(dim=1, keepdim=True)
    probed = count.clamp(max=k)
    i = torch.arange(k, device=mask.device)[None]
    pos = (i * count // probed.clamp_min(1)).clamp_max(C - 1)
    scale = torch.where(i < probed, count.double() / probed.clamp_min(1), 0.0).float()
    return pos, scale


def _profile_layer(source: ModelSource, lw: Layerwise, idx: int, hidden: torch.Tensor, domains: list[str],
                   dom_idx: torch.Tensor, probe_tokens: int | None, is_moe: bool) -> _LayerStats | None:
    """Layer ``idx``'s routing statistics (None for a dense layer), ``hidden`` propagated through it in place. A
    function of its own so that the layer's experts view (which holds the expert weights: 22.5 GB on DeepSeek-V3)
    is gone before the next layer loads; as a loop variable it stayed alive through that load, ~18 GB over a
    one-layer run's peak on the DeepSeek-V3 shape."""
    S = hidden.shape[1]
    relay = Relay(lw.world)
    with lw.layer(idx) as layer:
        view = experts_of(source, layer, idx)
        if view is None and is_moe:
            raise ModelError(
                f"{source.path}: layer {idx} has routed experts on disk but quant does not recognise its experts "
                f"module ({type(layer).__name__}); supported: transformers' fused experts or a per-expert "
                "nn.ModuleList of Linear MLPs"
            )
        handle, acc = None, None
        if view is not None:
            acc = _LayerStats(view.n_experts, domains, lw.device, probe_tokens)
            channel = relay.channel(acc.add)
            handle = view.on_route(lambda x, i, w, acc=acc, view=view, ch=channel: ch.put(acc.batch(view, x, i, w)))

        def before(rows: slice, acc=acc) -> None:
            if acc is not None:
                acc.token_domain = on_device(dom_idx[rows].repeat_interleave(S), lw.device)

        lw.forward(layer, hidden, before_batch=before, out=hidden, after_step=relay.flush)
        if handle is not None:
            handle.remove()
        if acc is not None:  # the probe's RTN copy of the layer's experts (22.5 GB on DeepSeek-V3) goes now
            acc.release()
    return acc


def profile_routing(source: ModelSource, calib: CalibrationSet, lw: Layerwise,
                    probe_tokens: int | None = PROBE_TOKENS, min_tokens: int = 4) -> RoutingProfile:
    """Run the calibration tokens through the model layer by layer and collect routing statistics (each rank
    runs its share of the batches; every rank returns the same profile). ``probe_tokens``: the sensitivity
    probe's per-expert, per-batch token subset (None: every routed token). ``min_tokens``: what the log lines
    count as a cold expert (``profile.min_tokens``)."""
    domains = sorted(set(calib.domains))
    dom_idx = torch.tensor([domains.index(d) for d in calib.domains])
    hidden = lw.embed(calib.tokens)
    per_layer: dict[int, _LayerStats] = {}
    moe_layers = set(source.moe_layers())
    log.info("profile: %d layers", source.n_layers, extra=step("profile", 0, source.n_layers))
    for idx in range(source.n_layers):
        acc = _profile_layer(source, lw, idx, hidden, domains, dom_idx, probe_tokens, idx in moe_layers)
        if acc is not None:
            per_layer[idx] = acc
        done = step("profile", idx + 1, source.n_layers)
        if acc is not None:
            c = acc.stat("counts")
            log.info("profile layer %d: %d experts, most/least used %s, %d cold (fewer than %d routed tokens)",
                     idx, c.numel(), ratio_text(usage_ratio(c).item()), int(cold(c, min_tokens).sum()),
                     max(min_tokens, 1), extra=done)
        else:
            log.info("profile layer %d: dense", idx, extra=done)
        lw.world.raise_if_stopped(f"profile layer {idx} of {source.n_layers}")  # every rank, after the same layer
    layers = sorted(per_layer)
    stack = lambda key: torch.stack([per_layer[i].stat(key).cpu() for i in layers])  # noqa: E731
    return RoutingProfile(
        model_fingerprint=source.fingerprint, model=source.display_name, layers=layers,
        n_experts=int(stack("counts").shape[1]), top_k=source.top_k, n_tokens=int(calib.tokens.numel()),
        sample_ids=list(calib.sample_ids), **{k: stack(k) for k in _STATS},
        domain_counts={d: torch.stack([per_layer[i].domain(d).cpu() for i in layers]) for d in domains},
        sensitivity=stack("sensitivity"),
    )
