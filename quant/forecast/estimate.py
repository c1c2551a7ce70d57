"""``quant estimate``: peak GPU memory, host memory, disk and time per stage, from config.json and tensor shapes.

Nothing is loaded but the shapes (``models.headers``). Memory is the sum of the tensors each stage's code holds at
its peak, named after the code that allocates them (bytes, per GPU):

- quantize, profile: per decoder layer, as ``quant.forecast.layer_costs`` counts it (the engine's own decisions size
  the work: expert passes, sub-batches, reduced statistics); the stage's peak is its worst layer's. The profile
  stage adds the layer-damage pass when the recipe asks for it.
- eval = the path ``evaluate.proxy_mode`` picks for the card: the whole model (transformers loads it to the CPU,
  then the GPU) + one batch of logits, or streamed: one decoder layer + one batch through it + the next layer's
  dequantization chunk + both lm_heads + final hidden states.

Time comes from throughputs measured on one H200 (quant/forecast/throughputs.py, each naming its measurement's record);
GPTQ's solve from its fp32 work at the fused column loop's rate, AWQ's search from its trial products.
``--gpus N`` follows quant's distributed run (quant/quantize/driver.py, quant/quantize/rank_split.py): calibration batches are dealt
out over ranks, so each rank holds 1/N of the activations and runs 1/N of the forward passes; every rank holds the
whole layer and the non-expert modules' input Hessians, whose solves are shared out (the worst rank is assumed to
solve them all). GPTQ and RTN divide the experts (their statistics, Hessians, solves and codes) over ranks; AWQ
divides its searches over ranks but every rank accumulates every expert's statistics from every rank's batches
(quant/quantize/awq_layer.py), so its Hessian chunks and passes are the one-GPU run's.
Export's shard files are divided over ranks, each at the one-GPU rate, up to an assumed storage bandwidth
(``STORAGE_BYTES_PER_S``). Eval dispatches the model over the N GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from quant.errors import PlanError, RecipeError
from quant.forecast.algorithm_costs import algorithm_cost
from quant.forecast.layer_costs import (
    DTYPE_BYTES,
    LayerShape,
    Workload,
    forward_transient,
    layer_shapes,
    profile_memory,
    quantize_memory,
    quantize_seconds,
    rank_activation_bytes,
    workload_of,
)
from quant.forecast.throughputs import THROUGHPUTS
from quant.io.staging import host_total_bytes
from quant.layerwise import ACTIVATION_BUDGET_BYTES
from quant.models import ModelSource
from quant.models.expert_compute import WIDEN_BYTES
from quant.models.headers import Dims, dims
from quant.models.source import layer_of_key
from quant.plan.bitplan import BitPlan, plan_bits
from quant.plan.summary import summarize
from quant.profile.damage_memory import place
from quant.profile.layer_damage import pass_carry, pass_cost, pass_samples, working_streams
from quant.profile.profile import RoutingProfile
from quant.recipe import Recipe
from quant.scheme import Scheme

GB = 1e9
HOST_BASE = 3 * GB  # python, torch, CUDA host state
HEADROOM = 0.95  # share of the card a forecast may fill
MAX_MEMORY_GB = 1e6  # the largest GPU or host memory a forecast takes (a petabyte): byte counts stay exact integers
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
    host_memory_gb: float | None = None  # the host's memory, when the forecast is to be checked against it

    def too_big(self) -> StageForecast | None:
        return next((s for s in self.stages if s.gpu_bytes > HEADROOM * self.gpu_memory_gb * GB), None)

    def too_big_for_host(self) -> StageForecast | None:
        if self.host_memory_gb is None:
            return None
        worst = max(self.stages, key=lambda s: s.host_bytes)
        return worst if worst.host_bytes > HEADROOM * self.host_memory_gb * GB else None


def synthetic_profile(source: ModelSource) -> RoutingProfile:
    """Equal routing everywhere: plans keep their budgets (top_fraction, budget) without calibration data."""
    layers = source.moe_layers()
    n = max(source.n_experts(L) for L in layers)
    ones = torch.ones(len(layers), n, dtype=torch.float64)
    return RoutingProfile("estimate", source.display_name, layers, n, source.top_k, 0, [], ones, ones.clone(),
                          ones.clone(), ones.clone(), ones.clone(), sensitivity=ones.clone())


def _profile_stage(layers: list[LayerShape], run: Workload, d: Dims, recipe: Recipe,
                   gpu_memory_gb: float, host_bytes: float) -> StageForecast:
    seconds = walk_seconds([(L.weight_bytes, run.tokens * L.active_params) for L in layers],
                           THROUGHPUTS["profile_param_tokens_per_s"])
    worst = max((profile_memory(L, run, d) for L in layers), key=lambda m: m["total"])
    stage = StageForecast("profile", worst["total"], _host(layers, run, d), 0.0, seconds,
                          parts={k: v for k, v in worst.items() if k != "total"})
    ls = recipe.profile.layer_sensitivity
    return stage if ls is None else _with_layer_damage(stage, layers, run, d, ls, gpu_memory_gb, host_bytes)


def _with_layer_damage(stage: StageForecast, layers: list[LayerShape], run: Workload, d: Dims, ls,
                       gpu_memory_gb: float, host_bytes: float) -> StageForecast:
    """The profile stage plus quant.profile.layer_damage's pass (``ls.method``): its walks over the weights (the
    routed experts as stored, the rest in ``ls.dtype``) and its layer forwards (``pass_cost``), at the pass's own
    rates (``damage_*`` in throughputs.py, fp32; a 16-bit pass at the profile's). Its hidden states: exact, every
    branch on the GPU while they fit the activation budget. Bounded, as the walk back holds them (``_walk_back_memory``);
    the host holds the pass's read-ahead (two layers as stored) and the streams ``damage_memory.place`` keeps there,
    the temporary directory the clean inputs it sends to files."""
    dt = DTYPE_BYTES[ls.dtype]
    tokens = pass_samples(ls.n_samples, run.n_samples) * run.seq_len  # as the run clamps them
    ls = ls.model_copy(update={"carry_layers": pass_carry(ls.carry_layers, len(layers))})
    cost = pass_cost([(L.active_params, L.n_experts > 0) for L in layers], len(ls.schemes), tokens, ls.method,
                     ls.carry_layers, ls.draws)
    stream = tokens * d.hidden * dt
    worst = max(layers, key=lambda L: L.weight_bytes)
    layer = pass_layer_bytes(worst, run, dt)
    # a range of experts widened (fp32) with its round-to-nearest temporaries (codes, scales, the dequantized copy)
    widened = 3 * min(WIDEN_BYTES, worst.n_experts * worst.expert_numel * dt)
    spilled = 0.0
    if ls.method == "exact":
        hidden = cost.streams * stream
        parts = {"layer damage: layer": layer, "layer damage: widened experts and their RTN": widened,
                 "layer damage: hidden states": hidden if hidden <= ACTIVATION_BUDGET_BYTES else 0.0}
        on_host = hidden - parts["layer damage: hidden states"]
        gpu_pass = sum(parts.values())
    else:
        parts, on_host, spilled = _walk_back_memory(worst, layer, widened, stream, run, d, ls, len(layers),
                                                    int(gpu_memory_gb * GB), host_bytes)
        gpu_pass = sum(parts.values())
    seconds = _pass_seconds(layers, cost, tokens, ls.method, dt)
    gpu = max(stage.gpu_bytes, gpu_pass)
    host = HOST_BASE + 2 * worst.weight_bytes + on_host  # the pass's read-ahead: two staging buffers of a layer
    return dataclasses.replace(stage, gpu_bytes=gpu, host_bytes=max(stage.host_bytes, host),
                               disk_bytes=stage.disk_bytes + spilled, seconds=stage.seconds + seconds,
                               parts=stage.parts if gpu == stage.gpu_bytes else parts,
                               note=f"includes the layer-damage pass ({ls.method}): {cost.layer_forwards} layer "
                                    f"forwards over {tokens} tokens" + (
                                        f"; clean inputs {spilled / GB:.1f} GB in TMPDIR" if spilled else ""))


def walk_seconds(layers: list[tuple[float, float]], rate: float) -> float:
    """One walk over ``layers`` (bytes read, param-tokens computed) with the next layer read while one computes
    (``engine.layerwise.LayerReader``): the first layer's read, then each layer the longer of its read and its
    compute, plus a fixed cost per layer (``layer_read_bytes_per_s``, ``walk_seconds_per_layer``)."""
    t = THROUGHPUTS
    read, fixed = t["layer_read_bytes_per_s"], t["walk_seconds_per_layer"]
    if not layers:
        return 0.0
    return layers[0][0] / read + sum(max(n_bytes / read, work / rate) + fixed for n_bytes, work in layers)


def _pass_seconds(layers: list[LayerShape], cost, tokens: int, method: str, dt: int) -> float:
    """The pass's walks (bounded: the clean walk, one forward a layer, then the walk back, the rest of
    ``cost.per_layer``; exact: one walk), at the pass's fp32 rate (``damage_param_tokens_per_s``; a 16-bit pass at the
    profile's)."""
    rate = THROUGHPUTS["damage_param_tokens_per_s" if dt == 4 else "profile_param_tokens_per_s"]
    walks = [[1] * len(layers), [n - 1 for n in cost.per_layer]] if method == "bounded" else [list(cost.per_layer)]
    return sum(walk_seconds([(L.weight_bytes, n * tokens * L.active_params)
                             for L, n in zip(layers, walk, strict=True) if n > 0], rate) for walk in walks)


