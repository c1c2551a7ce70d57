"""quant estimate: the forecast against the GPU runs recorded in benchmarks/records/ (peak memory within 25 %), shapes
read from headers only (local and hub metadata), refusal of plans that cannot fit, the per-rank split."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.records import load_record
from quant.errors import ModelError, PlanError
from quant.forecast.estimate import check_fits, forecast, render
from quant.forecast.throughputs import gptq_solve_seconds
from quant.models import ModelSource, resolve_model
from quant.models.headers import HeaderSource, load_headers, read_safetensors_header
from quant.models.synthetic import write_shapes_only
from quant.recipe import load_recipe, parse_recipe
from tests.conftest import REPO

# (label, record in benchmarks/records/, algorithm, solve budget, path of the measured peak GB or None, path of the
# measured s/layer or None, GPTQ column loop the record ran: the 2026-11-30 records at defaults ran the CUDA-graph
# loop, which the fused Triton loop has since replaced, so their times are reproduced with the kernel they measured;
# the current engine's solve time is checked against the fused loop's own measurements
# (test_fused_solve_model_matches_the_sub_batch_table)). The shape, saved (or tiled) layers and samples are the
# record's setup. Peaks measured before the fused solve, packed codes and the in-place Hessian normalization (the
# 2026-11-30 records) are retired as peak checks: the forecast models today's engine, whose peaks are the 2026-12-01
# records below (c6e56e8, 0480bed); their times stay checked with the kernel they ran.
RECORDS = [
    ("Qwen3-30B-A3B GPTQ at defaults (2026-11-30)", "2026-11-30-qwen3-30b-a3b-engine-at-defaults", "gptq", 3.0,
     None, "gptq.s_per_layer", "cuda-graph"),
    ("Qwen3-30B-A3B GPTQ, c6e56e8", "2026-12-01-qwen3-30b-a3b-against-llm-compressor", "gptq", 3.0,
     "gptq.peak_gb", "gptq.s_per_layer", "fused"),
    ("DeepSeek-V3 layer GPTQ, 0480bed", "2026-12-01-deepseek-v3-layer-gptq-awq", "gptq", 3.0,
     "gptq.peak_gb", "gptq.s_per_layer", "fused"),
    # AWQ's DeepSeek-V3 time was measured before its fused trial kernel (37.3 s): the peak only
    ("DeepSeek-V3 layer AWQ, 0480bed", "2026-12-01-deepseek-v3-layer-gptq-awq", "awq", 3.0,
     "awq.peak_gb", None, "fused"),
    # AWQ's peak (15.6 GB) was measured before its statistics came in expert chunks and its searches took their rows
    # a few experts at a time (whole-group copies then): the engine now holds less; its time is unchanged
    ("Qwen3-30B-A3B AWQ at defaults", "2026-11-30-qwen3-30b-a3b-awq-expert-sub-batches", "awq", 3.0,
     None, "awq.s_per_layer", "fused"),
    # its time (2.01 s/layer) is over-forecast by half: the time rates predate the read-ahead and the warm fused
    # solve (throughputs.py says where each comes from); the peak is today's
    ("Qwen3-30B-A3B GPTQ, 48 layers, 1 M tokens, 0480bed", "2026-12-01-qwen3-30b-a3b-48-layers-end-to-end", "gptq",
     3.0, "peak_gb", None, "fused"),
    ("DeepSeek-V3 layer GPTQ at defaults", "2026-11-30-deepseek-v3-layer-gptq-at-defaults", "gptq", 3.0,
     None, "gptq.s_per_layer", "cuda-graph"),
    # the 2577395 run on two H200s, after the forecasts were written (out of sample: the fused loop's layer time
    # and AWQ's chunked statistics had not been measured in a layer run before)
    ("DeepSeek-V3 layer GPTQ, fused loop", "2026-11-30-deepseek-v3-gptq-1-vs-2-gpus", "gptq", 3.0,
     None, "gpus_1.layer_s", "fused"),
    ("DeepSeek-V3 layer AWQ in expert chunks", "2026-11-30-deepseek-v3-awq-expert-chunks", "awq", 3.0,
     None, "stage_s", "fused"),
    # the Mixtral shape of 2026-11-30 (5d8cbd6), forecast before it was run; its time is right in total only by
    # compensation (its record's notes say which rates miss), so the record checks the peak
    ("Mixtral-8x7B layer GPTQ, a new shape", "2026-11-30-mixtral-8x7b-layer-forecast", "gptq", 3.0,
     "measured.quantize_peak_gb", None, "fused"),
]


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def get(shape: str, layers: int) -> Path:
        if (shape, layers) not in cache:
            cache[(shape, layers)] = write_shapes_only(shape, layers, tmp_path_factory.mktemp(f"{shape}-{layers}"))
        return cache[(shape, layers)]

    return get


def _bench_recipe(path: Path, samples: int, algorithm: str, solve: float, *extra: str):
    """engine.py's plan: every expert and attention projection W4 g128 (GPTQ symmetric, AWQ asymmetric)."""
    return parse_recipe({"name": "bench"}, model=str(path), overrides=(
        "plan.policy=uniform", "plan.low_bits=4", "plan.high_bits=4", "plan.protect.attention=4",
        "plan.protect.shared_experts=4", "plan.protect.dense_mlp=4", f"plan.symmetric={str(algorithm != 'awq').lower()}",
        f"quantize.algorithm={algorithm}", f"quantize.solve_budget_gb={solve}", f"calibration.n_samples={samples}",
        "calibration.seq_len=2048", *extra))


