"""What one decoder layer costs in the quantize and profile stages: its shape, the recipe's workload, peak GPU bytes
and seconds, sized by the engine's own decisions.

- quantize = calibration activations ``[N, S, D]`` (on the GPU when they fit layerwise's activation budget,
  ``engine.layerwise.ACTIVATION_BUDGET_BYTES``, else one batch in flight) + one decoder layer (model dtype) +
  linear-input Hessians (fp32) + max over expert chunks of (that chunk's expert Hessians, fp32, chunks fit
  ``hessian_budget_gb`` + the int8 codes solved so far, which stay on the GPU until the layer file is written) +
  max(forward transient, solve working set). The forward transient is one batch's routed expert activations, the
  statistics' padded blocks (``quantize.routing.GPU_BLOCK_ELEMS``) and, where SDPA has no fused kernel for the head
  dims (queries/keys and values of different width: MLA), the materialized attention scores. The solve working set
  is the algorithm's working-set factor (``algorithm_costs``) times the largest sub-batch
  ``quantize.budgets.sub_batch_cap`` admits, each element sized as the algorithm sizes it
  (``Algorithm.sub_batch_bytes``: GPTQ's solve, AWQ's search). AWQ's expert statistics come in the same chunks as
  GPTQ's (its first pass also sums every expert's mean |x|, no Hessians).
- profile = activations + layer + the W4 sensitivity probe, which rounds the rank's experts a few at a time in fp32
  into dequantized copies it keeps for the layer's batches (``profile_memory``).

The engine decides, the forecast asks it: expert chunks by Hessian budget, sub-batches by solve budget, whether the
statistics are summed over ranks (``quant.quantize.budgets``), what each algorithm accumulates, whether every rank
holds every expert's statistics and what one element of its sub-batches holds (``quant.quantize.algorithms``). What
only the forecast knows of an algorithm (its working-set factor, solve time, solved linear groups) is its
``algorithm_costs.AlgorithmCost``; nothing here tests an algorithm's name.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from quant.forecast.algorithm_costs import AlgorithmCost, algorithm_cost
from quant.forecast.footprint import store_module_bytes
from quant.forecast.throughputs import THROUGHPUTS
from quant.layerwise import ACTIVATION_BUDGET_BYTES
from quant.models import ModelSource
from quant.models.headers import Dims
from quant.models.source import layer_of_key
from quant.plan.bitplan import BitPlan
from quant.profile.profile import PROBE_CHUNK_BYTES
from quant.quantize.algorithms import Algorithm, algorithm
from quant.quantize.budgets import (
    expert_chunks,
    expert_hessian_bytes,
    reduce_asked,
    sub_batch_cap,
    sub_batches,
)
from quant.quantize.routing import GPU_BLOCK_ELEMS
from quant.recipe import Recipe

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
class Workload:
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
    def engine(self) -> Algorithm:
        """The engine's algorithm: its statistics, its reduction over ranks, its sub-batches' sizes."""
        return algorithm(self.algorithm)

    @property
    def cost(self) -> AlgorithmCost:
        """What only the forecast knows of the algorithm: working-set factor, solve time, solved linear groups."""
        return algorithm_cost(self.algorithm)

    @property
    def hessians(self) -> bool:
        return self.engine.statistics.hessians

    @property
    def expert_ranks(self) -> int:
        """Ranks the experts' statistics are divided over: replicated ones (AWQ's) are on every rank."""
        return 1 if self.engine.statistics.replicated else self.gpus


def rank_activation_bytes(run: Workload, d: Dims) -> float:
    """This rank's cached hidden states (its batches: layerwise deals batches out round-robin)."""
    rows = min(run.n_samples, math.ceil(math.ceil(run.n_samples / run.batch) / run.gpus) * run.batch)
    return rows * run.seq_len * d.hidden * run.dtype_bytes


def activation_bytes(run: Workload, d: Dims) -> float:
    """This rank's cached hidden states on the GPU: all of them when they fit the activation budget, else the two
    batches moved in and out of host memory."""
    full = rank_activation_bytes(run, d)
    return full if full <= ACTIVATION_BUDGET_BYTES else 2 * run.batch * run.seq_len * d.hidden * run.dtype_bytes


