"""What serving a plan with vLLM/SGLang costs: the plan's predicted damage and the best plan they can serve.

Both numbers come from the profile's per-layer damage (``quant.profile.layer_damage``: KL of the model output on
calibration tokens when only one MoE layer's experts are quantized, round-to-nearest), so they are on one scale:
a plan's *predicted KL* is the sum over MoE layers of its layer's damage. A layer whose experts share one
measured scheme contributes that scheme's damage; a layer mixing schemes per expert contributes the damages of
its schemes weighted by each expert's share of the layer's W4 output error (the profile's per-expert
sensitivity probe; routed-token shares when it is absent). The alternative is ``layer_sensitivity`` over every
measured scheme vLLM and SGLang run (int4 / int8, symmetric) within the plan's own storage budget, each layer's
schemes limited to those their fused-MoE kernels take at its widths (``runtimes.moe_width_problem``, the same rule
the plan's own servability goes through); it names the runtimes that serve it, and may store fewer bits than the
plan (whole-layer steps), which the report and the card then say.
"""

from __future__ import annotations

import math

import torch

from quant.algos.grid import shared_group_size
from quant.models import ModelSource
from quant.models.names import PROJ, expert_name
from quant.plan.bitplan import BitPlan
from quant.plan.layer_policy import choose_schemes, layer_storage, storage_bits
from quant.plan.runtimes import moe_width_problem, problems_for
from quant.profile.profile import RoutingProfile
from quant.scheme import Scheme

SERVING_RUNTIMES = ("vllm", "sglang")
RUNTIME_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}
SERVED_BITS = (4, 8)
SAME_SIZE = 0.005  # stored expert bits within this share of each other: plans of equal size


def same_size(bits_a: float, bits_b: float) -> bool:
    """Whether two plans' stored expert bits (per weight) count as the same size for comparing their damage."""
    return abs(bits_a - bits_b) <= SAME_SIZE * max(bits_a, bits_b)


def _expert_scheme(plan: BitPlan, source: ModelSource, layer: int, expert: int, measured: list[str]) -> str | None:
    """The measured scheme one expert's three projections resolve to (``keep`` when all are kept), else None."""
    projs = [(plan.modules[n], source.modules[n].in_features)
             for n in (expert_name(layer, expert, p) for p in PROJ)]
    if all(p.keep for p, _ in projs):
        return "keep"
    widths = {in_f for _, in_f in projs}
    for name in measured:
        s = Scheme.parse(name)
        if all(not p.keep and p.symmetric and p.bits == s.bits and p.group_size == shared_group_size(s.group_size, widths)
               for p, _ in projs):
            return name
    return None


def _expert_weights(profile: RoutingProfile) -> torch.Tensor:
    """``[L, E]`` each expert's share of its layer's quantization damage."""
    w = profile.sensitivity if profile.sensitivity is not None else profile.counts
    w = w.double().clamp_min(0)
    total = w.sum(dim=1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-300), torch.full_like(w, 1.0 / w.shape[1]))


def predicted_kl(plan: BitPlan, source: ModelSource, profile: RoutingProfile) -> float | None:
    """Sum over MoE layers of the plan's predicted single-layer KL; None when an expert's scheme was not measured."""
    damage = profile.layer_damage
    if damage is None:
        return None
    share = _expert_weights(profile)
    measured = sorted(damage, key=Scheme.parse)
    total = 0.0
    for row, layer in enumerate(profile.layers):
        for e in range(profile.n_experts):
            s = _expert_scheme(plan, source, layer, e, measured)
            if s is None:
                return None
            total += 0.0 if s == "keep" else share[row, e].item() * damage[s][row].item()
    return total


def expert_storage(plan: BitPlan, source: ModelSource) -> tuple[float, float]:
    """(stored bits, number of weights) over every routed-expert weight of the plan (kept weights at 16 bits)."""
    bits = numel = 0.0
    for name, m in source.modules.items():
        if m.kind == "expert":
            p = plan.modules[name]
            bits += m.numel * (16.0 if p.keep else storage_bits(p.bits, p.group_size, m.in_features, p.symmetric))
            numel += m.numel
    return bits, numel


