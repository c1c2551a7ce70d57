"""Per-MoE-layer damage: how far the model's next-token distribution moves when only one MoE layer's routed
experts are quantized, for each of several schemes, measured in one streamed pass over calibration tokens.

Dimensions: M MoE layers, K schemes, N samples, S sequence length, D hidden, V vocabulary.

The pass carries the clean hidden states ``[N, S, D]`` plus one *branch* per (MoE layer, scheme): at MoE layer
``l`` each scheme's branch starts from the clean input, runs layer ``l`` with its routed experts round-to-nearest
at that scheme (symmetric, one group size for the layer's projections, resolved like the plan does), and
runs every later layer unquantized. After the last layer each branch's next-token distribution is compared with
the clean one: ``damage[scheme][l] = mean over N·S positions of KL(clean ‖ branch)`` in nats.

Cost (what it takes on a 61-layer, 58-MoE-layer DeepSeek-V3): every layer's weights are read once, as in
profiling; layer forwards ≈ n_layers + K·M(M+1)/2 over N·S tokens (K = 4, N·S = 16 × 256: ~6.9 k forwards over
4 k tokens, about the compute of 1.8 profiling passes over 128 × 2048 tokens); branch activations (1 + K·M)·N·S·D in
the pass's dtype (27 GB there in fp32), kept on the device when they fit ``Layerwise``'s activation budget, else on the
CPU; one copy of one layer's expert weights in host memory while its branches are made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from quant.algos.grid import QuantSpec, quantize_weight, shared_group_size
from quant.engine.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.layers import ExpertsView, experts_of
from quant.recipe import parse_scheme

log = logging.getLogger(__name__)
_EXPERT_CHUNK = 16  # experts quantized at once while writing a scheme into a layer (bounds the fp32 temporaries)


@dataclass(frozen=True)
class _Branch:
    row: int  # index among the MoE layers
    scheme: str
    hidden: torch.Tensor  # [N, S, D]


def spread_rows(n_total: int, n: int) -> torch.Tensor:
    """``min(n, n_total)`` sample indices spread evenly over ``[0, n_total)`` (calibration rows are grouped by
    source, so the first rows would all come from one domain)."""
    n = min(n, n_total)
    return torch.arange(n) * n_total // n


def _write_rtn(view: ExpertsView, originals: tuple[torch.Tensor, torch.Tensor], bits: int, group: int) -> None:
    """Put round-to-nearest copies of the original expert weights into the layer, a few experts at a time."""
    group = shared_group_size(group, (originals[0].shape[2], originals[1].shape[2]))  # one per MoE layer, as planned
    for param, orig in ((view.gate_up, originals[0]), (view.down, originals[1])):
        spec = QuantSpec(bits, group)
        for s in range(0, orig.shape[0], _EXPERT_CHUNK):
            chunk = orig[s : s + _EXPERT_CHUNK].to(param.device)
            param.data[s : s + _EXPERT_CHUNK] = quantize_weight(chunk, spec, chunk.dtype).dequantize()


def _branch_device(lw: Layerwise, clean: torch.Tensor, n_branches: int) -> torch.device:
    total = (1 + n_branches) * clean.numel() * clean.element_size()
    return lw.device if total <= lw.budget or lw.device.type == "cpu" else torch.device("cpu")


def _branch_kl(lw: Layerwise, clean: torch.Tensor, branches: list[_Branch]) -> list[float]:
    """Mean KL(clean ‖ branch) per position for every branch, batch by batch (logits in fp32)."""
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
                totals[i] += (p * (base - logprobs(b.hidden[rows]))).sum().item()
    n_positions = clean.shape[0] * clean.shape[1]
    return [t / n_positions for t in totals]


def measure_layer_damage(source: ModelSource, tokens: torch.Tensor, lw: Layerwise,
                         schemes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``tokens [N, S]`` -> scheme name -> ``[M]`` mean KL per position (MoE layers in model order)."""
    parsed = {name: parse_scheme(name) for name in schemes}
    clean = lw.embed(tokens)
    store = _branch_device(lw, clean, len(parsed) * len(source.moe_layers()))
    branches: list[_Branch] = []
    n_moe, n_forwards = 0, 0
    for idx in range(source.n_layers):
        with lw.layer(idx) as layer:
            for b in branches:
                lw.forward(layer, b.hidden, out=b.hidden)
            n_forwards += len(branches) + 1
            view = experts_of(source, layer, idx)
            if view is not None:
                originals = (view.gate_up.data.to("cpu", copy=True), view.down.data.to("cpu", copy=True))
                for name, (bits, group) in parsed.items():
                    _write_rtn(view, originals, bits, group)
                    out = torch.empty(clean.shape, dtype=clean.dtype, device=store)
                    branches.append(_Branch(n_moe, name, lw.forward(layer, clean, out=out)))
                view.gate_up.data.copy_(originals[0])
                view.down.data.copy_(originals[1])
                del originals
                n_moe += 1
                n_forwards += len(parsed)
            clean = lw.forward(layer, clean, out=clean)
            del view  # it holds the layer's expert weights: gone before the next layer loads, not after
    kl = _branch_kl(lw, clean, branches)
    damage = {name: torch.zeros(n_moe, dtype=torch.float64) for name in parsed}
    for b, value in zip(branches, kl, strict=True):
        damage[b.scheme][b.row] = value
    log.info("layer damage: %d MoE layers x %d schemes on %d tokens, %d layer forwards; KL x1e3 per layer: %s",
             n_moe, len(parsed), tokens.numel(), n_forwards,
             "; ".join(f"{k} {[round(1e3 * v, 3) for v in d.tolist()]}" for k, d in damage.items()))
    return damage


def pass_cost(layers: list[tuple[float, bool]], n_schemes: int, n_tokens: int) -> tuple[int, float, int]:
    """What ``measure_layer_damage`` runs, for ``quant estimate``: ``layers`` is (active parameters per token, has
    routed experts) per decoder layer. Returns (layer forwards, parameter-tokens, hidden-state streams at the end)."""
    alive, forwards, param_tokens = 1, 0, 0.0
    for active, moe in layers:
        n = alive + (n_schemes if moe else 0)
        forwards += n
        param_tokens += n * n_tokens * active
        alive += n_schemes if moe else 0
    return forwards, param_tokens, alive