@pytest.mark.parametrize("record", RECORDS, ids=[r[0] for r in RECORDS])
def test_forecast_matches_benchmark_records(record, shapes_dir):
    name, record_name, algorithm, solve, peak_path, seconds_path, kernel = record
    rec = load_record(record_name)
    layers, samples = rec.setup.get("virtual_layers", rec.setup["layers"]), rec.setup["samples"]
    path = shapes_dir(rec.setup["shape"], layers)
    f = forecast(_bench_recipe(path, samples, algorithm, solve), load_headers(str(path)), gpu_memory_gb=143,
                 solve_kernel=kernel)
    quant = next(s for s in f.stages if s.stage == "quantize")
    if peak_path is not None:
        assert quant.gpu_bytes / 1e9 == pytest.approx(rec.number(peak_path), rel=0.25), (name, quant.parts)
    if seconds_path is not None:
        assert quant.seconds / layers == pytest.approx(rec.number(seconds_path), rel=0.3), name


def _fused_solve_table() -> list[tuple[int, int, int, float]]:
    """``(B, O, I, seconds)`` of each sub-batch of the fused column loop's record: its fused solve on a quiet
    machine."""
    rec = load_record("2026-11-30-gptq-solve-sub-batches")
    return [(*rec.value(f"setup.sub_batches.{k}.shape"), rec.number(f"{k}.fused_s")) for k in rec.setup["sub_batches"]]


def test_fused_solve_model_matches_the_sub_batch_table():
    """The engine's GPTQ solve time (fp32 work at the fused loop's rate plus a cost per sub-batch) against every
    sub-batch measured with the fused loop, within 25 %; the CUDA-graph loop's column model, which older records
    need, would be off by up to 8x on the same sub-batches."""
    rows = _fused_solve_table()
    assert len(rows) == 4, rows
    for B, O, I, seconds in rows:
        assert gptq_solve_seconds([(B, O, I)]) == pytest.approx(seconds, rel=0.25), (B, O, I)
    graph = [gptq_solve_seconds([(B, O, I)], "cuda-graph") / seconds for B, O, I, seconds in rows]
    assert max(graph) > 5


