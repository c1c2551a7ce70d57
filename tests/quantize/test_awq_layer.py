"""AWQ in the layer loop: expert statistics in chunks that fit quantize.hessian_budget_gb, results unchanged."""

import pytest
import torch

import quant.quantize.awq_layer as smooth
from quant.calibration import build_calibration
from quant.forecast.estimate import synthetic_profile
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.quantize.budgets import expert_hessian_bytes
from quant.quantize.driver import quantize_model
from quant.quantize.hessians import ExpertStats
from quant.quantize.qstore import layer_file, read_layer, read_params
from quant.recipe import PlanSpec, QuantizeSpec

# 3 and 8 bits with a token floor: per layer the shared gate/up search has a main group, a second group that
# counts in its loss (the experts below the floor) and a third spec quantized with the s found (the 8-bit ones)
PLAN = PlanSpec(group_size=32, symmetric=False, low_bits=3, high_bits=8)
BUDGET_GB = 1.3e-4  # 6 experts of the tiny models' 16 per pass: chunks of 6, 6 and 4


@pytest.fixture(scope="module", params=["deepseek-v3-tiny", "qwen3-moe-tiny"])
def setup(request):
    from transformers import AutoTokenizer

    src = resolve_model(f"builtin:{request.param}")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 4, 64, 0)
    return src, calib, plan_bits(synthetic_profile(src), src.modules, PLAN, src.n_layers)


class _Recorder:
    """Wraps ExpertStats and _GateUpSearch to record what each pass held and which search paths ran."""

    def __init__(self, monkeypatch):
        self.stats: list[ExpertStats] = []
        self.searches: list = []
        real_stats, real_search = smooth.ExpertStats, smooth._GateUpSearch

        def stats(*args, **kwargs):
            self.stats.append(real_stats(*args, **kwargs))
            return self.stats[-1]

        searches = self.searches

        class Search(real_search):
            def __init__(self, *args):
                super().__init__(*args)
                searches.append(self)

        monkeypatch.setattr(smooth, "ExpertStats", stats)
        monkeypatch.setattr(smooth, "_GateUpSearch", Search)


def _awq(setup, out, **qkw) -> dict:
    src, calib, plan = setup
    quantize_model(src, calib, plan.quantized_schemes(), "awq",
                   QuantizeSpec(algorithm="awq", min_tokens=40, **qkw),
                   Layerwise(src, "bfloat16", qkw.get("device", "cpu"), 4, World()), out)
    stored = {}
    for layer in range(src.n_layers):
        stored |= {n: (qw.q, qw.scale, qw.zero) for n, qw in read_layer(layer_file(out, layer)).items()}
        stored |= {f"{layer}:{n}": t for n, t in read_params(layer_file(out, layer)).items()}
    return stored


def test_chunked_expert_statistics_fit_the_budget_and_change_nothing(setup, tmp_path, monkeypatch):
    """Bit-identical codes, scales, zeros and folded norms/routers with the experts' Hessians in 3 passes per
    layer (and searches a few experts at a time) as with all at once; no pass holds more than the budget."""
    src = setup[0]
    whole = _awq(setup, tmp_path / "whole")
    rec = _Recorder(monkeypatch)
    chunked = _awq(setup, tmp_path / "chunked", hessian_budget_gb=BUDGET_GB, solve_budget_gb=2e-3)
    assert whole.keys() == chunked.keys() and any(":" in k and "norm" in k for k in whole)
    for k, a in whole.items():
        b = chunked[k]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else all(
            (x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert same, k

    n_moe, E = len(src.moe_layers()), rec.stats[0].view.n_experts
    per_expert = expert_hessian_bytes(rec.stats[0].view.gate_up.shape[2], rec.stats[0].view.intermediate)
    with_h = [st for st in rec.stats if st.sum_gu is not None]
    assert all(st.count * per_expert <= BUDGET_GB * 1e9 for st in with_h)
    assert [(st.first, st.count) for st in with_h] == [(0, 6), (6, 6), (12, 4)] * n_moe
    assert sum(st.sum_gu is None and st.count == E for st in rec.stats) == n_moe  # one totals pass per layer
    assert all(len(s.searched) == 2 and s.rest for s in rec.searches), "the plan must exercise every search path"


def test_one_chunk_of_expert_hessians_is_alive_at_a_time(setup, tmp_path, monkeypatch):
    """When a pass's statistics are made, no earlier chunk's Hessian sums are still referenced (a name bound to
    chunk 1 kept it alive through chunk 2's pass: two chunks, 14.6 GB more, on the DeepSeek-V3 shape's GPU run)."""
    import weakref

    real = smooth.ExpertStats
    made: list = []
    alive_at_start: list[int] = []

    def stats(*args, **kwargs):
        alive_at_start.append(sum(1 for r in made if r() is not None and r().sum_gu is not None))
        st = real(*args, **kwargs)
        made.append(weakref.ref(st))
        return st

    monkeypatch.setattr(smooth, "ExpertStats", stats)
    _awq(setup, tmp_path / "chunked", hessian_budget_gb=BUDGET_GB, solve_budget_gb=2e-3)
    n_moe = len(setup[0].moe_layers())
    assert len(alive_at_start) == 4 * n_moe  # three chunks and the totals pass per layer
    assert alive_at_start == [0, 1, 0, 0] * n_moe  # chunk 0, totals beside it, chunk 1, chunk 2


@pytest.mark.gpu
def test_gpu_chunked_awq_matches_whole(setup, tmp_path):
    """On the GPU the chunk passes' bf16 grams can differ from a single pass by fp32 reassociation (the load
    buckets differ), so up to the first MoE layer (whose input both runs share) the codes agree to within 1% (a
    rounding tie goes another way) and that layer's folded norm to 1e-3, as GPTQ's test allows
    (tests/quantize/test_driver.py); later layers calibrate on slightly different quantized outputs."""
    src = setup[0]
    whole = _awq(setup, tmp_path / "whole", device="cuda")
    chunked = _awq(setup, tmp_path / "chunked", device="cuda", hessian_budget_gb=BUDGET_GB, solve_budget_gb=2e-3)
    first_moe = min(src.moe_layers())
    shared_input = [n for n in whole if ":" not in n and src.modules[n].layer <= first_moe]
    differ = (sum(int((whole[n][0] != chunked[n][0]).sum()) for n in shared_input)
              / sum(whole[n][0].numel() for n in shared_input))
    assert differ < 1e-2, differ
    norm = next(k for k in whole if k.startswith(f"{first_moe}:") and "post_attention_layernorm" in k)
    torch.testing.assert_close(chunked[norm].float(), whole[norm].float(), rtol=1e-3, atol=0)
