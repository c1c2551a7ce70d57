"""``quant estimate``: peak GPU memory, host memory, disk and time per stage, from config.json and tensor shapes.

Nothing is loaded but the shapes (``models.headers``). Memory is the sum of the tensors each stage's code holds at
its peak, named after the code that allocates them (bytes, per GPU):

- quantize = calibration activations ``[N, S, D]`` (on the GPU when they fit layerwise's 8 GiB budget, else one
  batch in flight) + one decoder layer (model dtype) + linear-input Hessians (fp32) + max over expert chunks of
  (that chunk's expert Hessians, fp32, chunks fit ``hessian_budget_gb`` + the int8 codes solved so far, which stay
  on the GPU until the layer file is written) + max(forward transient, solve working set). The forward transient
  is one batch's routed expert activations, the statistics' padded blocks and, where SDPA has no fused kernel for
  the head dims (queries/keys and values of different width: MLA), the materialized attention scores. The solve
  working set is ``SOLVE_FACTOR`` times the largest sub-batch ``sharing.sub_batches`` admits (a GPTQ solve
  allocates ~2.8x that estimate: copies, act-order permutations, the loss terms); for AWQ ``AWQ_FACTOR`` times the
  largest search sub-batch (``smooth.search_bytes``). AWQ's expert statistics come in the same chunks as GPTQ's
  (its first pass also sums every expert's mean |x|, no Hessians).
- profile = activations + layer + the W4 sensitivity probe, which rounds the rank's experts a few at a time in fp32
  into dequantized copies it keeps for the layer's batches (``profile_memory``).
- eval = the path ``evaluate.proxy_mode`` picks for the card: the whole model (transformers loads it to the CPU,
  then the GPU) + one batch of logits, or streamed: one decoder layer + one batch through it + the next layer's
  dequantization chunk + both lm_heads + final hidden states.

Time comes from throughputs measured on one H200 (quant/forecast/throughputs.py, each naming its BENCHMARKS.md record);
GPTQ's solve from its fp32 work at the fused column loop's rate, AWQ's search from its trial products.
``--gpus N`` follows quant's distributed run (quant/engine/quantize.py, quant/engine/rank_split.py): calibration batches are dealt
out over ranks, so each rank holds 1/N of the activations and runs 1/N of the forward passes; every rank holds the
whole layer and the non-expert modules' input Hessians, whose solves are shared out (the worst rank is assumed to
solve them all). GPTQ and RTN divide the experts (their statistics, Hessians, solves and codes) over ranks; AWQ
divides its searches over ranks but every rank accumulates every expert's statistics from every rank's batches
(quant/engine/awq_layer.py), so its Hessian chunks and passes are the one-GPU run's.
Export's shard files are divided over ranks, each at the one-GPU rate, up to an assumed storage bandwidth
(``STORAGE_BYTES_PER_S``). Eval dispatches the model over the N GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from quant.errors import PlanError
from quant.forecast.footprint import store_module_bytes
from quant.forecast.throughputs import THROUGHPUTS, awq_search_seconds, gptq_solve_seconds
from quant.measure.layer_damage import pass_cost
from quant.measure.profile import PROBE_CHUNK_BYTES, RoutingProfile
from quant.models import ModelSource
from quant.models.headers import Dims, dims
from quant.models.source import layer_of_key
from quant.plan.bitplan import BitPlan, plan_bits
from quant.plan.summary import summarize
from quant.recipe import Recipe, parse_scheme

GB = 1e9
ACTIVATION_BUDGET = 8 << 30  # layerwise.Layerwise's default activation_budget_bytes
STATS_BLOCK = 1 << 28  # routing.chunk_budget on a GPU: elements of one padded [n, C, .] block
SOLVE_FACTOR = 1.4  # allocated / sub_batches' estimate, fit to the fused solve's Qwen3-30B-A3B GPTQ peak (10.6 GB)
# allocated / search_bytes at the peak of a trial (rows, x / s, x Wᵀ, Q(W · s), y, y - x Wᵀ and its square), counted
# from smooth's code (DeepSeek-V3 gate/up 1.13, down 1.22) with room for the quantizer's temporaries; the measured
# peaks it forecasts: Qwen3-30B-A3B 10.7 GB (8.7 measured), DeepSeek-V3 58.2 GB (54.1)
AWQ_FACTOR = 1.4
HOST_BASE = 3 * GB  # python, torch, CUDA host state
HEADROOM = 0.95  # share of the card a forecast may fill
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# assumed, not measured: what the run directory's storage absorbs from all ranks' shard writes together (local NVMe
# RAID or a parallel file system); the export forecast scales with ranks up to it
STORAGE_BYTES_PER_S = 5e9


@dataclass
class StageForecast:
    stage: str
    gpu_bytes: float
    host_bytes: float
    disk_bytes: float
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)  # the largest terms of gpu_bytes, for messages
    note: str = ""


@dataclass
class Forecast:
    model: str
    params: int
    gpus: int
    gpu_memory_gb: float
    stages: list[StageForecast]
    checkpoint_bytes: dict[str, float]
    fitting_budgets: tuple[float, float] | None  # (hessian_budget_gb, solve_budget_gb) that fit, or None

    def too_big(self) -> StageForecast | None:
        return next((s for s in self.stages if s.gpu_bytes > HEADROOM * self.gpu_memory_gb * GB), None)


@dataclass(frozen=True)
class LayerShape:
    """What one decoder layer costs: bytes in the model dtype, its experts and its quantized linears."""

    index: int
    weight_bytes: float
    n_experts: int
    expert_in: tuple[int, int]  # (D, I): gate/up read D, down reads I
    expert_numel: float  # weights of one expert (all three projections)
    expert_code_bytes: float  # int8 codes + scales of one expert's planned projections
    linear_groups: tuple[tuple[int, int], ...]  # (in_features, summed out_features) of linears sharing an input
    linear_code_bytes: float
    active_params: float  # parameters a token passes through (attention, shared, top_k experts)
    store_bytes: float = 0.0  # the layer's file in the quantized store (codes packed, footprint.store_module_bytes)


def synthetic_profile(source: ModelSource) -> RoutingProfile:
    """Equal routing everywhere: plans keep their budgets (top_fraction, budget) without calibration data."""
    layers = source.moe_layers()
    n = max(source.n_experts(L) for L in layers)
    ones = torch.ones(len(layers), n, dtype=torch.float64)
    return RoutingProfile("estimate", source.display_name, layers, n, source.top_k, 0, [], ones, ones.clone(),
                          ones.clone(), ones.clone(), ones.clone(), sensitivity=ones.clone())


def _code_bytes(plan: BitPlan, name: str, numel: int) -> float:
    p = plan.modules[name]
    return 0.0 if p.keep else numel * (1 + 2 / p.group_size + (0 if p.symmetric else 1 / p.group_size))


def layer_shapes(source: ModelSource, plan: BitPlan, dtype_bytes: int, top_k: int) -> list[LayerShape]:
    numel: dict[int, int] = defaultdict(int)
    for key, shape in source.shapes().items():
        if (layer := layer_of_key(key)) is not None:
            numel[layer] += math.prod(shape)
    out = []
    for L in range(source.n_layers):
        mods = {n: m for n, m in source.modules.items() if m.layer == L}
        experts = [m for m in mods.values() if m.kind == "expert"]
        n_exp = len({m.expert for m in experts})
        ins = {m.name.rsplit(".", 1)[1]: m.in_features for m in experts if m.expert == experts[0].expert} if experts else {}
        e_codes = sum(_code_bytes(plan, m.name, m.numel) for m in experts) / max(n_exp, 1)
        groups: dict[tuple, list] = defaultdict(list)
        for m in mods.values():
            if m.kind != "expert" and not plan.modules[m.name].keep:
                groups[(m.kind, m.in_features)].append(m.out_features)
        dense = sum(m.numel for m in mods.values() if m.kind not in ("expert", "router"))
        expert_numel = sum(m.numel for m in experts) / max(n_exp, 1)
        out.append(LayerShape(L, numel[L] * dtype_bytes, n_exp, (ins.get("gate", 0), ins.get("down", 0)),
                              expert_numel, e_codes,
                              tuple((k[1], sum(v)) for k, v in groups.items()),
                              sum(_code_bytes(plan, m.name, m.numel) for m in mods.values() if m.kind != "expert"),
                              dense + min(top_k, n_exp) * expert_numel,
                              sum(store_module_bytes(m.in_features, m.out_features, plan.modules[m.name])
                                  for m in mods.values() if not plan.modules[m.name].keep)))
    return out


@dataclass(frozen=True)
class Run:
    """The recipe's numbers a forecast reads, per GPU: tokens, batch, budgets, dtype, ranks."""

    n_samples: int
    seq_len: int
    batch: int
    dtype_bytes: int
    algorithm: str
    hessian_budget_gb: float
    solve_budget_gb: float
    gpus: int
    awq_grid: int = 20
    solve_kernel: str = "fused"  # GPTQ's column loop (throughputs.SOLVE_KERNELS): "cuda-graph" for older records
    statistics: str = "auto"  # quantize.statistics; a forecast is for GPUs, where auto means reduce
    stored_read: float = 0.0  # a layer's stored bytes per dense byte read into their own buffer (an FP8 release: 0.5)

    @property
    def tokens(self) -> int:
        return self.n_samples * self.seq_len

    @property
    def hessians(self) -> bool:
        return self.algorithm != "rtn"

    @property
    def expert_ranks(self) -> int:
        """Ranks the experts' statistics are divided over: AWQ's are replicated (its searches are divided)."""
        return 1 if self.algorithm == "awq" else self.gpus


