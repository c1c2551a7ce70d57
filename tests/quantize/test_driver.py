"""The layer loop: chunked statistics, fused problems, mixed bits and fallbacks on a real builtin model."""

import pytest
import torch

from quant.calibration import build_calibration
from quant.errors import NumericalError
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.profile.profile import profile_routing
from quant.quantize.driver import quantize_model
from quant.quantize.qstore import layer_file, read_layer
from quant.recipe import PlanSpec, QuantizeSpec


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    src = resolve_model("builtin:deepseek-v3-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 8, 64, 0)
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 4, world=World()))
    return src, calib, prof


def _quantize(setup, tmp_path, name, plan_spec=None, **qkw):
    src, calib, prof = setup
    algorithm = qkw.pop("algorithm", "gptq")
    plan = plan_bits(prof, src.modules, plan_spec or PlanSpec(group_size=32), src.n_layers)
    out = tmp_path / name
    device = qkw.get("device", "cpu")
    reports = quantize_model(src, calib, plan.quantized_schemes(), algorithm, QuantizeSpec(**qkw),
                             Layerwise(src, "bfloat16", device, 4, World()), out)
    return plan, out, reports


def _stored(out, src):
    return {n: qw for layer in range(src.n_layers) for n, qw in read_layer(layer_file(out, layer)).items()}


def test_chunked_statistics_and_small_solves_are_bit_identical(setup, tmp_path):
    src = setup[0]
    _, a, _ = _quantize(setup, tmp_path, "whole")
    _, b, _ = _quantize(setup, tmp_path, "chunked", hessian_budget_gb=2e-5, solve_budget_gb=1e-4)
    sa, sb = _stored(a, src), _stored(b, src)
    assert sa.keys() == sb.keys()
    for n in sa:
        assert torch.equal(sa[n].q, sb[n].q) and torch.equal(sa[n].scale, sb[n].scale), n


def test_mixed_bits_in_one_layer_are_exactly_the_plan(setup, tmp_path):
    src = setup[0]
    plan, out, _ = _quantize(setup, tmp_path, "mixed", PlanSpec(group_size=32, low_bits=3, high_bits=8))
    stored = _stored(out, src)
    assert set(stored) == set(plan.quantized())
    bits_seen = set()
    for name, p in plan.quantized().items():
        qw = stored[name]
        assert qw.spec.bits == p.bits and qw.spec.group_size == p.group_size
        assert int(qw.q.min()) >= -(1 << (p.bits - 1)) and int(qw.q.max()) <= (1 << (p.bits - 1)) - 1
        bits_seen.add(p.bits)
    assert {3, 8} <= bits_seen
    layer2 = {p.bits for n, p in plan.quantized().items() if n.startswith("layers.2.experts.")}
    assert layer2 == {3, 8}  # one layer holds both


def test_token_floor_falls_back_to_rtn_and_reports_it(setup, tmp_path):
    src, _, prof = setup
    _, out, reports = _quantize(setup, tmp_path, "floor", min_tokens=10**9)
    fallbacks = [n for r in reports for n in r.rtn_fallbacks]
    n_experts = sum(1 for n, m in src.modules.items() if m.kind == "expert")
    assert len(fallbacks) == n_experts
    _, rtn, _ = _quantize(setup, tmp_path, "rtn", algorithm="rtn")
    a, b = _stored(out, src), _stored(rtn, src)
    assert all(torch.equal(a[n].q, b[n].q) for n in fallbacks)


def _weight_error(stored: dict, src) -> float:
    """Σ ||W - Ŵ||² / Σ ||W||² over the stored modules (weights read from the checkpoint)."""
    from quant.quantize.qstore import dequantize_2d

    keys = {n: src.modules[n].disk_prefix + ".weight" for n in stored}
    weights = src.read_tensors(sorted(set(keys.values())))
    num = sum((dequantize_2d(stored[n]).float() - weights[k].float()).pow(2).sum().item() for n, k in keys.items())
    return num / sum(weights[k].float().pow(2).sum().item() for k in keys.values())


