"""Routing profile on the builtin models (biased routers: the hottest expert is known) and its statistics."""

import json

import pytest
import torch

from quant.calibration import build_calibration
from quant.layerwise import Layerwise
from quant.models import BUILTINS, resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.profile.profile import PROBE_TOKENS, RoutingProfile, profile_routing
from quant.quantize.routing import expert_intermediate, expert_output, load_buckets, with_zero_row
from quant.recipe import PlanSpec


@pytest.fixture(scope="module")
def profiles():
    from transformers import AutoTokenizer

    out = {}
    for name in BUILTINS:
        src = resolve_model(f"builtin:{name}")
        calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 16, 128, 0)
        out[name] = (src, calib, profile_routing(src, calib, Layerwise(src, "float32", "cpu", 4, world=World())))
    return out


@pytest.mark.parametrize("name", list(BUILTINS))
def test_profile_finds_hot_expert_and_plan_gives_it_8_bits(profiles, name):
    src, calib, prof = profiles[name]
    hottest = json.loads((src.path / "quant_builtin.json").read_text())["hot_experts"][0]
    assert prof.layers == src.moe_layers()
    assert (prof.counts.sum(1) == calib.tokens.numel() * src.top_k).all()
    share = prof.share()
    assert (share[:, hottest] > 1.0 / prof.n_experts).all()  # above uniform in every layer
    plan = plan_bits(prof, src.modules, PlanSpec(group_size=32), src.n_layers)
    for layer in prof.layers:
        assert plan.modules[f"layers.{layer}.experts.{hottest}.down"].bits == 8


def test_weight_mass_and_top1_are_consistent(profiles):
    _, calib, prof = profiles["qwen3-moe-tiny"]
    n_tokens = calib.tokens.numel()
    # normalized top-k weights (norm_topk_prob): every token distributes mass 1
    assert ((prof.weight_mass.sum(1) - n_tokens).abs() < 1e-3 * n_tokens).all()
    assert (prof.top1.sum(1) == n_tokens).all()
    assert (prof.top1 <= prof.counts).all()


def test_domain_counts_partition_the_total(profiles):
    _, calib, prof = profiles["deepseek-v3-tiny"]
    assert set(prof.domain_counts) == set(calib.domains)
    assert torch.allclose(sum(prof.domain_counts.values()), prof.counts)


def test_sensitivity_is_positive_for_used_experts(profiles):
    _, _, prof = profiles["olmoe-tiny"]
    used = prof.counts > 0
    assert (prof.sensitivity[used] > 0).all() and (prof.sensitivity[~used] == 0).all()


def test_profile_json_roundtrip(profiles, tmp_path):
    _, _, prof = profiles["mixtral-tiny"]
    prof.save(tmp_path / "p.json")
    again = RoutingProfile.load(tmp_path / "p.json")
    assert torch.equal(again.counts, prof.counts) and again.sample_ids == prof.sample_ids
    assert torch.equal(again.sensitivity, prof.sensitivity)


def test_super_expert_detection():
    prof = RoutingProfile("f", "m", [0, 1], 4, 2, 10, [], *(torch.ones(2, 4, dtype=torch.float64) for _ in range(5)))
    prof.down_out_absmax[1, 2] = 200.0
    assert prof.super_experts(50.0) == [(1, 2)]
    assert prof.super_experts(500.0) == []