def _rank_activation_bytes(run: Run, d: Dims) -> float:
    """This rank's cached hidden states (its batches: layerwise deals batches out round-robin)."""
    rows = min(run.n_samples, math.ceil(math.ceil(run.n_samples / run.batch) / run.gpus) * run.batch)
    return rows * run.seq_len * d.hidden * run.dtype_bytes


def _activations(run: Run, d: Dims) -> float:
    """This rank's cached hidden states on the GPU: all of them when they fit the activation budget, else the two
    batches moved in and out of host memory."""
    full = _rank_activation_bytes(run, d)
    return full if full <= ACTIVATION_BUDGET else 2 * run.batch * run.seq_len * d.hidden * run.dtype_bytes


def forward_transient(layer: LayerShape, run: Run, d: Dims, stats_blocks: int) -> float:
    """One batch through the layer: routed expert activations, hidden copies, attention's q/k/v and output (no
    ``[S, S]`` scores: SDPA's fused kernels, the memory-efficient one also for MLA's unequal query/value head dims;
    the DeepSeek-V3 layer's measured peaks leave no room for 17 GB of scores), plus ``stats_blocks`` padded
    statistics blocks."""
    tokens = run.batch * run.seq_len
    routed = tokens * min(d.top_k, max(layer.n_experts, 1)) * 2 * layer.expert_in[1] * run.dtype_bytes * 2
    attention = tokens * d.heads * (2 * d.qk_head_dim + 2 * d.v_head_dim) * run.dtype_bytes
    block = min(STATS_BLOCK, tokens * d.top_k * max(d.hidden, 2 * layer.expert_in[1]))  # padded rows, capped
    return routed + attention + tokens * d.hidden * run.dtype_bytes * 4 + stats_blocks * block * run.dtype_bytes