def _layer_widths(source: ModelSource, layers: list[int]) -> list[tuple[int, int]]:
    """Per MoE layer (``layers``, the profile's rows): its experts' (hidden, intermediate) sizes, from expert 0."""
    return [(g.in_features, g.out_features) for g in (source.modules[expert_name(layer, 0, "gate")] for layer in layers)]


def servers(source: ModelSource, profile: RoutingProfile, names: list[str]) -> dict[str, list[list[bool]]]:
    """Runtime of ``SERVING_RUNTIMES`` -> ``[L][K]`` whether its fused-MoE kernels take measured scheme ``names[k]``
    (symmetric, the group shared by the layer's projections) at layer l's widths (``runtimes.moe_width_problem``);
    only runtimes that take some scheme in every layer."""
    widths, schemes = _layer_widths(source, profile.layers), [Scheme.parse(n) for n in names]
    out = {}
    for rt in SERVING_RUNTIMES:
        takes = [[moe_width_problem(rt, s.bits, shared_group_size(s.group_size, {hidden, inter}), True, hidden, inter)
                  is None for s in schemes] for hidden, inter in widths]
        if all(any(row) for row in takes):
            out[rt] = takes
    return out


def runtime_titles(alternative: dict) -> list[str]:
    """The runtimes that serve a ``best_servable`` plan, by name (vLLM and SGLang in a plan.json written before
    the plan named them)."""
    return [RUNTIME_TITLES[rt] for rt in alternative.get("runtimes", SERVING_RUNTIMES)]


def best_servable(plan: BitPlan, source: ModelSource, profile: RoutingProfile) -> dict | None:
    """The least-damage one-scheme-per-MoE-layer plan within this plan's expert storage, of the schemes the
    runtimes of ``servers`` take at each layer's widths (``runtimes``: those that serve it), or None without damage
    or without such a plan."""
    if profile.layer_damage is None:
        return None
    names = sorted((n for n in profile.layer_damage if Scheme.parse(n).bits in SERVED_BITS), key=Scheme.parse)
    takes = servers(source, profile, names) if names else {}
    if not takes:
        return None
    allowed = torch.tensor([[all(t[r][k] for t in takes.values()) for k in range(len(names))]
                            for r in range(len(profile.layers))])
    layer_bits = torch.stack([layer_storage(source.modules, profile, Scheme.parse(n).bits, Scheme.parse(n).group_size) for n in names], dim=1)
    damage = torch.stack([profile.layer_damage[n] for n in names], dim=1).double().masked_fill(~allowed, math.inf)
    budget, numel = expert_storage(plan, source)
    if layer_bits.masked_fill(~allowed, math.inf).min(dim=1).values.sum().item() > budget:
        return None
    picks = choose_schemes(layer_bits, damage, budget)
    rows = range(len(profile.layers))
    return {"policy": "layer_sensitivity", "runtimes": list(takes),
            "layers": {str(layer): names[picks[r]] for r, layer in zip(rows, profile.layers, strict=True)},
            "predicted_kl": sum(damage[r, picks[r]].item() for r in rows),
            "expert_storage_bits": sum(layer_bits[r, picks[r]].item() for r in rows) / numel}


def serving_summary(plan: BitPlan, source: ModelSource, profile: RoutingProfile, formats: tuple[str, ...]) -> dict:
    """For plan.json: whether vLLM/SGLang serve the plan, its predicted KL, and the best plan they serve."""
    budget, numel = expert_storage(plan, source)
    problems = {rt: problems_for(plan, source, rt, formats) for rt in SERVING_RUNTIMES}
    return {"problems": problems, "predicted_kl": predicted_kl(plan, source, profile),
            "expert_storage_bits": budget / max(numel, 1.0), "damage_measured": profile.layer_damage is not None,
            "best_servable": best_servable(plan, source, profile)}
