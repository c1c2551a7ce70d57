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
- quant's own vLLM plugin (``vllm-quant``, quant.serve) serves compressed-tensors checkpoints whose experts differ
  within a layer (``quant_method: moe-quant-mixed``): each scheme group on vLLM's Marlin MoE kernel.
- Widths (``moe_width_problem``): vLLM runs Marlin MoE where it can (hidden a multiple of 128) and its Triton MoE
  kernel otherwise (group-wise symmetric only); SGLang has Marlin MoE alone (hidden ÷ 128, intermediate ÷ 64), so
  models narrower than that (the offline builtins: hidden 64) are not served by SGLang or by the plugin's mixed
  layers whatever the plan.
- GPTQModel unfuses experts into per-expert Linear modules and honours per-expert ``dynamic`` rules: the one
  runtime here that serves per-expert mixed bits (GPTQ format; it cannot read Mixtral's original
  ``block_sparse_moe.experts.N.w1`` names).
"""

from __future__ import annotations

from collections import defaultdict

from quant.errors import PlanError
from quant.models import ModelSource
from quant.models.families import STANDARD_EXPERT_GATE_NAMES, STANDARD_PROJ_NAMES
from quant.models.names import block_name, parse
from quant.plan.bitplan import BitPlan
from quant.plan.policies import policy
from quant.scheme import Scheme

RUNTIMES = ("any", "vllm", "vllm-quant", "sglang", "transformers", "gptqmodel")
# the runtimes each checkpoint is checked against, in the order its model card names them (export's served_by)
CHECKED_RUNTIMES = ("vllm-quant", "vllm", "sglang", "transformers", "gptqmodel")
# vLLM with quant's plugin (quant.serve, registered by installing quant beside vLLM): per-expert schemes in one MoE layer
PLUGIN = "vllm-quant"
PLUGIN_NEEDS_CT = ("quant's vLLM plugin serves the compressed-tensors export of a plan whose experts differ within a "
                   "MoE layer; add compressed-tensors to export.formats")
ATEN_INT4_GROUPS = (32, 64, 128, 256)  # torch's _weight_int4pack_mm_for_cpu (GPTQModel's TorchAtenLinear)
TRANSFORMERS_NO_GPTQ = ("transformers cannot load GPTQ-format MoE checkpoints (fused experts); export "
                        "compressed-tensors or serve the GPTQ checkpoint with gptqmodel/vllm")
GPTQMODEL_NEEDS_GPTQ = "GPTQModel loads GPTQ-format checkpoints only; add gptq to export.formats"
# canonical leaf groups a runtime fuses into one module, so they must share one scheme
FUSED = (("attn", ("q", "k", "v")), ("attn", ("q_a", "kv_a_proj_with_mqa")), ("mlp", ("gate", "up")),
         ("shared", ("gate", "up")))


def _scheme(plan: BitPlan, name: str) -> Scheme | None:
    """A module's scheme in the plan, None when it is kept."""
    p = plan.modules[name]
    return None if p.keep else p.scheme


def _fmt(s: Scheme | None) -> str:
    return "bf16 (kept)" if s is None else f"W{s.bits} g{s.group_size} {'sym' if s.symmetric else 'asym'}"


def expert_schemes_by_layer(plan: BitPlan, source: ModelSource) -> dict[int, set[Scheme | None]]:
    """MoE layer -> the schemes its routed experts' projections carry (None: kept)."""
    out: dict[int, set[Scheme | None]] = defaultdict(set)
    for name, m in source.modules.items():
        if m.kind == "expert":
            out[m.layer].add(_scheme(plan, name))
    return out


def _per_expert_hint(source: ModelSource) -> str:
    if not source.family.standard_expert_names:  # GPTQModel cannot read the checkpoint's expert names (Mixtral's)
        return ""
    return ", or plan.target_runtime: gptqmodel with export.formats: [gptq] for per-expert bits"


