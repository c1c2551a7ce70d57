"""The model card: parseable front matter, numbers from the inputs, failed gates and unservable runtimes shown."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from quant.card.render import render_card
from quant.models import ModelSource, resolve_model
from quant.plan.bitplan import Headline
from quant.recipe import parse_recipe

HEADLINE = Headline(avg_bits_experts=4.812, avg_bits_all=6.137, size_gb=12.3456,
                    expert_pct_by_bits={4: 81.25, 8: 18.75}, traffic_share_by_bits={4: 0.3541, 8: 0.6459},
                    traffic_weighted_bits=6.583)
ALL_OK = {"vllm": [], "sglang": [], "transformers": [], "gptqmodel": []}


def _eval(ppl_passed: bool = True) -> dict:
    return {"loader": "transformers",
            "proxies": {"perplexity": {"base": 10.0, "quantized": 10.5}, "kl": {"quantized": 0.0123},
                        "top1_agreement": {"quantized": 0.9512}, "n_tokens": 2048},
            "tasks": {"quant_mmlu": {"metric": "acc", "base": 0.6, "quantized": 0.58, "delta": -0.02,
                                     "stderr": 0.01, "n": 100}},
            "gates": [{"name": "perplexity", "kind": "max_rel_increase", "observed": 0.05,
                       "limit": 0.1 if ppl_passed else 0.01, "passed": ppl_passed},
                      {"name": "mmlu", "kind": "max_drop (points)", "observed": 2.0, "limit": 3.0, "passed": True}],
            "passed": ppl_passed}


@pytest.fixture(scope="module")
def builtin_source(quant_cache) -> ModelSource:
    return resolve_model("builtin:qwen3-moe-tiny")


def _recipe(model: str = "acme/Tiny-MoE-A1B", *overrides: str):
    return parse_recipe({"name": "mixed_int8_int4", "description": "hot experts at INT8, the rest INT4"},
                        overrides=("plan.group_size=32", *overrides), model=model)


def _split(card: str) -> tuple[dict, str]:
    """The front matter as YAML and as the hub's own reader (``huggingface_hub.ModelCard``) reads it, and the body."""
    from huggingface_hub import ModelCard

    m = re.match(r"^---\n(.*?)\n---\n(.*)$", card, re.S)
    assert m, card[:300]
    meta = yaml.safe_load(m.group(1))
    assert ModelCard(card).data.to_dict() == meta
    return meta, m.group(2)


def _section(body: str, title: str, level: str = "##") -> str:
    """Text under heading ``level title`` up to the next heading of the same or a higher level (headings inside
    fenced code blocks are code, not headings)."""
    out, inside, fenced = [], False, False
    for line in body.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"^(#+) (.*)$", line) if not fenced else None
        if heading and len(heading.group(1)) <= len(level):
            if inside:
                break
            inside = heading.group(1) == level and heading.group(2) == title
            continue
        if inside:
            out.append(line)
    assert inside, f"no section {title!r}"
    return "\n".join(out) + "\n"


def _copy_source(src: ModelSource, dst: Path, readme: str | None = None, config_extra: dict | None = None):
    shutil.copytree(src.path, dst)
    if readme is not None:
        (dst / "README.md").write_text(readme)
    if config_extra:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_extra}))
    return ModelSource(dst)


def test_front_matter_for_a_hub_model(builtin_source, tmp_path):
    src = _copy_source(builtin_source, tmp_path / "m", readme="---\nlicense: apache-2.0\nlanguage: [en]\n---\n# Tiny\n")
    meta, body = _split(render_card(_recipe(), src, HEADLINE, _eval(), ALL_OK, "0.1.0"))
    assert meta == {"base_model": "acme/Tiny-MoE-A1B", "base_model_relation": "quantized", "license": "apache-2.0",
                    "library_name": "transformers", "pipeline_tag": "text-generation",
                    "tags": ["quantized", "mixture-of-experts", "compressed-tensors", "moe-quant"],
                    "quantization": {"format": "compressed-tensors", "tool": "moe-quant", "algorithm": "rtn"}}
    assert body.startswith("\n# ")
    assert "moe-quant 0.1.0" in _section(body, "Provenance")


def test_license_from_config_and_omitted_fields(builtin_source, tmp_path):
    src = _copy_source(builtin_source, tmp_path / "m", config_extra={"license": "mit"})
    meta, _ = _split(render_card(_recipe(), src, HEADLINE, None, ALL_OK, "0.1.0", fmt="gptq"))
    assert meta["license"] == "mit" and meta["tags"][2] == "gptq"
    # builtin and local-folder models have no hub id; the builtin has no license anywhere
    for model in ("builtin:qwen3-moe-tiny", str(builtin_source.path)):
        meta, _ = _split(render_card(_recipe(model), builtin_source, HEADLINE, None, ALL_OK, "0.1.0"))
        assert "base_model" not in meta and "license" not in meta, meta
        assert meta["library_name"] == "transformers"


