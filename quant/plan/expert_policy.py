"""Expert policies: each MoE layer's experts at ``plan.high_bits`` or ``plan.low_bits``, chosen from per-expert
scores of the routing profile (``top_fraction``, ``inverse``, ``random``, ``budget``, ``sensitivity``,
``uniform``). Each returns ``(high [L, E] bool, scores [L, E])``: which experts get high bits, and the scores that
``per_layer`` granularity projects the choice onto whole MoE layers with.
"""

from __future__ import annotations

import torch

from quant.errors import PlanError
from quant.models import ModuleInfo
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec


def expert_scores(profile: RoutingProfile, score: str) -> torch.Tensor:
    """``[L, E]`` score per expert: routed tokens, routing-weight mass, or their product (MC-MoE style)."""
    if score == "tokens":
        return profile.counts.clone()
    if score == "weight_mass":
        return profile.weight_mass.clone()
    share = profile.share()
    mass = profile.weight_mass / profile.weight_mass.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return share * mass


def top_mask(scores: torch.Tensor, n: int, largest: bool = True) -> torch.Tensor:
    """Boolean mask of the n best entries of a 1-D tensor; ties go to the lower index (stable)."""
    order = torch.sort(scores if largest else -scores, descending=True, stable=True).indices
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[:n]] = True
    return mask


def _fraction_mask(scores: torch.Tensor, spec: PlanSpec, largest: bool = True) -> torch.Tensor:
    """``[L, E]`` True where the expert is among ``plan.top_fraction`` of its layer (or of the model, ranked
    globally) by ``scores``: the largest, or the smallest."""
    L, E = scores.shape
    if spec.ranking == "per_layer":
        n = round(spec.top_fraction * E)
        return torch.stack([top_mask(scores[i], n, largest) for i in range(L)])
    norm = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return top_mask(norm.reshape(-1), round(spec.top_fraction * L * E), largest).reshape(L, E)


def _budget_mask(scores: torch.Tensor, expert_bits: torch.Tensor, spec: PlanSpec) -> torch.Tensor:
    """Greedy by score per extra bit: upgrade experts low->high while average expert bits stay <= target.

    ``expert_bits [L, E]`` is the number of weights of each expert (all three projections).
    """
    numel = expert_bits.double()
    total = numel.sum()
    if spec.budget_avg_bits is not None:
        allowance = (spec.budget_avg_bits - spec.low_bits) * total
    else:
        allowance = spec.budget_gb * 8e9 - spec.low_bits * total
        if allowance < 0:  # not even every expert at low_bits fits: refuse rather than plan all-low silently
            raise PlanError(f"plan.budget_gb {spec.budget_gb:g} is below the size of every expert at "
                            f"{spec.low_bits} bits ({spec.low_bits * total.item() / 8e9:.4g} GB); raise it or lower "
                            "plan.low_bits")
    cost = (spec.high_bits - spec.low_bits) * numel
    norm = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-12)
    order = torch.sort((norm / cost).reshape(-1), descending=True, stable=True).indices
    mask = torch.zeros(numel.numel(), dtype=torch.bool)
    spent = 0.0
    for i in order.tolist():  # O(L*E) scalar loop over a score list, not a tensor hot path
        c = cost.reshape(-1)[i].item()
        if spent + c <= allowance + 1e-6:
            mask[i] = True
            spent += c
    return mask.reshape(scores.shape)


def _expert_numel(modules: dict[str, ModuleInfo], profile: RoutingProfile) -> torch.Tensor:
    numel = torch.zeros(len(profile.layers), profile.n_experts, dtype=torch.float64)
    for m in modules.values():
        if m.kind == "expert":
            numel[profile.row(m.layer), m.expert] += m.numel
    return numel


Choice = tuple[torch.Tensor, torch.Tensor]  # (high [L, E] bool, scores [L, E])


def top_fraction(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """The ``plan.top_fraction`` highest-scoring experts at high bits."""
    scores = expert_scores(profile, spec.score)
    return _fraction_mask(scores, spec), scores


def inverse(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """The ``plan.top_fraction`` lowest-scoring experts at high bits (a control for ``top_fraction``)."""
    scores = expert_scores(profile, spec.score)
    return _fraction_mask(scores, spec, largest=False), scores


def random(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """``plan.top_fraction`` of experts at high bits, drawn with ``plan.seed`` (a control)."""
    scores = expert_scores(profile, spec.score)
    drawn = torch.rand(*scores.shape, generator=torch.Generator().manual_seed(spec.seed), dtype=torch.float64)
    return _fraction_mask(drawn, spec), scores


def budget(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """Experts upgraded by score per extra bit within ``plan.budget_avg_bits`` or ``plan.budget_gb``."""
    scores = expert_scores(profile, spec.score)
    return _budget_mask(scores, _expert_numel(modules, profile), spec), scores


def sensitivity(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """As ``budget`` (with ``plan.budget_avg_bits``) or ``top_fraction``, ranked by the profile's measured
    sensitivity instead of routing."""
    if profile.sensitivity is None:
        raise PlanError("plan.policy 'sensitivity' needs a profile with sensitivity scores; re-run `quant profile`")
    scores = profile.sensitivity.clone()
    if spec.budget_avg_bits is not None:
        return _budget_mask(scores, _expert_numel(modules, profile), spec), scores
    return _fraction_mask(scores, spec), scores


def uniform(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> Choice:
    """Every expert at low bits."""
    scores = expert_scores(profile, spec.score)
    return torch.zeros_like(scores, dtype=torch.bool), scores


def describe_fraction(p: PlanSpec) -> str:
    """The model card's words for a fraction policy (after its name)."""
    return f" ({p.top_fraction:.0%} of experts at high bits; score `{p.score}`, ranking `{p.ranking}`)"


def describe_budget(p: PlanSpec) -> str:
    return f" ({f'{p.budget_avg_bits} average expert bits' if p.budget_avg_bits else f'{p.budget_gb} GB'})"


def describe_nothing(p: PlanSpec) -> str:
    return ""
