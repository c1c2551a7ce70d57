from pathlib import Path

import pytest

from quant.errors import RecipeError
from quant.recipe import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


def test_recipes_exist_including_nested():
    assert any(p.name == "mixed_int8_int4.yaml" for p in RECIPES)


def test_headline_recipe_quantizes_with_gptq_and_its_rtn_baseline_differs_only_there():
    headline = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml")
    baseline = load_recipe(REPO / "recipes" / "mixed_int8_int4_rtn.yaml")
    assert headline.quantize.algorithm == "gptq" and "GPTQ" in headline.description
    assert baseline.quantize.algorithm == "rtn" and "RTN" in baseline.description
    a, b = headline.model_dump(), baseline.model_dump()
    for d in (a, b):
        d.pop("name"), d.pop("description"), d["quantize"].pop("algorithm")
    assert a == b


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_recipe_validates(path):
    r = load_recipe(path)
    assert r.name and r.schema_version == 1


def test_unknown_key_names_closest_key():
    with pytest.raises(RecipeError, match=r"unknown recipe key 'plan\.top_fracton'.*did you mean 'plan\.top_fraction'"):
        parse_recipe({"name": "x", "plan": {"top_fracton": 0.2}})


def test_a_key_nothing_reads_is_unknown():
    """profile.extra_datasets was accepted and read by nothing; it is an unknown key now (see test_recipe_keys)."""
    with pytest.raises(RecipeError, match=r"unknown recipe key 'profile\.extra_datasets'"):
        parse_recipe({"name": "x", "profile": {"extra_datasets": ["calibration/code.yaml"]}})


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


LAYER_POLICY = {"policy": "layer_sensitivity", "granularity": "per_layer", "budget_avg_bits": 4.75}


@pytest.mark.parametrize("data, message", [
    ({"plan": LAYER_POLICY}, r"needs profile.layer_sensitivity.schemes to include w4g128, w8g128 \(have: "
                             r"profile.layer_sensitivity unset\)"),
    ({"plan": LAYER_POLICY, "profile": {"layer_sensitivity": {"schemes": ["w4g128", "w8g64"]}}},
     "to include w8g128"),
    ({"plan": dict(LAYER_POLICY, layer_group_sizes=[32]),
      "profile": {"layer_sensitivity": {"schemes": ["w4g128", "w8g128"]}}}, "measures no scheme with group 32"),
    ({"plan": {"policy": "layer_sensitivity"}, "profile": {"layer_sensitivity": {}}},
     "needs plan.budget_avg_bits, plan.granularity: per_layer"),
    ({"plan": dict(LAYER_POLICY, symmetric=False), "profile": {"layer_sensitivity": {}}}, "plan.symmetric: true"),
    ({"plan": dict(LAYER_POLICY, layer_group_sizes=[-1]), "profile": {"layer_sensitivity": {}}}, "per channel"),
    ({"plan": {"layer_group_sizes": [32]}}, "read by plan.policy 'layer_sensitivity' or 'joint' only"),
    ({"profile": {"layer_sensitivity": {"schemes": ["int4"]}}}, "written w<bits>g<group>"),
    ({"profile": {"layer_sensitivity": {"schemes": ["w5g128"]}}}, "bits of scheme 'w5g128'"),
    ({"profile": {"layer_sensitivity": {"schemes": ["w4g100"]}}}, "power of two"),
    ({"profile": {"layer_sensitivity": {"schemes": []}}}, "at least one scheme"),
    ({"profile": {"layer_sensitivity": {"schemes": ["w4g128", "w4g128"]}}}, "duplicates"),
    ({"profile": {"layer_sensitivity": {"n_samples": 0}}}, "n_samples"),
    ({"profile": {"layer_sensitivity": {"dtype": "int8"}}}, "dtype"),
    ({"profile": {"layer_sensitivity": {"method": "full"}}}, "'bounded' or 'exact'"),
    ({"profile": {"layer_sensitivity": {"method": "exact", "carry_layers": 2}}}, "read by method 'bounded' only"),
    ({"profile": {"layer_sensitivity": {"carry_layers": 0}}}, "carry_layers.*greater than or equal to 1"),
    ({"profile": {"layer_sensitivity": {"method": "exact", "draws": 4}}}, "draws is read by method 'bounded' only"),
    ({"profile": {"layer_sensitivity": {"draws": 0}}}, "draws.*greater than or equal to 1"),
])
def test_layer_policy_needs_its_measurements_and_settings(data, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"name": "x", **data})


JOINT = {"policy": "joint", "budget_avg_bits": 4.75}


