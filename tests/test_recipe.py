from pathlib import Path

import pytest

from quant.errors import RecipeError
from quant.recipe import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


def test_recipes_exist_including_nested():
    assert any(p.name == "mixed_int8_int4.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_recipe_validates(path):
    r = load_recipe(path)
    assert r.name and r.schema_version == 1


def test_unknown_key_names_closest_key():
    with pytest.raises(RecipeError, match=r"unknown recipe key 'plan\.top_fracton'.*did you mean 'plan\.top_fraction'"):
        parse_recipe({"name": "x", "plan": {"top_fracton": 0.2}})


def test_unknown_top_level_section():
    with pytest.raises(RecipeError, match="did you mean 'quantize'"):
        parse_recipe({"name": "x", "quantise": {}})


@pytest.mark.parametrize("bits", [5, 16, 1, "eight", True])
def test_bits_must_be_valid(bits):
    with pytest.raises(RecipeError, match="plan.high_bits"):
        parse_recipe({"name": "x", "plan": {"high_bits": bits}})


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.5])
def test_fraction_range(frac):
    with pytest.raises(RecipeError, match=r"top_fraction must be in \(0, 1\]"):
        parse_recipe({"name": "x", "plan": {"top_fraction": frac}})


@pytest.mark.parametrize("g", [0, 3, 100, 4])
def test_group_size_checked(g):
    with pytest.raises(RecipeError, match="group_size"):
        parse_recipe({"name": "x", "plan": {"group_size": g}})


def test_cross_field_checks():
    with pytest.raises(RecipeError, match="high_bits .* must be >= plan.low_bits"):
        parse_recipe({"name": "x", "plan": {"high_bits": 4, "low_bits": 8}})
    with pytest.raises(RecipeError, match="needs exactly one of"):
        parse_recipe({"name": "x", "plan": {"policy": "budget"}})
    with pytest.raises(RecipeError, match="budget_avg_bits .* must lie between"):
        parse_recipe({"name": "x", "plan": {"policy": "budget", "budget_avg_bits": 9}})


def test_overrides_and_model(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nplan: {top_fraction: 0.2}\n")
    r = load_recipe(p, overrides=("plan.top_fraction=0.5", "quantize.algorithm=gptq", "eval.tasks=[quant_mmlu]"),
                    model="builtin:olmoe-tiny")
    assert r.plan.top_fraction == 0.5 and r.quantize.algorithm == "gptq"
    assert r.eval.tasks == ("quant_mmlu",) and r.model.path == "builtin:olmoe-tiny"
    with pytest.raises(RecipeError, match="did you mean 'plan.top_fraction'"):
        load_recipe(p, overrides=("plan.topfraction=0.3",))
    with pytest.raises(RecipeError, match="expects KEY=VALUE"):
        load_recipe(p, overrides=("plan.top_fraction",))


def test_malformed_yaml_reports_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nplan:\n  top_fraction: [0.2\n")
    with pytest.raises(RecipeError, match=r"malformed YAML .*line \d+"):
        load_recipe(p)


def test_recipe_is_frozen_and_hash_is_stable():
    a = parse_recipe({"name": "x"})
    b = parse_recipe({"name": "x", "plan": {"top_fraction": 0.2}})
    assert a.section_hash("plan") == b.section_hash("plan")
    assert a.section_hash("plan") != parse_recipe({"name": "x", "plan": {"top_fraction": 0.3}}).section_hash("plan")
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        a.name = "y"


def test_eval_parallel_keys_belong_to_their_backend():
    """eval.mode is one of auto|whole|streamed; tensor/data-parallel sizes are vllm's, GPU dispatch is hf's."""
    assert parse_recipe({"name": "x", "eval": {"mode": "streamed"}}).eval.mode == "streamed"
    with pytest.raises(RecipeError, match="eval.mode"):
        parse_recipe({"name": "x", "eval": {"mode": "layerwise"}})
    with pytest.raises(RecipeError, match="vllm options"):
        parse_recipe({"name": "x", "eval": {"tensor_parallel_size": 2}})
    with pytest.raises(RecipeError, match="hf options"):
        parse_recipe({"name": "x", "eval": {"backend": "vllm", "gpus": 2}})
    with pytest.raises(RecipeError, match="eval.gpus"):
        parse_recipe({"name": "x", "eval": {"gpus": 0}})
    e = parse_recipe({"name": "x", "eval": {"backend": "vllm", "tensor_parallel_size": 8, "data_parallel_size": 2}}).eval
    assert (e.tensor_parallel_size, e.data_parallel_size) == (8, 2)
