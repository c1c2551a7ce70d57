"""Per-expert Linear expert layouts (remote code) against transformers' fused experts, on the same weights.

``per_expert_model`` (tests/conftest.py) is builtin:qwen3-moe-tiny's checkpoint under a transformers-4.x-style
modeling file whose MoE blocks hold an nn.ModuleList of gate_proj/up_proj/down_proj Linears and route in Python.
fp32 throughout: the fused and the per-expert forward sum in different orders, so bf16 results legitimately differ.
"""

import pytest
import torch
from torch import nn

from quant.calibration import build_calibration
from quant.errors import ModelError
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.models.layers import experts_of, layer_weights
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.profile.profile import profile_routing
from quant.quantize.algorithms import ALGORITHMS
from quant.quantize.driver import quantize_model
from quant.quantize.layer_job import LayerJob
from quant.quantize.qstore import layer_file, read_layer
from quant.recipe import PlanSpec, QuantizeSpec


@pytest.fixture(scope="module")
def sources(per_expert_model):
    return (resolve_model(str(per_expert_model), trust_remote_code=True, family="qwen3_moe"),
            resolve_model("builtin:qwen3-moe-tiny"))


@pytest.fixture(scope="module")
def calib(sources):
    from transformers import AutoTokenizer

    return build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(sources[1].path), 16, 128, 0)


@pytest.fixture(scope="module")
def profiles(sources, calib):
    return tuple(profile_routing(s, calib, Layerwise(s, "float32", "cpu", 4, world=World())) for s in sources)


def _layerwise_logits(src, tokens):
    return Layerwise(src, "float32", "cpu", batch_size=2, world=World()).logits(tokens)


def test_remote_code_needs_the_recipe_flag(per_expert_model):
    with pytest.raises(ModelError, match="set model.trust_remote_code: true"):
        resolve_model(str(per_expert_model))


def test_layerwise_per_expert_equals_native_fused_and_the_remote_model(sources, per_expert_model):
    from transformers import AutoModelForCausalLM

    pe, nat = sources
    assert pe.family.name == "qwen3_moe" and pe.modules.keys() == nat.modules.keys()
    tokens = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(1))
    logits = _layerwise_logits(pe, tokens)
    assert torch.allclose(logits, _layerwise_logits(nat, tokens), atol=1e-5)
    remote = AutoModelForCausalLM.from_pretrained(per_expert_model, dtype=torch.float32, trust_remote_code=True)
    assert isinstance(remote.model.layers[0].mlp.experts, nn.ModuleList)
    with torch.no_grad():
        assert torch.allclose(remote(tokens).logits, logits, atol=1e-5)
    # a full model (not materialized by load_layer) gets fused storage on first access; writes reach its Linears
    weights = layer_weights(pe, remote.model.layers[2], 2)
    weights["layers.2.experts.5.up"].zero_()
    assert not remote.model.layers[2].mlp.experts[5].up_proj.weight.any()


def test_expert_linears_are_views_of_the_fused_storage_and_routing_is_the_native_one(sources):
    pe, nat = sources
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(2))
    seen = {}
    for name, src in (("pe", pe), ("nat", nat)):
        lw = Layerwise(src, "float32", "cpu", batch_size=2, world=World())
        hidden = lw.embed(tokens)
        with lw.layer(1) as layer:
            view = experts_of(src, layer, 1)
            handle = view.on_route(lambda x, idx, w, name=name: seen.setdefault(name, []).append((x, idx, w)))
            lw.run(layer, hidden)
            handle.remove()
            lw.run(layer, hidden)  # removed: no second call
            if name == "pe":
                I, experts = view.intermediate, layer.mlp.experts
                for e in range(view.n_experts):
                    assert experts[e].gate_proj.weight.data_ptr() == view.gate_up[e, :I].data_ptr()
                    assert experts[e].up_proj.weight.data_ptr() == view.gate_up[e, I:].data_ptr()
                    assert experts[e].down_proj.weight.data_ptr() == view.down[e].data_ptr()
                disk = pe.read_tensors(["model.layers.1.mlp.experts.4.up_proj.weight"])
                assert torch.equal(experts[4].up_proj.weight, disk["model.layers.1.mlp.experts.4.up_proj.weight"])
                view.down.data[3] = 0.0  # the engine's kind of write
                assert not experts[3](torch.randn(5, 64)).any()
        if name == "pe":  # released: the fused storage and its views went back to meta
            assert view.module.quant_fused_gate_up.is_meta and layer.mlp.experts[0].gate_proj.weight.is_meta
    (x_pe, i_pe, w_pe), (x_nat, i_nat, w_nat) = seen["pe"][0], seen["nat"][0]
    assert len(seen["pe"]) == len(seen["nat"]) == 1 and i_pe.shape == (32, 4)
    assert torch.equal(x_pe, x_nat) and torch.equal(i_pe, i_nat) and torch.allclose(w_pe, w_nat)