def forward_transient(layer: LayerShape, run: Workload, d: Dims, stats_blocks: int) -> float:
    """One batch through the layer: routed expert activations, hidden copies, attention's q/k/v and output (no
    ``[S, S]`` scores: SDPA's fused kernels, the memory-efficient one also for MLA's unequal query/value head dims;
    the DeepSeek-V3 layer's measured peaks leave no room for 17 GB of scores), plus ``stats_blocks`` padded
    statistics blocks."""
    tokens = run.batch * run.seq_len
    routed = tokens * min(d.top_k, max(layer.n_experts, 1)) * 2 * layer.expert_in[1] * run.dtype_bytes * 2
    attention = tokens * d.heads * (2 * d.qk_head_dim + 2 * d.v_head_dim) * run.dtype_bytes
    block = min(GPU_BLOCK_ELEMS, tokens * d.top_k * max(d.hidden, 2 * layer.expert_in[1]))  # padded rows, capped
    return routed + attention + tokens * d.hidden * run.dtype_bytes * 4 + stats_blocks * block * run.dtype_bytes


def statistics_reduced(layer: LayerShape, run: Workload) -> bool:
    """Whether the ranks sum their own batches' statistics and add the sums, as the engine decides it
    (``budgets.reduce_asked`` on GPUs, then the algorithm's ``reduces_statistics``: GPTQ when every expert's
    Hessians fit one pass, AWQ always)."""
    n = layer.n_experts  # a dense layer has no expert Hessians: no pass
    passes = len(expert_chunks(range(n), n, expert_hessian_bytes(*layer.expert_in), run.hessian_budget_gb)) if n else 0
    return run.engine.reduces_statistics(reduce_asked(run.statistics, run.gpus, "nccl"), passes)


def expert_pass_sizes(layer: LayerShape, run: Workload) -> list[int]:
    """Experts per Hessian pass on the busiest rank (``budgets.expert_chunks`` over its share of the experts; RTN's
    experts, with no Hessians, count as one pass)."""
    n = math.ceil(layer.n_experts / run.expert_ranks)
    if not n:
        return []
    if not run.hessians:
        return [n]
    per = expert_hessian_bytes(*layer.expert_in)
    return [count for _, count in expert_chunks(range(n), n, per, run.hessian_budget_gb)]


def _solve_sets(layer: LayerShape, run: Workload, n_rank: int) -> tuple[list[tuple[int, float]], list[float]]:
    """Expert problems as (experts per sub-batch, its working set) and each linear group's working set."""
    per_element = run.engine.sub_batch_bytes
    D, I = layer.expert_in
    experts = []
    for out_f, in_f in ((2 * I, D), (D, I)) if n_rank else ():
        per = per_element(out_f, in_f)
        n = min(n_rank, sub_batch_cap(out_f, in_f, run.solve_budget_gb, per_element))  # the largest sub-batch
        experts.append((n, n * per))
    return experts, [per_element(out_f, in_f) for in_f, out_f in layer.linear_groups]


def _solve_problems(layer: LayerShape, run: Workload, d: Dims, chunks: list[int]) -> list[tuple[int, int, int]]:
    """The sub-batches a layer's solves run, as (elements, out_features, in_features): each expert chunk's
    projections split as ``budgets.sub_batches`` splits them, then the linear groups the algorithm solves
    (``AlgorithmCost.solved_groups``)."""
    D, I = layer.expert_in
    out = []
    for c in chunks:
        for out_f, in_f in ((2 * I, D), (D, I)):
            parts = sub_batches(list(range(c)), out_f, in_f, run.solve_budget_gb, run.engine.sub_batch_bytes)
            out += [(len(p), out_f, in_f) for p in parts]
    return out + [(1, out_f, in_f) for in_f, out_f in run.cost.solved_groups(layer.linear_groups, d.hidden)]


def quantize_memory(layer: LayerShape, run: Workload, d: Dims) -> dict[str, float]:
    """Peak GPU bytes of quantizing ``layer`` on the busiest rank, by term (``total`` is the peak)."""
    chunks = expert_pass_sizes(layer, run)
    per_h = expert_hessian_bytes(*layer.expert_in) if run.hessians else 0
    done, chunk_peak = 0, 0.0
    for count in chunks:  # a chunk's Hessians beside the codes of every expert solved so far
        done += count
        chunk_peak = max(chunk_peak, count * per_h + done * layer.expert_code_bytes)
    # statistics divided over ranks but summed over them instead (one pass: GPTQ): every expert's summed Hessians,
    # beside this rank's codes
    if statistics_reduced(layer, run) and not run.engine.statistics.replicated:
        chunk_peak = layer.n_experts * per_h + sum(chunks) * layer.expert_code_bytes
    lin_h = sum(4 * in_f**2 for in_f, _ in layer.linear_groups) if run.hessians else 0.0
    experts, linears = _solve_sets(layer, run, max(chunks, default=0))
    factor = run.cost.working_set_factor
    ws_experts = factor * max((b for _, b in experts), default=0.0)
    transient = forward_transient(layer, run, d, 3 if run.hessians else 0)
    base = {"activations": activation_bytes(run, d), "layer": layer.weight_bytes, "linear Hessians": lin_h}
    phase_experts = chunk_peak + max(ws_experts, transient)
    phase_linears = sum(chunks) * layer.expert_code_bytes + factor * max(linears, default=0.0)
    parts = {**base, "expert Hessians + codes": chunk_peak, "solve working set": ws_experts,
             "forward transient": transient}
    return {**parts, "total": sum(base.values()) + max(phase_experts, phase_linears)}


