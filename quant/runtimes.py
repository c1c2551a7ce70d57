"""Can the target runtime serve this plan? Checked before any GPU hour is spent.

Facts (read from vLLM 0.33, SGLang 0.5.23, transformers 5.17, GPTQModel 7.6; see docs/runtimes.md):
- vLLM builds one quantization method per fused MoE layer from expert 0's scheme
  (``<layer>.experts.0.gate_proj``) and applies it to every expert of that layer: bits may differ between
  layers, never between experts of one layer. Its MoE kernels take int4 (sym/asym) or symmetric int8, group
  size 32/64/128 or per channel. It fuses q/k/v (and DeepSeek's q_a/kv_a, MLP gate/up): fused shards must share
  a scheme.
- SGLang: the same per-layer rule; asymmetric experts only at 4 bits; its GPTQ-Marlin MoE path ignores
  ``dynamic`` rules, so GPTQ checkpoints need one expert scheme for the whole model.
- transformers 5.17 decompresses all fused experts of a compressed-tensors checkpoint with a single scheme
  (``get_experts_scheme``), symmetric only; any other expert scheme is silently loaded as garbage. It cannot
  load GPTQ MoE checkpoints at all.
- GPTQModel unfuses experts into per-expert Linear modules and honours per-expert ``dynamic`` rules: the one
  runtime here that serves per-expert mixed bits (GPTQ format; it cannot read Mixtral's original
  ``block_sparse_moe.experts.N.w1`` names).
"""

from __future__ import annotations

from collections import defaultdict

from quant.errors import PlanError
from quant.models import ModelSource
from quant.plan import BitPlan

RUNTIMES = ("any", "vllm", "sglang", "transformers", "gptqmodel")
# canonical leaf groups a runtime fuses into one module, so they must share one scheme
FUSED = (("attn", ("q", "k", "v")), ("attn", ("q_a", "kv_a_proj_with_mqa")), ("mlp", ("gate", "up")),
         ("shared", ("gate", "up")))


def _scheme(plan: BitPlan, name: str) -> tuple:
    p = plan.modules[name]
    return ("keep",) if p.keep else (p.bits, p.group_size, p.symmetric)


def _fmt(s: tuple) -> str:
    return "bf16 (kept)" if s == ("keep",) else f"W{s[0]} g{s[1]} {'sym' if s[2] else 'asym'}"


def expert_schemes_by_layer(plan: BitPlan, source: ModelSource) -> dict[int, set[tuple]]:
    out: dict[int, set[tuple]] = defaultdict(set)
    for name, m in source.modules.items():
        if m.kind == "expert":
            out[m.layer].add(_scheme(plan, name))
    return out


def _per_layer_uniform(plan: BitPlan, source: ModelSource, runtime: str) -> list[str]:
    problems = []
    for layer, schemes in sorted(expert_schemes_by_layer(plan, source).items()):
        if len(schemes) > 1:
            problems.append(
                f"{runtime} applies one quantization scheme to all experts of a fused MoE layer (it reads expert "
                f"0's), but layer {layer} mixes {', '.join(sorted(map(_fmt, schemes)))}; set plan.granularity: "
                f"per_layer (bits per MoE layer), or plan.target_runtime: gptqmodel for per-expert bits"
            )
            break
    return problems


def _moe_kernels(plan: BitPlan, source: ModelSource, runtime: str) -> list[str]:
    for name, m in source.modules.items():
        p = plan.modules[name]
        if m.kind != "expert" or p.keep:
            continue
        if p.bits not in (4, 8) or (p.bits == 8 and not p.symmetric):
            return [f"{runtime}'s MoE kernels take int4 (sym/asym) or symmetric int8 experts, not "
                    f"{_fmt(_scheme(plan, name))} ({name}); change plan.high_bits/low_bits or plan.symmetric"]
        if p.group_size not in (32, 64, 128, m.in_features):
            return [f"{runtime}'s MoE kernels take group size 32, 64 or 128 (or per channel), not {p.group_size} "
                    f"({name}); set plan.group_size"]
    return []


def _fused_shards(plan: BitPlan, source: ModelSource, runtime: str) -> list[str]:
    by_parent: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for name in source.modules:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) == 4:
            by_parent[(parts[1], parts[2])][parts[3]] = _scheme(plan, name)
    for (layer, block), leaves in by_parent.items():
        for fused_block, group in FUSED:
            present = [leaves[g] for g in group if g in leaves and block == fused_block]
            if len(set(present)) > 1:
                return [f"{runtime} fuses layers.{layer}.{block}.{{{','.join(group)}}} into one module; they must share "
                        f"one scheme but the plan gives {', '.join(sorted(map(_fmt, set(present))))}"]
    return []


def _transformers(plan: BitPlan, source: ModelSource, formats: tuple[str, ...]) -> list[str]:
    schemes = set().union(*expert_schemes_by_layer(plan, source).values())
    problems = []
    if len(schemes) > 1:
        problems.append(
            f"transformers 5.x decompresses every fused expert of a compressed-tensors checkpoint with one scheme "
            f"for the whole model, but the plan uses {', '.join(sorted(map(_fmt, schemes)))} (other experts would "
            f"load as garbage); use plan.policy: uniform, or serve with vllm (per_layer) / gptqmodel (per_expert)"
        )
    if any(s != ("keep",) and not s[2] for s in schemes):
        problems.append("transformers 5.x cannot load asymmetric (zero-point) experts; set plan.symmetric: true")
    if "gptq" in formats:
        problems.append("transformers cannot load GPTQ-format MoE checkpoints (fused experts); export "
                        "compressed-tensors or serve the GPTQ checkpoint with gptqmodel/vllm")
    return problems


def problems_for(plan: BitPlan, source: ModelSource, runtime: str, formats: tuple[str, ...] = ()) -> list[str]:
    """Reasons ``runtime`` cannot serve ``plan`` (empty when it can)."""
    if runtime == "any":
        return []
    if runtime == "transformers":
        return _transformers(plan, source, formats)
    if runtime == "gptqmodel":
        if source.family.name == "mixtral" and "gptq" in formats:
            return ["gptqmodel reads Mixtral experts as mlp.experts.N.gate_proj, not the original "
                    "block_sparse_moe.experts.N.w1 names the checkpoint keeps; serve Mixtral with vllm"]
        return []
    problems = _per_layer_uniform(plan, source, runtime) + _fused_shards(plan, source, runtime)
    problems += _moe_kernels(plan, source, runtime)
    if runtime == "sglang" and "gptq" in formats and len(set().union(*expert_schemes_by_layer(plan, source).values())) > 1:
        problems.append("sglang's GPTQ-Marlin MoE ignores dynamic rules: GPTQ checkpoints need one expert scheme "
                        "for the whole model; export compressed-tensors for per-layer bits")
    return problems


def check_runtime(plan: BitPlan, source: ModelSource, runtime: str, formats: tuple[str, ...] = ()) -> None:
    problems = problems_for(plan, source, runtime, formats)
    if problems:
        raise PlanError(f"plan cannot be served by {runtime}: {problems[0]}")
