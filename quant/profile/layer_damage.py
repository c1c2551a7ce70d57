"""Per-MoE-layer damage: how far the model's next-token distribution moves when only one MoE layer's routed
experts are quantized, for each of several schemes, measured in streamed passes over calibration tokens.

Dimensions: L decoder layers, M MoE layers, K schemes, R gradient draws, N samples, S sequence length, D hidden,
V vocabulary.

``damage[scheme][l]`` estimates the mean over N·S positions of KL(clean ‖ branch) in nats, where the *branch* is the
model with only MoE layer ``l``'s routed experts round-to-nearest at the scheme (symmetric, one group size for the
layer's projections, resolved like the plan does). Two methods:

- ``exact``: one branch per (MoE layer, scheme) starts at its layer from the clean input and runs every later layer;
  after the last layer each branch's distribution is compared with the clean one. Layer forwards
  ≈ L + K·M(M+1)/2: quadratic in depth (DeepSeek-V3, 58 MoE layers: ~6.9 k), activations (1 + K·M)·N·S·D.
- ``bounded`` (the default): each branch runs only its own layer and the next ``carry`` decoder layers. What happens
  after is valued at the layer where it stops, two ways. (1) The Fisher quadratic form of the branch's perturbation
  ``Δ = h_branch - h_clean`` of the hidden state there, ``½ Σ_positions (g · Δ)²`` with ``g`` the gradient of
  ``log p(y)`` for labels ``y`` drawn from the clean distribution (R draws): the second-order KL it causes at the
  output, through the clean network linearized, so every later layer's smooth response is counted. (2) What the
  linearization misses: a perturbation flips routing choices in the later MoE layers (near-tie experts swap: 4-15 %
  of tokens per layer at W4 on the reference MoE), which moves the output by more than its second-order term,
  and for W8 dominates its damage. Each MoE layer's share of that is measured on the branches that do reach it (the
  increase of their Fisher form across the layer), fit as ``a · s^b`` in the perturbation's mean relative size
  ``s = ‖Δ‖² / ‖h‖²`` arriving there, and added for the layers past each branch's stop at its size there. Branches
  whose carry reaches the output get their exact KL. Two walks: forward, keeping every layer's clean input, then
  back from the last layer, where each layer makes its branches (carried through the ``carry`` layers above, kept
  on the device meanwhile) before the gradient is carried down through it. Layer forwards ≈ L (clean) + (1 + 2R)
  per layer walked back + K·(1 + carry) per MoE layer: linear in depth; activations L·N·S·D (every layer's input,
  released as the walk passes) + R·N·S·D for each of the ``carry + 2`` gradients kept + the branches that reach the
  last layer (K·(1 + carry)); the device keeps every layer's input only when they all fit beside the walk's working
  set, else a window of ``carry + 2`` of them (``quant.profile.damage_memory``). On the reference MoE (8 layers) it
  ranks the layers per scheme as the exact pass does to within the exact pass's own variation between calibration
  samples (STUDY.md).

A MoE layer's branches differ from its clean forward only inside its MoE block: after its first scheme, the bounded
pass runs the block alone on the block input that forward recorded and adds the recorded residual
(``_BlockShortcut``; bit for bit the layer's own forward, checked once a pass).

Both read every layer's weights once per walk (exact: one; bounded: two). A MoE layer's routed experts are computed
by quant (``moe_layer``: ``models.expert_compute``), in the checkpoint's dtype where the caller's ``Layerwise`` keeps
them narrow and widened to the pass's dtype as they run; a branch's round-to-nearest is applied as they are widened,
so the weights are never written and no copy of them is kept. The exact pass's activations stay on the device when
they fit ``Layerwise``'s activation budget, else on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quant.algos.grid import quantize_weight, shared_group_size
from quant.errors import NumericalError, RecipeError
from quant.layerwise import Layerwise, free_gpu_bytes, transfer
from quant.models import ModelSource
from quant.models.expert_compute import ExpertsCompute, Transform, install
from quant.models.experts import moe_block
from quant.models.layers import experts_of, release
from quant.profile.damage_memory import (
    FORWARD_MARGIN_BYTES,
    CleanInputs,
    FittingBatches,
    PassMemory,
    empty_stream,
    plan_memory,
)
from quant.progress import step
from quant.scheme import Scheme

log = logging.getLogger(__name__)
STAGE = "layer damage"
UNIT = "layer forwards"
BACKWARD_FORWARDS = 2  # a backward pass through a layer counts as two forwards (progress, forecast)
GRAD_DTYPE = torch.bfloat16  # gradients only weigh a perturbation (the Fisher form): bf16 halves what is kept
HEAD_CHUNK_BYTES = 1 << 30  # the head's fp32 logits, softmax and gradient for a few sequences at a time
# the flip law's exponent in the perturbation's relative size s = ‖Δ‖² / ‖h‖²: routing flips grow with the
# perturbation's norm (s^0.5), the smooth second-order part with s itself
FLIP_EXPONENTS = (0.5, 1.0)


@dataclass(frozen=True)
class LayerDamage:
    """``damage``: scheme -> ``[M]`` mean KL per position (MoE layers in model order); ``layer_forwards``: what the
    pass ran, counted as ``pass_cost`` forecasts it."""

    damage: dict[str, torch.Tensor]
    layer_forwards: int


@dataclass
class _Branch:
    row: int  # index among the MoE layers
    scheme: str
    start: int  # decoder layer whose experts it quantizes
    stop: int  # last decoder layer it runs (bounded)
    hidden: torch.Tensor | None  # [N, S, D] after the last layer it ran
    fisher: dict[int, float] = field(default_factory=dict)  # decoder layer -> Fisher form of Δ at its output
    size: dict[int, float] = field(default_factory=dict)  # decoder layer -> mean ‖Δ‖² / ‖h‖² at its output


def spread_rows(n_total: int, n: int) -> torch.Tensor:
    """``pass_samples(n, n_total)`` sample indices spread evenly over ``[0, n_total)`` (calibration rows are grouped
    by source, so the first rows would all come from one domain)."""
    n = pass_samples(n, n_total)
    return torch.arange(n) * n_total // n


def pass_samples(n_samples: int, calibration_samples: int) -> int:
    """The samples the pass runs on (``profile.layer_sensitivity.n_samples``): at most the calibration set's. The run
    (``spread_rows``) and quant estimate both take it from here."""
    return min(n_samples, calibration_samples)


def pass_carry(carry: int, n_layers: int) -> int:
    """The carry a bounded pass runs with (``profile.layer_sensitivity.carry_layers``): at most the layers above the
    first, since a branch stops at the last layer whatever its carry. The pass and quant estimate both take it from
    here."""
    return max(1, min(carry, n_layers - 1))


def _store(lw: Layerwise, clean: torch.Tensor, n_streams: int) -> torch.device:
    """Where ``n_streams`` tensors like ``clean`` live: the device while they fit the activation budget."""
    total = n_streams * clean.numel() * clean.element_size()
    return lw.device if total <= lw.budget or lw.device.type == "cpu" else torch.device("cpu")


def _branch_kl(lw: Layerwise, clean: torch.Tensor, branches: list[torch.Tensor]) -> list[float]:
    """Mean KL(clean ‖ branch) per position for every branch's final hidden states, batch by batch (fp32 logits)."""
    norm, head = lw.logits_fn()
    w_head = head.weight.float()
    totals = [0.0] * len(branches)

    def logprobs(h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(torch.nn.functional.linear(norm(h.to(lw.device)).float(), w_head), dim=-1)

    with torch.no_grad():
        for s in range(0, clean.shape[0], lw.batch_size):
            rows = slice(s, s + lw.batch_size)
            base = logprobs(clean[rows])
            p = base.exp()
            for i, b in enumerate(branches):
                totals[i] += (p * (base - logprobs(b[rows]))).sum().item()
    release(norm)
    release(head)
    n_positions = clean.shape[0] * clean.shape[1]
    return [t / n_positions for t in totals]


def measure_layer_damage(source: ModelSource, tokens: torch.Tensor, lw: Layerwise, schemes: tuple[str, ...],
                         method: str = "bounded", carry: int = 1, draws: int = 1, seed: int = 0) -> LayerDamage:
    """``tokens [N, S]`` -> each scheme's damage per MoE layer (module docstring). ``carry``: decoder layers a branch
    runs past its own (bounded); ``draws``: label draws for the gradients (bounded); ``seed``: their generator."""
    parsed = {name: Scheme.parse(name) for name in schemes}
    if method == "exact":
        damage, forwards = _exact(source, tokens, lw, parsed)
    elif method == "bounded":
        damage, forwards = _bounded(source, tokens, lw, parsed, carry, draws, seed)
    else:
        raise ValueError(f"layer damage method {method!r}; known: bounded, exact")
    log.info("layer damage (%s): %d MoE layers x %d schemes on %d tokens, %d layer forwards; KL x1e3 per layer: %s",
             method, len(source.moe_layers()), len(parsed), tokens.numel(), forwards,
             "; ".join(f"{k} {', '.join(f'{1e3 * v:.3f}' for v in d.tolist())}" for k, d in damage.items()))
    return LayerDamage(damage, forwards)


@contextlib.contextmanager
def moe_layer(lw: Layerwise, idx: int, ahead: int | None = None
              ) -> Iterator[tuple[torch.nn.Module, ExpertsCompute | None]]:
    """Decoder layer ``idx`` on the device and, for a MoE layer, its routed experts computed by quant in the pass's
    dtype (``models.expert_compute``: widened from the checkpoint's dtype where ``lw`` keeps them narrow, at a
    scheme while ``compute.transform`` is set; the weights themselves are never written)."""
    with lw.layer(idx, ahead) as layer:
        view = experts_of(lw.source, layer, idx)
        compute = None if view is None else install(view, lw.dtype)
        del view  # the handle holds the layer's expert weights until it is removed, and no longer
        try:
            yield layer, compute
        finally:
            if compute is not None:
                compute.remove()


def at_scheme(compute: ExpertsCompute, scheme: Scheme) -> Transform:
    """Round-to-nearest at ``scheme``, one group size for the layer's projections (as the plan resolves it from the
    scheme's), in the pass's dtype."""
    view = compute.view
    spec = Scheme(scheme.bits, shared_group_size(scheme.group_size, (view.gate_up.shape[2], view.down.shape[2])),
                  scheme.symmetric)
    return lambda w: quantize_weight(w, spec, w.dtype).dequantize()


def _progress(lw: Layerwise, done: int, total: int, what: str, idx: int) -> None:
    """One progress line per layer walked, then a stop request (SIGTERM, SIGUSR1, the stop file) honoured: the pass
    ends after the layer in hand, not after its remaining walks."""
    log.info("layer damage: %s layer %d", what, idx, extra=step(STAGE, done, total, UNIT))
    lw.world.raise_if_stopped(f"layer damage: {what} layer {idx}")


def _exact(source: ModelSource, tokens: torch.Tensor, lw: Layerwise,
           parsed: dict[str, Scheme]) -> tuple[dict[str, torch.Tensor], int]:
    clean = lw.embed(tokens)
    moe = source.moe_layers()
    store = _store(lw, clean, 1 + len(parsed) * len(moe))
    total = pass_cost([(0.0, i in moe) for i in range(source.n_layers)], len(parsed), 0, "exact").layer_forwards
    log.info("layer damage: exact pass over %d layers", source.n_layers, extra=step(STAGE, 0, total, UNIT))
    branches: list[_Branch] = []
    forwards = 0
    for idx in range(source.n_layers):
        with moe_layer(lw, idx) as (layer, compute):
            for b in branches:
                lw.forward(layer, b.hidden, out=b.hidden)
            if compute is not None:
                for name, scheme in parsed.items():
                    compute.transform = at_scheme(compute, scheme)
                    out = torch.empty(clean.shape, dtype=clean.dtype, device=store)
                    branches.append(_Branch(moe.index(idx), name, idx, source.n_layers - 1,
                                            lw.forward(layer, clean, out=out)))
                compute.transform = None
            forwards += len(branches) + 1
            clean = lw.forward(layer, clean, out=clean)
        _progress(lw, forwards, total, "exact: branches through", idx)
    kl = _branch_kl(lw, clean, [b.hidden for b in branches])
    damage = {name: torch.zeros(len(moe), dtype=torch.float64) for name in parsed}
    for b, value in zip(branches, kl, strict=True):
        damage[b.scheme][b.row] = value
    return damage, forwards


@dataclass(frozen=True)
class PassCost:
    """What ``measure_layer_damage`` runs (``quant estimate``'s forecast, the pass's progress total): layer forwards
    (a backward pass through a layer counts as ``BACKWARD_FORWARDS``), parameter-tokens, walks over the layers'
    weights, and the hidden-state tensors ``[N, S, D]`` held at once: in the pass's dtype, and gradients in
    ``GRAD_DTYPE``. ``per_layer``: the layer forwards run at each decoder layer, over all walks (bounded: one of them
    in the clean walk)."""

    layer_forwards: int
    param_tokens: float
    weight_walks: int
    streams: int
    grad_streams: int = 0
    per_layer: tuple[int, ...] = ()


def pass_cost(layers: list[tuple[float, bool]], n_schemes: int, n_tokens: int, method: str = "bounded",
              carry: int = 1, draws: int = 1) -> PassCost:
    """``layers``: (active parameters per token, has routed experts) per decoder layer."""
    moe = [i for i, (_, m) in enumerate(layers) if m]
    per_layer = [1] * len(layers)  # the clean stream (exact: alongside the branches; bounded: its own walk)
    if method == "exact":
        alive = 1
        for idx in range(len(layers)):
            alive += n_schemes if idx in moe else 0
            per_layer[idx] = alive
    else:
        for idx in _walked_back(moe, len(layers)):
            per_layer[idx] += 1 + BACKWARD_FORWARDS * draws
        for idx, n in _branch_layers(moe, len(layers), n_schemes, carry).items():
            per_layer[idx] += n
    param_tokens = sum(n * n_tokens * active for n, (active, _) in zip(per_layer, layers, strict=True))
    if method == "exact":
        return PassCost(sum(per_layer), param_tokens, 1, 1 + n_schemes * len(moe), per_layer=tuple(per_layer))
    grads = draws * (carry + 2) if moe else 0  # the walk back's window (``_working_streams``)
    return PassCost(sum(per_layer), param_tokens, 2, len(layers) + 2 + n_schemes * (1 + carry), grads,
                    tuple(per_layer))


def _walked_back(moe: list[int], n_layers: int) -> range:
    """Decoder layers the gradients are carried back through: from the last down to just above the first MoE layer
    (the gradient at every MoE layer's output and below the last is needed)."""
    return range(n_layers - 1, moe[0], -1) if moe else range(0)


def _branch_layers(moe: list[int], n_layers: int, n_schemes: int, carry: int) -> dict[int, int]:
    """Decoder layer -> branch forwards run there by the bounded pass (its own schemes + the branches carried in)."""
    out: dict[int, int] = {}
    for start in moe:
        for idx in range(start, min(start + carry, n_layers - 1) + 1):
            out[idx] = out.get(idx, 0) + n_schemes
    return out


def _bounded(source: ModelSource, tokens: torch.Tensor, lw: Layerwise, parsed: dict[str, Scheme],
             carry: int, draws: int, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    L, moe = source.n_layers, source.moe_layers()
    carry = pass_carry(carry, L)
    total = pass_cost([(0.0, i in moe) for i in range(L)], len(parsed), 0, "bounded", carry, draws).layer_forwards
    log.info("layer damage: %d layers forward, then back with gradients and branches carried %d layer(s)", L,
             carry, extra=step(STAGE, 0, total, UNIT))
    h = lw.embed(tokens)
    stream = h.numel() * lw.dtype.itemsize
    memory = plan_memory(lw, stream, L + 1, working_streams(len(parsed), carry, draws), carry)
    log.debug("layer damage: clean inputs on %s (pinned %s), working streams on %s", memory.inputs, memory.pinned,
              memory.working)
    batches = FittingBatches(lw)
    with CleanInputs(lw, memory) as inputs:
        final = _clean_pass(lw, batches, h, total, inputs)
        branches, done = _walk_back(source, lw, batches, inputs, final, parsed, carry, draws, seed, memory, L, total)
    return _estimate(branches, moe, L, parsed), done


def working_streams(n_schemes: int, carry: int, draws: int) -> int:
    """Tensors like a layer's hidden states the walk back holds beside the clean inputs: the gradients at the
    ``carry + 1`` layer outputs its branches are valued at and the one below (R each), the branch being carried,
    the branches that reach the last layer (their exact KL is taken after the walk), and the layer's MoE block
    input and the residual beside it (``_BlockShortcut``)."""
    return draws * (carry + 2) + 1 + n_schemes * (carry + 1) + 2


class _BlockShortcut:
    """A MoE layer's branches differ from its clean forward only inside the MoE block (the router and attention are
    never quantized, and every branch starts from the clean input): the first scheme's forward records, batch by
    batch, the block's input ``x`` and the residual it is added to (hooks on the block and on
    ``post_attention_layernorm``, whose input that residual is); the other schemes then run the block alone,
    ``out = residual + block(x)``, the very operations the layer's own forward ends with in every family quant runs
    (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, Mixtral, OLMoE). The pass checks that once, on its first MoE layer, against a
    whole forward (``check``), and runs whole forwards when it does not hold."""

    def __init__(self, source: ModelSource, layer: torch.nn.Module, like: torch.Tensor, memory: PassMemory):
        found = moe_block(source.family, layer)
        norm = getattr(layer, "post_attention_layernorm", None)
        self.block = found[1] if found else None
        self.ok = self.block is not None and isinstance(norm, torch.nn.Module)
        self.rows = slice(0, 0)
        self.handles = []
        if self.ok:
            self.residual = empty_stream(like.shape, like.dtype, memory.working, memory.pinned)
            self.x = empty_stream(like.shape, like.dtype, memory.working, memory.pinned)
            self.handles = [norm.register_forward_pre_hook(lambda _m, a: self._keep(self.residual, a[0])),
                            self.block.register_forward_pre_hook(lambda _m, a: self._keep(self.x, a[0]))]

    def _keep(self, into: torch.Tensor, t: torch.Tensor) -> None:
        transfer(into[self.rows], t.detach())

    def at(self, rows: slice) -> None:
        """The rows of the batch the recording forward runs next."""
        self.rows = rows

    def stop_recording(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def _output(self, rows: slice, device: torch.device) -> torch.Tensor:
        y = self.block(self.x[rows].to(device, non_blocking=True))
        y = y[0] if isinstance(y, tuple) else y
        return self.residual[rows].to(device, non_blocking=True) + y  # the layer's own last step, same order

    def run(self, batches: FittingBatches, out: torch.Tensor) -> torch.Tensor:
        """``residual + block(x)`` into ``out``, batch by batch on the device."""

        def call(rows: slice) -> None:
            transfer(out[rows], self._output(rows, batches.lw.device))

        batches.each(out.shape[0], call)
        return out

    def check(self, batches: FittingBatches, layer: torch.nn.Module, clean_in: torch.Tensor) -> None:
        """A whole forward of the first batch against the shortcut's; ``ok`` stays only where they agree (to the
        float: bit for bit where the kernels are deterministic)."""
        rows = slice(0, min(batches.rows, clean_in.shape[0]))
        whole = batches.forward(layer, clean_in[rows], out=torch.empty_like(clean_in[rows]))
        short = self._output(rows, batches.lw.device).to(whole.device)
        scale = whole.abs().max().item()
        self.ok = bool((whole - short).abs().max().item() <= 1e-6 * max(scale, 1e-30))
        if not self.ok:
            log.debug("layer damage: this model's layers do not end in residual + MoE block; whole forwards")


def _clean_pass(lw: Layerwise, batches: FittingBatches, h: torch.Tensor, total: int, inputs: CleanInputs
                ) -> torch.Tensor:
    """Every decoder layer's clean input into ``inputs``; the last layer's output (on the device)."""
    for idx in range(lw.source.n_layers):
        inputs.keep(idx, h)
        with moe_layer(lw, idx) as (layer, _):
            h = batches.forward(layer, h, out=h)
        _progress(lw, idx + 1, total, "clean through", idx)
    return h.to(lw.device)


def _head_cotangents(lw: Layerwise, final: torch.Tensor, draws: int, seed: int, memory: PassMemory) -> torch.Tensor:
    """``[R, N, S, D]`` (bf16): for R label draws ``y ~ p_clean`` per position, the gradient of ``Σ log p(y)`` with
    respect to the last layer's output (through the final norm and lm_head), a few sequences at a time (their fp32
    logits and softmax stay within ``HEAD_CHUNK_BYTES``)."""
    norm, head = lw.logits_fn()
    for p in (*norm.parameters(), *head.parameters()):
        p.requires_grad_(False)
    gen = torch.Generator(device=lw.device).manual_seed(seed)
    out = empty_stream((draws, *final.shape), GRAD_DTYPE, memory.working, memory.pinned)
    step_rows = max(1, HEAD_CHUNK_BYTES // (3 * 4 * final.shape[1] * head.weight.shape[0]))
    with torch.enable_grad():
        for s in range(0, final.shape[0], step_rows):
            rows = slice(s, s + step_rows)
            x = final[rows].to(lw.device).requires_grad_()
            logp = torch.log_softmax(head(norm(x)).float(), dim=-1).flatten(0, 1)
            probs = logp.detach().exp()
            if not bool(torch.isfinite(probs).all()):
                raise NumericalError("layer damage: the model's own next-token distribution holds NaN or infinite "
                                     "values (a weight of the model folder is not finite?); repair the model, or "
                                     "turn profile.layer_sensitivity off")
            for r in range(draws):
                y = torch.multinomial(probs, 1, generator=gen)
                (g,) = torch.autograd.grad(logp.gather(1, y).sum(), x, retain_graph=r + 1 < draws)
                transfer(out[r, rows], g)
            del logp, probs, x
    release(norm)
    release(head)
    return out


def _value(lw: Layerwise, b: _Branch, idx: int, clean_out: torch.Tensor, g: torch.Tensor) -> None:
    """The branch's Fisher form ``½ mean over draws of Σ_positions (g · Δ)²`` (per position: the second-order KL of
    ``Δ = hidden - clean_out``) and its mean relative size ``‖Δ‖² / ‖h‖²`` at layer ``idx``'s output, batch by batch
    on the device (fp32)."""
    fisher = size = 0.0
    for s in range(0, clean_out.shape[0], lw.batch_size):
        rows = slice(s, s + lw.batch_size)
        h = clean_out[rows].to(lw.device).float()
        delta = b.hidden[rows].to(lw.device).float() - h
        fisher += (g[:, rows].to(lw.device).float() * delta[None]).sum(-1).pow(2).sum().item()
        size += (delta.pow(2).sum(-1) / h.pow(2).sum(-1).clamp_min(1e-30)).sum().item()
    n_positions = clean_out.shape[0] * clean_out.shape[1]
    b.fisher[idx] = 0.5 * fisher / (g.shape[0] * n_positions)
    b.size[idx] = size / n_positions


def _walk_back(source: ModelSource, lw: Layerwise, batches: FittingBatches, inputs: CleanInputs,
               final: torch.Tensor, parsed: dict[str, Scheme], carry: int, draws: int, seed: int,
               memory: PassMemory, done: int, total: int) -> tuple[list[_Branch], int]:
    """From the last layer down to the first MoE layer, one weight read each: at layer ``idx`` (the ``carry`` layers
    above it still on the device, experts clean) each scheme's branch runs ``idx`` with its experts round-to-nearest
    and then the layers above, valued at every output it reaches with the gradient there; then the gradient is
    carried down through ``idx`` (clean again), the layer above the next one's window released first (a DeepSeek-V3
    layer's 23.5 GB more room for the backward pass's graph). Branches that run the last layer also get their exact
    KL (``fisher[L]``). Only the gradients of the ``carry + 1`` outputs above are kept, and each clean input until no
    branch is valued against it any more."""
    L, moe = source.n_layers, source.moe_layers()
    if not moe:
        return [], done
    for j in range(moe[0]):
        inputs.drop(j)  # below every branch
    grads = {L - 1: _head_cotangents(lw, final, draws, seed, memory)}
    branches: list[_Branch] = []
    # decoder layer -> (its context, the layer): the ``carry`` above the current one
    resident: dict[int, tuple[contextlib.AbstractContextManager, torch.nn.Module]] = {}
    trust_shortcut: bool | None = None  # _BlockShortcut: None until checked on the first MoE layer
    try:
        for idx in range(L - 1, moe[0] - 1, -1):
            for j in [j for j in resident if j > idx + carry]:
                resident.pop(j)[0].__exit__(None, None, None)  # before the next layer loads
            context = moe_layer(lw, idx, ahead=idx - 1)
            layer, compute = context.__enter__()
            resident[idx] = (context, layer)
            if idx == L - 1:
                _check_window(layer, carry, min(carry, L - 1 - moe[0]))
            if compute is not None:
                clean_in = inputs.get(idx)
                shortcut = (_BlockShortcut(source, layer, clean_in, memory)
                            if trust_shortcut is not False and len(parsed) > 1 else None)
                with contextlib.ExitStack() as hooks:
                    hooks.callback(setattr, compute, "transform", None)  # the layer runs clean once its branches are made
                    if shortcut is not None:
                        hooks.callback(shortcut.stop_recording)
                    for k, (name, scheme) in enumerate(parsed.items()):
                        compute.transform = at_scheme(compute, scheme)
                        b = _Branch(moe.index(idx), name, idx, min(idx + carry, L - 1), None)
                        out = empty_stream(clean_in.shape, clean_in.dtype, memory.working, memory.pinned)
                        if k == 0 or shortcut is None or not shortcut.ok:
                            b.hidden = batches.forward(layer, clean_in, out=out,
                                                       before=shortcut.at if shortcut is not None else None)
                            if shortcut is not None:
                                shortcut.stop_recording()
                        else:
                            if trust_shortcut is None:  # once a pass: the shortcut against a whole forward
                                shortcut.check(batches, layer, clean_in)
                                trust_shortcut = shortcut.ok
                            b.hidden = (shortcut.run(batches, out) if shortcut.ok
                                        else batches.forward(layer, clean_in, out=out))
                        _carry(lw, batches, b, resident, inputs, final, grads)
                        done += 1 + b.stop - b.start
                        branches.append(b)
                del shortcut
            del compute  # the layer's expert weights go with its context, not later
            if idx > moe[0]:
                keep = max(idx, idx - 1 + carry)  # the next layer's window, and this layer for its backward pass
                for j in [j for j in resident if j > keep]:
                    resident.pop(j)[0].__exit__(None, None, None)  # every branch it carries is made
                for j in [j for j in grads if j > keep]:
                    del grads[j]
                below = torch.empty_like(grads[idx])
                batches.vjp(layer, inputs.get(idx), grads[idx], out=below)
                grads[idx - 1] = below
                done += 1 + BACKWARD_FORWARDS * draws
            for j in [j for j in grads if j > idx - 1 + carry]:
                del grads[j]  # every branch valued there is made
            inputs.drop(idx + carry + 1)  # the clean output of layer idx + carry: no later branch reaches it
            _progress(lw, done, total, "back through", idx)
    finally:
        for context, _ in resident.values():
            context.__exit__(None, None, None)
    ending = [b for b in branches if b.hidden is not None]
    for b, kl in zip(ending, _branch_kl(lw, final, [b.hidden for b in ending]), strict=True):
        b.fisher[L], b.hidden = kl, None  # the exact KL, after the head
    return branches, done


def _check_window(layer: torch.nn.Module, carry: int, above: int) -> None:
    """The walk back keeps ``above`` layers on the GPU beside the one it works on: refuse a carry whose layers do not
    fit, before any branch is made (a device out of memory later would lose the pass)."""
    dev = next(layer.parameters()).device
    if dev.type != "cuda" or above == 0:
        return
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    free = free_gpu_bytes(dev)
    if above * layer_bytes + FORWARD_MARGIN_BYTES > free:
        raise RecipeError(f"profile.layer_sensitivity.carry_layers {carry} keeps {above} more decoder layer(s) of "
                          f"{layer_bytes / 1e9:.1f} GB on the GPU during the walk back, and it has {free / 1e9:.1f} GB "
                          "free: use a smaller carry_layers, or method exact")


def _carry(lw: Layerwise, batches: FittingBatches, b: _Branch, resident: dict[int, tuple], inputs: CleanInputs,
           final: torch.Tensor, grads: dict[int, torch.Tensor]) -> None:
    """Value branch ``b`` at its own layer's output, then run it through the resident layers above up to its stop,
    valued at each; it keeps its hidden states only when it stops at the last layer (for the exact KL)."""
    L = lw.source.n_layers
    for idx in range(b.start, b.stop + 1):
        if idx > b.start:
            b.hidden = batches.forward(resident[idx][1], b.hidden, out=b.hidden)
        clean_out = inputs.get(idx + 1) if idx + 1 < L else final
        _value(lw, b, idx, clean_out, grads[idx])  # it moves each batch of them to the device
    if b.stop < L - 1:
        b.hidden = None


def _law(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``log inc = a + b log s`` over ``(s, inc)`` points with both positive: ``(a, b)``, or None. ``b`` is the
    least-squares slope held to ``FLIP_EXPONENTS`` (``a`` then fit to it): from a few points at nearly one size (the
    W4 schemes, when a W8 branch's increase is not positive) the free slope can come out at -12, and the law then
    prices a W8 branch, two decades smaller, at astronomic damage."""
    pts = [(math.log(s), math.log(inc)) for s, inc in points if s > 0 and inc > 0]
    if not pts:
        return None
    lo, hi = FLIP_EXPONENTS
    if len(pts) == 1 or max(x for x, _ in pts) - min(x for x, _ in pts) < 1e-6:
        b = lo  # flips scale with the perturbation's norm, not its square
    else:
        xs = torch.tensor([x for x, _ in pts], dtype=torch.float64)
        ys = torch.tensor([y for _, y in pts], dtype=torch.float64)
        fit = torch.linalg.lstsq(torch.stack([torch.ones_like(xs), xs], 1), ys[:, None]).solution[:, 0]
        b = min(max(fit[1].item(), lo), hi)
    return sum(y - b * x for x, y in pts) / len(pts), b


def _estimate(branches: list[_Branch], moe: list[int], L: int,
              parsed: dict[str, Scheme]) -> dict[str, torch.Tensor]:
    """Each branch's damage: its exact KL when it ran the last layer, else its Fisher form where it stopped plus, for
    each later MoE layer, that layer's flip law at the branch's size there."""
    laws: dict[int, tuple[float, float]] = {}
    for j in moe:
        arrived = [(b.size[j - 1], b.fisher[j] - b.fisher[j - 1]) for b in branches if b.start < j <= b.stop]
        law = _law(arrived)
        if law is not None:
            laws[j] = law
    damage = {name: torch.zeros(len(moe), dtype=torch.float64) for name in parsed}
    for b in branches:
        if L in b.fisher:
            damage[b.scheme][b.row] = _stable(b.fisher[L])
            continue
        value, size = b.fisher[b.stop], b.size[b.stop]
        for j in (j for j in moe if j > b.stop):
            law = laws.get(j) or _nearest(laws, j)
            if law is not None and size > 0:
                value += math.exp(law[0] + law[1] * math.log(size))
        damage[b.scheme][b.row] = _stable(value)
    return damage


def _stable(value: float) -> float:
    """``value`` to 12 significant digits: the estimate is good to a few percent, and its last float digits move
    with the kernels' summation order (thread count, launcher); rounded, a run gives the same figures, and so the
    same plan.json, at any world size."""
    return float(f"{value:.12g}")


def _nearest(laws: dict[int, tuple[float, float]], j: int) -> tuple[float, float] | None:
    """The law of the MoE layer nearest ``j`` that has one (the earlier on a tie)."""
    if not laws:
        return None
    return laws[min(laws, key=lambda k: (abs(k - j), k))]
