"""Group sizes every target format and runtime can hold, on every builtin; format/runtime problems caught at plan
time (before the quantize stage), with messages that say what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quant.errors import PlanError
from quant.export.inspect import read_checkpoint_bits
from quant.models import BUILTINS, resolve_model
from quant.plan.bitplan import BitPlan
from quant.recipe import load_recipe
from quant.run.pipeline import run

REPO = Path(__file__).resolve().parents[2]
HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=4", "calibration.seq_len=32")
BOTH = "export.formats=[compressed-tensors,gptq]"


def _run(out: Path, name: str, *overrides: str, until: str):
    recipe = load_recipe(HEADLINE, overrides=FAST + overrides, model=f"builtin:{name}")
    return run(recipe, out, until=until)


def _one_group_per_unit(plan: BitPlan, source) -> None:
    per_layer: dict[int, set[int]] = {}
    for name, m in source.modules.items():
        p = plan.modules[name]
        if m.kind == "expert" and not p.keep:
            per_layer.setdefault(m.layer, set()).add(p.group_size)
    assert per_layer and all(len(g) == 1 for g in per_layer.values()), per_layer


@pytest.mark.parametrize("name", list(BUILTINS))
def test_headline_with_both_formats_exports_on_every_builtin(tmp_path, name):
    """Used to stop after quantize with 'GPTQ rules need one scheme per expert' (group 128 clamped to 64 / 32)."""
    result = _run(tmp_path / name, name, BOTH, until="export")
    d = result.run_dir
    source = resolve_model(f"builtin:{name}")
    plan = BitPlan.load(d / "plan.json")
    _one_group_per_unit(plan, source)
    for folder in ("checkpoint", "checkpoint-gptq"):
        on_disk = read_checkpoint_bits(d / folder)
        for cname, p in plan.modules.items():
            if cname == "embed":  # the reader lists 2-D weights other than the embedding
                continue
            disk = on_disk[source.modules[cname].disk_prefix]
            expected = {"keep": True} if p.keep else {"bits": p.bits, "group_size": p.group_size,
                                                      "symmetric": p.symmetric}
            assert disk == expected, (folder, cname, disk)


@pytest.mark.parametrize("name", list(BUILTINS))
def test_headline_per_layer_for_vllm_plans_on_every_builtin(tmp_path, name):
    """Used to be refused ('layer 0 mixes W4 g32 sym, W4 g64 sym; set plan.granularity: per_layer')."""
    # vLLM serves Mixtral's experts (w1/w3/w2 on disk) from the GPTQ export: see the test below
    formats = ("export.formats=[compressed-tensors,gptq]",) if name == "mixtral-tiny" else ()
    result = _run(tmp_path / name, name, "plan.granularity=per_layer", "plan.target_runtime=vllm", *formats,
                  until="plan")
    source = resolve_model(f"builtin:{name}")
    plan = BitPlan.load(result.run_dir / "plan.json")
    _one_group_per_unit(plan, source)
    for layer in source.moe_layers():
        schemes = {(p.bits, p.group_size) for n, p in plan.modules.items() if n.startswith(f"layers.{layer}.experts.")}
        assert len(schemes) == 1, (layer, schemes)
    assert "largest power of two" in json.loads((result.run_dir / "plan.json").read_text())["group_rule"]


def _plan_error(tmp_path: Path, name: str, *overrides: str) -> str:
    with pytest.raises(PlanError) as e:
        _run(tmp_path / "r", name, *overrides, until="quantize")
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert "quantize" not in m["stages"], "the error must come before the quantize stage"
    return str(e.value)


def test_gptq_problems_are_caught_at_plan_time(tmp_path):
    msg = _plan_error(tmp_path / "a", "qwen3-moe-tiny", BOTH, "plan.low_bits=3")
    assert "GPTQ format packs (2, 4, 8) bits, not [3]" in msg
    msg = _plan_error(tmp_path / "b", "qwen3-moe-tiny", BOTH, "plan.group_size=-1")
    assert "expert 0 of layer 0 mixes W4 g32 sym, W4 g64 sym" in msg and "plan.group_size" in msg


def test_vllm_gptq_needs_symmetric_4_or_8_bits(tmp_path):
    msg = _plan_error(tmp_path, "qwen3-moe-tiny", BOTH, "plan.target_runtime=vllm", "plan.symmetric=false",
                      "plan.high_bits=4", "plan.protect.attention=4")  # asymmetric int4 experts suit vLLM's MoE kernels
    assert "vllm's GPTQ loader takes symmetric 4- or 8-bit weights" in msg


def test_per_layer_mix_message_names_the_rule_not_granularity(tmp_path):
    """per_layer is already set; what mixes a layer is the super-expert protection, and the message says so."""
    msg = _plan_error(tmp_path, "qwen3-moe-tiny", "plan.granularity=per_layer", "plan.target_runtime=vllm",
                      "plan.protect.super_experts=keep", "plan.protect.super_expert_ratio=1.01")
    assert "plan.granularity is per_layer, but plan.protect.super_experts gives single experts" in msg
    assert "set plan.granularity: per_layer" not in msg


def test_vllm_is_not_promised_mixtrals_compressed_tensors_experts(tmp_path):
    """vLLM 0.26 looks a fused MoE layer's compressed-tensors scheme up as experts.0.gate_proj whatever the
    checkpoint names them; Mixtral's w1/w3/w2 experts then load unquantized and fail (served on the H200:
    AttributeError 'RoutedExperts' object has no attribute 'w13_weight_packed')."""
    msg = _plan_error(tmp_path, "mixtral-tiny", "plan.granularity=per_layer", "plan.target_runtime=vllm")
    assert "names them w1/w3/w2" in msg and "add gptq to export.formats" in msg and "moe-quant-mixed" in msg


def test_mixtral_is_never_pointed_to_gptqmodel(tmp_path):
    msg = _plan_error(tmp_path / "a", "mixtral-tiny", "plan.target_runtime=vllm")
    assert "set plan.granularity: per_layer" in msg and "gptqmodel" not in msg
    msg = _plan_error(tmp_path / "b", "olmoe-tiny", "plan.target_runtime=vllm")
    assert "plan.target_runtime: gptqmodel with export.formats: [gptq]" in msg


def test_gptqmodel_target_needs_gptq_and_kernel_group_sizes(tmp_path):
    msg = _plan_error(tmp_path / "a", "qwen3-moe-tiny", "plan.target_runtime=gptqmodel")
    assert "GPTQModel loads GPTQ-format checkpoints only; add gptq to export.formats" in msg
    msg = _plan_error(tmp_path / "b", "qwen3-moe-tiny", "plan.target_runtime=gptqmodel", "export.formats=[gptq]",
                      "plan.group_size=16")
    assert "TorchAtenLinear) takes group sizes 32, 64, 128, 256, not 16" in msg and "BACKEND.TORCH" in msg


def test_sglang_is_not_promised_a_model_narrower_than_its_marlin_tiles(tmp_path):
    """The tiny builtins (hidden 64, expert intermediate 32): SGLang runs routed experts on Marlin MoE alone, which
    tiles the hidden size by 128; a per-layer plan for it was planned, exported and carded as SGLang-servable."""
    msg = _plan_error(tmp_path, "qwen3-moe-tiny", "plan.granularity=per_layer", "plan.target_runtime=sglang")
    assert "Marlin MoE only" in msg and "this model has 64 and 32" in msg