def pass_layer_bytes(layer: LayerShape, run: Workload, dt: int) -> float:
    """A decoder layer as the pass holds it: routed experts in the checkpoint's dtype (at most the pass's), the rest in
    the pass's dtype (``damage_memory.pass_layer_bytes``)."""
    experts = layer.n_experts * layer.expert_numel * run.dtype_bytes
    return (layer.weight_bytes - experts) * dt / run.dtype_bytes + experts * min(dt, run.dtype_bytes) / run.dtype_bytes


def _walk_back_memory(worst: LayerShape, layer: float, widened: float, stream: float, run: Workload, d: Dims, ls,
                      n_layers: int, card: int, host_bytes: float) -> tuple[dict[str, float], float, float]:
    """The bounded pass's device peak on ``card`` bytes as parts that sum to it, the bytes it keeps on the host, and
    those it writes to files. Always the ``carry + 1`` layers and the streams ``damage_memory.place`` keeps on the
    GPU (the gradients and branches, then every layer's clean input or a window of ``carry + 2``); then either a
    scheme's branch (a range of experts widened with their round-to-nearest, one batch's forward, its routed rows in
    quant's experts forward) or the gradient carried down (its own layer alone resident, one batch's autograd graph,
    ~3 forward transients), whichever is larger, at the batch ``FittingBatches`` halves down to until it fits."""
    dt = DTYPE_BYTES[ls.dtype]
    n_inputs, n_working = n_layers + 1, working_streams(len(ls.schemes), ls.carry_layers, ls.draws)
    working, inputs, _ = place(card, int(layer), int(stream), n_inputs, n_working, ls.carry_layers, int(host_bytes))
    layers_part = "layer damage: layers (the one walked back and those kept above)"
    resident = {layers_part: (1 + ls.carry_layers) * layer,
                "layer damage: clean inputs": (n_inputs if inputs == "device" else ls.carry_layers + 2) * stream,
                "layer damage: gradients and branches": n_working * stream if working else 0.0}
    on_host = (n_inputs * stream if inputs == "host" else 0) + (0 if working else n_working * stream)
    spilled = n_inputs * stream if inputs == "disk" else 0.0
    full = forward_transient(worst, run, d, 0) * dt / run.dtype_bytes  # one batch of the Layerwise rows
    rows, limit = run.batch, HEADROOM * card
    while True:
        fwd = full * rows / run.batch
        routed = rows * run.seq_len * min(d.top_k, max(worst.n_experts, 1)) * d.hidden * dt
        branch = {"layer damage: widened experts and their RTN": widened, "layer damage: a batch forward": fwd,
                  "layer damage: its routed rows": routed}
        # the backward pass runs with its own layer alone resident (those above are released once its branches
        # are made)
        back = resident | {layers_part: layer, "layer damage: backward through a layer": 3 * (fwd + routed)}
        parts = max(resident | branch, back, key=lambda p: sum(p.values()))
        if sum(parts.values()) <= limit or rows == 1:  # FittingBatches halves the batch until it fits
            return parts, on_host, spilled
        rows //= 2


