"""BitPlan: every quantizable weight -> bits, group size, symmetry, or keep. ``plan_bits`` is pure.

Expert decisions come from a policy over per-expert scores (routing profile); rules for attention, shared
experts, dense MLPs, super experts and edge layers override scores; router, embeddings and lm_head are always
kept. ``per_layer`` granularity projects expert decisions onto whole MoE layers under the same budget, which is
what vLLM can serve (one scheme per fused MoE layer). The policy is the registered one of ``plan.policy``
(``policies``): an expert policy scores experts; a layer policy decides bits and group size for a MoE layer's
experts directly from measured layer damage.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quant.algos.grid import shared_group_size
from quant.errors import PlanError
from quant.models import ModuleInfo
from quant.models.names import block_name, parse
from quant.plan.expert_policy import top_mask
from quant.plan.policies import policy
from quant.profile.profile import RoutingProfile
from quant.recipe import PlanSpec
from quant.scheme import Scheme

# 2: the headline is a typed field (1 carried it as a JSON string in ``notes``); 3: no algorithm (the recipe's)
SCHEMA_VERSION = 3
KEEP_BITS = 16  # what a kept (bf16/fp16) weight costs


@dataclass(frozen=True)
class ModulePlan:
    """``bits`` None means keep in the model dtype."""

    bits: int | None
    group_size: int = 0
    symmetric: bool = True
    reason: str = ""

    @property
    def keep(self) -> bool:
        return self.bits is None

    @property
    def scheme(self) -> Scheme:
        """The scheme of a quantized module (``algos``, the engine and the export writers speak in these)."""
        assert self.bits is not None, "a kept module has no scheme"
        return Scheme(self.bits, self.group_size, self.symmetric)


def _by_bits(d: dict[Any, float]) -> dict[int, float]:
    """A bits -> value map with int keys (JSON gives them back as strings), in ascending bits."""
    return {int(b): v for b, v in sorted(d.items(), key=lambda kv: int(kv[0]))}


@dataclass(frozen=True)
class Headline:
    """A plan's summary figures (``quant.plan.summary.summarize``). Bits keys: 16 means kept in the model dtype.

    ``avg_bits_experts`` / ``avg_bits_all``: mean code bits per weight over the routed experts / over every
    quantizable weight (scales not counted); ``size_gb``: the checkpoint's size (codes, scales, zero points, kept
    tensors); ``expert_pct_by_bits``: % of expert projections at each width; ``traffic_share_by_bits``: share of
    a layer's routed traffic reading each width (mean over MoE layers); ``traffic_weighted_bits``: mean bits of
    the expert weights a routed token reads (what decode bandwidth sees).
    """

    avg_bits_experts: float
    avg_bits_all: float
    size_gb: float
    expert_pct_by_bits: dict[int, float]
    traffic_share_by_bits: dict[int, float]
    traffic_weighted_bits: float

    @classmethod
    def from_json(cls, d: dict) -> Headline:
        return cls(**{**d, "expert_pct_by_bits": _by_bits(d["expert_pct_by_bits"]),
                      "traffic_share_by_bits": _by_bits(d["traffic_share_by_bits"])})

    def line(self) -> str:
        """One line for a terminal: the bits figures under their names (``summary.BITS_TERMS``), size, and how the
        experts and their traffic split by bits."""
        return (f"expert bits {self.avg_bits_experts}, bits over all weights {self.avg_bits_all}, traffic-weighted "
                f"expert bits {self.traffic_weighted_bits}; {self.size_gb * 1000:.1f} MB; expert projections by bits "
                f"{self.experts_by_bits()}; routed traffic by bits {self.traffic_by_bits()}")

    def experts_by_bits(self) -> str:
        """``4: 81.25%, 8: 18.75%``: the share of expert projections at each width, as text."""
        return by_bits(self.expert_pct_by_bits, lambda pct: f"{pct}%")

    def traffic_by_bits(self) -> str:
        """``4: 47.7%, 8: 52.3%``: the share of routed traffic reading each width, as text."""
        return by_bits(self.traffic_share_by_bits, lambda share: f"{100 * share:.1f}%")


def by_bits(values: dict[int, float], shown=str) -> str:
    """A bits -> value mapping as text (``4: 39, 8: 9``), in ascending bits; never a Python dict."""
    return ", ".join(f"{b}: {shown(v)}" for b, v in sorted(values.items()))


@dataclass(frozen=True)
class BitPlan:
    """The plan artifact (``plan.json``). ``plan_bits`` decides ``modules``; the plan stage adds what the plan
    costs and whom it serves (``headline``, ``serving``) with ``dataclasses.replace``."""

    modules: dict[str, ModulePlan]
    granularity: str
    target_runtime: str
    policy: str
    model_fingerprint: str
    schema_version: int = SCHEMA_VERSION
    group_rule: str = ""  # how each module's group size was chosen (see ``resolve_group_sizes``)
    # quant.plan.servable.serving_summary: vLLM/SGLang problems, predicted KL, the best plan they serve (plan stage)
    serving: dict = field(default_factory=dict)
    headline: Headline | None = None  # quant.plan.summary.summarize (plan stage)

    def quantized(self) -> dict[str, ModulePlan]:
        return {n: p for n, p in self.modules.items() if not p.keep}

    def quantized_schemes(self) -> dict[str, Scheme]:
        """Canonical name -> scheme of every quantized module, in plan order: what the engine quantizes."""
        return {n: p.scheme for n, p in self.quantized().items()}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> BitPlan:
        d = json.loads(path.read_text())
        if d.get("schema_version") != SCHEMA_VERSION:
            raise PlanError(f"{path}: plan schema_version {d.get('schema_version')} != {SCHEMA_VERSION}; redo the "
                            "plan stage (quant plan RECIPE --force plan)")
        d["modules"] = {n: ModulePlan(**p) for n, p in d["modules"].items()}
        if d.get("headline") is not None:
            d["headline"] = Headline.from_json(d["headline"])
        return cls(**d)


def _per_layer(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Project an expert mask onto whole layers with the same number of upgraded experts (rounded)."""
    L, E = mask.shape
    n_layers_high = round(mask.sum().item() / E)
    norm = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-12)
    layer_score = (norm * mask).sum(dim=1)  # traffic the per-expert plan sent to high bits, per layer
    chosen = top_mask(layer_score, n_layers_high)
    return chosen.unsqueeze(1).expand(L, E).clone()