def test_deepseek_v3_awq_fits_80gb_at_defaults(shapes_dir):
    """AWQ on the DeepSeek-V3 layer at the recipe's defaults fits an 80 GB card, profile included: its expert
    statistics come in hessian_budget_gb chunks (one pass each, as GPTQ's) and its searches take a few experts at a
    time, sized as quant/quantize/awq_layer.py sizes them; the profile's probe rounds a few experts at a time."""
    from quant.forecast.algorithm_costs import AWQ_FACTOR
    from quant.quantize.budgets import search_bytes

    path = shapes_dir("deepseek-v3", 1)
    recipe = _bench_recipe(path, 32, "awq", 3.0)
    f = forecast(recipe, load_headers(str(path)), gpu_memory_gb=80)
    check_fits(f, recipe)
    assert f.fitting_budgets == (recipe.quantize.hessian_budget_gb, recipe.quantize.solve_budget_gb)
    quant = next(s for s in f.stages if s.stage == "quantize")
    per = [search_bytes(4096, 7168), search_bytes(7168, 2048)]  # gate/up, down
    assert quant.parts["solve working set"] == pytest.approx(AWQ_FACTOR * max(int(3e9) // b * b for b in per))
    assert quant.parts["expert Hessians + codes"] < 16e9 + 256 * 3 * 7168 * 2048 * 1.05  # one chunk + every code
    assert "fit the card" in render(f, recipe)


def test_headers_only_and_equal_to_the_real_source(quant_cache, tmp_path):
    """A builtin read through its headers has the same module inventory as the loaded source; a header-only file
    (no data section) is enough, and weights can never be read from it."""
    real = resolve_model("builtin:qwen3-moe-tiny")
    headers = load_headers("builtin:qwen3-moe-tiny")
    assert headers.modules == real.modules and headers.shapes() == real.shapes()
    path = write_shapes_only("tiny", 2, tmp_path / "m")
    assert (path / "model.safetensors").stat().st_size < 100_000  # headers, no data
    src = load_headers(str(path))
    assert src.n_layers == 2 and len(src.moe_layers()) == 2
    with pytest.raises(ModelError, match="only tensor shapes"):
        src.read_tensors(["lm_head.weight"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ModelError, match="not a safetensors file"):
        load_headers(str(tmp_path / "bad"))


class FakeHub:
    """huggingface_hub's two calls, answered from a local folder with huggingface_hub's own metadata types (the
    hub itself is unreachable here); records what was asked."""

    def __init__(self, folder: Path, fail: bool = False):
        self.folder, self.fail, self.calls = folder, fail, []

    def hf_hub_download(self, repo_id: str, filename: str) -> str:
        self.calls.append(("download", repo_id, filename))
        if self.fail:
            raise OSError("offline")
        return str(self.folder / filename)

    def get_safetensors_metadata(self, repo_id: str):
        from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

        self.calls.append(("metadata", repo_id))
        header = read_safetensors_header(self.folder / "model.safetensors")
        offsets, tensors = 0, {}
        for k, (dtype, shape) in header.items():
            tensors[k] = TensorInfo(dtype=dtype, shape=list(shape), data_offsets=(offsets, offsets))
        files = {"model.safetensors": SafetensorsFileMetadata(metadata={}, tensors=tensors)}
        return SafetensorsRepoMetadata(metadata=None, sharded=False, weight_map={k: "model.safetensors" for k in tensors},
                                       files_metadata=files)


def test_hub_model_reads_config_and_safetensors_metadata_only(quant_cache):
    local = resolve_model("builtin:olmoe-tiny")
    hub = FakeHub(local.path)
    src = load_headers("acme/Tiny-OLMoE", hub=hub)
    assert isinstance(src, HeaderSource) and src.modules == local.modules
    assert hub.calls == [("download", "acme/Tiny-OLMoE", "config.json"), ("metadata", "acme/Tiny-OLMoE")]
    with pytest.raises(ModelError, match="could not be read from the hub: offline"):
        load_headers("acme/Tiny-OLMoE", hub=FakeHub(local.path, fail=True))


def test_more_gpus_split_expert_work_and_activations_not_the_layer(shapes_dir):
    path = shapes_dir("deepseek-v3", 1)
    recipe, src = _bench_recipe(path, 32, "gptq", 3.0), load_headers(str(path))
    one, four = forecast(recipe, src, gpus=1, gpu_memory_gb=143), forecast(recipe, src, gpus=4, gpu_memory_gb=143)
    q1, q4 = (next(s for s in f.stages if s.stage == "quantize") for f in (one, four))
    assert q4.parts["layer"] == q1.parts["layer"] and q4.parts["activations"] == q1.parts["activations"] / 4
    assert q4.parts["expert Hessians + codes"] < q1.parts["expert Hessians + codes"]  # 64 experts per rank, one chunk
    assert q4.seconds < q1.seconds and q4.gpu_bytes < q1.gpu_bytes


def test_host_memory_counts_only_the_activations_of_the_ranks_own_batches(shapes_dir):
    """512 x 2048 tokens of DeepSeek-V3 hidden states are 15 GB: over the 8 GiB activation budget on one GPU (kept on
    the host), 1.9 GB per rank on 8 (kept on the GPU): the host forecast must not hold them on every rank."""
    path = shapes_dir("deepseek-v3", 1)
    recipe, src = _bench_recipe(path, 512, "gptq", 3.0), load_headers(str(path))
    layer = sum(math.prod(s) * 2 for k, s in src.shapes().items() if k.startswith("model.layers.0."))
    acts = 512 * 2048 * 7168 * 2
    h1, h8 = (next(s for s in forecast(recipe, src, gpus=n, gpu_memory_gb=143).stages if s.stage == "quantize").host_bytes
              for n in (1, 8))
    assert h1 - h8 == pytest.approx(acts + 2 * layer * 7 / 8, rel=0.02)


def test_host_memory_holds_two_staged_shares_of_the_layer(shapes_dir):
    """The read-ahead pins two buffers, each a rank's share of a layer (one uploading, one being read): on 8 ranks
    the host forecast drops by 2 x 7/8 of the 23 GB DeepSeek-V3 layer, nothing else changes at these tokens."""
    path = shapes_dir("deepseek-v3", 1)
    recipe, src = _bench_recipe(path, 32, "gptq", 3.0), load_headers(str(path))
    layer = sum(math.prod(s) * 2 for k, s in src.shapes().items() if k.startswith("model.layers.0."))
    h1, h8 = (next(s for s in forecast(recipe, src, gpus=n, gpu_memory_gb=143).stages if s.stage == "quantize").host_bytes
              for n in (1, 8))
    assert layer > 20e9 and h1 - h8 == pytest.approx(2 * layer * 7 / 8, rel=0.02)


def test_reduced_statistics_hold_every_experts_hessians_on_each_rank(shapes_dir):
    """Qwen3-30B-A3B at 2 GPUs: its 128 experts' Hessians (2.4 GB) fit one pass, so by default on GPUs each rank
    sums its own batches for every expert (``quantize.statistics: reduce``) and holds all of them, as one GPU does;
    ``ordered`` holds only the rank's 64. DeepSeek-V3's (56 GB) need chunks: ordered either way."""
    from quant.quantize.budgets import expert_hessian_bytes

    per = expert_hessian_bytes(2048, 768)
    path = shapes_dir("qwen3-30b-a3b", 1)
    src = load_headers(str(path))
    hess = {}
    for mode in ("auto", "reduce", "ordered"):
        recipe = _bench_recipe(path, 256, "gptq", 3.0, f"quantize.statistics={mode}")
        q = next(s for s in forecast(recipe, src, gpus=2, gpu_memory_gb=143).stages if s.stage == "quantize")
        hess[mode] = q.parts["expert Hessians + codes"]
    codes = hess["ordered"] - 64 * per
    assert hess["auto"] == hess["reduce"] == pytest.approx(128 * per + codes) and 0 < codes < 64 * per
    path = shapes_dir("deepseek-v3", 1)
    dsv3 = [next(s for s in forecast(_bench_recipe(path, 32, "gptq", 3.0, f"quantize.statistics={m}"),
                                     load_headers(str(path)), gpus=2, gpu_memory_gb=143).stages
                 if s.stage == "quantize").parts["expert Hessians + codes"] for m in ("reduce", "ordered")]
    assert dsv3[0] == dsv3[1]


def test_export_divides_over_ranks_up_to_the_storage_bandwidth(shapes_dir):
    from quant.forecast.estimate import STORAGE_BYTES_PER_S
    from quant.forecast.throughputs import THROUGHPUTS

    path = shapes_dir("deepseek-v3", 1)
    recipe, src = _bench_recipe(path, 32, "gptq", 3.0), load_headers(str(path))
    e1, e8, e64 = (next(s for s in forecast(recipe, src, gpus=n, gpu_memory_gb=143).stages if s.stage == "export")
                   for n in (1, 8, 64))
    assert e1.disk_bytes == e8.disk_bytes and e1.seconds == pytest.approx(e1.disk_bytes / THROUGHPUTS["export_bytes_per_s"])
    assert e8.seconds == pytest.approx(e1.seconds / 8) and "8 ranks write shards" in e8.note
    assert e64.seconds == pytest.approx(e1.disk_bytes / STORAGE_BYTES_PER_S)  # 64 x 0.34 GB/s is past the storage


def test_more_gpus_divide_awq_searches_not_its_statistics(shapes_dir):
    """AWQ (quant/quantize/awq_layer.py): at 4 GPUs each rank still holds every expert's statistics chunks (same expert
    memory, same passes) but searches a quarter of the experts; its share of the batches' activations and forward
    passes shrinks too. The rendered assumptions say so."""
    path = shapes_dir("deepseek-v3", 1)
    recipe, src = _bench_recipe(path, 32, "awq", 3.0), load_headers(str(path))
    one, four = forecast(recipe, src, gpus=1, gpu_memory_gb=143), forecast(recipe, src, gpus=4, gpu_memory_gb=143)
    q1, q4 = (next(s for s in f.stages if s.stage == "quantize") for f in (one, four))
    assert q4.parts["activations"] == q1.parts["activations"] / 4
    for part in ("layer", "expert Hessians + codes", "solve working set"):
        assert q4.parts[part] == q1.parts[part], part
    assert q1.seconds / q4.seconds > 2.5  # the searches dominate this layer
    assert "AWQ searches divided over ranks" in render(four, recipe)
    ordered = _bench_recipe(path, 32, "awq", 3.0, "quantize.statistics=ordered")
    qo = next(s for s in forecast(ordered, src, gpus=4, gpu_memory_gb=143).stages if s.stage == "quantize")
    assert qo.seconds > q4.seconds and qo.parts == q4.parts  # reduced statistics: each rank sums its own batches


def test_refuses_what_cannot_fit_and_names_budgets_that_do(shapes_dir):
    path = shapes_dir("deepseek-v3", 1)
    src = load_headers(str(path))
    # 48 GB cards: quantize needs ~49 GB at the recipe's budgets; smaller Hessian chunks make it fit
    recipe = _bench_recipe(path, 32, "gptq", 3.0, "quantize.hessian_budget_gb=32")
    f = forecast(recipe, src, gpus=4, gpu_memory_gb=48)
    assert f.too_big() is not None and f.too_big().stage == "quantize"
    with pytest.raises(PlanError) as e:
        check_fits(f, recipe)
    h, s = f.fitting_budgets
    assert f"quantize.hessian_budget_gb: {h:g} and quantize.solve_budget_gb: {s:g}" in str(e.value)
    refit = forecast(_bench_recipe(path, 32, "gptq", s, f"quantize.hessian_budget_gb={h}"), src, gpus=4, gpu_memory_gb=48)
    assert refit.too_big() is None and "fit the card" in render(refit, recipe)
    # a card smaller than one layer: nothing to tune
    with pytest.raises(PlanError, match="use more or larger GPUs"):
        check_fits(forecast(recipe, src, gpu_memory_gb=16), recipe)
    with pytest.raises(PlanError, match="--gpus must be >= 1"):
        forecast(recipe, src, gpus=0)


def test_cli_estimate(shapes_dir, capsys):
    from tests.export.test_gptq_format import quant_cli

    path = shapes_dir("qwen3-30b-a3b", 2)
    recipe = str(REPO / "recipes" / "mixed_int8_int4.yaml")
    code, out, err = quant_cli(capsys, "estimate", recipe, "--model", str(path), "--set", "quantize.algorithm=gptq",
                               "--gpus", "2", "--gpu-memory-gb", "80")
    assert code == 0, err
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in
            ("calibrate", "profile", "plan", "quantize", "export", "eval")}
    assert len(rows) == 6 and "GB" in rows["quantize"]
    assert "checkpoints: compressed-tensors" in out and "experts divided over ranks" in out
    code, out, err = quant_cli(capsys, "estimate", recipe, "--model", str(path), "--gpu-memory-gb", "2")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "per GPU" in errors[0], err
    assert json.loads(json.dumps(out))  # the table still went to stdout


def test_real_source_and_header_source_forecast_alike(quant_cache):
    recipe = parse_recipe({"name": "x"}, model="builtin:deepseek-v3-tiny")
    a = forecast(recipe, load_headers("builtin:deepseek-v3-tiny"))
    b = forecast(recipe, ModelSource(resolve_model("builtin:deepseek-v3-tiny").path))
    assert [(s.stage, s.gpu_bytes, s.disk_bytes) for s in a.stages] == [(s.stage, s.gpu_bytes, s.disk_bytes)
                                                                        for s in b.stages]


def test_mixed_vllm_recipe_forecasts_the_layer_damage_pass(shapes_dir):
    """recipes/mixed_vllm.yaml on 8 DeepSeek-V3-shaped layers: the plan is made (synthetic damage), and the profile
    stage adds the damage pass. Bounded (the default): the clean walk, the gradients walked back to the first MoE
    layer (a forward and a two-forward backward per layer), and each MoE layer's 4 schemes through it and the next
    layer. Exact: every stream alive at each layer (1 + 4 schemes per MoE layer so far), quadratic in depth."""
    from quant.recipe import load_recipe

    path = shapes_dir("deepseek-v3", 8)
    src = load_headers(str(path))
    recipe = lambda *o: load_recipe(REPO / "recipes" / "mixed_vllm.yaml", model=str(path), overrides=o)  # noqa: E731
    without = forecast(recipe("plan.policy=top_fraction", "plan.budget_avg_bits=null", "plan.layer_group_sizes=[]",
                              "profile.layer_sensitivity=null"), src)
    bounded, exact = forecast(recipe(), src), forecast(recipe("profile.layer_sensitivity.method=exact"), src)
    p0, pb, pe = (next(s for s in f.stages if s.stage == "profile") for f in (without, bounded, exact))
    L, moe = src.n_layers, src.moe_layers()
    streams, forwards = 1, 0
    for layer in range(L):
        forwards += streams + (4 if layer in moe else 0)
        streams += 4 if layer in moe else 0
    assert f"(exact): {forwards} layer forwards over {16 * 256} tokens" in pe.note
    carried = sum(4 * (1 + min(1, L - 1 - m)) for m in moe)
    linear = L + 3 * (L - 1 - moe[0]) + carried
    assert f"(bounded): {linear} layer forwards over {16 * 256} tokens" in pb.note
    assert min(pe.seconds, pb.seconds) > p0.seconds and pb.gpu_bytes >= p0.gpu_bytes
    # bounded reads the weights three times (clean walk, gradients, branches), exact once: at 8 layers of 256-token
    # samples the reads dominate and exact is the cheaper pass; at depth, on 2048-token samples, bounded is
    assert pb.seconds > pe.seconds
    deep = shapes_dir("qwen3-30b-a3b", 48)
    at = lambda *o: next(s for s in forecast(load_recipe(REPO / "recipes" / "mixed_vllm.yaml", model=str(deep),  # noqa: E731
                                                         overrides=("calibration.seq_len=2048", *o)),
                                             load_headers(str(deep))).stages if s.stage == "profile")
    assert at("profile.layer_sensitivity.method=exact").seconds > 1.5 * at().seconds


def test_the_layer_damage_forecast_counts_what_the_measurement_runs(quant_cache):
    """quant estimate's count of the pass's layer forwards is the one the measurement reports running, for both
    methods, on the builtin families (DeepSeek-V3's first layer dense, OLMoE's, Mixtral's, Qwen3-MoE's routing)."""
    import torch

    from quant.layerwise import Layerwise
    from quant.parallel.world import World
    from quant.profile.layer_damage import measure_layer_damage

    for name in ("qwen3-moe-tiny", "deepseek-v3-tiny"):
        src = resolve_model(f"builtin:{name}")
        tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        for method in ("bounded", "exact"):
            recipe = parse_recipe({"name": "x", "calibration": {"seq_len": 8}, "profile": {"layer_sensitivity": {
                "n_samples": 2, "schemes": ["w4g32", "w8g32"], "method": method}}}, model=f"builtin:{name}")
            note = next(s for s in forecast(recipe, load_headers(f"builtin:{name}")).stages if s.stage == "profile").note
            ran = measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), ("w4g32", "w8g32"),
                                       method)
            assert f"({method}): {ran.layer_forwards} layer forwards over 16 tokens" in note, (name, method, note)