def test_profile_matches_native(profiles, calib):
    pe, nat = profiles
    assert pe.layers == nat.layers and torch.equal(pe.counts, nat.counts) and torch.equal(pe.top1, nat.top1)
    assert pe.counts.sum() == calib.tokens.numel() * 4 * len(pe.layers)
    for key in ("weight_mass", "down_in_absmax", "down_out_absmax", "sensitivity"):
        assert torch.allclose(getattr(pe, key), getattr(nat, key), rtol=1e-4, atol=1e-9), key


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_quantize_writes_the_native_codes(sources, calib, profiles, algorithm, tmp_path):
    """A mixed 8/4 plan: the per-expert run writes the fused run's codes in every layer, so statistics and the
    propagation through each quantized layer (which feeds the next layer's statistics) match the native ones."""
    pe, nat = sources
    plan = plan_bits(profiles[1], nat.modules, PlanSpec(group_size=32), nat.n_layers)
    assert {p.bits for n, p in plan.quantized().items() if ".experts." in n} == {4, 8}
    stored = {}
    for name, src in (("pe", pe), ("nat", nat)):
        out = tmp_path / name
        quantize_model(src, calib, plan.quantized_schemes(), algorithm, QuantizeSpec(),
                       Layerwise(src, "float32", "cpu", 4, World()), out)
        stored[name] = {n: q for i in range(src.n_layers) for n, q in read_layer(layer_file(out, i)).items()}
    a, b = stored["pe"], stored["nat"]
    assert a.keys() == b.keys() == plan.quantized().keys()
    # Exact where both layouts run quant's own code on the same inputs: every layer's RTN codes, and the first
    # layer's GPTQ codes (its statistics come from the embeddings). A later layer's inputs come from each layout's
    # own forward through the quantized layers (transformers' fused experts vs the remote code's per-expert
    # Linear loop): fp32 sums in two kernels, equal only where the BLAS sums both call shapes in the same order
    # (CI's CPU does, with MKL_CBWR=STRICT; the H200 host's CPU flipped one code in layer 3). There a flipped code
    # is one step off, rare, and every scale agrees to rounding.
    first = min(int(n.split(".")[1]) for n in a)
    flips = codes = 0
    for n in a:
        if algorithm == "rtn" or int(n.split(".")[1]) == first:
            assert torch.equal(a[n].q, b[n].q) and torch.equal(a[n].scale, b[n].scale), n
            continue
        step = (a[n].q.int() - b[n].q.int()).abs()
        assert step.max() <= 1 and torch.allclose(a[n].scale, b[n].scale, rtol=1e-4, atol=0), n
        flips, codes = flips + int((step > 0).sum()), codes + step.numel()
    assert flips <= 1e-3 * codes, (flips, codes)


