"""The whole pipeline on every builtin family: artifacts, checkpoint exactness, loading, generation."""

import gc
import json
from pathlib import Path

import pytest
import torch

from quant.errors import StopRequested
from quant.models import BUILTINS, resolve_model
from quant.parallel.world import World
from quant.quantize.qstore import dequantize_2d, layer_file, load_into_layer, read_layer
from quant.recipe import load_recipe
from quant.run.pipeline import STAGES, run

REPO = Path(__file__).resolve().parents[2]
HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=2", "eval.perplexity.seq_len=64")


def _run(tmp_path, name, *overrides, until="report"):
    recipe = load_recipe(HEADLINE, overrides=FAST + overrides, model=f"builtin:{name}")
    return recipe, run(recipe, tmp_path / name, until=until)


def test_a_stop_request_ends_with_the_run_that_took_it(tmp_path):
    """A stop file stops the run in hand after its stage, and only that run: the next run in the same process has a
    stop flag of its own (one flag shared by every in-process run made each later run stop at once)."""
    recipe = load_recipe(HEADLINE, overrides=FAST, model="builtin:qwen3-moe-tiny")
    d = tmp_path / "r"
    run(recipe, d, until="calibrate")
    (d / "STOP").touch()
    with pytest.raises(StopRequested, match="stop file"):
        run(recipe, d, until="profile", force="calibrate")
    assert not (d / "STOP").exists()
    gc.collect()  # the stopped run's directory lock goes with its objects (the CLI's process ends instead)
    again = run(recipe, d, until="profile", force="calibrate")
    assert again.ran == ["calibrate", "profile"]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: _run(root, name) for name in BUILTINS}


@pytest.mark.parametrize("name", list(BUILTINS))
def test_run_completes_with_every_artifact(family_runs, name):
    recipe, result = family_runs[name]
    d = result.run_dir
    assert result.ran == list(STAGES) and result.passed is True
    for f in ("calibration.safetensors", "calibration.json", "profile.json", "plan.json", "quantized/layers.json",
              "checkpoint/config.json", "checkpoint/quant_manifest.json", "eval.json", "report.md", "metrics.json",
              "routing_heatmap.png", "bit_map.png", "traffic_curve.png"):
        assert (d / f).is_file(), f
    m = json.loads((d / "manifest.json").read_text())
    for stage in STAGES:
        entry = m["stages"][stage]
        assert entry["status"] == "done" and entry["wall_s"] >= 0 and entry["peak_memory_bytes"] >= 0
        assert entry["input_hash"] and entry["outputs"]
    # on a GPU a stage's peak is the device's (0 for stages that never touch it: calibrate, plan, report); the
    # stages that hold a layer on the device always have one
    assert all(m["stages"][s]["peak_memory_bytes"] > 0 for s in ("profile", "quantize"))
    assert m["versions"]["torch"] and m["versions"]["transformers"]
    calib = json.loads((d / "calibration.json").read_text())
    assert calib["seed"] == 0 and len(calib["sample_ids"]) == 8
    assert f"Recipe description (as written in the recipe file): {recipe.description}" in (d / "report.md").read_text()