@pytest.mark.parametrize("mode", ["whole", "streamed"])
def test_eval_forecast_matches_the_streamed_and_whole_records(mode, shapes_dir):
    """The eval stage's peak against the two paths measured on 2026-11-30 (Qwen3-30B-A3B shape, 2 layers, the headline
    mix, 16 x 1024 tokens, batch 8) within 25 %; auto follows evaluate's rule (whole up to half the card)."""
    measured = load_record("2026-11-30-eval-streamed-vs-whole").number(f"{mode}.peak_gpu_gb")
    path = shapes_dir("qwen3-30b-a3b", 2)
    recipe = parse_recipe({"name": "x", "eval": {"mode": mode, "batch_size": 8,
                                                 "perplexity": {"n_samples": 16, "seq_len": 1024}}}, model=str(path))
    ev = next(s for s in forecast(recipe, load_headers(str(path)), gpu_memory_gb=143).stages if s.stage == "eval")
    assert abs(ev.gpu_bytes / 1e9 - measured) <= 0.25 * measured, (ev.gpu_bytes / 1e9, measured)
    assert ev.note.startswith(f"proxies {mode}")
    auto = parse_recipe({"name": "x"}, model=str(path))
    notes = {gb: next(s for s in forecast(auto, load_headers(str(path)), gpu_memory_gb=gb).stages
                      if s.stage == "eval").note for gb in (4, 80)}
    assert notes == {4: "proxies streamed", 80: "proxies whole"}  # the dense model is 2.75 GB