def _mix_hint(plan: BitPlan, source: ModelSource, layer: int, schemes: set[Scheme | None]) -> str:
    """What to change when a layer's experts mix schemes: depends on what made them differ."""
    if None not in schemes and len({(s.bits, s.symmetric) for s in schemes}) == 1:  # only the group sizes differ
        widths = ", ".join(sorted({str(s.group_size) for s in schemes}, key=int))
        return (f"only their group sizes differ ({widths}: per-channel groups follow each projection's width); set "
                f"plan.group_size to 32, 64 or 128")
    if policy(plan.policy).splits_layers:
        return (f"plan.policy {plan.policy} splits a layer's experts into two scheme groups, which quant's vLLM plugin serves: "
                "set plan.target_runtime: vllm-quant, or plan.policy: layer_sensitivity (one scheme per MoE layer)")
    if plan.granularity == "per_expert":
        return ("set plan.granularity: per_layer (bits per MoE layer), or plan.target_runtime: vllm-quant (quant's "
                "vLLM plugin serves per-expert bits)" + _per_expert_hint(source))
    reasons = sorted({plan.modules[n].reason for n, m in source.modules.items()
                      if m.kind == "expert" and m.layer == layer and not plan.modules[n].reason.endswith((":high", ":low"))})
    rules = ", ".join(f"plan.{r}" for r in reasons) or "a protection rule"
    return (f"plan.granularity is per_layer, but {rules} gives single experts of the layer other bits; unset it or "
            f"give it the layer's bits" + _per_expert_hint(source))


def _per_layer_uniform(plan: BitPlan, source: ModelSource, runtime: str) -> list[str]:
    for layer, schemes in sorted(expert_schemes_by_layer(plan, source).items()):
        if len(schemes) > 1:
            return [f"{runtime} applies one quantization scheme to all experts of a fused MoE layer (it reads expert "
                    f"0's gate, up and down), but layer {layer} mixes {', '.join(sorted(map(_fmt, schemes)))}; "
                    f"{_mix_hint(plan, source, layer, schemes)}"]
    return []


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


MARLIN_GROUPS = (32, 64, 128)


def moe_width_problem(runtime: str, bits: int, group: int, symmetric: bool, hidden: int, intermediate: int) -> str | None:
    """Why ``runtime``'s fused-MoE kernels on a CUDA GPU cannot take experts of this scheme at these widths (hidden
    size, expert intermediate size at tensor-parallel size 1; ``group == hidden``: per channel), or None. Read from
    vLLM 0.26 / 0.33 and SGLang 0.5.17 (docs/runtimes.md): vLLM runs an expert scheme on Marlin MoE where Marlin
    takes it (hidden a multiple of 128, group 32/64/128 or per channel dividing the intermediate size) and on its
    Triton MoE kernel otherwise (group-wise, symmetric, both widths multiples of the group); SGLang runs Marlin MoE
    with no fallback (thread tiles of 128 along the hidden size and 64 along the intermediate one); quant's plugin
    runs every scheme group of a mixed layer on Marlin MoE (``quant.serve.layout.check_servable``)."""
    channel = group == hidden
    divides = channel or (hidden % group == 0 and intermediate % group == 0)
    if runtime == PLUGIN:
        from quant.serve.layout import check_servable

        return check_servable(Scheme(bits, group, symmetric), hidden, intermediate)
    if runtime == "sglang":
        if hidden % 128 or intermediate % 64 or not divides:
            return (f"sglang runs experts on Marlin MoE only, which needs the hidden size a multiple of 128 and the "
                    f"expert intermediate size a multiple of 64 (and of the group size {group}); this model has "
                    f"{hidden} and {intermediate}")
        return None
    marlin = hidden % 128 == 0 and (channel or (group in MARLIN_GROUPS and intermediate % group == 0))
    if marlin or (not channel and symmetric and divides):
        return None
    why = "per-channel" if channel else ("asymmetric" if not symmetric else f"group {group} not dividing both widths")
    return (f"{runtime} runs experts that Marlin MoE cannot take (it needs the hidden size a multiple of 128; this "
            f"model has {hidden}, expert intermediate {intermediate}) on its Triton MoE kernel, which takes "
            f"group-wise symmetric experts whose widths the group size divides, not {why} ones")