def test_bucketed_expert_ops_match_per_expert_loop():
    g = torch.Generator().manual_seed(0)
    T, k, E, D, I = 50, 3, 6, 16, 8
    x = torch.randn(T, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    gate_up, down = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    counts, buckets = load_buckets(idx, w, E, width=D, max_elems=3 * 30 * D)
    assert len(buckets) > 1
    for b in buckets:
        y = expert_output(expert_intermediate(b.gather(with_zero_row(x)), b.take(gate_up), torch.nn.functional.silu),
                          b.take(down))
        for j, e in enumerate(b.experts.tolist()):
            tok, slot = torch.where(idx == e)
            n = len(tok)
            assert counts[e] == n and b.mask[j].sum() == n
            assert torch.equal(b.token[j, :n], tok)
            assert torch.allclose(b.weight[j, :n], w[tok, slot])
            gate, up = (x[tok] @ gate_up[e].T).chunk(2, dim=-1)
            ref = (torch.nn.functional.silu(gate) * up) @ down[e].T
            assert torch.allclose(y[j, :n], ref, atol=1e-5)
            assert (y[j, n:] == 0).all()


def _random_experts(E: int, D: int, I: int, k: int, g: torch.Generator):
    """transformers' fused Qwen3-MoE experts with seeded N(0, 0.3²) weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    mod = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k))
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn(E, 2 * I, D, generator=g) * 0.3)
        mod.down_proj.copy_(torch.randn(E, D, I, generator=g) * 0.3)
    return mod


def test_layer_statistics_equal_a_per_expert_loop_under_skewed_routing():
    """Every per-expert statistic of one layer (counts, routing mass, top-1, per-domain counts, down-projection
    maxima, the W4 sensitivity probe) against a plain loop over experts, with a hot expert and a cold one."""
    from quant.models.experts import fused_view
    from quant.profile.profile import _LayerStats

    T, k, E, D, I = 120, 2, 6, 32, 16
    g = torch.Generator().manual_seed(2)
    mod = _random_experts(E, D, I, k, g)
    view = fused_view(mod)
    idx = torch.multinomial(torch.tensor([30.0, 5, 3, 2, 1, 0]).expand(T, E), k, generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    x = torch.randn(T, D, generator=g)
    dom = torch.randint(0, 2, (T,), generator=g)
    acc = _LayerStats(E, ["a", "b"], torch.device("cpu"), probe_tokens=None)  # the probe on every token
    for s in (slice(0, 50), slice(50, T)):  # two batches
        acc.token_domain = dom[s]
        acc.add(acc.batch(view, x[s], idx[s], w[s]))
    gu_q, down_q = acc._probe_weights(view)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        st = {key: acc.stat(key)[e].item() for key in ("counts", "weight_mass", "top1", "down_in_absmax",
                                                         "down_out_absmax")}
        assert st["counts"] == len(tok)
        assert st["weight_mass"] == pytest.approx(w[tok, slot].double().sum().item())
        assert st["top1"] == int((idx[torch.arange(T), w.argmax(dim=1)] == e).sum())
        assert [acc.domain(d)[e].item() for d in ("a", "b")] == [int((dom[tok] == i).sum()) for i in (0, 1)]
        if not len(tok):
            assert st["down_in_absmax"] == st["down_out_absmax"] == acc.stat("sensitivity")[e].item() == 0
            continue
        a = view.act(x[tok] @ mod.gate_up_proj[e, :I].T) * (x[tok] @ mod.gate_up_proj[e, I:].T)
        y = a @ mod.down_proj[e].T
        a_q = view.act(x[tok] @ gu_q[e, :I].T) * (x[tok] @ gu_q[e, I:].T)
        y_q = a_q @ down_q[e].T
        sens = ((y - y_q).pow(2).sum(dim=1) * w[tok, slot].pow(2)).sum().item()
        assert st["down_in_absmax"] == pytest.approx(a.abs().max().item(), rel=1e-5)
        assert st["down_out_absmax"] == pytest.approx(y.abs().max().item(), rel=1e-5)
        assert acc.stat("sensitivity")[e].item() == pytest.approx(sens, rel=1e-4)


def test_probe_on_a_token_subset_equals_its_definition():
    """With a per-batch cap of 5 tokens per expert, each expert's sensitivity is the sum over batches of
    (routed / probed) x the routing-weighted error of the probed tokens: evenly strided positions
    ``i * c // 5`` among its ``c`` routed tokens of the batch (every token when ``c <= 5``)."""
    from quant.models.experts import fused_view
    from quant.profile.profile import _LayerStats

    T, k, E, D, I, cap = 90, 2, 5, 16, 8, 5
    g = torch.Generator().manual_seed(3)
    mod = _random_experts(E, D, I, k, g)
    view = fused_view(mod)
    idx = torch.multinomial(torch.tensor([20.0, 5, 2, 0.3, 0]).expand(T, E), k, generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    x = torch.randn(T, D, generator=g)
    acc = _LayerStats(E, [], torch.device("cpu"), probe_tokens=cap)
    batches = (slice(0, 40), slice(40, T))
    for s in batches:
        acc.add(acc.batch(view, x[s], idx[s], w[s]))
    gu_q, down_q = acc._probe_weights(view)
    expect = torch.zeros(E, dtype=torch.float64)
    for s in batches:
        for e in range(E):
            tok, slot = torch.where(idx[s] == e)  # the batch's routed tokens of e, in token order
            c = len(tok)
            if c == 0:
                continue
            pick = [i * c // cap for i in range(cap)] if c > cap else list(range(c))
            xt, wt = x[s][tok[pick]], w[s][tok[pick], slot[pick]]
            y = (view.act(xt @ mod.gate_up_proj[e, :I].T) * (xt @ mod.gate_up_proj[e, I:].T)) @ mod.down_proj[e].T
            y_q = (view.act(xt @ gu_q[e, :I].T) * (xt @ gu_q[e, I:].T)) @ down_q[e].T
            expect[e] += ((y - y_q).pow(2).sum(dim=1) * wt.pow(2)).sum().double() * c / len(pick)
    assert acc.stat("counts")[0] > 2 * cap and acc.stat("counts")[4] == 0  # subsampled, and a cold expert
    torch.testing.assert_close(acc.stat("sensitivity"), expect, rtol=1e-4, atol=0)


def test_probe_subset_ranks_experts_like_the_full_probe_on_the_reference_moe():
    """The default subset (PROBE_TOKENS per expert and batch; here ~1/4 of the routed tokens on average, ~1/20
    for the busiest experts) ranks every layer's experts like probing every token: Spearman >= 0.95 (seen: 0.98+)."""
    from transformers import AutoTokenizer

    from quant.profile.profile import _spearman

    src = resolve_model("builtin:reference-moe")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 32, 256, 0)
    full = profile_routing(src, calib, Layerwise(src, "float32", "cpu", 8, world=World()), probe_tokens=None)
    subset = profile_routing(src, calib, Layerwise(src, "float32", "cpu", 8, world=World()))
    assert (full.counts / 4 > 4 * PROBE_TOKENS).any()  # the busiest experts are probed on a small fraction
    rho = [_spearman(full.sensitivity[r], subset.sensitivity[r]) for r in range(len(full.layers))]
    assert min(rho) >= 0.95, rho
    assert torch.equal(full.counts, subset.counts) and torch.equal(full.down_out_absmax, subset.down_out_absmax)


def test_rank_stability_and_cold_experts():
    counts = torch.tensor([[10.0, 5, 1, 0], [3, 3, 9, 1]], dtype=torch.float64)
    z = torch.zeros_like(counts)
    prof = RoutingProfile("f", "m", [0, 1], 4, 1, 10, [], counts, counts, z, z, z,
                          domain_counts={"a": counts, "b": counts.flip(1), "c": counts * 2})
    st = prof.rank_stability(fraction=0.25)
    assert st["a~c"] == {"spearman": pytest.approx(1.0), "top_overlap": 1.0}
    assert st["a~b"]["spearman"] < 0 and st["a~b"]["top_overlap"] == 0.0
    assert prof.cold_experts(2) == [(0, 2), (0, 3), (1, 3)]
    assert prof.max_min_ratio()[1].item() == 9.0


def test_domains_of_the_bundled_set_disagree_somewhat(profiles):
    _, _, prof = profiles["qwen3-moe-tiny"]
    st = prof.rank_stability()
    assert set(st) == {"code~gpl3", "code~prose", "gpl3~prose"}
    assert all(-1.0 <= v["spearman"] <= 1.0 and 0.0 <= v["top_overlap"] <= 1.0 for v in st.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probe_tokens", [None, 5])
def test_grouped_kernel_gives_the_statistics_of_the_load_buckets(monkeypatch, dtype, probe_tokens):
    """The grouped-GEMM pass over expert-sorted rows (no padding, weights sliced not copied, ranges cut by the
    chunk budget: here 3 rows' worth, so experts are split over many ranges) against the padded load buckets:
    the same rows, the same probe slots, so counts and maxima are equal and sensitivities equal up to summation
    order; and it is the path taken by default where torch has grouped GEMMs."""
    from quant.models.experts import fused_view
    from quant.profile import profile as prof
    from quant.profile.profile import _MAXED, _SUMMED, _LayerStats, grouped_mm_ok

    T, k, E, D, I = 300, 2, 7, 32, 16
    g = torch.Generator().manual_seed(5)
    mod = _random_experts(E, D, I, k, g).to(dtype)
    view = fused_view(mod)
    idx = torch.multinomial(torch.tensor([40.0, 9, 5, 0, 3, 1, 0.5]).expand(T, E), k, generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1).to(dtype)
    x = torch.randn(T, D, generator=g).to(dtype)
    assert grouped_mm_ok(view, dtype)
    out = {}
    for kernel in ("grouped", "buckets"):
        if kernel == "grouped":
            monkeypatch.setattr(prof, "chunk_budget", lambda device: 3 * 2 * I)
        else:
            monkeypatch.undo()
        acc = _LayerStats(E, [], torch.device("cpu"), probe_tokens=probe_tokens, kernel=kernel)
        for sl in (slice(0, 120), slice(120, T)):
            acc.add(acc.batch(view, x[sl], idx[sl], w[sl]))
        out[kernel] = {key: acc.stat(key) for key in _SUMMED + _MAXED}
    grouped, buckets = out["grouped"], out["buckets"]
    assert buckets["counts"][3] == 0 and buckets["counts"][0] > 100
    for key in ("counts", "weight_mass", "top1"):
        assert torch.equal(grouped[key], buckets[key]), key
    for key in ("down_in_absmax", "down_out_absmax"):
        torch.testing.assert_close(grouped[key], buckets[key], rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    torch.testing.assert_close(grouped["sensitivity"], buckets["sensitivity"],
                               rtol=1e-5 if dtype == torch.float32 else 3e-2, atol=0)
    assert grouped["sensitivity"][3] == 0 and (grouped["sensitivity"][[0, 1, 2, 4, 5]] > 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "buckets"])
def test_gpu_layer_statistics_equal_the_cpu(kernel):
    """One layer's statistics from bf16 activations on the GPU (grouped GEMMs where CUDA has them, else and also
    the load buckets; aminmax maxima, the subset probe) against the same bf16 computation on the CPU: counts and
    routing mass equal, maxima and sensitivity equal up to the order of bf16 accumulation."""
    from quant.models.experts import fused_view
    from quant.profile.profile import _MAXED, _SUMMED, _LayerStats, _spearman, grouped_mm_ok

    T, k, E, D, I = 4000, 2, 8, 64, 32
    g = torch.Generator().manual_seed(4)
    mod = _random_experts(E, D, I, k, g).to(torch.bfloat16)
    idx = torch.multinomial(torch.tensor([30.0, 9, 5, 3, 2, 1, 1, 0]).expand(T, E), k, generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1).bfloat16()
    x = torch.randn(T, D, generator=g).bfloat16()
    out = {}
    for device in ("cpu", "cuda"):
        view = fused_view(mod.to(device))
        if device == "cuda" and kernel == "auto":
            assert grouped_mm_ok(view, torch.bfloat16)  # the H200's path
        acc = _LayerStats(E, [], torch.device(device), probe_tokens=32, kernel=kernel if device == "cuda" else "auto")
        for s in (slice(0, 1500), slice(1500, T)):
            acc.add(acc.batch(view, x[s].to(device), idx[s].to(device), w[s].to(device)))
        out[device] = {key: acc.stat(key).cpu() for key in _SUMMED + _MAXED}
    cpu, gpu = out["cpu"], out["cuda"]
    assert torch.equal(cpu["counts"], gpu["counts"]) and torch.equal(cpu["top1"], gpu["top1"])
    torch.testing.assert_close(gpu["weight_mass"], cpu["weight_mass"], rtol=1e-9, atol=0)
    for key, tol in (("down_in_absmax", 1e-2), ("down_out_absmax", 1e-2), ("sensitivity", 2e-2)):
        torch.testing.assert_close(gpu[key], cpu[key], rtol=tol, atol=0)
    assert _spearman(gpu["sensitivity"], cpu["sensitivity"]) >= 0.95


def test_profile_reads_the_host_once_per_batch_and_layer():
    """The profile's per-batch statistics (counts, top-1, domains, maxima, the probe's token subset) stay on the
    device; the one host read per batch is the expert counts that size the grouped GEMMs. The causal mask and
    rotary embeddings are made once per batch shape, not per batch (transformers' mask builder reads back)."""
    from transformers import AutoTokenizer

    from quant.diag.hostsync import HostSyncs

    src = resolve_model("builtin:qwen3-moe-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 16, 64, 0)
    with HostSyncs() as s:
        prof = profile_routing(src, calib, Layerwise(src, "float32", "cpu", 4, world=World()))
    per_batch = {site: n for site, n in s.sites.items()
                 if site.split(" ")[1] in ("batch", "_grouped", "sort_by_expert", "load_buckets", "__call__", "_inputs")}
    batches = 16 // 4
    assert sum(per_batch.values()) <= batches * len(prof.layers) + 1, per_batch


def test_each_layers_probe_weights_are_freed_with_the_layer():
    """The probe's RTN copy of a layer's experts (22.5 GB on DeepSeek-V3) lives only while that layer runs: at the
    profile's peak at most one layer's copy is alive, and when profile_routing returns none is, even before a
    garbage collection. (Every layer's copy was kept until the end, then by reference cycles: on the H200, 22.6 GB
    were still allocated when the DeepSeek-V3 quantize began.)"""
    import gc

    from transformers import AutoTokenizer

    from quant.diag.memtrace import LiveBytes

    src = resolve_model("builtin:deepseek-v3-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 8, 64, 0)
    gc.collect()
    gc.disable()
    try:
        with LiveBytes(step=1) as m:  # the sites at the exact peak
            prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 4, world=World()))
            left = sum(n for n, site in m._live.values() if "_rtn_probe" in site)
    finally:
        gc.enable()
    layer = src.read_tensors([k for k in src.weight_map if k.startswith(f"model.layers.{prof.layers[0]}.mlp.experts.")])
    one_layer = sum(t.numel() * 2 for t in layer.values())  # bf16
    at_peak = sum(n for site, n in m.peak.sites if "_rtn_probe" in site)
    assert len(prof.layers) >= 2 and 0 < at_peak <= one_layer, (at_peak, one_layer)
    assert left == 0


def expert_weights_alive_at_each_load(monkeypatch, module, run) -> list[int]:
    """For each layer load during ``run()``: how many earlier layers' expert weights (as ``module.experts_of``
    handed them out) were still alive and not released to meta."""
    import weakref

    from quant import layerwise

    refs, alive_at_load = [], []
    experts_of, load_layer = module.experts_of, layerwise.load_layer

    def spy_view(*args, **kwargs):
        view = experts_of(*args, **kwargs)
        if view is not None:
            refs.append(weakref.ref(view.gate_up))
        return view

    def spy_load(*args, **kwargs):
        alive_at_load.append(sum(r() is not None and not r().is_meta for r in refs))
        return load_layer(*args, **kwargs)

    monkeypatch.setattr(module, "experts_of", spy_view)
    monkeypatch.setattr(layerwise, "load_layer", spy_load)
    run()
    assert len(refs) >= 2
    return alive_at_load


def test_a_layer_s_expert_weights_are_gone_before_the_next_layer_loads(monkeypatch):
    """The profile's experts view holds the layer's expert weights (22.5 GB on DeepSeek-V3); kept past its layer, it
    stayed alive through the next layer's load and raised the stage's peak by ~18 GB over three layers. When a layer
    loads, no earlier layer's expert weights may be alive (released to meta, or collected)."""
    from quant.calibration import CalibrationSet
    from quant.profile import profile as profile_mod

    src = resolve_model("builtin:deepseek-v3-tiny")  # a dense first layer, then MoE layers
    tokens = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    calib = CalibrationSet(tokens, tuple(map(str, range(4))), ("x",) * 4, 0, "random")
    alive = expert_weights_alive_at_each_load(
        monkeypatch, profile_mod, lambda: profile_routing(src, calib, Layerwise(src, "float32", "cpu", 2, World())))
    assert alive == [0] * src.n_layers


def test_the_log_lines_and_the_report_count_cold_experts_and_usage_ratios_alike(caplog):
    """One definition each: a cold expert is one routed fewer than profile.min_tokens tokens; the usage ratio is
    the most used expert's tokens over the least used one's (inf when one is unused)."""
    import re

    from transformers import AutoTokenizer

    from quant.report import _routing_lines

    src = resolve_model("builtin:qwen3-moe-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 2, 32, 0)
    caplog.set_level("INFO", logger="quant")
    prof = profile_routing(src, calib, Layerwise(src, "float32", "cpu", 2, World()), min_tokens=8)
    logged = [re.search(r"profile layer (\d+): \d+ experts, most/least used (.+?), (\d+) cold \(fewer than 8 ",
                        r.getMessage()) for r in caplog.records if "profile layer" in r.getMessage()]
    assert len(logged) == len(prof.layers) and all(logged)
    report = "\n".join(_routing_lines(prof, 8))
    n_cold = sum(int(m[3]) for m in logged)
    assert n_cold > 0 and f"cold experts (fewer than 8 routed tokens, profile.min_tokens): {n_cold}" in report
    for m in logged:
        assert f"layer {m[1]}: {m[2]}" in report
    assert not re.search(r"[\[\]{}]", report), report  # text, never a Python list, tuple or dict


def test_a_stop_request_ends_the_profile_after_the_layer_in_hand():
    """SIGTERM during the routing profile ends it after the layer in hand with the stop error (every rank after the
    same layer: the request is agreed over ranks, as in quantize)."""
    import logging

    from transformers import AutoTokenizer

    from quant.errors import StopRequested

    src = resolve_model("builtin:qwen3-moe-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 2, 32, 0)
    lw, seen = Layerwise(src, "float32", "cpu", 2, World()), []

    class StopAtLayer1(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
            if record.getMessage().startswith("profile layer 1:"):
                lw.world.stop.set("SIGTERM")

    logger, handler = logging.getLogger("quant.profile.profile"), StopAtLayer1(logging.INFO)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(StopRequested, match=f"after profile layer 1 of {src.n_layers}; rerun"):
            profile_routing(src, calib, lw)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen[-1].startswith("profile layer 1:")
