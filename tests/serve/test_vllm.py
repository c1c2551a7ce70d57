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

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from quant.serve.names import vllm_version_problem
from quant.serve.vllm_plugin import checkout_entry_point
from tests.conftest import REPO, repo_pythonpath

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

N_PROMPTS, PROMPT_LEN, GREEDY = 32, 128, 32
# top-1 over the 32 x 127 prompt positions; the greedy figure compares the free-running generations position by
# position, so after the first flip the two continuations differ: on these random-weight models every form, stock
# per-layer checkpoints included, measured 0.89-0.99 (1x H200, vLLM 0.26.0, 2026-12-01)
MIN_TOP1, MIN_GREEDY = 0.98, 0.85
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


def vllm_paths() -> list[str]:
    """``QUANT_VLLM_PYTHONPATH``: one folder per vLLM installation to serve with, ``os.pathsep`` between them (the
    whole module runs against each: the serving matrix)."""
    return [p for p in os.environ.get("QUANT_VLLM_PYTHONPATH", "").split(os.pathsep) if p]


def _vllm_version(path: str) -> tuple[str | None, str | None]:
    """(vLLM's version at ``path``, None) or (None, why the module is skipped there)."""
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU (the GPU tier; see README 'Tests on a GPU')"
    if not path:
        return None, "set QUANT_VLLM_PYTHONPATH to folders holding vLLM (benchmarks/device.sh vllm-install)"
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                           env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if probe.returncode:
        return None, f"vLLM does not import from {path} ({(probe.stderr.strip().splitlines() or ['?'])[-1]})"
    return probe.stdout.strip().splitlines()[-1], None


REPORT: list[dict] = []  # every vLLM's agreement rows, written to QUANT_SERVE_REPORT after each


def _inputs(work: Path) -> tuple[Path, Path]:
    """Random-word calibration and held-out text over the synthetic models' word-level vocabulary (ids 1..511)."""
    from quant.models.synthetic import random_words

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    manifests = []
    for name, seed in (("calibration", 0), ("heldout", 1)):
        (data / f"{name}.txt").write_text(random_words(40 * 128, 512, seed))
        (data / f"{name}.yaml").write_text(yaml.safe_dump(
            {"name": f"random-{name}", "sources": [{"name": name, "kind": "text", "path": f"{name}.txt"}]}))
        manifests.append(data / f"{name}.yaml")
    return manifests[0], manifests[1]


def _export(name: str, work: Path, models: dict[str, Path], calib: Path) -> Path:
    shape, _, plan, formats = CASES[name]
    recipe = {"name": name, "model": {"path": str(models[name]), "dtype": "bfloat16"},
              "calibration": {"dataset": str(calib), "n_samples": 16, "seq_len": 128, "seed": 0},
              "plan": plan, "quantize": {"algorithm": "rtn"}, "export": {"formats": formats}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_dir = work / f"run-{name}"
    p = subprocess.run([sys.executable, "-m", "quant.cli", "export", str(path), "-o", str(run_dir)], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo_pythonpath()},
                       timeout=900)
    assert p.returncode == 0, f"{name}: quant export failed\n{p.stderr[-3000:]}"
    return run_dir


def _dequantized(checkpoint: Path, out: Path) -> Path:
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    convert_checkpoint(checkpoint, out, CompressedTensorsDequantizer(checkpoint), device="cpu")
    return out


def _top1(a: dict, b: dict) -> float:
    pairs = [(x, y) for pa, pb in zip(a["top1"], b["top1"], strict=True) for x, y in zip(pa, pb, strict=True)]
    assert len(pairs) >= 4000
    return sum(x == y for x, y in pairs) / len(pairs)


