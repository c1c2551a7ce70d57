"""What a plan costs and whom it serves: the bits figures (``BITS_TERMS``), checkpoint size, traffic at high
precision, per layer.

``traffic-weighted expert bits`` is the mean bit width of the expert weights a routed token actually reads (each
expert weighted by its share of the layer's routed assignments): what decode bandwidth sees.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from quant.models import ModelSource
from quant.plan.bitplan import KEEP_BITS, BitPlan, Headline
from quant.profile.profile import RoutingProfile

SCALE_BYTES = 2
# The bits figures quant prints, defined once; every output names them so.
BITS_TERMS = {
    "expert bits": "code bits per routed-expert weight (scales not counted)",
    "stored expert bits": "expert bits with each group's scale (and zero point) counted",
    "traffic-weighted expert bits": "expert bits weighted by each expert's share of its layer's routed tokens: what "
                                    "a routed token reads",
    "bits over all weights": "code bits per weight over every weight of the model, kept ones (router, embeddings, "
                             "lm_head) at 16",
    "layer bits": "code bits per weight over one decoder layer's quantized weights (attention and experts)",
}


def module_bytes(bits: int | None, out_f: int, in_f: int, group: int, symmetric: bool) -> float:
    """Checkpoint bytes of one weight: packed codes + scales (+ zero points), or the dense weight."""
    if bits is None:
        return out_f * in_f * KEEP_BITS / 8
    n_groups = out_f * (in_f // group)
    return out_f * in_f * bits / 8 + n_groups * SCALE_BYTES + (0 if symmetric else n_groups * bits / 8) + 16


def _bits(plan: BitPlan, name: str) -> int:
    p = plan.modules[name]
    return KEEP_BITS if p.keep else p.bits


@dataclass(frozen=True)
class PlanSummary:
    """``headline``: the plan's figures; ``per_layer``: per MoE layer, expert projections and routed traffic share by
    bits (``{"layer", "modules_by_bits", "traffic_share_by_bits", "traffic_weighted_bits"}``)."""

    headline: Headline
    per_layer: list[dict]


def summarize(plan: BitPlan, source: ModelSource, profile: RoutingProfile) -> PlanSummary:
    """Headline numbers and a per-layer table (bits in keys: 16 means kept in the model dtype)."""
    mods = source.modules
    share = profile.share()
    e_bits = e_numel = all_bits = all_numel = size = 0.0
    expert_mods_by_bits: dict[int, int] = defaultdict(int)
    traffic_by_bits: dict[int, float] = defaultdict(float)
    per_layer: dict[int, dict] = defaultdict(lambda: {"bits": defaultdict(int), "traffic_bits": 0.0, "numel": 0.0,
                                                      "traffic": defaultdict(float)})
    for name, m in mods.items():
        p = plan.modules[name]
        b = _bits(plan, name)
        size += module_bytes(p.bits, m.out_features, m.in_features, p.group_size or 1, p.symmetric)
        all_bits, all_numel = all_bits + b * m.numel, all_numel + m.numel
        if m.kind != "expert":
            continue
        e_bits, e_numel = e_bits + b * m.numel, e_numel + m.numel
        s = share[profile.row(m.layer), m.expert].item() / 3  # three projections per expert
        lay = per_layer[m.layer]
        lay["bits"][b] += 1
        lay["traffic"][b] += s
        lay["traffic_bits"] += s * b
        expert_mods_by_bits[b] += 1
    size += _other_bytes(source)
    table = [{"layer": layer, "modules_by_bits": dict(sorted(lay["bits"].items())),
              "traffic_share_by_bits": {b: round(v, 4) for b, v in sorted(lay["traffic"].items())},
              "traffic_weighted_bits": round(lay["traffic_bits"], 3)}
             for layer, lay in sorted(per_layer.items())]
    for row in table:
        for b, v in row["traffic_share_by_bits"].items():
            traffic_by_bits[b] += v / len(table)
    n_expert_mods = sum(expert_mods_by_bits.values())
    headline = Headline(
        avg_bits_experts=round(e_bits / max(e_numel, 1), 3),
        avg_bits_all=round(all_bits / max(all_numel, 1), 3),
        size_gb=round(size / 1e9, 4),
        expert_pct_by_bits={b: round(100 * n / max(n_expert_mods, 1), 2) for b, n in sorted(expert_mods_by_bits.items())},
        traffic_share_by_bits={b: round(v, 4) for b, v in sorted(traffic_by_bits.items())},
        traffic_weighted_bits=round(sum(r["traffic_weighted_bits"] for r in table) / max(len(table), 1), 3),
    )
    return PlanSummary(headline, table)


def _other_bytes(source: ModelSource) -> float:
    """Bytes of tensors that are not quantizable modules (norms, biases, buffers), at 2 bytes each."""
    module_keys = {m.disk_prefix + ".weight" for m in source.modules.values()}
    total = 0
    for key, shape in source.shapes().items():
        if key not in module_keys:
            n = 1
            for d in shape:
                n *= d
            total += n * 2
    return float(total)


KIND_LABELS = {"expert": "experts", "attn": "attention", "shared": "shared experts", "dense_mlp": "dense MLPs"}


def scheme_counts(plan: BitPlan, source: ModelSource) -> dict[str, dict[str, int]]:
    """Module kind (``KIND_LABELS``) -> quantization scheme (``W4 g32 sym``) -> number of modules at it: the
    schemes a checkpoint of this plan holds (its config.json's groups), in ascending bits and group size."""
    out: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    for name, p in plan.quantized().items():
        out[KIND_LABELS.get(source.modules[name].kind, source.modules[name].kind)][(p.bits, p.group_size, p.symmetric)] += 1
    return {kind: {f"W{b} g{g} {'sym' if s else 'asym'}" if g != -1 else f"W{b} per channel {'sym' if s else 'asym'}": n
                   for (b, g, s), n in sorted(schemes.items())}
            for kind, schemes in sorted(out.items(), key=lambda kv: list(KIND_LABELS.values()).index(kv[0])
                                        if kv[0] in KIND_LABELS.values() else 99)}