def _moe_widths(plan: BitPlan, source: ModelSource, runtime: str, mixed: set[int] = frozenset()) -> list[str]:
    """``moe_width_problem`` for each expert scheme of each MoE layer; ``mixed``: layers whose experts differ, which
    quant's plugin runs on Marlin MoE (the others it leaves to vLLM's own MoE method)."""
    seen = set()
    for name, m in source.modules.items():
        p = plan.modules[name]
        if m.kind != "expert" or p.keep or parse(name).leaf != "gate" or (m.layer, _scheme(plan, name)) in seen:
            continue
        seen.add((m.layer, _scheme(plan, name)))
        rules = PLUGIN if runtime == PLUGIN and m.layer in mixed else ("vllm" if runtime == PLUGIN else runtime)
        why = moe_width_problem(rules, p.bits, p.group_size, p.symmetric, m.in_features, m.out_features)
        if why is not None:
            where = "quant's vLLM plugin runs a mixed MoE layer on Marlin MoE, which cannot take " if rules == PLUGIN else ""
            return [f"{where}{why} ({name})"]
    return []


def _fused_shards(plan: BitPlan, source: ModelSource, runtime: str) -> list[str]:
    by_parent: dict[tuple, dict[str, Scheme | None]] = defaultdict(dict)
    for name in source.modules:
        n = parse(name)
        if n.block is not None and n.expert is None:  # leaves of one block: attention, shared expert, dense MLP
            by_parent[(n.layer, n.block)][n.leaf] = _scheme(plan, name)
    for (layer, block), leaves in by_parent.items():
        for fused_block, group in FUSED:
            present = [leaves[g] for g in group if g in leaves and block == fused_block]
            if len(set(present)) > 1:
                return [f"{runtime} fuses {block_name(layer, block)}.{{{','.join(group)}}} into one module; they must "
                        f"share one scheme but the plan gives {', '.join(sorted(map(_fmt, set(present))))}"]
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
    if any(s is not None and not s.symmetric for s in schemes):
        problems.append("transformers 5.x cannot load asymmetric (zero-point) experts; set plan.symmetric: true")
    if "gptq" in formats:
        problems.append(TRANSFORMERS_NO_GPTQ)
    return problems


def _gptq_types(plan: BitPlan, runtime: str, formats: tuple[str, ...]) -> list[str]:
    """vLLM's and SGLang's GPTQ loaders take symmetric 4- or 8-bit weights only (their TYPE_MAP)."""
    if "gptq" not in formats:
        return []
    for name, p in plan.quantized().items():
        if p.bits not in (4, 8) or not p.symmetric:
            return [f"{runtime}'s GPTQ loader takes symmetric 4- or 8-bit weights, not {_fmt(_scheme(plan, name))} "
                    f"({name}); export compressed-tensors, or set plan.symmetric: true and bits 4/8"]
    return []


def gptqmodel_kernel_problem(plan: BitPlan) -> str | None:
    """Why GPTQModel's default 4-bit CPU kernel (TorchAtenLinear: ``_weight_int4pack_mm_for_cpu``, group 32, 64,
    128 or 256) cannot run this plan; its ``BACKEND.TORCH`` kernel (TorchLinear) takes any group. None if it can."""
    for name, p in plan.quantized().items():
        if p.bits == 4 and p.group_size not in ATEN_INT4_GROUPS:
            return (f"GPTQModel's default 4-bit CPU kernel (TorchAtenLinear) takes group sizes "
                    f"{', '.join(map(str, ATEN_INT4_GROUPS))}, not {p.group_size} ({name}); load with "
                    f"backend=BACKEND.TORCH")
    return None