@pytest.mark.gpu
def test_gpu_layer_loop_matches_the_cpu(setup, tmp_path):
    """The layer loop on the GPU (bf16 grams with fp32 output, load buckets, expert-chunked Hessians, small
    solve sub-batches, the fused GPTQ kernel) against the same loop on the CPU.

    Chunking changes the GPU's fp32 sums only by reassociation: up to the first MoE layer (whose calibration
    input both runs share) the codes nearly agree (an fp32 tie sends a row another way); later layers calibrate
    on the outputs of slightly different quantized layers (seen: 2.6% of all codes differ), so there only the
    weight error is compared: chunked vs whole, and GPU vs CPU (the GPU's bf16 forward rounds differently),
    each within 2%."""
    src = setup[0]
    _, cpu, _ = _quantize(setup, tmp_path, "cpu")
    _, gpu, _ = _quantize(setup, tmp_path, "gpu", device="cuda")
    _, chunked, _ = _quantize(setup, tmp_path, "gpu-chunked", device="cuda", hessian_budget_gb=2e-5,
                              solve_budget_gb=1e-4)
    sc, sg, sk = _stored(cpu, src), _stored(gpu, src), _stored(chunked, src)
    assert sc.keys() == sg.keys() == sk.keys()
    assert all(sc[n].spec == sg[n].spec for n in sc)
    first_moe = min(src.moe_layers())
    shared_input = [n for n in sg if src.modules[n].layer <= first_moe]
    differ = sum(int((sg[n].q != sk[n].q).sum()) for n in shared_input) / sum(sg[n].q.numel() for n in shared_input)
    assert differ < 1e-2, differ
    e_cpu, e_gpu, e_chunked = _weight_error(sc, src), _weight_error(sg, src), _weight_error(sk, src)
    assert abs(e_chunked - e_gpu) <= 0.02 * e_gpu, (e_chunked, e_gpu)
    assert abs(e_gpu - e_cpu) <= 0.02 * e_cpu, (e_gpu, e_cpu)


def test_each_statistics_chunk_is_freed_before_the_next_is_allocated(setup, tmp_path, monkeypatch):
    """Memory holds one chunk's Hessian sums at a time: no earlier chunk may survive (a reference cycle through
    the relay once kept every chunk of a layer alive until the garbage collector ran: +36 GB on DeepSeek-V3)."""
    import gc
    import weakref

    import quant.quantize.hessians as q

    alive, most = [], [0]
    orig = q.ExpertStats.__init__

    def tracked(self, *args, **kwargs):
        alive[:] = [r for r in alive if r() is not None]
        most[0] = max(most[0], len(alive))
        orig(self, *args, **kwargs)
        alive.append(weakref.ref(self))

    monkeypatch.setattr(q.ExpertStats, "__init__", tracked)
    gc.disable()
    try:
        _quantize(setup, tmp_path, "chunks", hessian_budget_gb=4 * (64 ** 2 + 32 ** 2) * 3 / 1e9)
    finally:
        gc.enable()
    assert most[0] == 0, f"{most[0]} earlier statistics chunk(s) still alive when the next one was allocated"


def test_resumed_layers_report_what_was_measured(setup, tmp_path):
    """A rerun over stored layer files (a resumed quantize) reports each layer's stored worst error, module,
    fallbacks and repairs, not zeros and empty names."""
    src, calib, prof = setup
    plan, out, first = _quantize(setup, tmp_path, "resume", min_tokens=10**6)
    again = quantize_model(src, calib, plan.quantized_schemes(), "gptq", QuantizeSpec(min_tokens=10**6),
                           Layerwise(src, "bfloat16", "cpu", 4, World()), out)
    assert all(r.resumed for r in again) and not any(r.resumed for r in first)
    for a, b in zip(first, again, strict=True):
        assert b.worst_module == a.worst_module and b.worst_rel_error == a.worst_rel_error
        assert b.rtn_fallbacks == a.rtn_fallbacks and b.repairs == a.repairs and b.solve_seconds == a.solve_seconds
    assert any(r.worst_rel_error > 0 and r.worst_module for r in again)
    assert any(r.rtn_fallbacks for r in again)


