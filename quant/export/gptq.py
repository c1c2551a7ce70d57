"""GPTQ-format checkpoint (what AutoGPTQ/GPTQModel write and vLLM's GPTQ loaders read), mixed bits as ``dynamic``.

Per quantized module (out = N, in = K, group g): ``qweight [K*b/32, N]`` int32 packed along K, least significant
bits first, unsigned codes ``q + 2^(b-1)``; ``qzeros [K/g, N*b/32]`` int32 packed along N; ``scales [K/g, N]``
fp16; ``g_idx [K]`` int32 (``k // g``: act-order runs use static groups, so the layout stays ordered).
Symmetric checkpoints use the classic v1 zero encoding (stored zero − 1, e.g. ``0x77777777`` at 4 bits);
asymmetric ones are written as ``checkpoint_format: gptq_v2`` (zeros stored as is: v1 cannot store zero 0).

``dynamic`` rules (GPTQModel syntax; vLLM and GPTQModel both use start-anchored ``re.match`` and take the
first matching rule) override the base scheme, the plan's most common one:
- ``-:`` rules first: blocks kept in bf16 (e.g. ``-:model\\.layers\\.3\\.self_attn\\.``).
- per-expert rules (``+:model\\.layers\\.3\\.mlp\\.experts\\.(1|6)\\.``) only where a layer mixes experts:
  GPTQModel honours them; vLLM matches rules against the fused layer prefix only, so per-expert plans are
  GPTQModel-only (the runtime check says so). Such layers also get a guard rule (``VLLM_GUARD``) that makes vLLM
  refuse the checkpoint at load instead of serving it silently wrong.
- per-layer rules with no trailing ``\\.`` or ``$`` after ``experts``, so the same rule matches vLLM's fused
  prefix ``model.layers.3.mlp.experts`` and GPTQModel's ``model.layers.3.mlp.experts.12.gate_proj``;
  attention by block (``model\\.layers\\.3\\.self_attn\\.``), never by single projection, since vLLM sees the
  fused ``qkv_proj``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import torch

from quant.errors import PlanError
from quant.export.writer import write_checkpoint
from quant.models import ModelSource
from quant.models.families import layer_rule
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan
from quant.quantize.qstore import packed_words, with_codes

GPTQ_BITS = (2, 4, 8)
# Appended to a rule that matches only vLLM's fused MoE prefix (``model.layers.3.mlp.experts``, never GPTQModel's
# per-expert Linear names) of a layer whose experts mix schemes. The rule sets desc_act, which vLLM (0.33) refuses
# for every dynamic rule when it builds its GPTQ config, so vLLM fails at load, naming this rule, instead of
# narrowing mismatched expert tensors into expert 0's buffers silently (docs/runtimes.md). GPTQModel's kernels
# accept desc_act and never match the rule. The regex comment is inert in both regex engines.
VLLM_GUARD = "(?#quant: this layer mixes expert bits; vLLM cannot serve it, load with GPTQModel)"


def pack_rows(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``u [R, C]`` (values < 2^bits) along dim 0: ``[R*bits/32, C]`` int32, LSB first."""
    per = 32 // bits
    assert u.shape[0] % per == 0, f"{u.shape[0]} rows not divisible by {per}"
    u = u.to(torch.int64).reshape(u.shape[0] // per, per, u.shape[1])
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    packed = (u << shifts).sum(dim=1)
    return (packed - ((packed >= 2**31).to(torch.int64) << 32)).to(torch.int32)


def unpack_rows(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_rows``: ``[R*bits/32, C]`` int32 -> ``[R, C]`` int64 unsigned codes."""
    per = 32 // bits
    x = p.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return ((x.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0] * per, p.shape[1])


def gptq_tensors(qw, v2: bool) -> dict[str, torch.Tensor]:
    """One stored module (codes ``[N, K]``, or as ``read_layer(packed=True)`` returns them) -> qweight, qzeros,
    scales, g_idx. W4 codes the store keeps two a byte are qweight's words transposed (``qstore.packed_words``)."""
    bits, g = qw.spec.bits, qw.spec.group_size
    offset = 1 << (bits - 1)
    words = packed_words(qw)
    if words is None:
        qw = with_codes(qw)
        qweight = pack_rows((qw.q.to(torch.int64) + offset).T.contiguous(), bits)  # codes [K, N] packed along K
    else:
        qweight = words.T.contiguous()
    N, K = qw.q.shape[0], qw.q.shape[1] if words is None else 8 * words.shape[1]
    zero = torch.full((N, K // g), offset, dtype=torch.int64) if qw.zero is None else qw.zero.to(torch.int64) + offset
    stored_zero = zero if v2 else zero - 1
    scales = qw.scale.to(torch.float16)
    if not torch.equal(scales.to(qw.scale.dtype), qw.scale):
        raise PlanError("a scale does not survive the fp16 conversion GPTQ checkpoints need (out of fp16 range)")
    return {
        "qweight": qweight,
        "qzeros": pack_rows(stored_zero, bits).T.contiguous(),  # [N, G] packed along N -> [G, N*b/32]
        "scales": scales.T.contiguous(),
        "g_idx": (torch.arange(K, dtype=torch.int32) // g),
    }


def _scheme(plan: BitPlan, name: str) -> tuple | None:
    p = plan.modules[name]
    return None if p.keep else (p.bits, p.group_size, p.symmetric)


def _override(s: tuple) -> dict:
    return {"bits": s[0], "group_size": s[1], "sym": s[2], "desc_act": False}


def dynamic_rules(plan: BitPlan, source: ModelSource) -> tuple[tuple, dict]:
    """(base scheme, ordered dynamic rules) reproducing the plan; see the module docstring."""
    quantized = [s for n in source.modules if (s := _scheme(plan, n)) is not None]
    if not quantized:
        raise PlanError("the plan quantizes nothing; there is no GPTQ checkpoint to write")
    base = Counter(quantized).most_common(1)[0][0]
    blocks: dict[tuple, dict] = defaultdict(dict)  # (layer, block) -> expert-or-None -> scheme
    for name in source.modules:
        where = source.family.rule_block(name)
        if where is not None:
            blocks[(where[0], where[1])].setdefault(where[2], set()).add(_scheme(plan, name))
    skip, per_expert, per_block = defaultdict(list), defaultdict(list), defaultdict(list)
    for (layer, block), members in sorted(blocks.items()):
        schemes = set().union(*members.values())
        if len(schemes) == 1:
            (s,) = schemes
            if s is None:
                skip[block].append(layer)
            elif s != base:
                per_block[(block, s)].append(layer)
            continue
        if None in schemes:
            raise PlanError(f"layer {layer}: a GPTQ block cannot mix kept and quantized modules ({block}); give "
                            "the whole block bits or keep it (plan.protect), or export compressed-tensors only")
        by_scheme = defaultdict(list)
        for expert, ss in members.items():
            if len(ss) > 1:
                raise PlanError(_mixed_unit(layer, block, expert, ss))
            by_scheme[next(iter(ss))].append(expert)
        for s, experts in by_scheme.items():
            if s != base:
                per_expert[(layer, block, s)] = experts
    rules: dict[str, object] = {}
    for block, layers in skip.items():
        rules[f"-:{layer_rule(_alt(layers), block)}"] = {}
    mixed_layers = defaultdict(list)
    for (layer, block, _), _experts in per_expert.items():
        mixed_layers[block].append(layer)
    for block, layers in mixed_layers.items():
        rules[f"+:{layer_rule(_alt(layers), block)}${VLLM_GUARD}"] = {"desc_act": True}
    for (layer, block, s), experts in per_expert.items():
        rules[f"+:{layer_rule(str(layer), block)}\\.{_alt(experts)}\\."] = _override(s)
    for (block, s), layers in per_block.items():
        rules[f"+:{layer_rule(_alt(layers), block)}"] = _override(s)
    return base, rules


def _mixed_unit(layer: int, block: str, expert: int | None, schemes: set) -> str:
    name = block.replace("\\", "").rstrip(".")
    what = f"expert {expert} of layer {layer}" if expert is not None else f"layer {layer}'s {name}"
    got = ", ".join(sorted(f"W{b} g{g} {'sym' if sym else 'asym'}" for b, g, sym in schemes))
    return (f"GPTQ dynamic rules hold one scheme per expert and per block, but {what} mixes {got}; set "
            "plan.group_size to a size dividing every projection's width (32, 64 or 128 rather than -1), or export "
            "compressed-tensors only")


def _alt(numbers: list[int]) -> str:
    numbers = sorted(set(numbers))
    return str(numbers[0]) if len(numbers) == 1 else "(" + "|".join(map(str, numbers)) + ")"


def quantize_config(plan: BitPlan, source: ModelSource) -> dict:
    from quant import version

    base, rules = dynamic_rules(plan, source)
    sym_all = all(p.symmetric for p in plan.quantized().values())
    return {
        "bits": base[0], "group_size": base[1], "desc_act": False, "sym": base[2], "lm_head": False,
        "quant_method": "gptq", "checkpoint_format": "gptq" if sym_all else "gptq_v2", "pack_dtype": "int32",
        "dynamic": rules, "meta": {"quantizer": [f"moe-quant:{version()}"]},
    }


def check_gptq_plan(plan: BitPlan, source: ModelSource) -> None:
    """Raise PlanError if the plan cannot be written in GPTQ format (run at plan time, before any quantization)."""
    bad = sorted({p.bits for p in plan.quantized().values()} - set(GPTQ_BITS))
    if bad:
        raise PlanError(f"the GPTQ format packs {GPTQ_BITS} bits, not {bad}; change plan.high_bits/low_bits or "
                        "drop gptq from export.formats")
    dynamic_rules(plan, source)


def write_gptq(source: ModelSource, plan: BitPlan, qdir: Path, out: Path, max_shard_bytes: int, world: World,
               extra_manifest: dict | None = None) -> Path:
    """Write the GPTQ-format checkpoint to ``out`` atomically (each rank of ``world`` its share of the shards);
    returns ``out``."""
    check_gptq_plan(plan, source)
    qcfg = quantize_config(plan, source)
    v2 = qcfg["checkpoint_format"] == "gptq_v2"
    config = json.loads((source.path / "config.json").read_text())
    config["quantization_config"] = qcfg
    return write_checkpoint(source, plan, qdir, out, max_shard_bytes, lambda qw: gptq_tensors(qw, v2),
                            {"config.json": config, "quantize_config.json": qcfg},
                            {"format": "gptq", **(extra_manifest or {})}, world)