@pytest.mark.parametrize("name", list(BUILTINS))
def test_checkpoint_decompresses_bit_exactly(family_runs, name):
    """compressed-tensors' own dequantizer reproduces the pipeline's dequantized weights bit for bit."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    from quant.plan.bitplan import BitPlan

    _, result = family_runs[name]
    d = result.run_dir
    src = resolve_model(f"builtin:{name}")
    dense = CompressedTensorsDequantizer(d / "checkpoint").process(load_file(str(d / "checkpoint" / "model.safetensors")))
    plan = BitPlan.load(d / "plan.json")
    assert len(plan.quantized()) > 0
    for cname in plan.quantized():
        m = src.modules[cname]
        ours = dequantize_2d(read_layer(layer_file(d / "quantized", m.layer))[cname])
        assert torch.equal(ours, dense[m.disk_prefix + ".weight"]), cname
    for cname, p in plan.modules.items():
        if p.keep:
            assert src.modules[cname].disk_prefix + ".weight" in dense


@pytest.mark.parametrize("name", list(BUILTINS))
def test_per_layer_plan_loads_in_transformers_and_matches_fake_quant(tmp_path, name):
    """A plan transformers can serve (uniform expert scheme, mixed bits elsewhere) loads directly; its logits
    equal the model with the pipeline's dequantized weights."""
    from transformers import AutoModelForCausalLM

    _, result = _run(tmp_path, name, "plan.policy=uniform", "plan.group_size=32", "plan.target_runtime=transformers",
                     until="export")
    d = result.run_dir
    src = resolve_model(f"builtin:{name}")
    quant = AutoModelForCausalLM.from_pretrained(d / "checkpoint", dtype=torch.bfloat16)
    fake = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.bfloat16)
    _apply_dequantized(fake, src, d / "quantized")
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = quant(ids).logits.float(), fake(ids).logits.float()
    assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()
    out = quant.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 11)
    bits = {p["bits"] for p in json.loads((d / "plan.json").read_text())["modules"].values() if p["bits"]}
    assert bits == {4, 8}  # attention 8-bit, experts 4-bit: mixed bits in one checkpoint
    # one expert scheme per layer: plain compressed-tensors, which every runtime reads
    assert json.loads((d / "checkpoint" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"


def _apply_dequantized(model, src, qdir: Path) -> None:
    """The pipeline's dequantized weights (and AWQ-changed norms/routers) written into a full model."""
    for layer in range(src.n_layers):
        load_into_layer(src, model.model.layers[layer], layer, layer_file(qdir, layer))


def test_a_per_expert_checkpoint_names_the_method_only_quant_serves(family_runs):
    """Experts of one layer at different bits: config.json names ``moe-quant-mixed`` (quant's vLLM plugin), not
    compressed-tensors, so no runtime loads it as one scheme per layer. transformers does not know the name: it skips
    the quantization config and leaves every packed weight unloaded (randomly initialised, with a load report),
    which is why eval dequantizes mixed plans first and the card says not to load such a checkpoint there."""
    from transformers import AutoModelForCausalLM

    _, result = family_runs["qwen3-moe-tiny"]
    d = result.run_dir
    qcfg = json.loads((d / "checkpoint" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "moe-quant-mixed" and qcfg["format"] == "pack-quantized"
    plan = json.loads((d / "plan.json").read_text())["modules"]
    model = AutoModelForCausalLM.from_pretrained(d / "checkpoint", dtype=torch.bfloat16)
    gu = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    stored = read_layer(layer_file(d / "quantized", 0))
    ups = [c for c, p in plan.items() if c.startswith("layers.0.experts.") and c.endswith(".up")]
    assert {plan[c]["bits"] for c in ups} == {4, 8}
    half = gu.shape[1] // 2
    assert not any(torch.equal(gu[int(c.split(".")[3]), half:], dequantize_2d(stored[c])) for c in ups)
    ev = json.loads((d / "eval.json").read_text())
    assert ev["loader"] == "compressed-tensors-dequantize"


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_awq_folds_ship_in_the_checkpoint(tmp_path, name):
    """AWQ divides norms and scales routers; the checkpoint must carry those changed kept tensors, so that
    transformers' model equals the pipeline's in-memory quantized layers."""
    from transformers import AutoModelForCausalLM

    from quant.quantize.qstore import read_params

    _, result = _run(tmp_path, name, "quantize.algorithm=awq", "plan.policy=uniform", "plan.group_size=32",
                     "plan.target_runtime=transformers", until="export")
    d = result.run_dir
    src = resolve_model(f"builtin:{name}")
    params = {layer: read_params(layer_file(d / "quantized", layer)) for layer in src.moe_layers()}
    assert all("post_attention_layernorm.weight" in p and "mlp.gate.weight" in p for p in params.values())
    quant = AutoModelForCausalLM.from_pretrained(d / "checkpoint", dtype=torch.bfloat16)
    fake = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.bfloat16)
    _apply_dequantized(fake, src, d / "quantized")
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, base = quant(ids).logits.float(), fake(ids).logits.float(), \
            AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.bfloat16)(ids).logits.float()
    assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()
    # and the folded, quantized model still computes (approximately) the original function
    assert (a - base).abs().mean() < 0.2 * base.abs().mean()


def test_sharded_checkpoint_with_index_loads(tmp_path):
    """A shard limit far below the model size gives several shards, an index, and a manifest covering them."""
    from transformers import AutoModelForCausalLM

    from quant.export.writer import verify_manifest

    _, result = _run(tmp_path, "qwen3-moe-tiny", "export.max_shard_gb=0.0002", "plan.policy=uniform",
                     "plan.group_size=32", until="export")
    ckpt = result.run_dir / "checkpoint"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((ckpt / s).is_file() for s in shards)
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    manifest = json.loads((ckpt / "quant_manifest.json").read_text())["files"]
    assert set(shards) <= set(manifest) and verify_manifest(ckpt) == []
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == 1024


def _proxies_close(a: dict, b: dict) -> None:
    for metric in ("perplexity", "kl", "top1_agreement"):
        for k in a[metric]:
            assert a[metric][k] == pytest.approx(b[metric][k], rel=1e-4), (metric, k)
    assert a["n_tokens"] == b["n_tokens"]


@pytest.mark.parametrize("name", list(BUILTINS))
def test_streamed_eval_equals_whole_model_eval_on_a_mixed_plan(family_runs, name):
    """The run's eval (auto picks whole models for these tiny ones, through the dense copy a per-expert 4/8-bit
    mix needs) and the streamed path (per-layer compressed-tensors dequantization) agree to 1e-4."""
    from quant.eval.evaluate import evaluate_run

    _, result = family_runs[name]
    ev = json.loads((result.run_dir / "eval.json").read_text())
    assert ev["proxy_mode"] == "whole" and ev["proxy_mode_reason"].startswith("auto")
    assert ev["loader"] == "compressed-tensors-dequantize"
    recipe = load_recipe(HEADLINE, overrides=FAST + ("eval.mode=streamed",), model=f"builtin:{name}")
    streamed = evaluate_run(recipe, resolve_model(f"builtin:{name}"), result.run_dir, World())
    assert streamed["proxy_mode"] == "streamed" and streamed["loader"] == "compressed-tensors-per-layer"
    _proxies_close(ev["proxies"], streamed["proxies"])


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_streamed_eval_equals_transformers_loading_the_checkpoint(tmp_path, name):
    """A plan transformers loads directly (its own compressed-tensors decompression, whole model) and the streamed
    path give the same proxies to 1e-4."""
    from quant.eval.evaluate import evaluate_run

    overrides = ("plan.policy=uniform", "plan.group_size=32", "plan.target_runtime=transformers")
    _, result = _run(tmp_path, name, *overrides, until="export")
    src = resolve_model(f"builtin:{name}")
    out = {}
    for mode in ("whole", "streamed"):
        recipe = load_recipe(HEADLINE, overrides=FAST + overrides + (f"eval.mode={mode}",), model=f"builtin:{name}")
        out[mode] = evaluate_run(recipe, src, result.run_dir, World())
    assert out["whole"]["loader"] == "transformers"
    _proxies_close(out["whole"]["proxies"], out["streamed"]["proxies"])


def test_a_plan_of_an_older_schema_is_redone_not_loaded(tmp_path):
    """A run directory made by a quant whose plan.json had another schema (headline in ``notes``): the plan stage
    is redone and quantize reads the new plan; the plan is typed and frozen."""
    import dataclasses

    from quant.io.rundir import hash_path
    from quant.plan.bitplan import SCHEMA_VERSION, BitPlan

    recipe, _ = _run(tmp_path, "qwen3-moe-tiny", until="plan")
    d = tmp_path / "qwen3-moe-tiny"
    new = json.loads((d / "plan.json").read_text())
    old = {k: v for k, v in new.items() if k != "headline"} | {"schema_version": SCHEMA_VERSION - 1,
                                                               "notes": [json.dumps(new["headline"])]}
    (d / "plan.json").write_text(json.dumps(old, indent=1))
    m = json.loads((d / "manifest.json").read_text())
    m["stages"]["plan"]["outputs"]["plan.json"] = hash_path(d / "plan.json")  # as the older quant recorded it
    (d / "manifest.json").write_text(json.dumps(m))
    result = run(recipe, d, until="quantize")
    assert result.ran == ["plan", "quantize"] and result.skipped == ["calibrate", "profile"]
    plan = BitPlan.load(d / "plan.json")
    assert plan.schema_version == SCHEMA_VERSION and "notes" not in json.loads((d / "plan.json").read_text())
    assert plan.headline.avg_bits_experts == new["headline"]["avg_bits_experts"]
    assert plan.headline.expert_pct_by_bits == {int(b): v for b, v in new["headline"]["expert_pct_by_bits"].items()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.serving = {}


def test_the_card_stage_alone_writes_the_model_card_after_eval(tmp_path):
    """export writes a checkpoint without a card; the card stage writes it once, with eval's numbers, and adds it
    to the checkpoint's manifest; the report stage leaves the checkpoint alone."""
    recipe, result = _run(tmp_path, "qwen3-moe-tiny", until="eval")
    ckpt = result.run_dir / "checkpoint"
    manifest = json.loads((ckpt / "quant_manifest.json").read_text())
    assert not (ckpt / "README.md").exists() and "README.md" not in manifest["files"]
    result = run(recipe, result.run_dir, until="card")
    assert result.ran == ["card"]
    card = (ckpt / "README.md").read_text()
    ppl = json.loads((result.run_dir / "eval.json").read_text())["proxies"]["perplexity"]["quantized"]
    assert f"{ppl:.4f}" in card and "All quality gates passed." in card
    files = json.loads((ckpt / "quant_manifest.json").read_text())["files"]
    assert files == dict(sorted({**manifest["files"], "README.md": files["README.md"]}.items()))
    stamps = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    result = run(recipe, result.run_dir, force="report")
    assert result.ran == ["report"] and (result.run_dir / "report.md").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == stamps