def _greedy(a: dict, b: dict) -> float:
    pairs = [(x, y) for ga, gb in zip(a["greedy"], b["greedy"], strict=True) for x, y in zip(ga[:GREEDY], gb[:GREEDY], strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module", params=vllm_paths() or [""])
def served(request, tmp_path_factory):
    """Every case exported, dequantized and served by the vLLM at ``request.param``; ``{model name: vllm_check
    result}`` plus the run folders and that vLLM's version."""
    version, reason = _vllm_version(request.param)
    if reason:
        pytest.skip(reason)
    from quant.models.synthetic import build_model

    work = tmp_path_factory.mktemp("vllm")
    calib, _ = _inputs(work)
    shapes = {(CASES[n][0], CASES[n][1]) for n in CASES}
    folders = {key: work / f"model-{key[0]}-{key[1]}" for key in shapes}
    for (shape, layers), folder in folders.items():
        build_model(shape, layers, folder, seed=0, logit_scale=4.0)
    models = {n: folders[(CASES[n][0], CASES[n][1])] for n in CASES}
    def export_and_reference(name: str) -> Path:
        run = _export(name, work, models, calib)
        _dequantized(run / "checkpoint", work / f"ref-{name}")
        return run

    with ThreadPoolExecutor(6) as pool:
        runs = dict(zip(CASES, pool.map(export_and_reference, CASES), strict=True))
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
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 512, (N_PROMPTS, PROMPT_LEN), generator=g).tolist()
    spec = {"prompts": prompts, "max_model_len": 512, "greedy_tokens": GREEDY, "enforce_eager": True,
            "kv_cache_memory_bytes": 1 << 30, "models": spec_models}
    (work / "spec.json").write_text(json.dumps(spec))
    path = os.pathsep.join([request.param, str(checkout_entry_point(work / "plugin")), str(REPO)])
    p = subprocess.run([sys.executable, "-m", "quant.serve.vllm_check", str(work / "spec.json"),
                        str(work / "served.json"), "--jobs", "8"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path}, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((work / "served.json").read_text())
    REPORT.extend({"vllm": version, **row} for row in _table(results))
    (Path(os.environ.get("QUANT_SERVE_REPORT", work / "report.json"))).write_text(json.dumps(REPORT, indent=1))
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
                row |= {"top1": round(_top1(r, ref), 4), "greedy": round(_greedy(r, ref), 4)}
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
    assert _top1(got, ref) >= MIN_TOP1, (name, fmt, _top1(got, ref))
    assert _greedy(got, ref) >= MIN_GREEDY, (name, fmt, _greedy(got, ref))


def test_the_plugin_serves_inside_cuda_graphs(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/graphs"):
        return
    got, ref = results["qwen3-experts/graphs"], results["qwen3-experts/ref-graphs"]
    assert "error" not in got, got.get("traceback")
    assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY


def test_the_plugins_marlin_groups_serve_one_after_another_and_side_by_side(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/sequential", "qwen3-experts/overlapped"):
        return
    ref = results["qwen3-experts/ref"]
    sequential, overlapped = results["qwen3-experts/sequential"], results["qwen3-experts/overlapped"]
    for got in (sequential, overlapped):
        assert "error" not in got, got.get("traceback")
        assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY
    # the same kernels on the same inputs: the streams change when they run, not what they compute
    assert _top1(sequential, overlapped) >= 0.999, _top1(sequential, overlapped)



def test_the_plugins_mixed_kernel_serves_both_groups_in_one_launch(served):
    results, _, _ = served
    if _refused_by_version(results, "qwen3-experts/mixed", "deepseek-experts/mixed"):
        return
    for name in ("qwen3-experts", "deepseek-experts"):
        got, ref = results[f"{name}/mixed"], results[f"{name}/ref"]
        assert "error" not in got, got.get("traceback")
        assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY
        # the same layer as the Marlin calls compute (fp32 sums in other orders)
        assert _top1(got, results[f"{name}/compressed-tensors"]) >= 0.98


def test_the_plugins_nibble_stack_serves_every_expert_in_one_marlin_call(served):
    results, _, _ = served
    names = ("qwen3-experts/nibbles", "deepseek-experts/nibbles", "qwen3-experts/nibbles-graphs")
    if _refused_by_version(results, *names):
        return
    for name in names:
        case = name.split("/")[0]
        got, ref = results[name], results[f"{case}/ref-graphs" if name.endswith("graphs") else f"{case}/ref"]
        assert "error" not in got, got.get("traceback")
        assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY, (name, _top1(got, ref))
        # the same layer as the Marlin calls compute (a W8 expert's two halves rounded apart)
        assert _top1(got, results[f"{case}/compressed-tensors"]) >= 0.98, name


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
    assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY


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
        assert _top1(got, ref) >= MIN_TOP1 and _greedy(got, ref) >= MIN_GREEDY
