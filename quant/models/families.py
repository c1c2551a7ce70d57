"""What differs between MoE families, as data: on-disk names and where things live in transformers' modules.

Canonical names (used everywhere outside ``models/``, built and parsed by ``names.py``):
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

from quant.models.names import PROJ, parse

DISK_LAYERS = "model.layers"  # every family's decoder layers on disk (and in transformers' module tree)
_STANDARD_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def layer_rule(layers: str, block: str) -> str:
    """Regex over on-disk / runtime module names: decoder layers ``layers`` (a regex: ``3``, ``(1|4)``) and then
    ``block`` (a regex from ``FamilySpec.rule_block``), start-anchored by the caller's ``re.match``."""
    return re.escape(DISK_LAYERS) + rf"\.{layers}\.{block}"


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """Naming facts of one model family. ``disk_moe`` is the MoE block's attribute name in checkpoints; ``title``
    how people write the family's name (messages)."""

    name: str
    model_types: tuple[str, ...]
    title: str = ""
    disk_moe: str = "mlp"
    expert_proj: dict[str, str] = field(default_factory=lambda: dict(_STANDARD_PROJ))
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
        return f"{layer_key_prefix(layer)}{local}"

    @property
    def standard_expert_names(self) -> bool:
        """Routed experts stored as ``mlp.experts.N.{gate,up,down}_proj``, the names transformers 5's modules and
        GPTQModel read (Mixtral keeps ``block_sparse_moe.experts.N.w1/w3/w2``)."""
        return self.disk_moe == "mlp" and self.expert_proj == _STANDARD_PROJ

    @property
    def standard_proj_names(self) -> bool:
        """An expert's projections stored as gate_proj / up_proj / down_proj, what vLLM 0.26's compressed-tensors
        lookup asks for (Mixtral's are w1 / w3 / w2)."""
        return self.expert_proj == _STANDARD_PROJ

    @property
    def proj_names(self) -> str:
        """The on-disk names of an expert's gate, up and down projections, ``/``-joined (messages)."""
        return "/".join(self.expert_proj[p] for p in PROJ)

    @property
    def expert_gate_names(self) -> str:
        """How this family's checkpoints name an expert's gate projection, N for the expert (messages)."""
        return f"{self.disk_moe}.experts.N.{self.expert_proj['gate']}"

    def rule_block(self, canonical: str) -> tuple[int, str, int | None] | None:
        """(layer, block regex after ``model.layers.L.``, expert) of a canonical module that per-block rules (GPTQ
        ``dynamic``) address, else None: routed experts by their MoE block (on-disk name, and transformers 5's
        ``mlp`` where it differs), attention, shared experts and dense MLPs by block."""
        n = parse(canonical)
        if n.layer is None:
            return None
        if n.block == "experts":
            moe = rf"(mlp|{re.escape(self.disk_moe)})\.experts" if self.disk_moe != "mlp" else r"mlp\.experts"
            return n.layer, moe, n.expert
        if n.block == "attn":
            return n.layer, r"self_attn\.", None
        if n.block == "shared":
            return n.layer, rf"mlp\.{re.escape(self.shared_attr or 'shared_experts')}\.", None
        if n.block == "mlp":
            return n.layer, r"mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)", None
        return None

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


def layer_key_prefix(layer: int) -> str:
    """What every on-disk tensor name of decoder layer ``layer`` starts with (``model.layers.3.``)."""
    return f"{DISK_LAYERS}.{layer}."


STANDARD_EXPERT_GATE_NAMES = FamilySpec("standard", ()).expert_gate_names  # what GPTQModel reads
STANDARD_PROJ_NAMES = FamilySpec("standard", ()).proj_names  # what vLLM's compressed-tensors lookup asks for
FAMILIES: dict[str, FamilySpec] = {
    "qwen3_moe": FamilySpec("qwen3_moe", ("qwen3_moe",), "Qwen3-MoE"),
    "qwen2_moe": FamilySpec("qwen2_moe", ("qwen2_moe",), "Qwen2-MoE", shared_attr="shared_expert"),
    "deepseek_v3": FamilySpec("deepseek_v3", ("deepseek_v3",), "DeepSeek-V3", shared_attr="shared_experts",
                              attn_norm_fed=("q_a", "kv_a_proj_with_mqa"), logit_routing=False),
    "mixtral": FamilySpec(
        "mixtral", ("mixtral",), "Mixtral", disk_moe="block_sparse_moe",
        expert_proj={"gate": "w1", "up": "w3", "down": "w2"}, renormalize=True,
    ),
    "olmoe": FamilySpec("olmoe", ("olmoe",), "OLMoE"),
}


def family_for(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    return None