def test_awq_on_one_layer_matches_native(sources, calib, profiles):
    """AWQ folds 1/s into the norm and s into the router: a Linear gate here, a router parameter natively."""
    plan = plan_bits(profiles[1], sources[1].modules, PlanSpec(group_size=32), sources[1].n_layers)
    out = {}
    for name, src in zip(("pe", "nat"), sources, strict=True):
        lw = Layerwise(src, "float32", "cpu", 4, world=World())
        hidden = lw.embed(calib.tokens[:8])
        awq = ALGORITHMS["awq"]
        with lw.layer(0) as layer:
            job = LayerJob(src, 0, layer, plan.quantized_schemes(), QuantizeSpec(), World(), awq.solve)
            awq.run_layer(job, lw, hidden)
            out[name] = (job.results.params, job.results.codes)
    (p_pe, r_pe), (p_nat, r_nat) = out["pe"], out["nat"]
    assert p_pe.keys() == p_nat.keys() and "mlp.gate.weight" in p_pe
    assert all(torch.equal(p_pe[k], p_nat[k]) for k in p_pe)
    assert r_pe.keys() == r_nat.keys() and all(torch.equal(r_pe[n].q, r_nat[n].q) for n in r_pe)


class _Expert(nn.Module):
    """A transformers-4.x Mixtral expert: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, d: int, i: int):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False), nn.Linear(i, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class _TupleGate(nn.Module):
    """DeepSeek-style gate: returns (topk_idx, topk_weight, aux) from its own (here: sigmoid) scores."""

    def __init__(self, d: int, e: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, d))

    def forward(self, x):
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]) @ self.weight.T)
        w, idx = scores.topk(2, dim=-1)
        return idx, w * 2.5, None


def test_mixtral_and_deepseek_style_blocks():
    from quant.models.experts import experts_view, per_expert_layout
    from quant.models.families import FAMILIES
    from quant.models.layers import _layer_state

    torch.manual_seed(0)
    D, I, E = 16, 8, 4
    layer = nn.Module()
    layer.block_sparse_moe = nn.Module()
    layer.block_sparse_moe.gate = nn.Linear(D, E, bias=False)
    layer.block_sparse_moe.experts = nn.ModuleList([_Expert(D, I) for _ in range(E)])
    x = torch.randn(6, D)
    before = [layer.block_sparse_moe.experts[e](x) for e in range(E)]
    view = experts_view(FAMILIES["mixtral"], None, 2, layer, 0)  # fuses in place
    assert per_expert_layout(FAMILIES["mixtral"], layer, 0).prefix == "block_sparse_moe.experts"
    assert all(torch.equal(layer.block_sparse_moe.experts[e](x), before[e]) for e in range(E))
    got = []
    handle = view.on_route(lambda *a: got.append(a))
    layer.block_sparse_moe.gate(x[None])
    handle.remove()
    (xs, idx, w), = got
    ref_w, ref_idx = torch.softmax(layer.block_sparse_moe.gate(x), -1).topk(2, dim=-1)
    assert torch.equal(xs, x) and torch.equal(idx, ref_idx) and torch.allclose(w, ref_w / ref_w.sum(-1, keepdim=True))
    # on-disk Mixtral keys keep their block name when the module does (remote code), else become mlp.*
    state, fused = _layer_state(resolve_model("builtin:mixtral-tiny"), 0, "cpu", "block_sparse_moe")
    assert "block_sparse_moe.gate.weight" in state and fused[0].shape == (8, 64, 64) and fused[1].shape == (8, 64, 32)

    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.ModuleList([_Expert(D, I) for _ in range(E)])
    for mlp in layer.mlp.experts:  # DeepSeek's expert names
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = mlp.w1, mlp.w3, mlp.w2
        del mlp.w1, mlp.w3, mlp.w2
    layer.mlp.gate = nn.Linear(D, E, bias=False)
    with pytest.raises(ModelError, match="does not route by softmax top-k"):
        experts_view(FAMILIES["deepseek_v3"], None, 2, layer, 3)
    layer.mlp.gate = _TupleGate(D, E)
    view = experts_view(FAMILIES["deepseek_v3"], None, 2, layer, 3)
    got.clear()
    handle = view.on_route(lambda *a: got.append(a))
    ref_idx, ref_w, _ = layer.mlp.gate(x[None])
    handle.remove()
    (xs, idx, w), = got
    assert torch.equal(xs, x) and torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