def _high_mask(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec) -> torch.Tensor:
    """``[L, E]`` True where an expert gets ``high_bits``, before protection rules."""
    mask, scores = policy(spec.policy).experts(profile, modules, spec)
    if spec.granularity == "per_layer":
        mask = _per_layer(mask, scores)
    return mask


GROUP_RULE = (
    "plan.group_size {requested} is the largest group: every scheme unit gets one group size, the largest power of "
    "two <= {requested} dividing the input width of each of its projections (-1: one group per row). Units: the "
    "experts of one MoE layer (gate, up and down of every expert: vLLM and SGLang build one scheme per fused MoE "
    "layer, GPTQ rules address whole experts); with GPTQ export also each attention, shared-expert and dense-MLP "
    "block (one dynamic rule per block); any other module alone."
)


def scheme_unit(m: ModuleInfo, formats: tuple[str, ...]) -> str:
    """Name of the group of modules that must share one group size (see ``GROUP_RULE``)."""
    if m.kind == "expert":
        return block_name(m.layer, "experts")
    if "gptq" in formats and m.kind in ("attn", "shared", "dense_mlp"):
        return block_name(m.layer, parse(m.name).block)
    return m.name


def resolve_group_sizes(modules: dict[str, ModuleInfo], requested: int, formats: tuple[str, ...]) -> dict[str, int]:
    """Module name -> effective group size along its input dim, one per scheme unit (``GROUP_RULE``).

    A unit whose widths are all >= ``requested`` takes ``requested`` (each width must be a multiple of it); a unit
    with a narrower projection (tiny models: down_proj 32 wide under a 128 request) takes the largest power of two
    that divides every width, so one expert never mixes group sizes. ``-1``: each module's own width.
    """
    units: dict[str, list[ModuleInfo]] = defaultdict(list)
    for m in modules.values():
        units[scheme_unit(m, formats)].append(m)
    out: dict[str, int] = {}
    for unit, members in units.items():
        widths = sorted({m.in_features for m in members})
        if requested == -1:
            out.update({m.name: m.in_features for m in members})
            continue
        bad = [w for w in widths if w >= requested and w % requested]
        if bad:
            raise PlanError(f"{unit}: in_features {bad[0]} is not divisible by plan.group_size {requested}; use a "
                            f"group size dividing {bad[0]} (e.g. 32, 64) or -1 (per channel)")
        group = shared_group_size(requested, widths)
        out.update({m.name: group for m in members})
    return out