@pytest.mark.parametrize("data, message", [
    ({"plan": JOINT}, r"plan.policy 'joint' needs profile.layer_sensitivity.schemes to include w4g128, w8g128 \(have: "
                      r"profile.layer_sensitivity unset\)"),
    ({"plan": dict(JOINT, layer_group_sizes=[64]), "profile": {"layer_sensitivity": {"schemes": ["w4g128", "w8g128"]}}},
     "measures no scheme with group 64"),
    ({"plan": {"policy": "joint"}, "profile": {"layer_sensitivity": {}}}, r"'joint' \(up to two .* needs plan.budget_avg_bits$"),
    ({"plan": dict(JOINT, budget_avg_bits=None, budget_gb=1.0), "profile": {"layer_sensitivity": {}}},
     "needs plan.budget_avg_bits"),
    ({"plan": dict(JOINT, granularity="per_layer"), "profile": {"layer_sensitivity": {}}},
     "needs plan.granularity: per_expert; for one scheme per MoE layer use plan.policy: layer_sensitivity"),
    ({"plan": dict(JOINT, symmetric=False), "profile": {"layer_sensitivity": {}}}, "'joint' .* needs plan.symmetric: true"),
    ({"plan": dict(JOINT, group_size=-1), "profile": {"layer_sensitivity": {}}}, "needs plan.group_size other than -1"),
    ({"plan": dict(JOINT, layer_group_sizes=[-1]), "profile": {"layer_sensitivity": {}}}, "per channel"),
    ({"plan": dict(JOINT, split_by="experts"), "profile": {"layer_sensitivity": {}}}, "plan.split_by"),
    ({"plan": dict(LAYER_POLICY, split_by="tokens"), "profile": {"layer_sensitivity": {}}},
     "plan.split_by is read by plan.policy 'joint' only \\(the policy is 'layer_sensitivity'\\)"),
])
def test_joint_policy_needs_its_measurements_and_settings(data, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"name": "x", **data})


def test_joint_policy_recipe_resolves():
    r = parse_recipe({"name": "x", "plan": dict(JOINT, layer_group_sizes=[32, 64], split_by="tokens",
                                                target_runtime="vllm-quant"), "profile": {"layer_sensitivity": {}}})
    assert (r.plan.policy, r.plan.split_by, r.plan.layer_group_sizes) == ("joint", "tokens", (32, 64))
    assert r.plan.granularity == "per_expert"
    assert parse_recipe({"name": "x", "plan": JOINT, "profile": {"layer_sensitivity": {}}}).plan.split_by == "sensitivity"


def test_layer_policy_recipe_resolves():
    r = parse_recipe({"name": "x", "plan": dict(LAYER_POLICY, layer_group_sizes=[32, 64]),
                      "profile": {"layer_sensitivity": {}}})
    assert r.profile.layer_sensitivity.schemes == ("w4g128", "w4g64", "w4g32", "w8g128")
    assert r.profile.layer_sensitivity.n_samples == 16 and r.profile.layer_sensitivity.dtype == "float32"
    assert (r.profile.layer_sensitivity.method, r.profile.layer_sensitivity.carry_layers) == ("bounded", 1)
    assert r.plan.layer_group_sizes == (32, 64)
    exact = parse_recipe({"name": "x", "profile": {"layer_sensitivity": {"method": "exact"}}})
    assert exact.profile.layer_sensitivity.method == "exact"


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


def test_humaneval_sandbox_policy_is_require_or_an_explicit_allow_weak():
    """Generated code needs every kernel layer of the sandbox unless the recipe opts out by name."""
    assert parse_recipe({"name": "x"}).eval.humaneval_sandbox == "require"
    weak = parse_recipe({"name": "x", "eval": {"tasks": ["quant_humaneval"], "humaneval_sandbox": "allow_weak"}})
    assert weak.eval.humaneval_sandbox == "allow_weak"
    for value in ("off", "weak", True, 0):
        with pytest.raises(RecipeError, match="eval.humaneval_sandbox"):
            parse_recipe({"name": "x", "eval": {"humaneval_sandbox": value}})
    with pytest.raises(RecipeError, match="did you mean 'eval.humaneval_sandbox'"):
        parse_recipe({"name": "x", "eval": {"humaneval_sandbx": "allow_weak"}})


def _file(tmp_path, text: str | bytes) -> Path:
    p = tmp_path / "r.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


@pytest.mark.parametrize("section,key,value", [
    ("plan", "top_fraction", True), ("calibration", "seed", True), ("calibration", "n_samples", True),
    ("plan", "high_bits", 8.0), ("plan", "symmetric", 1), ("export", "max_shard_gb", True)])
def test_booleans_are_not_numbers_and_numbers_not_booleans(section, key, value):
    with pytest.raises(RecipeError, match=f"{section}.{key}"):
        parse_recipe({"name": "x", section: {key: value}})


