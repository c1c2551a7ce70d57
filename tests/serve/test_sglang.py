"""Per-layer checkpoints served by SGLang (GPU tier, ``sglang`` marker): the compressed-tensors export of a per-layer
plan (one scheme per MoE layer, what ``recipes/mixed_vllm.yaml`` plans) of a Qwen3-MoE-shaped and a DeepSeek-V3-shaped
model is served by SGLang's offline engine and agrees with SGLang serving its dequantized reference, the same check
and threshold as the vLLM tests (``tests/serve/serving.py``).

SGLang runs where ``QUANT_SGLANG_PYTHONPATH`` points (``os.pathsep`` between several folders: the module runs against
each), apart from quant's own packages (SGLang pins its own compressed-tensors and transformers):
``benchmarks/sglang_wheels.sh`` and ``benchmarks/device.sh sglang-install``. The models' widths are the
``serve-qwen3-moe`` and ``serve-deepseek-v3`` shapes, which SGLang's Marlin MoE takes (hidden a multiple of 128, expert
intermediate of 64; ``quant.plan.runtimes``), planned for ``target_runtime: sglang``.
"""

from __future__ import annotations

import pytest

from tests.serve.serving import (
    GREEDY,
    MIN_GREEDY,
    MIN_TOP1,
    exported,
    greedy,
    prompts,
    record,
    runtime_paths,
    runtime_version,
    serve,
    top1,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

# name -> (shape, decoder layers, plan keys, export formats): W8 g128, W4 g64 and W4 g128 layers in one checkpoint
CASES = {
    "qwen3-layers": ("serve-qwen3-moe", 3, dict(policy="uniform", group_size=128, granularity="per_layer",
                                                target_runtime="sglang",
                                                layer_schemes={"0": "w8g128", "1": "w4g64"}),
                     ["compressed-tensors"]),
    # MLA, a shared expert, a dense first layer
    "deepseek-layers": ("serve-deepseek-v3", 3, dict(policy="uniform", group_size=128, granularity="per_layer",
                                                     target_runtime="sglang", layer_schemes={"1": "w8g128"}),
                        ["compressed-tensors"]),
}


@pytest.fixture(scope="module", params=runtime_paths("QUANT_SGLANG_PYTHONPATH") or [""])
def served(request, tmp_path_factory):
    """Every case exported, dequantized and served by the SGLang at ``request.param``: ``{model name:
    sglang_check result}``, the run folders and the models (the agreement rows added to the report)."""
    version, reason = runtime_version(request.param, "sglang", "QUANT_SGLANG_PYTHONPATH",
                                      "benchmarks/device.sh sglang-install")
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("sglang")
    runs, models = exported(CASES, work, jobs=2)
    spec_models = []
    for name, run in runs.items():
        spec_models += [{"name": f"{name}/ref", "path": str(work / f"ref-{name}")},
                        {"name": f"{name}/compressed-tensors", "path": str(run / "checkpoint")}]
    # one engine at a time: SGLang sizes its pool as a fraction of the GPU's memory
    spec = {"prompts": prompts(), "max_model_len": 512, "greedy_tokens": GREEDY, "mem_fraction_static": 0.3,
            "models": spec_models}
    results = serve("quant.serve.sglang_check", spec, work, [request.param], jobs=1, timeout_s=1500)
    rows = []
    for name in CASES:
        got, ref = results[f"{name}/compressed-tensors"], results[f"{name}/ref"]
        row = {"runtime": "sglang", "version": version, "case": name, "format": "compressed-tensors",
               "quantization": got.get("quantization"), "error": got.get("error") or ref.get("error")}
        if "error" not in got and "error" not in ref:
            row |= {"top1": round(top1(got, ref), 4), "greedy": round(greedy(got, ref), 4)}
        rows.append(row)
    record(rows, work)
    return results, runs, models


@pytest.mark.parametrize("name", list(CASES))
def test_sglang_serves_a_per_layer_checkpoint_as_its_dequantized_reference(served, name):
    results, _, _ = served
    ref, got = results[f"{name}/ref"], results[f"{name}/compressed-tensors"]
    assert "error" not in ref, (ref.get("traceback"), ref.get("log"))
    assert "error" not in got, (got.get("traceback"), got.get("log"))
    assert got["quantization"] == "compressed-tensors"
    assert top1(got, ref) >= MIN_TOP1, (name, top1(got, ref))
    assert greedy(got, ref) >= MIN_GREEDY, (name, greedy(got, ref))


def test_the_runtime_check_has_nothing_to_refuse_in_what_sglang_served(served):
    """The same plans, checked by ``quant.plan.runtimes`` for SGLang (read from its source): no problem."""
    from quant.models import ModelSource
    from quant.plan.bitplan import BitPlan
    from quant.plan.runtimes import problems_for

    _, runs, models = served
    for name in CASES:
        plan = BitPlan.load(runs[name] / "plan.json")
        assert problems_for(plan, ModelSource(models[name]), "sglang", ("compressed-tensors",)) == [], name