def test_the_whole_pipeline_run_on_the_deepseek_v3_shape_is_forecast_within_25_percent(shapes_dir):
    """benchmarks/node.py's one-GPU run (2026-12-01 on 16a0119): the headline mix with GPTQ on DeepSeek-V3 layers,
    32 x 2048 calibration tokens, streamed eval on 16 x 2048: the profile's and quantize's measured peaks over three
    tiled layers and the streamed eval's, against the forecast."""
    rec = load_record("2026-12-01-deepseek-v3-whole-pipeline")
    measured = {"profile": rec.number("depth.profile.peak_gb"), "quantize": rec.number("depth.quantize.peak_gb"),
                "eval": rec.number("breadth.eval_streamed.peak_gb")}
    path = shapes_dir("deepseek-v3", 3)
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(path), overrides=(
        "profile.layer_sensitivity=null", "quantize.algorithm=gptq", "quantize.batch_size=8",
        "calibration.n_samples=32", "calibration.seq_len=2048", "eval.mode=streamed", "eval.batch_size=8",
        "eval.perplexity.n_samples=16", "eval.perplexity.seq_len=2048"))
    stages = {s.stage: s for s in forecast(recipe, load_headers(str(path)), gpu_memory_gb=141).stages}
    for stage, peak_gb in measured.items():
        assert stages[stage].gpu_bytes / 1e9 == pytest.approx(peak_gb, rel=0.25), (stage, stages[stage].gpu_bytes)