def _host(layers: list[LayerShape], run: Workload, d: Dims) -> float:
    """Process baseline; the read-ahead's two page-locked staging buffers, each this rank's share of a layer
    (``quant.io.staging``: one uploading, the next being read), and for a release stored quantized the buffer its
    stored bytes are read into (``models.dequant``); a layer's codes copied out; activations kept on the CPU when
    this rank's exceed the activation budget."""
    acts = rank_activation_bytes(run, d)
    layer = max((2 + run.stored_read) * L.weight_bytes / run.gpus + L.n_experts * L.expert_code_bytes
                + L.linear_code_bytes for L in layers)
    return HOST_BASE + layer + (acts if acts > ACTIVATION_BUDGET_BYTES else 0.0)


def _quantize_stage(layers: list[LayerShape], run: Workload, d: Dims) -> StageForecast:
    mems = [quantize_memory(L, run, d) for L in layers]
    worst = max(mems, key=lambda m: m["total"])
    store = sum(L.store_bytes for L in layers)
    seconds = sum(quantize_seconds(L, run, d, read_ahead=i > 0) for i, L in enumerate(layers))
    return StageForecast("quantize", worst["total"], _host(layers, run, d), store, seconds,
                         parts={k: v for k, v in worst.items() if k != "total"})


def checkpoint_bytes(plan: BitPlan, source: ModelSource, profile: RoutingProfile, formats: tuple[str, ...]) -> dict:
    """Format -> bytes: the plan summary's size (packed codes, scales, kept tensors); GPTQ adds g_idx and qzeros."""
    size = summarize(plan, source, profile).headline.size_gb * GB
    out = {}
    for fmt in formats:
        extra = 0.0
        if fmt == "gptq":
            for name, p in plan.quantized().items():
                m = source.modules[name]
                extra += 4 * m.in_features + (m.out_features * m.in_features // p.group_size * p.bits / 8 if p.symmetric else 0)
        out[fmt] = size + extra
    return out


def _eval_stage(recipe: Recipe, source: ModelSource, plan: BitPlan, model_bytes: float, run: Workload, d: Dims,
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
    on_gpu = hidden / 2 <= ACTIVATION_BUDGET_BYTES
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
        profile = dataclasses.replace(profile, layer_damage={
            s: torch.full((len(profile.layers),), 4.0 ** -p.bits * p.group_size / 128, dtype=torch.float64)
            for s, p in ((s, Scheme.parse(s)) for s in recipe.profile.layer_sensitivity.schemes)})
    return plan_bits(profile, source.modules, recipe.plan, source.n_layers,
                     recipe.export.formats), profile


def fitting_budgets(layers: list[LayerShape], recipe: Recipe, d: Dims, gpus: int, gpu_memory_gb: float):
    """The largest (hessian_budget_gb, solve_budget_gb) up to the recipe's whose quantize peak fits the card (halving
    the Hessian budget first, then the solve budget); None if nothing down to 1/256 of them fits."""
    limit = HEADROOM * gpu_memory_gb * GB
    q = recipe.quantize
    for solve in [q.solve_budget_gb / 2**k for k in range(6)]:
        for hessian in [q.hessian_budget_gb / 2**k for k in range(9)]:
            run = workload_of(recipe, gpus, hessian, solve)
            if max(quantize_memory(L, run, d)["total"] for L in layers) <= limit:
                return round(hessian, 3), round(solve, 3)
    return None


def forecast(recipe: Recipe, source: ModelSource, gpus: int = 1, gpu_memory_gb: float = 80.0,
             solve_kernel: str = "fused", host_memory_gb: float | None = None) -> Forecast:
    """Every stage's forecast for ``recipe`` on ``source`` (shapes only) with ``gpus`` GPUs of ``gpu_memory_gb``.
    ``solve_kernel``: GPTQ's column loop (``throughputs.SOLVE_KERNELS``): the engine's, or the one an older
    record measured. ``host_memory_gb``: the host's memory, which ``check_fits`` then checks too."""
    check_machine(gpus, gpu_memory_gb, host_memory_gb)
    d = dims(source.config_dict)
    plan, profile = plan_for(recipe, source)
    run = dataclasses.replace(workload_of(recipe, gpus, solve_kernel=solve_kernel),
                              stored_read=0.5 if source.stored_quantized else 0.0)  # FP8: 1 of bf16's 2 bytes
    layers = layer_shapes(source, plan, run.dtype_bytes, d.top_k)
    model_bytes = sum(math.prod(s) for s in source.shapes().values()) * run.dtype_bytes
    ckpt = checkpoint_bytes(plan, source, profile, recipe.export.formats)
    tokens_bytes = recipe.calibration.n_samples * recipe.calibration.seq_len * 8
    profile_run = dataclasses.replace(run, batch=recipe.profile.batch_size)
    host = host_memory_gb * GB if host_memory_gb is not None else host_total_bytes()
    profile_stage = _profile_stage(layers, profile_run, d, recipe, gpu_memory_gb, host)
    stages = [StageForecast("calibrate", 0.0, HOST_BASE + tokens_bytes, tokens_bytes, 0.0), profile_stage,
              StageForecast("plan", 0.0, HOST_BASE, 0.0, 0.0), _quantize_stage(layers, run, d),
              _export_stage(recipe, layers, ckpt, gpus),
              _eval_stage(recipe, source, plan, model_bytes, run, d, layers, gpu_memory_gb)]
    params = sum(math.prod(s) for s in source.shapes().values())
    return Forecast(source.display_name, params, gpus, gpu_memory_gb, stages, ckpt,
                    fitting_budgets(layers, recipe, d, gpus, gpu_memory_gb), host_memory_gb)


def check_machine(gpus: int, gpu_memory_gb: float, host_memory_gb: float | None = None) -> None:
    """The job's machine as given on the command line: at least one GPU, memories finite and positive."""
    def positive(x: float) -> bool:
        return math.isfinite(x) and 0 < x <= MAX_MEMORY_GB

    if gpus < 1 or not positive(gpu_memory_gb) or (host_memory_gb is not None and not positive(host_memory_gb)):
        raise PlanError(f"--gpus must be >= 1 and --gpu-memory-gb and --host-memory-gb finite and > 0 (at most "
                        f"{MAX_MEMORY_GB:g} GB), got {gpus}, {gpu_memory_gb:g} and "
                        f"{host_memory_gb if host_memory_gb is None else f'{host_memory_gb:g}'}")


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
    host = f", host {_gb(f.host_memory_gb * GB)}" if f.host_memory_gb is not None else ""
    lines = [f"{f.model}: {params_text(f.params)} parameters; {f.gpus} GPU(s) x {f.gpu_memory_gb:g} GB{host}; "
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
        ranks = f"{algorithm_cost(q.algorithm).ranks}, every rank holds the layer and its share of the batches; "
    lines.append(f"assumes: {ranks}time from one H200's throughputs (BENCHMARKS.md)")
    return "\n".join(lines)


def check_fits(f: Forecast, recipe: Recipe) -> None:
    """Raise PlanError (one line) naming the stage that does not fit (a GPU, then the host) and what to change."""
    stage = f.too_big()
    if stage is None:
        _check_host(f)
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


def _check_host(f: Forecast) -> None:
    stage = f.too_big_for_host()
    if stage is None:
        return
    raise PlanError(f"the {stage.stage} stage needs {_gb(stage.host_bytes)} of host memory per process but the host "
                    f"has {_gb(f.host_memory_gb * GB)} (--host-memory-gb; {_gb(HEADROOM * f.host_memory_gb * GB)} usable); "
                    "lower calibration.n_samples or calibration.seq_len (cached activations beyond a GPU's budget "
                    "stay on the host), use more GPUs, or a host with more memory")


def run_host_parts(recipe: Recipe, source: ModelSource, stage: str, on_cpu: bool, ranks: int = 1) -> dict[str, float]:
    """Host bytes one process of a run holds in ``stage``, by term: the token table (int64), this rank's cached
    hidden states ``[N, S, D]`` in the model dtype (eval: the base model's and the quantized one's) where they stay on
    the host (a CPU run, or beyond layerwise's GPU budget), and two decoder layers (one materialized, the next
    being read)."""
    d = dims(source.config_dict)
    dt = DTYPE_BYTES[recipe.model.dtype]
    spec = recipe.eval.perplexity if stage == "eval" else recipe.calibration
    copies = 2 if stage == "eval" else 1
    hidden = copies * math.ceil(spec.n_samples / ranks) * spec.seq_len * d.hidden * dt
    layers: dict[int, int] = defaultdict(int)
    for key, shape in source.shapes().items():
        if (layer := layer_of_key(key)) is not None:
            layers[layer] += math.prod(shape)
    return {"tokens": spec.n_samples * spec.seq_len * 8,
            "cached hidden states": hidden if on_cpu or hidden / copies > ACTIVATION_BUDGET_BYTES else 0.0,
            "two decoder layers": 2 * max(layers.values(), default=0) * dt}


def check_run_memory(recipe: Recipe, source: ModelSource, stage: str, on_cpu: bool, ranks: int,
                     available_bytes: int) -> None:
    """Before ``stage`` allocates: RecipeError (one line) when its host memory (``run_host_parts``) exceeds what the
    host has available."""
    parts = run_host_parts(recipe, source, stage, on_cpu, ranks)
    need = sum(parts.values())
    if need <= available_bytes:
        return
    key = "eval.perplexity" if stage == "eval" else "calibration"
    spec = recipe.eval.perplexity if stage == "eval" else recipe.calibration
    terms = ", ".join(f"{k} {_gb(v)}" for k, v in parts.items() if v)
    who = "the eval stage needs" if stage == "eval" else "calibration, profile and quantize need"
    raise RecipeError(f"{who} about {_gb(need)} of host memory ({terms}) for {spec.n_samples} x "
                      f"{spec.seq_len} tokens, but this host has {_gb(available_bytes)} available; lower {key}.n_samples "
                      f"or {key}.seq_len" + ("" if not on_cpu else ", or run on a GPU"))