def quantize_seconds(layer: LayerShape, run: Workload, d: Dims, read_ahead: bool = False) -> float:
    """Load, statistics (one pass per expert chunk), solve (GPTQ's fp32 work or AWQ's trial products) and
    propagation. ``read_ahead``: the layer was read while the one before it computed (every layer but a stage's
    first, ``engine.layerwise.LayerReader``), so it takes the longer of its load and its compute."""
    t = THROUGHPUTS
    load = layer.weight_bytes / t["load_bytes_per_s"]
    compute = _quantize_compute_seconds(layer, run, d)
    return max(load, compute) if read_ahead else load + compute


def _quantize_compute_seconds(layer: LayerShape, run: Workload, d: Dims) -> float:
    t = THROUGHPUTS
    seconds = run.tokens * layer.active_params / run.gpus / t["forward_param_tokens_per_s"]
    chunks = expert_pass_sizes(layer, run)
    if not run.hessians:  # no statistics to gather: the solves alone (RTN's rounding)
        return seconds + run.cost.solve_seconds(layer, [], run)
    D, I = layer.expert_in
    # statistics: ordered, each rank sums every batch (for its experts); reduced, its own batches (for every expert)
    reduced = statistics_reduced(layer, run)
    macs = (run.tokens * d.top_k * (D**2 + I**2) * (layer.n_experts > 0) / (run.gpus if reduced else run.expert_ranks)
            + run.tokens * sum(in_f**2 for in_f, _ in layer.linear_groups) / (run.gpus if reduced else 1)
            + max(len(chunks), 1) * run.tokens * layer.active_params / run.gpus)
    problems = _solve_problems(layer, run, d, chunks)
    return seconds + macs / t["stats_macs_per_s"] + run.cost.solve_seconds(layer, problems, run)


def workload_of(recipe: Recipe, gpus: int, hessian_budget_gb: float | None = None,
            solve_budget_gb: float | None = None, solve_kernel: str = "fused") -> Workload:
    q, c = recipe.quantize, recipe.calibration
    return Workload(c.n_samples, c.seq_len, q.batch_size, DTYPE_BYTES[recipe.model.dtype], q.algorithm,
               hessian_budget_gb or q.hessian_budget_gb, solve_budget_gb or q.solve_budget_gb, gpus, q.awq_grid,
               solve_kernel, q.statistics)


def probe_chunk_bytes(n_experts: int, proj_numel: int) -> int:
    """fp32 bytes of the probe's largest chunk: as many of the ``n_experts`` projections of ``proj_numel`` weights
    as fit ``PROBE_CHUNK_BYTES`` (at least one; all of them when they fit, so a small model's is small)."""
    per = 4 * proj_numel
    return per * min(n_experts, max(1, PROBE_CHUNK_BYTES // max(per, 1)))


def profile_memory(layer: LayerShape, run: Workload, d: Dims) -> dict[str, float]:
    """Peak GPU bytes of profiling ``layer`` by term. The W4 sensitivity probe (profile._rtn_probe) rounds the rank's
    experts a few at a time (fp32, ~12 bytes per weight of a ``PROBE_CHUNK_BYTES`` chunk at the peak of grid fitting
    and rounding) into dequantized copies in the model dtype, which it keeps for the layer's batches."""
    D, I = layer.expert_in
    n = math.ceil(layer.n_experts / run.gpus)
    copies = n * 3 * I * D * run.dtype_bytes
    probe = copies + max(3 * probe_chunk_bytes(n, I * D), forward_transient(layer, run, d, 4))
    parts = {"activations": activation_bytes(run, d), "layer": layer.weight_bytes, "W4 sensitivity probe": probe}
    return {**parts, "total": sum(parts.values())}