def test_what_and_plan_numbers_match_the_inputs(builtin_source):
    recipe = _recipe("acme/Tiny-MoE-A1B", "quantize.algorithm=gptq", "plan.granularity=per_layer",
                     "plan.symmetric=false")
    _, body = _split(render_card(recipe, builtin_source, HEADLINE, None, ALL_OK, "0.1.0"))
    what = _section(body, "What this is")
    assert "`mixed_int8_int4`" in what and "`gptq`" in what and "`top_fraction`" in what and "`per_layer`" in what
    assert "group size 32" in what and "asymmetric" in what and "20%" in what
    plan = _section(body, "Plan")
    assert "**4.812**" in plan and "6.137" in plan and "6.583" in plan and "12.3456 GB" in plan
    rows = {r[0]: r[1:] for r in (ln.strip("|").split("|") for ln in plan.splitlines() if ln.startswith("| "))}
    rows = {k.strip(): [c.strip() for c in v] for k, v in rows.items()}
    assert rows["4"] == ["81.25%", "35.4%"] and rows["8"] == ["18.75%", "64.6%"]
    # a headline that went through JSON (plan.json: string keys) renders the same table
    as_json = Headline.from_json(json.loads(json.dumps(asdict(HEADLINE))))
    assert _section(_split(render_card(recipe, builtin_source, as_json, None, ALL_OK, "0.1.0"))[1], "Plan") == plan


def test_eval_table_and_gates(builtin_source):
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, _eval(True), ALL_OK, "0.1.0"))
    ev = _section(body, "Evaluation")
    ppl = next(ln for ln in ev.splitlines() if ln.startswith("| held-out perplexity"))
    assert "10.0000" in ppl and "10.5000" in ppl and "+0.5000" in ppl and "+5.00%" in ppl and "pass" in ppl
    mmlu = next(ln for ln in ev.splitlines() if ln.startswith("| quant_mmlu"))
    assert "-2.00 pts" in mmlu and "pass" in mmlu  # the 'mmlu' gate applies to task quant_mmlu
    assert "0.0123" in ev and "0.9512" in ev and "All quality gates passed." in ev and "FAIL" not in ev

    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, _eval(False), ALL_OK, "0.1.0"))
    ev = _section(body, "Evaluation")
    ppl = next(ln for ln in ev.splitlines() if ln.startswith("| held-out perplexity"))
    assert "**FAILED**" in ppl and "0.01" in ppl
    assert "Quality gates FAILED: perplexity" in ev and "All quality gates passed" not in ev

    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, ALL_OK, "0.1.0"))
    assert _section(body, "Evaluation").strip() == "Not evaluated."


def test_serving_follows_runtime_compatibility(builtin_source):
    problems = {"vllm": ["vllm applies one quantization scheme to all experts of a fused MoE layer"],
                "sglang": [], "transformers": [], "gptqmodel": []}
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", repo_id="me/tiny-w4"))
    serving = _section(body, "Serving")
    vllm, sglang = _section(serving, "vLLM", "###"), _section(serving, "SGLang", "###")
    assert vllm.strip() == f"not servable: {problems['vllm'][0]}" and "vllm serve" not in vllm
    assert "python -m sglang.launch_server --model-path me/tiny-w4" in sglang
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-w4"' in _section(serving, "transformers", "###")
    gptqmodel = _section(serving, "GPTQModel", "###")  # compressed-tensors: not a format GPTQModel loads
    assert gptqmodel.strip().startswith("not servable:") and "GPTQ-format" in gptqmodel

    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, ALL_OK, "0.1.0", fmt="gptq",
                                 repo_id="me/tiny-gptq"))
    serving = _section(body, "Serving")
    assert "vllm serve me/tiny-gptq" in _section(serving, "vLLM", "###")
    assert 'GPTQModel.load("me/tiny-gptq")' in _section(serving, "GPTQModel", "###")
    assert "not servable: transformers cannot load GPTQ-format" in _section(serving, "transformers", "###")

    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, {"vllm": []}, "0.1.0"))
    assert "not checked" in _section(_section(body, "Serving"), "SGLang", "###")