def _gptqmodel(plan: BitPlan, source: ModelSource, formats: tuple[str, ...]) -> list[str]:
    if formats and "gptq" not in formats:
        return [GPTQMODEL_NEEDS_GPTQ]
    fam = source.family
    if not fam.standard_expert_names:
        return [f"gptqmodel reads {fam.title} experts as {STANDARD_EXPERT_GATE_NAMES}, not the original "
                f"{fam.expert_gate_names} names the checkpoint keeps; serve {fam.title} with vllm (per_layer)"]
    return []


def _plugin(plan: BitPlan, source: ModelSource, formats: tuple[str, ...]) -> list[str]:
    """vLLM's own rules, except that the experts of one fused MoE layer may differ in bits and group size."""
    problems = _fused_shards(plan, source, "vllm") + _moe_kernels(plan, source, "vllm")
    mixed = {layer for layer, s in expert_schemes_by_layer(plan, source).items() if len(s) > 1}
    if mixed:
        if formats and "compressed-tensors" not in formats:
            problems.append(PLUGIN_NEEDS_CT)
    else:
        problems += _gptq_types(plan, "vllm", formats)
    return problems + _moe_widths(plan, source, PLUGIN, mixed)


def _vllm_expert_names(source: ModelSource, formats: tuple[str, ...]) -> list[str]:
    """vLLM 0.26 looks a fused MoE layer's compressed-tensors scheme up under ``experts.0.gate_proj`` (and up/down)
    whatever the checkpoint calls them; experts stored under other names (Mixtral: w1/w3/w2) match no target, load
    as unquantized experts and fail. The GPTQ export (rules per layer prefix) and quant's plugin find them."""
    fam = source.family
    if fam.standard_proj_names or "gptq" in formats:
        return []
    return [f"vllm 0.26 looks compressed-tensors experts up as {STANDARD_PROJ_NAMES}, but this model names them "
            f"{fam.proj_names}: it loads them unquantized and fails; add gptq to export.formats, or serve with quant's plugin "
            f"(plan.target_runtime: vllm-quant; vllm serve --quantization moe-quant-mixed)"]


def problems_for(plan: BitPlan, source: ModelSource, runtime: str, formats: tuple[str, ...] = ()) -> list[str]:
    """Reasons ``runtime`` cannot serve ``plan`` exported as ``formats`` (empty when it can)."""
    if runtime == "any":
        return []
    if runtime == "transformers":
        return _transformers(plan, source, formats)
    if runtime == "gptqmodel":
        return _gptqmodel(plan, source, formats)
    if runtime == PLUGIN:
        return _plugin(plan, source, formats)
    problems = _per_layer_uniform(plan, source, runtime) + _fused_shards(plan, source, runtime)
    problems += _moe_kernels(plan, source, runtime) + _gptq_types(plan, runtime, formats)
    if runtime == "vllm":
        problems += _vllm_expert_names(source, formats)
    if runtime == "sglang" and "gptq" in formats and len(set().union(*expert_schemes_by_layer(plan, source).values())) > 1:
        problems.append("sglang's GPTQ-Marlin MoE ignores dynamic rules: GPTQ checkpoints need one expert scheme "
                        "for the whole model; export compressed-tensors for per-layer bits")
    return problems + _moe_widths(plan, source, runtime)


def check_runtime(plan: BitPlan, source: ModelSource, runtime: str, formats: tuple[str, ...] = ()) -> None:
    """Raise PlanError with the first reason ``runtime`` cannot serve the plan; for ``gptqmodel`` group sizes its
    default CPU kernel rejects are kept out of the plan too (the model card names the backend otherwise)."""
    problems = problems_for(plan, source, runtime, formats)
    if runtime == "gptqmodel" and (kernel := gptqmodel_kernel_problem(plan)):
        problems.append(kernel.replace("; load with", "; set plan.group_size to 32, 64 or 128, or load with"))
    if problems:
        raise PlanError(f"plan cannot be served by {runtime}: {problems[0]}")
