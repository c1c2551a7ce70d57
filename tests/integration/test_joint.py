"""recipes/joint_vllm_quant.yaml through the pipeline on the reference MoE: the joint policy splits MoE layers into a
hot expert group and the rest within the budget, the plan passes the check for vLLM with quant's plugin, the
checkpoint's config.json holds the split layers' two schemes, and stock vLLM is refused at plan time."""

import json
import re
from pathlib import Path

import pytest

from quant.errors import PlanError
from quant.export.writer import CARD
from quant.models import resolve_model
from quant.plan.bitplan import BitPlan
from quant.plan.layer_policy import storage_bits
from quant.recipe import load_recipe
from quant.run.pipeline import run
from quant.serve.names import QUANT_METHOD
from tests.conftest import expert_schemes_by_layer

REPO = Path(__file__).resolve().parents[2]
JOINT = REPO / "recipes" / "joint_vllm_quant.yaml"
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=64", "profile.layer_sensitivity.n_samples=4", "eval.gates={}",
        "quantize.algorithm=rtn")


def _targets(config: dict, bits: int, group: int) -> list[re.Pattern]:
    groups = [g for g in config["config_groups"].values()
              if g["weights"]["num_bits"] == bits and g["weights"]["group_size"] == group]
    assert len(groups) == 1, config["config_groups"]
    return [re.compile(t.removeprefix("re:")) for t in groups[0]["targets"]]


def test_joint_recipe_writes_a_checkpoint_with_split_layers(tmp_path):
    recipe = load_recipe(JOINT, overrides=FAST)
    d = run(recipe, tmp_path / "j").run_dir
    plan = BitPlan.load(d / "plan.json")
    layers = expert_schemes_by_layer(plan)
    split = sorted(layer for layer, s in layers.items() if len(s) == 2)
    assert split and all(len(s) <= 2 for s in layers.values()) and plan.policy == "joint"
    src = resolve_model(recipe.model.path)
    experts = [(n, m) for n, m in src.modules.items() if m.kind == "expert"]
    stored = sum(storage_bits(plan.modules[n].bits, plan.modules[n].group_size, m.in_features) * m.numel
                 for n, m in experts) / sum(m.numel for _, m in experts)
    assert stored <= 4.8 + 16 / 128 + 1e-9
    assert plan.serving["problems"]["vllm"] and "plan.policy joint splits" in plan.serving["problems"]["vllm"][0]

    config = json.loads((d / "checkpoint" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == QUANT_METHOD
    layer = split[0]
    hot = next(n for n, m in experts if m.layer == layer and plan.modules[n].reason.startswith("joint:hot:"))
    rest = next(n for n, m in experts if m.layer == layer and plan.modules[n].reason.startswith("joint:rest:"))
    for name in (hot, rest):  # each expert is a target of its own scheme's config group, of no other
        p = plan.modules[name]
        mine = _targets(config, p.bits, p.group_size)
        assert any(r.fullmatch(src.modules[name].disk_prefix) for r in mine), (name, src.modules[name].disk_prefix)
    (hb, hg), (rb, rg) = ((plan.modules[n].bits, plan.modules[n].group_size) for n in (hot, rest))
    assert (hb, hg) != (rb, rg)
    assert not any(r.fullmatch(src.modules[hot].disk_prefix) for r in _targets(config, rb, rg))
    assert (d / "eval.json").is_file()
    card = (d / "checkpoint" / CARD).read_text()
    assert "--quantization moe-quant-mixed" in card and "its hot experts by `sensitivity`" in card

    stock = load_recipe(JOINT, overrides=(*FAST, "plan.target_runtime=vllm"))
    with pytest.raises(PlanError, match="cannot be served by vllm: .*plan.policy joint splits .*vllm-quant"):
        run(stock, tmp_path / "j", until="plan")


def test_joint_recipe_at_a_budget_that_fits_all_w8_splits_no_layer(tmp_path):
    """At 8 average bits every routed expert fits at W8; splitting off the experts calibration never routed (W4, no
    predicted damage) would lower nothing, so the plan is all W8, one scheme group per layer."""
    recipe = load_recipe(JOINT, overrides=(*FAST, "plan.budget_avg_bits=8"))
    plan = BitPlan.load(run(recipe, tmp_path / "j8", until="plan").run_dir / "plan.json")
    src = resolve_model(recipe.model.path)
    experts = [plan.modules[n] for n, m in src.modules.items() if m.kind == "expert"]
    assert experts and {(p.bits, p.group_size) for p in experts} == {(8, 128)}
    assert {p.reason for p in experts} == {"joint:w8g128"}
