"""Checkpoints served by vLLM (GPU tier, ``vllm`` marker): every form quant says vLLM serves is served by vLLM and
agrees with vLLM serving its dequantized reference; what the runtime check says vLLM cannot serve fails loudly.

Models are random-weight models of each family at the smallest widths vLLM's MoE kernels accept
(``quant.models.synthetic`` ``serve-*`` shapes), quantized by ``quant export`` (RTN; the whole pipeline up to the
checkpoint). The reference of a checkpoint is its compressed-tensors dequantization (compressed-tensors' own
dequantizer); a GPTQ export is compared with the dequantization of the compressed-tensors export of the same run
(both hold the same codes). vLLM runs where ``QUANT_VLLM_PYTHONPATH`` points (vLLM pins its own compressed-tensors,
so it lives apart from quant's: ``benchmarks/vllm_wheels.sh`` and ``benchmarks/device.sh vllm-install``). quant's
plugin reaches vLLM as an installed package registers it: its entry point in the ``vllm.general_plugins`` group
(``quant.serve.vllm_plugin.checkout_entry_point`` writes it beside the checkout, as pip would).
"""

from __future__ import annotations

import pytest

from quant.serve.names import vllm_version_problem
from quant.serve.vllm_plugin import checkout_entry_point
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

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

# name -> (shape, decoder layers, plan keys, export formats)
CASES = {
    # one scheme per MoE layer: both bits and every group size vLLM's MoE kernels take, in both formats
    "qwen3-layers": ("serve-qwen3-moe", 5, dict(policy="uniform", group_size=128, granularity="per_layer",
                                                target_runtime="vllm",
                                                layer_schemes={"0": "w8g128", "1": "w4g32", "2": "w4g64"}),
                     ["compressed-tensors", "gptq"]),
    "qwen3-w4-asym": ("serve-qwen3-moe", 2, dict(policy="uniform", group_size=128, symmetric=False,
                                                 target_runtime="vllm",
                                                 protect=dict(attention="keep", shared_experts="keep",
                                                              dense_mlp="keep")), ["compressed-tensors"]),
    "qwen3-w8": ("serve-qwen3-moe", 2, dict(policy="uniform", low_bits=8, high_bits=8, group_size=128,
                                            target_runtime="vllm"), ["compressed-tensors"]),
    "mixtral-layers": ("serve-mixtral", 3, dict(policy="uniform", group_size=64, granularity="per_layer",
                                                target_runtime="vllm", layer_schemes={"0": "w8g128"}),
                       ["compressed-tensors", "gptq"]),
    "olmoe-layers": ("serve-olmoe", 3, dict(policy="uniform", group_size=128, granularity="per_layer",
                                            target_runtime="vllm", layer_schemes={"1": "w8g64"}),
                     ["compressed-tensors"]),
    # MLA, a shared expert, a dense first layer
    "deepseek-layers": ("serve-deepseek-v3", 3, dict(policy="uniform", group_size=128, granularity="per_layer",
                                                     target_runtime="vllm", layer_schemes={"1": "w8g128"}),
                        ["compressed-tensors", "gptq"]),
    # experts narrower than Marlin MoE tiles (hidden 64, intermediate 32): vLLM's Triton MoE kernel, int4 and int8
    "qwen3-narrow": ("serve-qwen3-narrow", 2, dict(policy="uniform", group_size=32, granularity="per_layer",
                                                   target_runtime="vllm", layer_schemes={"0": "w8g32"},
                                                   protect=dict(attention="keep")), ["compressed-tensors"]),
    # the headline plan: the most used 20 % of each layer's experts at 8 bits, the rest at 4 (quant's plugin)
    "qwen3-experts": ("serve-qwen3-moe", 3, dict(policy="top_fraction", top_fraction=0.25, group_size=128,
                                                 target_runtime="vllm-quant"), ["compressed-tensors", "gptq"]),
    "deepseek-experts": ("serve-deepseek-v3", 3, dict(policy="top_fraction", top_fraction=0.25, group_size=64,
                                                      target_runtime="vllm-quant"), ["compressed-tensors"]),
}


