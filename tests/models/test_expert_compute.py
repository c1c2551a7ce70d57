"""quant's own experts forward (models.expert_compute) against the modules' own: the same outputs and input
gradients on every builtin family and on per-expert Linear experts, bf16-stored experts widened bit for bit as their
fp32 copies, a weight transform equal to writing the transformed weights in, and the module's forward back after."""

import pytest
import torch

from quant.algos.grid import quantize_weight
from quant.layerwise import Layerwise
from quant.models import expert_compute, resolve_model
from quant.models.expert_compute import install
from quant.models.experts import moe_block
from quant.models.layers import experts_of
from quant.parallel.world import World
from quant.scheme import Scheme

FAMILIES = ["builtin:qwen3-moe-tiny", "builtin:deepseek-v3-tiny", "builtin:mixtral-tiny", "builtin:olmoe-tiny"]


def _block_io(name: str, narrow: bool, seed: int = 0):
    """(source, Layerwise, the first MoE layer's index, a batch of its MoE block's inputs)."""
    src = resolve_model(name)
    lw = Layerwise(src, "float32", "cpu", 2, World(), narrow_experts=narrow)
    x = torch.randn(2, 12, src.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return src, lw, src.moe_layers()[0], x


def _run_block(src, layer, idx, x, requires_grad=False):
    block = moe_block(src.family, layer)[1]
    x = x.clone().requires_grad_(requires_grad)
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    if not requires_grad:
        return y.detach(), None
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y) / y.numel())
    return y.detach(), g


def _rtn(bits: int, group: int):
    return lambda w: quantize_weight(w, Scheme(bits, group), w.dtype).dequantize()


@pytest.mark.parametrize("name", FAMILIES)
def test_outputs_and_input_gradients_are_the_module_s_own(name):
    src, lw, idx, x = _block_io(name, narrow=False)
    with lw.layer(idx) as layer:
        want, want_g = _run_block(src, layer, idx, x, requires_grad=True)
        compute = install(experts_of(src, layer, idx), torch.float32)
        got, got_g = _run_block(src, layer, idx, x, requires_grad=True)
        compute.remove()
        again, _ = _run_block(src, layer, idx, x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_g, want_g, rtol=1e-4, atol=1e-9)
    assert torch.equal(again, want)  # the module's own forward is back
    assert all("forward" not in m.__dict__ for m in layer.modules())


@pytest.mark.parametrize("name", ["builtin:qwen3-moe-tiny", "builtin:deepseek-v3-tiny"])
def test_bf16_experts_widened_give_their_fp32_copies_figures_bit_for_bit(name):
    src, narrow, idx, x = _block_io(name, narrow=True)
    _, wide, _, _ = _block_io(name, narrow=False)
    results = []
    for lw in (narrow, wide):
        with lw.layer(idx) as layer:
            view = experts_of(src, layer, idx)
            results.append((view.gate_up.dtype, *_computed(src, layer, idx, x)))
    assert results[0][0] == torch.bfloat16 and results[1][0] == torch.float32
    for a, b in zip(results[0][1:], results[1][1:], strict=True):
        assert torch.equal(a, b)


def _computed(src, layer, idx, x):
    compute = install(experts_of(src, layer, idx), torch.float32)
    try:
        y, g = _run_block(src, layer, idx, x, requires_grad=True)
        compute.transform = _rtn(4, 16)
        y_q, _ = _run_block(src, layer, idx, x)
    finally:
        compute.remove()
    return y, g, y_q


@pytest.mark.parametrize("name", FAMILIES)
def test_a_transform_runs_the_experts_as_if_its_weights_were_written_in(name):
    src, lw, idx, x = _block_io(name, narrow=True, seed=1)
    with lw.layer(idx) as layer:
        view = experts_of(src, layer, idx)
        stored = (view.gate_up.detach().clone(), view.down.detach().clone())
        compute = install(view, torch.float32)
        compute.transform = _rtn(4, 16)
        got, _ = _run_block(src, layer, idx, x)
        compute.transform = None
        clean, _ = _run_block(src, layer, idx, x)
        compute.remove()
        assert torch.equal(view.gate_up, stored[0]) and torch.equal(view.down, stored[1])  # never written
    _, wide, _, _ = _block_io(name, narrow=False)
    with wide.layer(idx) as layer:
        view = experts_of(src, layer, idx)
        want_clean, _ = _run_block(src, layer, idx, x)
        for p in (view.gate_up, view.down):
            p.data.copy_(_rtn(4, 16)(p.data))
        want, _ = _run_block(src, layer, idx, x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(clean, want_clean, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, clean, rtol=1e-3, atol=0)


def test_the_backward_widens_again_instead_of_keeping_the_widened_weights(monkeypatch):
    src, lw, idx, x = _block_io("builtin:qwen3-moe-tiny", narrow=True)
    monkeypatch.setattr(expert_compute, "WIDEN_BYTES", 1)  # one expert at a time
    widened = []
    real = expert_compute.ExpertsCompute.widen
    monkeypatch.setattr(expert_compute.ExpertsCompute, "widen",
                        lambda self, w, t: (widened.append(w.shape[0]), real(self, w, t))[1])
    with lw.layer(idx) as layer:
        compute = install(experts_of(src, layer, idx), torch.float32)
        y = moe_block(src.family, layer)[1](x.clone().requires_grad_())
        y = y[0] if isinstance(y, tuple) else y
        forward = len(widened)
        y.sum().backward()
        compute.remove()
    assert set(widened) == {1} and forward > 0 and len(widened) == 2 * forward


def test_per_expert_linear_experts_compute_as_the_fused_ones(per_expert_model):
    pe = resolve_model(str(per_expert_model), trust_remote_code=True, family="qwen3_moe")
    nat = resolve_model("builtin:qwen3-moe-tiny")
    x = torch.randn(2, 10, nat.config.hidden_size, generator=torch.Generator().manual_seed(4))
    out = []
    for src in (pe, nat):
        with Layerwise(src, "float32", "cpu", 2, World(), narrow_experts=True).layer(1) as layer:
            assert experts_of(src, layer, 1).gate_up.dtype == torch.bfloat16
            out.append(_computed(src, layer, 1, x))
    for a, b in zip(*out, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_grouped_and_per_group_products_agree_on_empty_groups():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    sizes = [3, 0, 4, 0]
    offs = torch.tensor([3, 3, 7, 7], dtype=torch.int32)
    want = torch.cat([x[:3] @ w[0].t(), x[3:] @ w[2].t()])
    assert torch.allclose(expert_compute.grouped_mm(x, w, offs, sizes), want, rtol=1e-5, atol=1e-6)
    expert_compute._GROUPED[("cpu", None, torch.float32)] = False  # the per-group path
    try:
        assert torch.allclose(expert_compute.grouped_mm(x, w, offs, sizes), want, rtol=1e-5, atol=1e-6)
    finally:
        expert_compute._GROUPED.pop(("cpu", None, torch.float32))