def test_recipe_description_is_not_repeated(builtin_source):
    """The headline recipe says 'RTN baseline'; a run with --set quantize.algorithm=gptq must not claim it."""
    recipe = parse_recipe({"name": "mixed_int8_int4", "description": "top-20% at INT8, RTN baseline."},
                          overrides=("quantize.algorithm=gptq",))
    _, body = _split(render_card(recipe, builtin_source, HEADLINE, None, ALL_OK, "0.1.0"))
    assert "RTN" not in body and "- algorithm: `gptq`" in _section(body, "What this is")


def test_library_name_follows_the_runtime_check(builtin_source):
    def library(problems: dict, fmt: str = "compressed-tensors"):
        meta, _ = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", fmt=fmt))
        return meta.get("library_name")

    mixed = ["transformers 5.x decompresses every fused expert ... with one scheme"]
    assert library(ALL_OK) == "transformers"
    assert library({**ALL_OK, "transformers": mixed}) == "vllm"
    assert library(ALL_OK, fmt="gptq") == "vllm"  # transformers cannot load GPTQ MoE checkpoints
    assert library({rt: ["no"] for rt in ALL_OK}) is None


def test_runtime_notes_and_backend_are_rendered(builtin_source):
    notes = {"vllm": "**vLLM may load this checkpoint without an error and serve wrong outputs**: x"}
    problems = {**ALL_OK, "vllm": ["vllm applies one quantization scheme to all experts"]}
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", fmt="gptq",
                                 runtime_notes=notes, gptqmodel_backend="TORCH", repo_id="me/x"))
    serving = _section(body, "Serving")
    vllm = _section(serving, "vLLM", "###")
    assert vllm.strip().startswith(notes["vllm"]) and "not servable: vllm applies" in vllm
    gptqmodel = _section(serving, "GPTQModel", "###")
    assert "from gptqmodel import GPTQModel, BACKEND" in gptqmodel
    assert 'GPTQModel.load("me/x", backend=BACKEND.TORCH)' in gptqmodel


def test_cards_of_a_per_expert_mixtral_run(tmp_path):
    """Real plan, both formats: the CT card says stock vLLM refuses it by name (``moe-quant-mixed``) and warns in
    bold not to load it with transformers (it leaves the weights uninitialised), the GPTQ card says vLLM fails to
    load it: what vLLM 0.26.0 and transformers 5.17 did with such checkpoints. The tiny model is too narrow for the
    plugin's kernel, and the card says so; nothing points Mixtral users to GPTQModel; no library can serve it."""
    from quant.card import write_cards
    from quant.run.pipeline import run

    recipe = parse_recipe({"name": "headline"}, overrides=("calibration.n_samples=4", "calibration.seq_len=32",
                                                           "export.formats=[compressed-tensors,gptq]"),
                          model="builtin:mixtral-tiny")
    run(recipe, tmp_path, until="export")
    write_cards(recipe, resolve_model("builtin:mixtral-tiny"), tmp_path)
    meta, body = _split((tmp_path / "checkpoint" / "README.md").read_text())
    serving = _section(body, "Serving")
    vllm = _section(serving, "vLLM", "###")
    assert "Stock vLLM refuses this checkpoint by name" in vllm and "serves it (above)" not in vllm
    assert "gptqmodel" not in vllm.lower() and "not servable" in vllm
    assert "hidden size 64" in _section(serving, "vLLM with quant's plugin", "###")
    assert "**Do not load this checkpoint with transformers**" in _section(serving, "transformers", "###")
    assert "library_name" not in meta
    _, body = _split((tmp_path / "checkpoint-gptq" / "README.md").read_text())
    serving = _section(body, "Serving")
    assert "vLLM fails to load this checkpoint" in _section(serving, "vLLM", "###")
    assert "serves the compressed-tensors export" in _section(serving, "vLLM with quant's plugin", "###")
    assert "not servable" in _section(serving, "GPTQModel", "###") and "serve Mixtral with vllm" in serving


SERVING = {"problems": {"vllm": ["vllm applies one quantization scheme to all experts of a fused MoE layer"],
                        "sglang": ["sglang applies one quantization scheme"]},
           "predicted_kl": 0.0209, "expert_storage_bits": 4.875, "damage_measured": True,
           "best_servable": {"policy": "layer_sensitivity", "layers": {"0": "w8g128", "1": "w4g32"},
                             "predicted_kl": 0.0166, "expert_storage_bits": 4.87}}