@pytest.fixture(scope="module", params=runtime_paths("QUANT_VLLM_PYTHONPATH") or [""])
def served(request, tmp_path_factory):
    """Every case exported, dequantized and served by the vLLM at ``request.param``; ``{model name: vllm_check
    result}`` plus the run folders and that vLLM's version."""
    version, reason = runtime_version(request.param, "vllm", "QUANT_VLLM_PYTHONPATH",
                                      "benchmarks/device.sh vllm-install")
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("vllm")
    runs, models = exported(CASES, work, jobs=6)
    spec_models = []
    for name, run in runs.items():
        spec_models.append({"name": f"{name}/ref", "path": str(work / f"ref-{name}")})
        for fmt, folder in (("compressed-tensors", "checkpoint"), ("gptq", "checkpoint-gptq")):
            if fmt in CASES[name][3]:
                spec_models.append({"name": f"{name}/{fmt}", "path": str(run / folder)})
    # stock vLLM (no plugin) must refuse the per-expert checkpoint by name, not load it with one scheme per layer
    spec_models.append({"name": "qwen3-experts/stock", "path": str(runs["qwen3-experts"] / "checkpoint"),
                        "env": {"VLLM_PLUGINS": ""}})
    # Mixtral's experts are w1/w3/w2 on disk: the plugin looks them up by those names (--quantization moe-quant-mixed)
    spec_models.append({"name": "mixtral-layers/plugin", "path": str(runs["mixtral-layers"] / "checkpoint"),
                        "engine_args": {"quantization": "moe-quant-mixed"}})
    # the plugin leaves a layer whose experts share one scheme to vLLM's own MoE method, narrow widths included
    spec_models.append({"name": "qwen3-narrow/plugin", "path": str(runs["qwen3-narrow"] / "checkpoint"),
                        "engine_args": {"quantization": "moe-quant-mixed"}})
    # the plugin's forward inside CUDA graphs (the default serving mode), against the reference served the same way
    spec_models.append({"name": "qwen3-experts/graphs", "path": str(runs["qwen3-experts"] / "checkpoint"),
                        "enforce_eager": False})
    spec_models.append({"name": "qwen3-experts/ref-graphs", "path": str(work / "ref-qwen3-experts"),
                        "enforce_eager": False})
    # the plugin's Marlin scheme groups one after another on vLLM's stream and on two streams at every batch (by
    # default they overlap at decode-sized batches only), and its mixed kernel (both groups in one launch)
    for variant, env in (("sequential", {"QUANT_MOE_OVERLAP": "0"}), ("overlapped", {"QUANT_MOE_OVERLAP": "1"})):
        spec_models.append({"name": f"qwen3-experts/{variant}", "path": str(runs["qwen3-experts"] / "checkpoint"),
                            "env": env})
    for name in ("qwen3-experts", "deepseek-experts"):
        for kernel in ("mixed", "nibbles"):
            spec_models.append({"name": f"{name}/{kernel}", "path": str(runs[name] / "checkpoint"),
                                "env": {"QUANT_MOE_KERNEL": kernel}})
    # the nibble stack inside CUDA graphs: its alignment and zeroed rows captured, replayed at every decode size
    spec_models.append({"name": "qwen3-experts/nibbles-graphs", "path": str(runs["qwen3-experts"] / "checkpoint"),
                        "enforce_eager": False, "env": {"QUANT_MOE_KERNEL": "nibbles"}})
    spec = {"prompts": prompts(), "max_model_len": 512, "greedy_tokens": GREEDY, "enforce_eager": True,
            "kv_cache_memory_bytes": 1 << 30, "models": spec_models}
    results = serve("quant.serve.vllm_check", spec, work, [request.param, str(checkout_entry_point(work / "plugin"))],
                    jobs=8, timeout_s=1200)
    record([{"runtime": "vllm", "version": version, **row} for row in _table(results)], work)
    results["vllm_version"] = version
    return results, runs, models


def _table(results: dict) -> list[dict]:
    rows = []
    for name in CASES:
        ref = results[f"{name}/ref"]
        extra = {"qwen3-experts": ["graphs", "sequential", "overlapped", "mixed", "nibbles", "nibbles-graphs", "stock"],
                 "deepseek-experts": ["mixed", "nibbles"], "mixtral-layers": ["plugin"],
                 "qwen3-narrow": ["plugin"]}.get(name, [])
        for fmt in CASES[name][3] + extra:
            r = results[f"{name}/{fmt}"]
            row = {"case": name, "format": fmt, "quantization": r.get("quantization"), "error": r.get("error")}
            if "error" not in r and "error" not in ref:
                row |= {"top1": round(top1(r, ref), 4), "greedy": round(greedy(r, ref), 4)}
            rows.append(row)
    return rows


# what the runtime check says vLLM cannot serve: the per-expert GPTQ export (vLLM's dynamic rules are per layer), and
# Mixtral's compressed-tensors experts (vLLM 0.26 looks them up as gate_proj/up_proj/down_proj, not w1/w3/w2)
REFUSED = {("qwen3-experts", "gptq"): "vllm", ("mixtral-layers", "compressed-tensors"): "vllm"}


def _refused_by_version(results: dict, *names: str) -> bool:
    """Whether this vLLM is one the plugin does not support; then every checkpoint ``names`` served through the
    plugin was refused with the plugin's one line naming the versions it serves."""
    problem = vllm_version_problem(results["vllm_version"])
    for name in names if problem else ():
        assert problem in results[name].get("error", ""), results[name]
    return problem is not None


@pytest.mark.parametrize("name,fmt", [(n, f) for n in CASES for f in CASES[n][3] if (n, f) not in REFUSED])
def test_served_checkpoint_agrees_with_its_dequantized_reference(served, name, fmt):
    results, _, _ = served
    if "experts" in name and fmt == "compressed-tensors" and _refused_by_version(results, f"{name}/{fmt}"):
        return
    ref, got = results[f"{name}/ref"], results[f"{name}/{fmt}"]
    assert "error" not in ref, ref.get("traceback")
    assert "error" not in got, got.get("traceback")
    expected = {"compressed-tensors": ("moe-quant-mixed" if "experts" in name else "compressed-tensors"),
                "gptq": None}[fmt]
    if expected:
        assert got["quantization"] == expected
    assert top1(got, ref) >= MIN_TOP1, (name, fmt, top1(got, ref))
    assert greedy(got, ref) >= MIN_GREEDY, (name, fmt, greedy(got, ref))