LAYER_GROUP_RULE = (" Layer policies ask for a group size per scheme group of a MoE layer (one, or two with policy "
                    "joint); the same rule resolves it for those experts.")


def _resolve_requested(quantized: dict[str, ModuleInfo], requested: dict[str, int],
                       formats: tuple[str, ...]) -> dict[str, int]:
    """``resolve_group_sizes`` for each requested group size in turn (layer policies ask per MoE layer)."""
    groups: dict[str, int] = {}
    for g in sorted({requested[n] for n in quantized}):
        groups.update(resolve_group_sizes({n: m for n, m in quantized.items() if requested[n] == g}, g, formats))
    return groups


def _rule_bits(m: ModuleInfo, spec: PlanSpec, n_layers: int) -> tuple[int | str | None, str] | None:
    """Bits (or 'keep') a protection rule forces on module ``m``, with the rule's name; None if no rule."""
    p = spec.protect
    if m.kind in ("router", "embed", "lm_head"):
        return "keep", m.kind
    if m.kind == "attn":
        return p.attention, "protect.attention"
    if m.kind == "shared":
        return p.shared_experts, "protect.shared_experts"
    if m.kind == "dense_mlp":
        return p.dense_mlp, "protect.dense_mlp"
    if m.layer is not None and (m.layer < p.first_layers or m.layer >= n_layers - p.last_layers):
        return p.edge_layer_bits, "protect.edge_layers"
    return None


def plan_bits(profile: RoutingProfile, modules: dict[str, ModuleInfo], spec: PlanSpec, n_layers: int,
              formats: tuple[str, ...] = ("compressed-tensors",)) -> BitPlan:
    """Decide every module's bits from the profile and the plan spec (pure: no I/O, no model). ``formats``: the
    checkpoint formats the plan will be exported to (they decide which modules share a group size)."""
    decide = policy(spec.policy)
    layer_groups = decide.layers(profile, modules, spec) if decide.layers else None
    high = _high_mask(profile, modules, spec) if layer_groups is None else None
    supers = set(profile.super_experts(spec.protect.super_expert_ratio)) if spec.protect.super_experts else set()
    pinned = spec.pinned_layers()
    decided: dict[str, tuple[int | None, str]] = {}
    requested: dict[str, int] = {}  # the group size asked for: plan.group_size, or a layer policy's per MoE layer
    for name, m in modules.items():
        rule = _rule_bits(m, spec, n_layers)
        if rule is None and (m.layer, m.expert) in supers:
            rule = (spec.protect.super_experts, "protect.super_experts")
        group_size = spec.group_size
        if rule is not None:
            bits, reason = rule
        elif m.kind == "expert" and m.layer in pinned:
            bits, group_size = pinned[m.layer].bits, pinned[m.layer].group_size
            reason = f"plan.layer_schemes:w{bits}g{group_size}"
        elif layer_groups is not None:
            scheme, role = layer_groups[m.layer].of(m.expert)
            bits, group_size = scheme.bits, scheme.group_size
            reason = f"{spec.policy}:{role + ':' if role else ''}w{bits}g{group_size}"
        elif high[profile.row(m.layer), m.expert]:
            bits, reason = spec.high_bits, f"{spec.policy}:high"
        else:
            bits, reason = spec.low_bits, f"{spec.policy}:low"
        decided[name] = (None if bits == "keep" else int(bits), reason)
        requested[name] = group_size
    unknown = sorted(set(pinned) - {m.layer for m in modules.values() if m.kind == "expert"})
    if unknown:
        raise PlanError(f"plan.layer_schemes names layer {unknown[0]}, which has no routed experts; MoE layers: "
                        f"{sorted({m.layer for m in modules.values() if m.kind == 'expert'})}")
    groups = _resolve_requested({n: modules[n] for n, (bits, _) in decided.items() if bits is not None}, requested,
                                formats)
    out = {n: ModulePlan(bits, groups[n], spec.symmetric, reason) if bits is not None else ModulePlan(None, reason=reason)
           for n, (bits, reason) in decided.items()}
    rule = GROUP_RULE.format(requested=spec.group_size) + (LAYER_GROUP_RULE if layer_groups is not None else "")
    return BitPlan(out, spec.granularity, spec.target_runtime, spec.policy, profile.model_fingerprint,
                   group_rule=rule)