def test_a_damaged_stored_layer_is_recomputed_not_reused(setup, tmp_path, caplog):
    """A resumed quantize over a store whose layer 0 has a flipped byte and layer 1 is truncated recomputes both
    (one warning each) and ends with the codes an uninterrupted run stores; the intact layers are reused."""
    src, calib, prof = setup
    plan, out, _ = _quantize(setup, tmp_path, "store")
    clean = {n: (qw.q.clone(), qw.scale.clone()) for n, qw in _stored(out, src).items()}  # not views of the files
    first, second = layer_file(out, 0), layer_file(out, 1)
    data = bytearray(first.read_bytes())
    data[-3] ^= 0x10
    first.write_bytes(bytes(data))
    with open(second, "r+b") as f:
        f.truncate(second.stat().st_size - 100)
    with caplog.at_level("WARNING", logger="quant.quantize.driver"):
        again = quantize_model(src, calib, plan.quantized_schemes(), "gptq", QuantizeSpec(),
                               Layerwise(src, "bfloat16", "cpu", 4, World()), out)
    assert [r.resumed for r in again] == [False, False] + [True] * (src.n_layers - 2)
    warnings = [r.getMessage() for r in caplog.records if "recomputing the layer" in r.getMessage()]
    assert len(warnings) == 2 and "layer 0" in warnings[0] and "damaged" in warnings[0], warnings
    stored = _stored(out, src)
    assert stored.keys() == clean.keys()
    for n, (q, scale) in clean.items():
        assert torch.equal(stored[n].q, q) and torch.equal(stored[n].scale, scale), n


def _expert_forward_calls(monkeypatch) -> list[int]:
    """Count real forwards of any routed-experts module (fused experts class, or a per-expert MLP), per call."""
    from quant.models import experts as ex

    calls = [0]
    real_view = ex.ExpertsView.outputs_unused

    def counting(module):
        cls = type(module)
        if getattr(cls, "_quant_counted", False):
            return
        real = cls.forward

        def forward(self, *a, **kw):
            calls[0] += 1
            return real(self, *a, **kw)

        monkeypatch.setattr(cls, "forward", forward)
        monkeypatch.setattr(cls, "_quant_counted", True, raising=False)

    def outputs_unused(self):
        for m in (list(self.module) if isinstance(self.module, torch.nn.ModuleList) else [self.module]):
            counting(m)
        return real_view(self)

    monkeypatch.setattr(ex.ExpertsView, "outputs_unused", outputs_unused)
    return calls


@pytest.mark.parametrize("model,algorithm", [("qwen3-moe-tiny", "gptq"), ("deepseek-v3-tiny", "gptq"),
                                             ("mixtral-tiny", "gptq"), ("olmoe-tiny", "gptq"),
                                             ("deepseek-v3-tiny", "awq"), ("per-expert", "gptq")])