@pytest.mark.parametrize("algorithm", ["gptq", "awq", "rtn"])
@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_builtin_family_is_forecast_at_any_world_size(algorithm, gpus):
    """Dense decoder layers (DeepSeek-V3's first three; the tiny one's layer 0) have no expert Hessians: GPTQ at 2+
    GPUs divided by their zero size (ZeroDivisionError from `quant estimate --gpus 8` on DeepSeek-V3)."""
    from quant.models import BUILTINS

    for name in BUILTINS:
        src = load_headers(f"builtin:{name}")
        recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=f"builtin:{name}",
                             overrides=(f"quantize.algorithm={algorithm}",))
        f = forecast(recipe, src, gpus=gpus)
        assert {s.stage for s in f.stages} >= {"profile", "quantize", "export", "eval"}
        assert all(s.gpu_bytes >= 0 and s.seconds >= 0 for s in f.stages), name


def test_a_forecast_over_the_hosts_memory_is_refused(quant_cache, capsys):
    """Before: calibration within the recipe's limit but far over memory forecast 265 GB of host memory and exit 0."""
    from tests.export.test_gptq_format import quant_cli

    big = ("calibration.n_samples=1000000", "calibration.seq_len=2048")
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", overrides=big)
    f = forecast(recipe, load_headers("builtin:qwen3-moe-tiny"), host_memory_gb=64)
    check_fits(forecast(recipe, load_headers("builtin:qwen3-moe-tiny")), recipe)  # no host given: not checked
    with pytest.raises(PlanError, match=r"the profile stage needs 26\d.\d GB of host memory per process but the host "
                                        r"has 64.0 GB \(--host-memory-gb"):
        check_fits(f, recipe)
    args = ["estimate", str(REPO / "recipes" / "mixed_int8_int4.yaml"), *(a for kv in big for a in ("--set", kv))]
    code, _, err = quant_cli(capsys, *args)  # this machine's memory by default
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "of host memory per process" in errors[0], err
    assert quant_cli(capsys, *args, "--host-memory-gb", "1000")[0] == 0