def _reduced(layer: LayerShape, run: Run) -> bool:
    """Whether the ranks sum their own batches' statistics and add the sums (quantize.statistics: reduce, auto on
    GPUs): GPTQ when every expert's Hessians fit one pass (quantize._LayerJob.reduces_statistics), AWQ always."""
    from quant.engine.quantize import expert_hessian_bytes

    if run.gpus == 1 or not run.hessians or run.statistics == "ordered":
        return False
    if run.algorithm == "awq" or layer.n_experts == 0:  # a dense layer has no expert Hessians to fit
        return True
    return int(run.hessian_budget_gb * GB) // expert_hessian_bytes(*layer.expert_in) >= layer.n_experts


def _expert_chunks(layer: LayerShape, run: Run) -> list[int]:
    """Experts per Hessian pass on one rank (quantize._LayerJob.expert_chunks)."""
    from quant.engine.quantize import expert_hessian_bytes

    n = math.ceil(layer.n_experts / run.expert_ranks)
    if not n:
        return []
    per = expert_hessian_bytes(*layer.expert_in) if run.hessians else 0
    count = n if not per else max(1, min(n, int(run.hessian_budget_gb * GB) // per))
    return [min(count, n - f) for f in range(0, n, count)]


def _element_bytes(run: Run):
    """One element's estimated working set for the run's algorithm (what sizes its sub-batches)."""
    from quant.engine.awq_layer import search_bytes
    from quant.engine.rank_split import solve_bytes

    return search_bytes if run.algorithm == "awq" else solve_bytes


def _solve_sets(layer: LayerShape, run: Run, n_rank: int) -> tuple[list[tuple[int, float]], list[float]]:
    """Expert problems as (experts per sub-batch, its working set) and each linear group's working set."""
    per_element = _element_bytes(run)
    D, I = layer.expert_in
    experts = []
    for out_f, in_f in ((2 * I, D), (D, I)) if n_rank else ():
        per = per_element(out_f, in_f)
        n = max(1, min(n_rank, int(run.solve_budget_gb * GB) // per))
        experts.append((n, n * per))
    return experts, [per_element(out_f, in_f) for in_f, out_f in layer.linear_groups]


def _solve_problems(layer: LayerShape, run: Run, d: Dims, chunks: list[int]) -> list[tuple[int, int, int]]:
    """The sub-batches a layer's solves run, as (elements, out_features, in_features): each expert chunk's
    projections split as ``sharing.sub_batches`` splits them, then the linear groups; AWQ searches only the groups
    reading the hidden state (attention or dense MLP inputs: their s folds into a norm; counted also for a shared
    expert, which reuses the experts' s) and rounds the rest."""
    from quant.engine.rank_split import sub_batches

    D, I = layer.expert_in
    out = []
    for c in chunks:
        for out_f, in_f in ((2 * I, D), (D, I)):
            parts = sub_batches(list(range(c)), out_f, in_f, run.solve_budget_gb, _element_bytes(run))
            out += [(len(p), out_f, in_f) for p in parts]
    linears = [g for g in layer.linear_groups if run.algorithm != "awq" or g[0] == d.hidden]
    return out + [(1, out_f, in_f) for in_f, out_f in linears]


def quantize_memory(layer: LayerShape, run: Run, d: Dims) -> dict[str, float]:
    """Peak GPU bytes of quantizing ``layer`` on the busiest rank, by term (``total`` is the peak)."""
    from quant.engine.quantize import expert_hessian_bytes

    chunks = _expert_chunks(layer, run)
    per_h = expert_hessian_bytes(*layer.expert_in) if run.hessians else 0
    done, chunk_peak = 0, 0.0
    for count in chunks:  # a chunk's Hessians beside the codes of every expert solved so far
        done += count
        chunk_peak = max(chunk_peak, count * per_h + done * layer.expert_code_bytes)
    if _reduced(layer, run) and run.algorithm == "gptq":  # every expert's summed Hessians, beside this rank's codes
        chunk_peak = layer.n_experts * per_h + sum(chunks) * layer.expert_code_bytes
    lin_h = sum(4 * in_f**2 for in_f, _ in layer.linear_groups) if run.hessians else 0.0
    experts, linears = _solve_sets(layer, run, max(chunks, default=0))
    factor = AWQ_FACTOR if run.algorithm == "awq" else SOLVE_FACTOR
    ws_experts = factor * max((b for _, b in experts), default=0.0)
    transient = forward_transient(layer, run, d, 3 if run.hessians else 0)
    base = {"activations": _activations(run, d), "layer": layer.weight_bytes, "linear Hessians": lin_h}
    phase_experts = chunk_peak + max(ws_experts, transient)
    phase_linears = sum(chunks) * layer.expert_code_bytes + factor * max(linears, default=0.0)
    parts = {**base, "expert Hessians + codes": chunk_peak, "solve working set": ws_experts,
             "forward transient": transient}
    return {**parts, "total": sum(base.values()) + max(phase_experts, phase_linears)}


def quantize_seconds(layer: LayerShape, run: Run, d: Dims) -> float:
    """Load, statistics (one pass per expert chunk), solve (GPTQ's fp32 work or AWQ's trial products) and
    propagation."""
    t = THROUGHPUTS
    seconds = (layer.weight_bytes / t["load_bytes_per_s"]
               + run.tokens * layer.active_params / run.gpus / t["forward_param_tokens_per_s"])
    chunks = _expert_chunks(layer, run)
    if not run.hessians:
        return seconds + layer.weight_bytes / t["rtn_bytes_per_s"]
    D, I = layer.expert_in
    # statistics: ordered, each rank sums every batch (for its experts); reduced, its own batches (for every expert)
    reduced = _reduced(layer, run)
    macs = (run.tokens * d.top_k * (D**2 + I**2) * (layer.n_experts > 0) / (run.gpus if reduced else run.expert_ranks)
            + run.tokens * sum(in_f**2 for in_f, _ in layer.linear_groups) / (run.gpus if reduced else 1)
            + max(len(chunks), 1) * run.tokens * layer.active_params / run.gpus)
    problems = _solve_problems(layer, run, d, chunks)
    if run.algorithm == "awq":
        solve = awq_search_seconds(problems, run.awq_grid) / run.gpus  # each rank searches its share
    else:
        solve = gptq_solve_seconds(problems, run.solve_kernel)
    return seconds + macs / t["stats_macs_per_s"] + solve


def _run_of(recipe: Recipe, gpus: int, hessian_budget_gb: float | None = None,
            solve_budget_gb: float | None = None, solve_kernel: str = "fused") -> Run:
    q, c = recipe.quantize, recipe.calibration
    return Run(c.n_samples, c.seq_len, q.batch_size, DTYPE_BYTES[recipe.model.dtype], q.algorithm,
               hessian_budget_gb or q.hessian_budget_gb, solve_budget_gb or q.solve_budget_gb, gpus, q.awq_grid,
               solve_kernel, q.statistics)


def probe_chunk_bytes(n_experts: int, proj_numel: int) -> int:
    """fp32 bytes of the probe's largest chunk: as many of the ``n_experts`` projections of ``proj_numel`` weights
    as fit ``PROBE_CHUNK_BYTES`` (at least one; all of them when they fit, so a small model's is small)."""
    per = 4 * proj_numel
    return per * min(n_experts, max(1, PROBE_CHUNK_BYTES // max(per, 1)))


def profile_memory(layer: LayerShape, run: Run, d: Dims) -> dict[str, float]:
    """Peak GPU bytes of profiling ``layer`` by term. The W4 sensitivity probe (profile._rtn_probe) rounds the rank's
    experts a few at a time (fp32, ~12 bytes per weight of a ``PROBE_CHUNK_BYTES`` chunk at the peak of grid fitting
    and rounding) into dequantized copies in the model dtype, which it keeps for the layer's batches."""
    D, I = layer.expert_in
    n = math.ceil(layer.n_experts / run.gpus)
    copies = n * 3 * I * D * run.dtype_bytes
    probe = copies + max(3 * probe_chunk_bytes(n, I * D), forward_transient(layer, run, d, 4))
    parts = {"activations": _activations(run, d), "layer": layer.weight_bytes, "W4 sensitivity probe": probe}
    return {**parts, "total": sum(parts.values())}


def _profile_stage(layers: list[LayerShape], run: Run, d: Dims, recipe: Recipe) -> StageForecast:
    t = THROUGHPUTS
    seconds = sum(L.weight_bytes / t["load_bytes_per_s"] + run.tokens * L.active_params / t["profile_param_tokens_per_s"]
                  for L in layers)
    worst = max((profile_memory(L, run, d) for L in layers), key=lambda m: m["total"])
    stage = StageForecast("profile", worst["total"], _host(layers, run, d), 0.0, seconds,
                          parts={k: v for k, v in worst.items() if k != "total"})
    ls = recipe.profile.layer_sensitivity
    return stage if ls is None else _with_layer_damage(stage, layers, run, d, ls)


def _with_layer_damage(stage: StageForecast, layers: list[LayerShape], run: Run, d: Dims, ls) -> StageForecast:
    """The profile stage plus quant.measure.layer_damage's pass: the weights once more (in ``ls.dtype``), every stream
    through every later layer; branches on the GPU while they fit the activation budget, else on the host."""
    dt = DTYPE_BYTES[ls.dtype]
    tokens = ls.n_samples * run.seq_len
    forwards, param_tokens, streams = pass_cost([(L.active_params, L.n_experts > 0) for L in layers],
                                                len(ls.schemes), tokens)
    branches = streams * tokens * d.hidden * dt
    worst = max(layers, key=lambda L: L.weight_bytes)
    parts = {"layer damage: branches": branches if branches <= ACTIVATION_BUDGET else 0.0,
             "layer damage: layer": worst.weight_bytes * dt / run.dtype_bytes,
             "layer damage: RTN of 16 experts": 12 * 16 * worst.expert_numel}
    seconds = (sum(L.weight_bytes for L in layers) / THROUGHPUTS["load_bytes_per_s"]
               + param_tokens / THROUGHPUTS["profile_param_tokens_per_s"])
    gpu = max(stage.gpu_bytes, sum(parts.values()))
    originals = worst.n_experts * worst.expert_numel * dt  # the layer's expert weights, kept on the host
    host = HOST_BASE + parts["layer damage: layer"] + originals + branches - parts["layer damage: branches"]
    return dataclasses.replace(stage, gpu_bytes=gpu, host_bytes=max(stage.host_bytes, host),
                               seconds=stage.seconds + seconds, parts=stage.parts if gpu == stage.gpu_bytes else parts,
                               note=f"includes the layer-damage pass: {forwards} layer forwards over {tokens} tokens")


def _host(layers: list[LayerShape], run: Run, d: Dims) -> float:
    """Process baseline; the read-ahead's two page-locked staging buffers, each this rank's share of a layer
    (``quant.io.staging``: one uploading, the next being read), and for a release stored quantized the buffer its
    stored bytes are read into (``models.dequant``); a layer's codes copied out; activations kept on the CPU when
    this rank's exceed the activation budget."""
    acts = _rank_activation_bytes(run, d)
    layer = max((2 + run.stored_read) * L.weight_bytes / run.gpus + L.n_experts * L.expert_code_bytes
                + L.linear_code_bytes for L in layers)
    return HOST_BASE + layer + (acts if acts > ACTIVATION_BUDGET else 0.0)


def _quantize_stage(layers: list[LayerShape], run: Run, d: Dims) -> StageForecast:
    mems = [quantize_memory(L, run, d) for L in layers]
    worst = max(mems, key=lambda m: m["total"])
    store = sum(L.store_bytes for L in layers)
    seconds = sum(quantize_seconds(L, run, d) for L in layers)
    return StageForecast("quantize", worst["total"], _host(layers, run, d), store, seconds,
                         parts={k: v for k, v in worst.items() if k != "total"})


def checkpoint_bytes(plan: BitPlan, source: ModelSource, profile: RoutingProfile, formats: tuple[str, ...]) -> dict:
    """Format -> bytes: the plan summary's size (packed codes, scales, kept tensors); GPTQ adds g_idx and qzeros."""
    size = summarize(plan, source, profile)["headline"]["size_gb"] * GB
    out = {}
    for fmt in formats:
        extra = 0.0
        if fmt == "gptq":
            for name, p in plan.quantized().items():
                m = source.modules[name]
                extra += 4 * m.in_features + (m.out_features * m.in_features // p.group_size * p.bits / 8 if p.symmetric else 0)
        out[fmt] = size + extra
    return out


def _eval_stage(recipe: Recipe, source: ModelSource, plan: BitPlan, model_bytes: float, run: Run, d: Dims,
                layers: list[LayerShape], gpu_memory_gb: float) -> StageForecast:
    """The proxies' path as ``evaluate.proxy_mode`` picks it for this card. whole: the model + one batch of logits
    (a per-expert mix first dequantized to disk). streamed: max of streaming (a layer on the device, one batch
    through it, the read-ahead's dequantization chunk of the next layer, the kept lm_head, both final hidden states)
    and scoring (both lm_heads, hidden states, chunked logits)."""
    from quant.eval.evaluate import WHOLE_MAX_MEMORY_FRACTION
    from quant.eval.stream import LOGIT_CHUNK_BYTES, TEMPORARIES
    from quant.models.dequant import DEQUANT_CHUNK_BYTES
    from quant.plan.runtimes import problems_for

    e, t = recipe.eval, THROUGHPUTS
    whole = e.mode == "whole" or (e.mode == "auto" and model_bytes <= WHOLE_MAX_MEMORY_FRACTION * gpu_memory_gb * GB
                                  and not source.stored_quantized)  # an FP8 release streams (evaluate.proxy_mode)
    note = f"proxies {'whole' if whole else 'streamed'}" + ("; lm-eval tasks not included" if e.tasks else "")
    if whole:
        logits = e.batch_size * e.perplexity.seq_len * d.vocab * 4 * 2
        dense_copy = model_bytes if problems_for(plan, source, "transformers") else 0.0
        host = HOST_BASE + model_bytes + e.perplexity.n_samples * e.perplexity.seq_len * d.vocab * 4 * 2
        seconds = 2 * model_bytes / t["load_bytes_per_s"] + dense_copy / t["export_bytes_per_s"]
        return StageForecast("eval", model_bytes / run.gpus + logits, host, dense_copy, seconds, note=note)
    hidden = 2 * math.ceil(e.perplexity.n_samples / run.gpus) * e.perplexity.seq_len * d.hidden * run.dtype_bytes
    on_gpu = hidden / 2 <= ACTIVATION_BUDGET
    head = d.vocab * d.hidden * run.dtype_bytes
    chunk = min(e.perplexity.seq_len - 1, LOGIT_CHUNK_BYTES // (TEMPORARIES * 4 * d.vocab)) * TEMPORARIES * 4 * d.vocab
    batch = max(1, min(e.batch_size, math.ceil(e.perplexity.n_samples / run.gpus)))  # streamed_proxies' batches
    one_batch = dataclasses.replace(run, batch=batch, seq_len=e.perplexity.seq_len)
    worst = max(layers, key=lambda L: L.weight_bytes + forward_transient(L, one_batch, d, 0))
    # packed bytes uploaded a chunk at a time and their dense output (INT4 -> 16 bits: 4x the packed bytes)
    dequant = DEQUANT_CHUNK_BYTES * (1 + 2 * run.dtype_bytes)
    parts = {"decoder layer": worst.weight_bytes, "one batch through it": forward_transient(worst, one_batch, d, 0),
             "next layer's dequantization chunk": dequant, "lm_head": head, "final hidden states": hidden * on_gpu}
    gpu = max(sum(parts.values()), 2 * head + hidden * on_gpu + chunk)
    return StageForecast("eval", gpu, HOST_BASE + hidden * (not on_gpu), 0.0, 2 * model_bytes / t["load_bytes_per_s"],
                         parts=parts, note=note)


def _export_stage(recipe: Recipe, layers: list[LayerShape], ckpt: dict[str, float], gpus: int) -> StageForecast:
    """Every rank packs, writes and hashes its share of the shard files (balanced by bytes) at one H200 host's
    measured rate, together at most ``STORAGE_BYTES_PER_S``; a rank holds one shard (no larger than the largest
    checkpoint) and a layer's codes."""
    rate = min(gpus * THROUGHPUTS["export_bytes_per_s"], STORAGE_BYTES_PER_S)
    note = f"{gpus} ranks write shards, <= {STORAGE_BYTES_PER_S / GB:g} GB/s storage assumed" if gpus > 1 else ""
    shard = min(recipe.export.max_shard_gb * GB, max(ckpt.values(), default=0.0))
    return StageForecast("export", 0.0, HOST_BASE + max(L.weight_bytes for L in layers) + shard,
                         sum(ckpt.values()), sum(ckpt.values()) / rate, note=note)


def plan_for(recipe: Recipe, source: ModelSource) -> tuple[BitPlan, RoutingProfile]:
    profile = synthetic_profile(source)
    if recipe.profile.layer_sensitivity is not None:  # same damage in every layer, less with more bits / smaller groups
        profile.layer_damage = {s: torch.full((len(profile.layers),), 4.0 ** -b * g / 128, dtype=torch.float64)
                                for s, (b, g) in ((s, parse_scheme(s)) for s in recipe.profile.layer_sensitivity.schemes)}
    return plan_bits(profile, source.modules, recipe.plan, recipe.quantize.algorithm, source.n_layers,
                     recipe.export.formats), profile


def fitting_budgets(layers: list[LayerShape], recipe: Recipe, d: Dims, gpus: int, gpu_memory_gb: float):
    """The largest (hessian_budget_gb, solve_budget_gb) up to the recipe's whose quantize peak fits the card (halving
    the Hessian budget first, then the solve budget); None if nothing down to 1/256 of them fits."""
    limit = HEADROOM * gpu_memory_gb * GB
    q = recipe.quantize
    for solve in [q.solve_budget_gb / 2**k for k in range(6)]:
        for hessian in [q.hessian_budget_gb / 2**k for k in range(9)]:
            run = _run_of(recipe, gpus, hessian, solve)
            if max(quantize_memory(L, run, d)["total"] for L in layers) <= limit:
                return round(hessian, 3), round(solve, 3)
    return None


def forecast(recipe: Recipe, source: ModelSource, gpus: int = 1, gpu_memory_gb: float = 80.0,
             solve_kernel: str = "fused") -> Forecast:
    """Every stage's forecast for ``recipe`` on ``source`` (shapes only) with ``gpus`` GPUs of ``gpu_memory_gb``.
    ``solve_kernel``: GPTQ's column loop (``throughputs.SOLVE_KERNELS``): the engine's, or the one an older
    record measured."""
    if gpus < 1 or gpu_memory_gb <= 0:
        raise PlanError(f"--gpus must be >= 1 and --gpu-memory-gb > 0, got {gpus} and {gpu_memory_gb}")
    d = dims(source.config_dict)
    plan, profile = plan_for(recipe, source)
    run = dataclasses.replace(_run_of(recipe, gpus, solve_kernel=solve_kernel),
                              stored_read=0.5 if source.stored_quantized else 0.0)  # FP8: 1 of bf16's 2 bytes
    layers = layer_shapes(source, plan, run.dtype_bytes, d.top_k)
    model_bytes = sum(math.prod(s) for s in source.shapes().values()) * run.dtype_bytes
    ckpt = checkpoint_bytes(plan, source, profile, recipe.export.formats)
    tokens_bytes = recipe.calibration.n_samples * recipe.calibration.seq_len * 8
    profile_run = dataclasses.replace(run, batch=recipe.profile.batch_size)
    profile_stage = _profile_stage(layers, profile_run, d, recipe)
    stages = [StageForecast("calibrate", 0.0, HOST_BASE, tokens_bytes, 0.0), profile_stage,
              StageForecast("plan", 0.0, HOST_BASE, 0.0, 0.0), _quantize_stage(layers, run, d),
              _export_stage(recipe, layers, ckpt, gpus),
              _eval_stage(recipe, source, plan, model_bytes, run, d, layers, gpu_memory_gb)]
    params = sum(math.prod(s) for s in source.shapes().values())
    return Forecast(source.display_name, params, gpus, gpu_memory_gb, stages, ckpt,
                    fitting_budgets(layers, recipe, d, gpus, gpu_memory_gb))


def _gb(b: float) -> str:
    return f"{b / GB:.1f} GB" if b >= 0.1 * GB else f"{b / 1e6:.0f} MB"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    m = round(s / 60)
    return f"{m // 60}h {m % 60:02d}m" if m >= 60 else f"{m} min"


def params_text(n: float) -> str:
    """A parameter count as people write it: 671.0 B, 31.2 M, 12.3 K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f}"


def render(f: Forecast, recipe: Recipe) -> str:
    q = recipe.quantize
    lines = [f"{f.model}: {params_text(f.params)} parameters; {f.gpus} GPU(s) x {f.gpu_memory_gb:g} GB; "
             f"{recipe.calibration.n_samples} x {recipe.calibration.seq_len} calibration tokens, {q.algorithm}",
             f"{'stage':<10} {'peak GPU':>10} {'host':>10} {'disk':>10} {'time (H200)':>12}"]
    for s in f.stages:
        lines.append(f"{s.stage:<10} {_gb(s.gpu_bytes):>10} {_gb(s.host_bytes):>10} {_gb(s.disk_bytes):>10} "
                     f"{_duration(s.seconds):>12}{'  (' + s.note + ')' if s.note else ''}")
    lines.append("checkpoints: " + ", ".join(f"{fmt} {_gb(b)}" for fmt, b in f.checkpoint_bytes.items()))
    quant = next(s for s in f.stages if s.stage == "quantize")
    lines.append("quantize peak: " + ", ".join(f"{k} {_gb(v)}" for k, v in quant.parts.items()))
    if f.fitting_budgets == (q.hessian_budget_gb, q.solve_budget_gb):
        lines.append(f"budgets: the recipe's quantize.hessian_budget_gb {q.hessian_budget_gb:g} and solve_budget_gb "
                     f"{q.solve_budget_gb:g} fit the card")
    elif f.fitting_budgets:
        h, s = f.fitting_budgets
        lines.append(f"budgets: quantize.hessian_budget_gb {h:g} and solve_budget_gb {s:g} fit the card (the recipe's "
                     f"{q.hessian_budget_gb:g} and {q.solve_budget_gb:g} do not)")
    else:
        lines.append("budgets: no quantize.hessian_budget_gb / solve_budget_gb fits the card")
    ranks = ""
    if f.gpus > 1:
        experts = ("AWQ searches divided over ranks, its statistics replicated on every rank" if q.algorithm == "awq"
                   else "experts divided over ranks")
        ranks = f"{experts}, every rank holds the layer and its share of the batches; "
    lines.append(f"assumes: {ranks}time from one H200's throughputs (BENCHMARKS.md)")
    return "\n".join(lines)


def check_fits(f: Forecast, recipe: Recipe) -> None:
    """Raise PlanError (one line) naming the stage that does not fit and what to change."""
    stage = f.too_big()
    if stage is None:
        return
    need = (f"the {stage.stage} stage needs {_gb(stage.gpu_bytes)} per GPU but {f.gpus} x {f.gpu_memory_gb:g} GB "
            f"cards leave {_gb(HEADROOM * f.gpu_memory_gb * GB)}")
    if stage.stage == "quantize" and f.fitting_budgets:
        h, s = f.fitting_budgets
        raise PlanError(f"{need}; set quantize.hessian_budget_gb: {h:g} and quantize.solve_budget_gb: {s:g}, or "
                        f"use more GPUs")
    biggest = max(stage.parts, key=stage.parts.get) if stage.parts else "the model"
    raise PlanError(f"{need} ({biggest} alone: {_gb(stage.parts.get(biggest, stage.gpu_bytes))}); use more or "
                    f"larger GPUs (--gpus, --gpu-memory-gb)")
