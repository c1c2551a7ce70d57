"""The servable path through the pipeline: recipes/mixed_vllm.yaml plans one scheme per MoE layer from measured
layer damage; a layer plan's card shows the vLLM snippet; a per-expert plan's report names the best servable plan."""

import json
from pathlib import Path

import pytest

from quant.export.writer import CARD
from quant.models import resolve_model
from quant.plan.bitplan import BitPlan
from quant.plan.layer_policy import storage_bits
from quant.profile.profile import RoutingProfile
from quant.recipe import load_recipe
from quant.run.pipeline import run
from tests.conftest import expert_schemes_by_layer

REPO = Path(__file__).resolve().parents[2]
MIXED_VLLM = REPO / "recipes" / "mixed_vllm.yaml"
HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=64", "profile.layer_sensitivity.n_samples=4", "eval.gates={}")


def test_mixed_vllm_recipe_plans_one_scheme_per_layer_within_budget(tmp_path):
    recipe = load_recipe(MIXED_VLLM, overrides=FAST)
    result = run(recipe, tmp_path / "r", until="plan")
    profile = RoutingProfile.load(result.run_dir / "profile.json")
    assert set(profile.layer_damage) == {"w4g128", "w4g64", "w4g32", "w8g128"}
    assert all(d.shape == (len(profile.layers),) and (d > 0).all() for d in profile.layer_damage.values())
    plan = BitPlan.load(result.run_dir / "plan.json")
    layers = expert_schemes_by_layer(plan)
    assert all(len(s) == 1 for s in layers.values()) and len(layers) == len(profile.layers)
    src = resolve_model(recipe.model.path)
    stored = sum(storage_bits(plan.modules[n].bits, plan.modules[n].group_size, m.in_features) * m.numel
                 for n, m in src.modules.items() if m.kind == "expert")
    numel = sum(m.numel for m in src.modules.values() if m.kind == "expert")
    assert stored / numel <= 4.8 + 16 / 128 + 1e-9
    assert plan.serving["problems"] == {"vllm": [], "sglang": []}
    assert plan.serving["predicted_kl"] == pytest.approx(sum(
        profile.layer_damage["w{}g{}".format(*next(iter(layers[layer])))][row].item()
        for row, layer in enumerate(profile.layers)))


def test_layer_plan_card_shows_vllm_snippet_and_no_sglang_one_on_a_narrow_model(tmp_path):
    """On the tiny model (experts 64 and 32 wide) every requested group resolves to 32 for the whole layer. vLLM
    runs such experts on its Triton MoE kernel; SGLang has only Marlin MoE, which tiles the hidden size by 128: the
    report, the card, the export's runtimes and metrics.json all say so (they claimed SGLang before)."""
    recipe = load_recipe(MIXED_VLLM, overrides=FAST, model="builtin:qwen3-moe-tiny")
    result = run(recipe, tmp_path / "t")
    d = result.run_dir
    plan = BitPlan.load(d / "plan.json")
    assert set().union(*expert_schemes_by_layer(plan).values()) <= {(4, 32), (8, 32)}
    assert all(len(s) == 1 for s in expert_schemes_by_layer(plan).values()) and plan.serving["predicted_kl"] > 0
    report = (d / "report.md").read_text()
    assert "## Serving with vLLM / SGLang" in report and "not servable by sglang: sglang runs experts on Marlin" in report
    card = (d / "checkpoint" / CARD).read_text()
    assert "vllm serve ORG/NAME" in card and "python -m sglang.launch_server" not in card
    problems = json.loads((d / "metrics.json").read_text())["serving"]["problems"]
    assert problems["vllm"] == [] and "this model has 64 and 32" in problems["sglang"][0]
    served = json.loads((d / "manifest.json").read_text())["stages"]["export"]["served_by"]["checkpoint"]
    assert "vllm" in served and "sglang" not in served


def test_per_expert_plan_report_names_best_servable_plan_and_price(tmp_path):
    recipe = load_recipe(HEADLINE, overrides=FAST, model="builtin:qwen3-moe-tiny")  # it measures layer damage
    d = run(recipe, tmp_path / "h").run_dir
    serving = BitPlan.load(d / "plan.json").serving
    alt = serving["best_servable"]
    assert serving["problems"]["vllm"] and alt["policy"] == "layer_sensitivity"
    assert serving["predicted_kl"] > 0 and alt["expert_storage_bits"] <= serving["expert_storage_bits"] + 1e-9
    report = (d / "report.md").read_text()
    assert "not servable by vllm, sglang" in report and f"{alt['predicted_kl']:.4g}" in report
    assert "servable plan minus this plan, predicted KL" in report
    # whole-layer schemes cannot fill the headline's size on this model (W8 in one of 4 layers overshoots it), and
    # only vLLM serves its widths: neither is passed off as the price of serving at equal size
    assert alt["runtimes"] == ["vllm"] and alt["expert_storage_bits"] < serving["expert_storage_bits"] - 0.5
    assert "best plan vLLM serve within this size" in report and "(not at equal size" in report
    card = (d / "checkpoint" / CARD).read_text()
    assert "The best such plan vLLM serve within this checkpoint's size" in card and f"{alt['predicted_kl']:.4g}" in card
    assert "not compared at equal size" in card