@pytest.mark.parametrize("option", [("--gpu-memory-gb", "nan"), ("--gpu-memory-gb", "inf"), ("--gpu-memory-gb", "0"),
                                    ("--gpu-memory-gb", "1e300"), ("--host-memory-gb", "1e300"),
                                    ("--host-memory-gb", "nan"), ("--host-memory-gb", "-1"), ("--gpus", "0")])
def test_a_machine_that_cannot_exist_is_one_error_line(option, quant_cache, capsys):
    """--gpu-memory-gb nan exited 0 and 1e300 ended in an internal error (a float byte count cast to an integer)."""
    from tests.export.test_gptq_format import quant_cli

    code, _, err = quant_cli(capsys, "estimate", str(REPO / "recipes" / "mixed_int8_int4.yaml"), *option)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "finite and > 0" in errors[0], err


def test_a_run_that_cannot_fit_the_hosts_memory_is_refused_before_it_allocates(quant_cache, tmp_path):
    """Before: calibration.n_samples x seq_len within the recipe's limit but far over memory allocated 16.4 GB and
    ended in an internal error. The eval stage's held-out set is checked the same way before eval allocates."""
    from quant.errors import RecipeError
    from quant.forecast.estimate import check_run_memory
    from quant.run.pipeline import run

    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",
                         overrides=("calibration.n_samples=1000000", "calibration.seq_len=2048"))
    with pytest.raises(RecipeError, match=r"calibration, profile and quantize need about 27\d.\d GB of host memory "
                                          r"\(tokens 16.4 GB, cached hidden states 262.1 GB.*lower calibration"):
        run(recipe, tmp_path / "r")
    assert not (tmp_path / "r" / "calibration.safetensors").exists()
    source = resolve_model("builtin:qwen3-moe-tiny")
    evals = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",
                        overrides=("eval.perplexity.n_samples=100000", "eval.perplexity.seq_len=65536"))
    with pytest.raises(RecipeError, match="the eval stage needs about .* lower eval.perplexity.n_samples"):
        check_run_memory(evals, source, "eval", True, 1, 64 << 30)
    check_run_memory(recipe, source, "eval", True, 1, 64 << 30)
    mid = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",  # hidden states 4.3 GB: within a GPU's budget
                      overrides=("calibration.n_samples=16384", "calibration.seq_len=2048"))
    with pytest.raises(RecipeError, match="cached hidden states 4.3 GB.*or run on a GPU"):
        check_run_memory(mid, source, "profile", True, 1, 2 << 30)
    check_run_memory(mid, source, "profile", False, 1, 2 << 30)
    with pytest.raises(RecipeError, match="cached hidden states 2.1 GB"):  # a rank holds its share of the rows
        check_run_memory(mid, source, "profile", True, 2, 2 << 30)
def test_small_models_are_forecast_at_their_own_scale(quant_cache):
    """The reference MoE (31 M parameters, about 60 MB in bf16): its parameter count is printed as such (every
    builtin showed 0.0 B), and the profile's W4 probe is sized by its experts, not by the 1 GiB chunk a large
    model's probe fills (a 3.2 GB GPU peak for a model that profiles in well under 1 GB)."""
    from quant.forecast.estimate import render

    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model="builtin:reference-moe")
    f = forecast(recipe, load_headers("builtin:reference-moe"))
    head = render(f, recipe).splitlines()[0]
    assert re.search(r": 3\d\.\d M parameters;", head), head
    profile = next(s for s in f.stages if s.stage == "profile")
    export = next(s for s in f.stages if s.stage == "export")
    assert profile.gpu_bytes < 0.5e9, profile
    assert export.host_bytes < 3.5e9, export  # python and torch, not a 5 GB shard for a 26 MB checkpoint


H200_GB = 143_771 * 2**20 / 1e9  # the H200's memory as torch reports it


def _headline_at_depth(path: Path, samples: int, *extra: str):
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(path), overrides=(
        "quantize.algorithm=gptq", f"calibration.n_samples={samples}", "calibration.seq_len=2048", *extra))
    return {s.stage: s for s in forecast(recipe, load_headers(str(path)), gpu_memory_gb=H200_GB, host_memory_gb=128).stages}


