"""What differs between MoE families, as data: on-disk names and where things live in transformers' modules.

Canonical names (used everywhere outside ``models/``):
  ``layers.L.attn.<proj>`` (``q``, ``k``, ``v``, ``o``, ``q_a``, ``q_b``, ``kv_a_proj_with_mqa``, ``kv_b`` …),
  ``layers.L.experts.E.{gate,up,down}``, ``layers.L.shared.{gate,up,down}``, ``layers.L.mlp.{gate,up,down}``
  (dense MLP layers), ``layers.L.router``, ``layers.L.shared_gate``, ``embed``, ``lm_head``.

On disk transformers 5 keeps per-expert tensors (``model.layers.0.mlp.experts.0.gate_proj.weight``) and fuses
them in memory into ``mlp.experts.gate_up_proj [E, 2I, D]`` (gate rows first) and ``down_proj [E, D, I]``.
Remote-code models (``trust_remote_code``) keep the same on-disk names and a per-expert ``nn.ModuleList`` in memory
(see ``models/experts.py``); the recipe's ``model.family`` says which family a remote ``model_type`` follows.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

PROJ = ("gate", "up", "down")


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """Naming facts of one model family. ``disk_moe`` is the MoE block's attribute name in checkpoints."""

    name: str
    model_types: tuple[str, ...]
    disk_moe: str = "mlp"
    expert_proj: dict[str, str] = field(default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    shared_attr: str | None = None
    attn_norm_fed: tuple[str, ...] = ("q", "k", "v")  # canonical attention leaves reading input_layernorm
    dense_proj: dict[str, str] = field(default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    # Routing of a per-expert (remote-code) MoE block whose router is a plain nn.Linear producing logits [T, E]:
    # softmax over experts (fp32) -> top-k -> renormalize the k weights to sum 1 when ``renormalize`` (None: when
    # the config's ``norm_topk_prob`` is true) -> cast to the logits' dtype, as transformers 4.x Mixtral, Qwen-MoE
    # and OLMoE do. ``logit_routing=False``: the family routes otherwise (DeepSeek-V3's grouped sigmoid with score
    # correction), so its gate must return ``(topk_idx, topk_weight, ...)`` itself.
    logit_routing: bool = True
    renormalize: bool | None = None

    def rules(self) -> list[tuple[re.Pattern, str]]:
        """(regex over an on-disk weight key, canonical template) pairs, first match wins."""
        moe, lay = re.escape(self.disk_moe), r"^model\.layers\.(?P<L>\d+)\."
        inv_expert = {v: k for k, v in self.expert_proj.items()}
        inv_dense = {v: k for k, v in self.dense_proj.items()}
        out = [
            (re.compile(lay + r"self_attn\.(?P<p>(?!\w*norm)\w+?)(?:_proj)?\.weight$"), "layers.{L}.attn.{p}"),
            (
                re.compile(lay + moe + r"\.experts\.(?P<E>\d+)\.(?P<p>" + "|".join(inv_expert) + r")\.weight$"),
                "layers.{L}.experts.{E}.{p}",
            ),
            (re.compile(lay + moe + r"\.gate\.weight$"), "layers.{L}.router"),
        ]
        if self.shared_attr:
            out.append((
                re.compile(lay + r"mlp\." + re.escape(self.shared_attr) + r"\.(?P<p>gate_proj|up_proj|down_proj)\.weight$"),
                "layers.{L}.shared.{p}",
            ))
            out.append((re.compile(lay + r"mlp\.shared_expert_gate\.weight$"), "layers.{L}.shared_gate"))
        out.append((re.compile(lay + r"mlp\.(?P<p>" + "|".join(inv_dense) + r")\.weight$"), "layers.{L}.mlp.{p}"))
        out.append((re.compile(r"^model\.embed_tokens\.weight$"), "embed"))
        out.append((re.compile(r"^lm_head\.weight$"), "lm_head"))
        return out

    def disk_key(self, layer: int, local: str) -> str:
        """On-disk key of a decoder layer's in-memory parameter (``mlp.gate.weight`` -> Mixtral's
        ``block_sparse_moe.gate.weight``)."""
        if local.startswith("mlp.") and self.disk_moe != "mlp" and not local.startswith("mlp.shared"):
            local = self.disk_moe + local[3:]
        return f"model.layers.{layer}.{local}"

    def canonical(self, disk_key: str) -> str | None:
        """Canonical module name of an on-disk ``*.weight`` key, or None for norms, biases, buffers."""
        inv_expert = {v: k for k, v in self.expert_proj.items()}
        inv_dense = {v: k for k, v in self.dense_proj.items()}
        for pattern, template in _compiled_rules(self):
            m = pattern.match(disk_key)
            if not m:
                continue
            groups = m.groupdict()
            p = groups.get("p")
            if "experts.{E}" in template:
                groups["p"] = inv_expert[p]
            elif ".shared." in template:
                groups["p"] = p.removesuffix("_proj")
            elif ".mlp." in template:
                groups["p"] = inv_dense[p]
            return template.format(**groups)
        return None


@functools.cache
def _compiled_rules(spec: FamilySpec) -> list[tuple[re.Pattern, str]]:
    return spec.rules()


def module_kind(canonical: str) -> str:
    """One of attn, expert, shared, dense_mlp, router, embed, lm_head (the planner's rule classes)."""
    parts = canonical.split(".")
    if parts[0] in ("embed", "lm_head"):
        return parts[0]
    kind = parts[2]
    return {"attn": "attn", "experts": "expert", "shared": "shared", "mlp": "dense_mlp"}.get(kind, "router")


def layer_of(canonical: str) -> int | None:
    parts = canonical.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def expert_of(canonical: str) -> int | None:
    parts = canonical.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[2] == "experts" else None


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_moe": FamilySpec("qwen3_moe", ("qwen3_moe",)),
    "qwen2_moe": FamilySpec("qwen2_moe", ("qwen2_moe",), shared_attr="shared_expert"),
    "deepseek_v3": FamilySpec("deepseek_v3", ("deepseek_v3",), shared_attr="shared_experts",
                              attn_norm_fed=("q_a", "kv_a_proj_with_mqa"), logit_routing=False),
    "mixtral": FamilySpec(
        "mixtral", ("mixtral",), disk_moe="block_sparse_moe", expert_proj={"gate": "w1", "up": "w3", "down": "w2"},
        renormalize=True,
    ),
    "olmoe": FamilySpec("olmoe", ("olmoe",)),
}


def family_for(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    return None