def test_statistics_passes_skip_the_routed_experts_and_change_nothing(model, algorithm, tmp_path, monkeypatch,
                                                                      request):
    """In a statistics pass the layer's output is discarded, so the routed experts return zeros instead of computing
    (their statistics come from the routed tokens). Same codes, scales and folded parameters as with the experts
    computing; the experts' real forward then runs only when the activations are propagated, one call per batch."""
    from transformers import AutoTokenizer

    from quant.models import experts as ex
    from quant.quantize.qstore import read_params

    spec = str(request.getfixturevalue("per_expert_model")) if model == "per-expert" else f"builtin:{model}"
    src = resolve_model(spec, trust_remote_code=model == "per-expert", family="qwen3_moe" if model == "per-expert"
                        else None)
    tok = AutoTokenizer.from_pretrained(src.path, trust_remote_code=model == "per-expert")
    calib = build_calibration("calibration/bundled.yaml", tok, 8, 32, 0)
    plan = plan_bits(profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 4, world=World())), src.modules,
                     PlanSpec(group_size=32, symmetric=algorithm != "awq"), src.n_layers)
    budget = {"hessian_budget_gb": 2e-5} if algorithm == "gptq" else {}  # several passes per layer

    def run(name):
        out = tmp_path / name
        quantize_model(src, calib, plan.quantized_schemes(), algorithm, QuantizeSpec(algorithm=algorithm, **budget),
                       Layerwise(src, "bfloat16", "cpu", 4, world=World()), out)
        return {**{f"{i}:{n}": (q.q, q.scale, q.zero) for i in range(src.n_layers)
                   for n, q in read_layer(layer_file(out, i)).items()},
                **{f"{i}:param:{n}": t for i, n_t in enumerate(read_params(layer_file(out, i))
                                                              for i in range(src.n_layers)) for n, t in n_t.items()}}

    calls = _expert_forward_calls(monkeypatch)
    skipped = run("skipped")
    n_skipped = calls[0]
    monkeypatch.setattr(ex.ExpertsView, "outputs_unused", lambda self: __import__("contextlib").nullcontext())
    calls[0] = 0
    computed = run("computed")
    assert skipped.keys() == computed.keys()
    for k, a in skipped.items():
        b = computed[k]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else all(
            (x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert same, k
    assert 0 < n_skipped <= calls[0] / 2  # every layer makes at least one statistics pass besides propagation
    if model != "per-expert":  # one fused experts call per MoE layer and batch (8 samples in batches of 4)
        assert n_skipped == len(src.moe_layers()) * 2


def test_host_reads_do_not_grow_with_the_modules(setup, tmp_path, monkeypatch):
    """On a GPU each host read (``.item()``, ``bool``, ``.tolist()``) drains the queue of launched kernels: a layer's
    quantize reads back once per solved batch of modules (its codes' checks and errors), never once per module or
    expert (it was twice per module: ~800 stalls a Qwen3-30B-A3B layer)."""
    from collections import Counter

    from quant.diag.hostsync import HostSyncs
    from quant.quantize.results import LayerResults

    calls = Counter()
    record = LayerResults.record

    def counted(self, *a, **kw):
        calls["record"] += 1
        return record(self, *a, **kw)

    import quant.algos.gptq as gq

    solve = gq.gptq

    def counted_solve(*a, **kw):
        calls["gptq"] += 1
        return solve(*a, **kw)

    monkeypatch.setattr(LayerResults, "record", counted)
    monkeypatch.setattr(gq, "gptq", counted_solve)
    with HostSyncs() as s:
        _, _, reports = _quantize(setup, tmp_path, "reads")
    by_function, by_file = Counter(), Counter()
    for site, n in s.sites.items():
        by_function[site.split(" ")[1]] += n
        by_file[site.split(":")[0]] += n
    n_modules = sum(r.n_modules for r in reports)
    assert by_function["record"] == calls["record"] and calls["record"] * 4 < n_modules, (calls, n_modules, s.sites)
    assert by_function["expert_groups"] <= len(reports), s.sites
    # GPTQ: one read a solve (its divergence flags come back with record's read); it was seven
    assert calls["gptq"] > 0 and by_file["gptq.py"] == calls["gptq"], (calls, s.sites)


def test_a_diverged_solve_names_the_module(setup, tmp_path, monkeypatch):
    """A GPTQ solve whose updates overflow is caught in record's one read and named by module."""
    import quant.algos.gptq as gq

    real = gq.upper_inverse_factor

    def blown(Hr):
        U, ok = real(Hr)
        U[-1] += U[-1].triu(1) * 1e38  # the batch's last element diverges
        return U, ok

    monkeypatch.setattr(gq, "upper_inverse_factor", blown)
    with pytest.raises(NumericalError, match=r"^layers\.0\.\S+: GPTQ diverged \(NaN/Inf in the updated weights\): "):
        _quantize(setup, tmp_path, "diverged")


def test_slice_sums_equal_direct_sums_per_module():
    """record's one-read checks: each (batch element, row slice)'s sum from one cumulative sum equals summing the
    slice directly (float64); a NaN row spoils only sums over its own batch element's later rows."""
    from quant.quantize.results import _slice_sums

    g = torch.Generator().manual_seed(0)
    v = torch.rand(3, 4, 10, generator=g, dtype=torch.float64)
    v[:, 2, 7] = float("nan")
    parts = [(0, slice(0, 4)), (0, slice(4, 10)), (1, slice(3, 5)), (2, slice(0, 7)), (3, slice(0, 10)), (2, slice(7, 8))]
    got = _slice_sums(v, parts)
    assert got.shape == (len(parts), 3)
    for p, (b, r) in enumerate(parts):
        want = v[:, b, r].sum(dim=1)
        assert torch.allclose(got[p], want, rtol=1e-12, atol=0, equal_nan=True), (b, r)
    assert torch.isnan(got[5]).all() and not torch.isnan(got[:5]).any()


def test_codes_wait_for_the_writer_two_a_byte(setup, tmp_path, monkeypatch):
    """A layer's solved codes stay on the device until its file is written; W4 codes are kept packed two a byte
    from the moment they are recorded (half the memory: 5.7 instead of 11.3 GB at a DeepSeek-V3 layer's end), W8
    codes as int8, and the file holds the same codes."""
    from quant.quantize import driver as qz
    from quant.quantize.qstore import unpack_codes

    submitted = {}
    real = qz.LayerWriter.submit

    def spy(self, path, results, params, report=None):
        submitted[path.name] = dict(results)
        return real(self, path, results, params, report)

    monkeypatch.setattr(qz.LayerWriter, "submit", spy)
    _, out, _ = _quantize(setup, tmp_path, "packed")
    bits = set()
    for name, results in submitted.items():
        stored = read_layer(out / name)
        for module, qw in results.items():
            bits.add(qw.spec.bits)
            assert qw.q.dtype == (torch.uint8 if qw.spec.bits == 4 else torch.int8), module
            codes = unpack_codes(qw.q, qw.spec) if qw.q.dtype == torch.uint8 else qw.q
            assert torch.equal(codes, stored[module].q), module
    assert bits == {4, 8}


@pytest.mark.parametrize("min_tokens", [0, 1])
def test_experts_without_tokens_are_not_said_to_fall_below_a_token_floor_the_recipe_did_not_set(caplog, min_tokens):
    from quant.quantize.driver import LayerReport, _log_layer

    caplog.set_level("INFO", logger="quant")
    _log_layer(LayerReport(3, rtn_fallbacks=["layers.3.experts.5.gate", "layers.3.experts.5.up"]), 4, min_tokens)
    text = caplog.text
    assert "token floor" not in text and "min_tokens" not in text and "WARNING" not in text
    assert "2 expert projections of experts routed no calibration token were rounded to nearest" in text


def test_a_token_floor_the_recipe_set_is_named_when_experts_fall_below_it(caplog):
    from quant.quantize.driver import LayerReport, _log_layer

    _log_layer(LayerReport(3, rtn_fallbacks=["layers.3.experts.5.down"]), 4, 16)
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "routed fewer than 16 calibration tokens (quantize.min_tokens) fell back to RTN" in record.getMessage()


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq"])
def test_worst_error_is_over_every_quantized_module_for_every_algorithm(setup, tmp_path, algorithm):
    """2-bit experts beside 8-bit attention: the worst relative weight error of each layer is an expert's, whatever
    the algorithm (AWQ's experts were left out, so its worst module was an 8-bit attention projection)."""
    src = setup[0]
    spec = PlanSpec(policy="uniform", low_bits=2, high_bits=2, group_size=32)
    _, _, reports = _quantize(setup, tmp_path, algorithm, spec, algorithm=algorithm)
    for r in reports:
        if r.layer in src.moe_layers():
            assert ".experts." in r.worst_module and r.worst_rel_error > 0.2, (r.layer, r.worst_module)