def test_serving_names_the_best_servable_plan_when_vllm_cannot_serve(builtin_source):
    problems = dict(ALL_OK, vllm=SERVING["problems"]["vllm"], sglang=SERVING["problems"]["sglang"])
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", serving=SERVING))
    serving = _section(body, "Serving")
    assert "layer_sensitivity" in serving and "0.0166" in serving and "0.0209" in serving
    assert "vllm serve" not in _section(serving, "vLLM", "###")
    # a layer plan vLLM serves: the snippet, and no alternative offered
    layer = _recipe("acme/Tiny-MoE-A1B", "plan.policy=layer_sensitivity", "plan.granularity=per_layer",
                    "plan.budget_avg_bits=4.8", "plan.layer_group_sizes=[64]",
                    "profile.layer_sensitivity.schemes=[w4g32,w8g32,w4g64]")
    _, body = _split(render_card(layer, builtin_source, HEADLINE, None, ALL_OK, "0.1.0",
                                 serving=dict(SERVING, problems={"vllm": [], "sglang": []})))
    serving = _section(body, "Serving")
    assert "vllm serve ORG/NAME" in serving and "layer_sensitivity" not in serving
    assert "one scheme per MoE layer, chosen by measured output damage within 4.8 average expert bits; group " \
           "sizes 32, 64" in _section(body, "What this is")
    # no measured damage: nothing to offer, nothing invented
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0",
                                 serving=dict(SERVING, best_servable=None, damage_measured=False)))
    assert "layer_sensitivity" not in _section(body, "Serving")


def test_the_card_says_when_the_servable_plan_is_smaller(builtin_source):
    problems = dict(ALL_OK, vllm=SERVING["problems"]["vllm"], sglang=SERVING["problems"]["sglang"])
    smaller = dict(SERVING, expert_storage_bits=5.25,
                   best_servable=dict(SERVING["best_servable"], expert_storage_bits=4.5, runtimes=["vllm"]))
    serving = _section(_split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0",
                                          serving=smaller))[1], "Serving")
    assert "The best such plan vLLM serve within" in serving
    assert "It stores 4.500 bits per expert weight against this checkpoint's 5.250" in serving
    same = _section(_split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0",
                                       serving=dict(SERVING, expert_storage_bits=4.5,
                                                    best_servable=smaller["best_servable"])))[1], "Serving")
    assert "not compared at equal size" not in same


def test_the_plugins_snippet_is_what_the_serving_tests_ran(builtin_source):
    """A per-expert checkpoint the plugin serves: install line and ``vllm serve`` (tests/serve/test_vllm.py);
    a plain compressed-tensors checkpoint stock vLLM cannot serve is named to the plugin explicitly."""
    problems = dict(ALL_OK, **{"vllm-quant": [], "vllm": ["vllm applies one quantization scheme to all experts"]})
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", repo_id="me/x"))
    plugin = _section(_section(body, "Serving"), "vLLM with quant's plugin", "###")
    assert "pip install vllm==0.26.0 && pip install --no-deps moe-quant" in plugin
    assert "vllm serve me/x --quantization moe-quant-mixed" in plugin and 'quantization="moe-quant-mixed"' in plugin
    problems = dict(ALL_OK, **{"vllm-quant": []})
    _, body = _split(render_card(_recipe(), builtin_source, HEADLINE, None, problems, "0.1.0", repo_id="me/x"))
    plugin = _section(_section(body, "Serving"), "vLLM with quant's plugin", "###")
    assert "vllm serve me/x\n" in plugin and "--quantization" not in plugin


def test_the_card_lists_the_schemes_config_json_holds(tmp_path):
    """The recipe asks for group 128; the tiny model's widths resolve it to 32 and 64: the card says what the
    checkpoint holds, not what the recipe asked for."""
    from quant.card import write_cards
    from quant.run.pipeline import run

    recipe = parse_recipe({"name": "headline"}, overrides=("calibration.n_samples=4", "calibration.seq_len=32"))
    run(recipe, tmp_path, until="export")
    write_cards(recipe, resolve_model(recipe.model.path), tmp_path)
    groups = json.loads((tmp_path / "checkpoint" / "config.json").read_text())["quantization_config"]["config_groups"]
    held = {f"W{g['weights']['num_bits']} g{g['weights']['group_size']} "
            f"{'sym' if g['weights']['symmetric'] else 'asym'}" for g in groups.values()}
    _, body = _split((tmp_path / "checkpoint" / "README.md").read_text())
    (line,) = [x for x in _section(body, "What this is").splitlines() if x.startswith("- schemes")]
    listed = set(re.findall(r"W\d+ g\d+ a?sym", line.split("(recipe:")[0]))
    assert listed == held and len(held) > 1 and "g128" not in line.split("(recipe:")[0], line
    assert "experts W4 g32 sym ×" in line and "attention W8 g64 sym ×" in line