@pytest.mark.parametrize("section,key,value", [
    ("calibration", "seed", 2**64), ("calibration", "seed", -1), ("plan", "seed", 2**80),
    ("calibration", "n_samples", 10**12), ("calibration", "seq_len", 2**40), ("eval", "max_gen_toks", 2**40),
    ("export", "max_shard_gb", float("inf")), ("quantize", "hessian_budget_gb", float("inf")),
    ("quantize", "solve_budget_gb", 1e300), ("plan", "super_expert_ratio", float("inf")),
    ("plan", "budget_gb", 0), ("plan", "budget_gb", -3.0), ("plan", "budget_gb", float("nan")),
    ("quantize", "awq_grid", 10**9)])
def test_values_that_would_crash_later_are_refused_at_load(section, key, value):
    spec = {key: value, "policy": "budget"} if key == "budget_gb" else {key: value}
    if key == "super_expert_ratio":
        spec = {"protect": {key: value}}
    with pytest.raises(RecipeError, match=key):
        parse_recipe({"name": "x", section: spec})


def test_calibration_token_count_is_bounded():
    with pytest.raises(RecipeError, match="tokens"):
        parse_recipe({"name": "x", "calibration": {"n_samples": 1_000_000, "seq_len": 1 << 20}})


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0:1", "", "CUDA"])
def test_device_syntax_is_checked_at_load(device):
    with pytest.raises(RecipeError, match="device must be auto, cpu"):
        parse_recipe({"name": "x", "quantize": {"device": device}})
    with pytest.raises(RecipeError, match="eval.device"):
        parse_recipe({"name": "x", "eval": {"device": device}})


def test_absent_device_is_refused_before_any_work(tmp_path):
    import torch

    from quant.run.pipeline import run

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    r = parse_recipe({"name": "x", "quantize": {"device": "cuda:7"}})
    with pytest.raises(RecipeError, match="device 'cuda:7' is not present on this machine"):
        run(r, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("gates,match", [
    ({"mmlu": {"max_drop": 1.0}}, "eval.gates.mmlu: no such metric"),
    ({"perplexity": {}}, "eval.gates.perplexity takes max_rel_increase"),
    ({"perplexity": {"max_drop": 1.0}}, "takes max_rel_increase, not max_drop"),
    ({"kl": {"max_value": 0.1, "max_drop": 1.0}}, "eval.gates.kl takes max_value"),
    ({"perplexity": None}, "eval.gates.perplexity")])
def test_gates_are_checked_at_load(gates, match):
    with pytest.raises(RecipeError, match=match):
        parse_recipe({"name": "x", "eval": {"gates": gates}})


def test_gates_on_tasks_and_proxies_are_accepted():
    r = parse_recipe({"name": "x", "eval": {"tasks": ["quant_mmlu"], "gates": {
        "mmlu": {"max_drop": 1.0}, "perplexity": {"max_rel_increase": 0.05}, "top1_agreement": {"max_value": 0.9}}}})
    assert set(r.eval.gates) == {"mmlu", "perplexity", "top1_agreement"}


def test_yaml_classes_in_recipe_files(tmp_path):
    for text, match in [
        (b"name: x\xff\n", "is not UTF-8 text"),
        ("name: x\ncalibration: {seed: 2024-01-01}\n", "calibration.seed"),
        ("name: !!binary eA==\n", "unsupported YAML tag '!!binary'"),
        ("name: x\neval: {tasks: !!set {a}}\n", "unsupported YAML tag '!!set'"),
        ("name: x\nname: y\n", "duplicate key 'name'"),
        ("name: x\nplan: " + "[" * 100 + "]" * 100, "nesting deeper"),
    ]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(_file(tmp_path, text))
    assert load_recipe(_file(tmp_path, "name: 2024-01-01\ndescription: 2024-01-01T10:00:00\n")).name == "2024-01-01"


def test_set_values_go_through_the_strict_loader(tmp_path):
    p = _file(tmp_path, "name: x\n")
    for assignment, match in [("name=a\x07b", "control character"), ("plan.a\nb=1", "--set key"),
                              ("name=!!binary eA==", "unsupported YAML tag"), ("calibration.seed=2024-01-01", "seed"),
                              ("plan.top_fraction=[1, &a 2, *a]", "top_fraction")]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(p, overrides=(assignment,))


@pytest.mark.parametrize("model_section", ["model: builtin:olmoe-tiny\n", "model: [a]\n", "model: 3\n"])
def test_model_that_is_not_a_section_with_model_option(tmp_path, model_section):
    with pytest.raises(RecipeError, match="'model' must be a section"):
        load_recipe(_file(tmp_path, "name: x\n" + model_section), model="builtin:mixtral-tiny")


def test_empty_sections_mean_defaults(tmp_path):
    r = load_recipe(_file(tmp_path, "name: x\nmodel:\nplan:\n"), model="builtin:mixtral-tiny")
    assert r.model.path == "builtin:mixtral-tiny" and r.plan.top_fraction == 0.2


@pytest.mark.parametrize("name", ["", "  ", "a" * 201, ".hidden", "a/b"])
def test_bad_names(name):
    with pytest.raises(RecipeError, match="name must be a plain file name"):
        parse_recipe({"name": name})