def test_the_plugin_serves_inside_cuda_graphs(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/graphs"):
        return
    got, ref = results["qwen3-experts/graphs"], results["qwen3-experts/ref-graphs"]
    assert "error" not in got, got.get("traceback")
    assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY


def test_the_plugins_marlin_groups_serve_one_after_another_and_side_by_side(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/sequential", "qwen3-experts/overlapped"):
        return
    ref = results["qwen3-experts/ref"]
    sequential, overlapped = results["qwen3-experts/sequential"], results["qwen3-experts/overlapped"]
    for got in (sequential, overlapped):
        assert "error" not in got, got.get("traceback")
        assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY
    # the same kernels on the same inputs: the streams change when they run, not what they compute
    assert top1(sequential, overlapped) >= 0.999, top1(sequential, overlapped)



def test_the_plugins_mixed_kernel_serves_both_groups_in_one_launch(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/mixed", "deepseek-experts/mixed"):
        return
    for name in ("qwen3-experts", "deepseek-experts"):
        got, ref = results[f"{name}/mixed"], results[f"{name}/ref"]
        assert "error" not in got, got.get("traceback")
        assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY
        # the same layer as the Marlin calls compute (fp32 sums in other orders)
        assert top1(got, results[f"{name}/compressed-tensors"]) >= 0.98


def test_the_plugins_nibble_stack_serves_every_expert_in_one_marlin_call(served):
    results, _, _ = served
    names = ("qwen3-experts/nibbles", "deepseek-experts/nibbles", "qwen3-experts/nibbles-graphs")
    if _refused_by_version(results, *names):
        return
    for name in names:
        case = name.split("/")[0]
        got, ref = results[name], results[f"{case}/ref-graphs" if name.endswith("graphs") else f"{case}/ref"]
        assert "error" not in got, got.get("traceback")
        assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY, (name, top1(got, ref))
        # the same layer as the Marlin calls compute (a W8 expert's two halves rounded apart)
        assert top1(got, results[f"{case}/compressed-tensors"]) >= 0.98, name


def test_stock_vllm_refuses_a_per_expert_checkpoint_by_name(served):
    results, _, _ = served
    err = results["qwen3-experts/stock"].get("error", "")
    assert "moe-quant-mixed" in err and "nknown quantization method" in err, err


@pytest.mark.parametrize("name,fmt", list(REFUSED))
def test_what_the_runtime_check_refuses_fails_loudly_in_vllm(served, name, fmt):
    from quant.models import ModelSource
    from quant.plan.bitplan import BitPlan
    from quant.plan.runtimes import problems_for

    results, runs, models = served
    plan = BitPlan.load(runs[name] / "plan.json")
    assert problems_for(plan, ModelSource(models[name]), REFUSED[(name, fmt)], (fmt,))
    assert "error" in results[f"{name}/{fmt}"], "vLLM served a checkpoint it cannot serve right"


def test_the_plugin_serves_mixtral_by_its_own_expert_names(served):
    results, _, _ = served
    if _refused_by_version(results, "mixtral-layers/plugin"):
        return
    got, ref = results["mixtral-layers/plugin"], results["mixtral-layers/ref"]
    assert "error" not in got, got.get("traceback")
    assert got["quantization"] == "moe-quant-mixed"
    assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY


def test_experts_narrower_than_marlin_tiles_serve_as_the_runtime_check_says(served):
    """hidden 64: Marlin MoE cannot tile it, so vLLM runs the experts on its Triton MoE kernel (what
    ``plan.runtimes.moe_width_problem`` says, read from vLLM's source), stock and under quant's plugin, and the
    check names SGLang (Marlin MoE only) as unable to serve it."""
    from quant.models import ModelSource
    from quant.plan.bitplan import BitPlan
    from quant.plan.runtimes import problems_for

    results, runs, models = served
    plan, source = BitPlan.load(runs["qwen3-narrow"] / "plan.json"), ModelSource(models["qwen3-narrow"])
    assert problems_for(plan, source, "vllm") == [] and problems_for(plan, source, "vllm-quant") == []
    assert "Marlin MoE only" in problems_for(plan, source, "sglang")[0]
    ref = results["qwen3-narrow/ref"]
    plugin = [] if _refused_by_version(results, "qwen3-narrow/plugin") else [results["qwen3-narrow/plugin"]]
    for got in (results["qwen3-narrow/compressed-tensors"], *plugin):
        assert "error" not in got, got.get("traceback")
        assert top1(got, ref) >= MIN_TOP1 and greedy(got, ref) >= MIN_GREEDY