@pytest.mark.parametrize("record", ["2026-12-03-deepseek-v3-headline-12-layers",
                                    "2026-12-03-qwen3-30b-a3b-headline-48-layers"])
def test_the_headline_at_depth_is_forecast_against_its_measurements(record, shapes_dir):
    """The headline recipe (GPTQ, its layer-damage pass) from calibrate to quantize as node.py's depth part measured it
    on one H200 (benchmarks/records/: 12 tiled DeepSeek-V3 layers at 32 x 2048, 48 tiled Qwen3-30B-A3B layers at
    512 x 2048): the pass's seconds (the profile forecast's with the pass less without it), the quantize stage's
    seconds and the profile stage's peak, each within 20 %."""
    rec = load_record(record)
    depth, samples = rec.value("depth"), rec.setup["samples"]
    path = shapes_dir(rec.setup["shape"], rec.setup["virtual_layers"])
    with_pass, without = _headline_at_depth(path, samples), _headline_at_depth(path, samples,
                                                                               "profile.layer_sensitivity=null")
    profile = with_pass["profile"]
    assert profile.gpu_bytes / 1e9 == pytest.approx(depth["stages"]["profile"]["peak_gb"], rel=0.2), profile.parts
    assert profile.seconds - without["profile"].seconds == pytest.approx(depth["layer_damage_s"]["pass"], rel=0.2)
    assert with_pass["quantize"].seconds == pytest.approx(depth["stages"]["quantize"]["wall_s"], rel=0.2)
    assert sum(profile.parts.values()) == pytest.approx(profile.gpu_bytes)  # the parts name the whole peak


def test_deepseek_v3_at_full_depth_is_accepted_on_one_h200_host_whose_memory_does_not_grow_with_depth(shapes_dir):
    """61 DeepSeek-V3 layers (702 B parameters) with the headline recipe at 32 x 2048 on one H200 and a 128 GB host:
    the forecast accepts the run (the pass's host memory was 129.8 GB and refused when its fp32 layers and every clean
    input sat in host memory), the profile's host peak is at most 64 GB and the same at 12 layers as at 61."""
    from quant.forecast.estimate import check_fits

    recipe = lambda path: load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(path), overrides=(  # noqa: E731
        "calibration.n_samples=32", "calibration.seq_len=2048"))
    hosts = {}
    for layers in (12, 61):
        path = shapes_dir("deepseek-v3", layers)
        f = forecast(recipe(path), load_headers(str(path)), gpu_memory_gb=141, host_memory_gb=128)
        check_fits(f, recipe(path))
        hosts[layers] = next(s for s in f.stages if s.stage == "profile").host_bytes
    assert hosts[61] <= 64e9 and hosts[61] == hosts[12]
    # an 80 GB card: the clean inputs no longer fit beside the walk back, nor in a quarter of the host: files
    path = shapes_dir("deepseek-v3", 61)
    profile = next(s for s in forecast(recipe(path), load_headers(str(path)), gpu_memory_gb=80,
                                       host_memory_gb=128).stages if s.stage == "profile")
    assert profile.host_bytes <= 64e9 and profile.disk_bytes == pytest.approx(62 * 16 * 2048 * 7168 * 4)
    assert "clean inputs 58.3 GB in TMPDIR" in profile.note


def test_the_forecast_clamps_the_pass_as_the_run_does(quant_cache):
    """profile.layer_sensitivity.n_samples over the calibration's and carry_layers over the depth: the run takes the
    calibration's samples and the layers there are (``layer_damage.pass_samples``, ``pass_carry``), and so does the
    forecast (it forecast 196,608 GB of clean inputs for n_samples 1e9 with 32 calibration samples, and refused a run
    that works; carry 30 and carry 3 on a 4-layer model, the same run, got two peaks)."""
    import torch

    from quant.layerwise import Layerwise
    from quant.parallel.world import World
    from quant.profile.layer_damage import measure_layer_damage, spread_rows

    def profile(*overrides):
        recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", overrides=overrides)
        stage = next(s for s in forecast(recipe, load_headers(recipe.model.path)).stages if s.stage == "profile")
        return stage.gpu_bytes, stage.host_bytes, stage.seconds, stage.note

    assert profile("profile.layer_sensitivity.n_samples=1000000000") == profile(
        "profile.layer_sensitivity.n_samples=32")  # the recipe's 32 calibration samples
    assert profile("profile.layer_sensitivity.carry_layers=30") == profile("profile.layer_sensitivity.carry_layers=3")
    src = resolve_model("builtin:qwen3-moe-tiny")  # 4 layers
    assert len(spread_rows(32, 1_000_000_000)) == 32
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    ran = {carry: measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), ("w4g32",),
                                       "bounded", carry) for carry in (3, 30)}
    assert ran[3].layer_forwards == ran[30].layer_forwards
    assert all(torch.equal(ran[3].damage[k], ran[30].damage[k]) for k in ran[3].damage)
