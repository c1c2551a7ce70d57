"""quant.serve.nibbles: W8 and W4 experts as one 4-bit stack with zero points, against each expert's own dequantized
weights, compressed-tensors' own dequantizer, and the grouped forward (plain-torch kernels of Marlin's semantics)."""

import pytest
import torch

from quant.scheme import Scheme
from quant.serve import nibbles
from quant.serve.layout import expert_groups, grouped_moe_reference, stacked_shapes
from quant.serve.mixed_moe import dequantize as dequantize_sym
from tests.serve.test_moe_routing import REF

W8, W4 = Scheme(8, 128), Scheme(4, 128)


def _tensors(groups, H, N, gen):
    """Random stacked checkpoint tensors of each group (codes over every bit pattern) and ``[E, Nout, K]`` dense
    weights per side, each expert's dequantized at its own index."""
    E = sum(len(g.experts) for g in groups)
    dense = {"w13": torch.empty(E, 2 * N, H), "w2": torch.empty(E, H, N)}
    out = []
    for g in groups:
        t = {}
        for key, shape in stacked_shapes(g.scheme, len(g.experts), H, N).items():
            if key[1] == "weight_scale":
                t[key] = (torch.rand(shape, generator=gen) * 0.02 + 0.01).to(torch.bfloat16)
            else:
                t[key] = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)
        for side in dense:
            c, s = t[(side, "weight_packed")], t[(side, "weight_scale")]
            if g.scheme.symmetric:
                w = dequantize_sym(c, s, g.scheme)
            else:
                w = nibbles.dequantize(c, s, t[(side, "weight_zero_point")], g.scheme.group_size)
            dense[side][list(g.experts)] = w
        out.append(t)
    return out, dense


def _stack_dense(stack, side):
    g = stack[0].group_size
    t = stack[1]
    return nibbles.dequantize(t[(side, "weight_packed")], t[(side, "weight_scale")], t[(side, "weight_zero_point")], g)


SCHEMES = {
    "w8-w4": [W8 if e % 5 == 0 else W4 for e in range(10)],
    "w8g128-w4g32": [W8 if e in (1, 6) else Scheme(4, 32) for e in range(8)],
    "w8g32-w4g128-w4asym": [Scheme(8, 32)] * 2 + [W4] * 3 + [Scheme(4, 64, False)] * 3,
    "w4-only": [W4] * 4,
    "w8-only": [W8] * 3,
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_expert_is_its_rows_summed_bit_for_bit(name):
    schemes = SCHEMES[name]
    groups = expert_groups(schemes)
    tensors, dense = _tensors(groups, 256, 128, torch.Generator().manual_seed(len(name)))
    scheme, t, rows = nibbles.nibble_stack(groups, tensors, len(schemes))
    assert scheme == Scheme(4, min(s.group_size for s in schemes), symmetric=False)
    assert rows.n_rows == sum(2 if s.bits == 8 else 1 for s in schemes)
    for side in ("w13", "w2"):
        assert tuple(t[(side, "weight_packed")].shape[1:]) == stacked_shapes(scheme, 1, 256, 128)[(side, "weight_packed")][1:]
        w = _stack_dense((scheme, t), side)
        for e, s in enumerate(schemes):
            got = w[rows.first[e]]
            if s.bits == 8:
                got = got + w[rows.second[e]]
            else:
                assert int(rows.second[e]) == rows.n_rows
            assert torch.equal(got, dense[side][e]), (side, e, s)


def test_the_stack_reads_as_compressed_tensors_asymmetric_int4():
    """Each row, in checkpoint layout, through compressed-tensors' own unpacking and dequantizer."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    assert ct
    groups = expert_groups([W8, Scheme(4, 64), Scheme(4, 64)])
    tensors, dense = _tensors(groups, 128, 128, torch.Generator().manual_seed(3))
    scheme, t, rows = nibbles.nibble_stack(groups, tensors, 3)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=scheme.group_size)
    for e in range(3):
        got = 0
        for r in {int(rows.first[e]), int(rows.second[e])} - {rows.n_rows}:
            packed = t[("w2", "weight_packed")][r].t().contiguous()  # checkpoint layout [out, in / 8]
            zp = t[("w2", "weight_zero_point")][r].t().contiguous()  # [out / 8, in / g]
            out_f, in_f = packed.shape[0], packed.shape[1] * 8
            q = unpack_from_int32(packed, 4, torch.Size([out_f, in_f]))
            z = unpack_from_int32(zp, 4, torch.Size([out_f, in_f // scheme.group_size]), packed_dim=0)
            scale = t[("w2", "weight_scale")][r].t().float()
            got = got + dequantize(q.float(), scale, z, args=args, dtype=torch.float32)
        assert torch.equal(got, dense["w2"][e]), e


class _Dense:
    def __init__(self, w13, w2):
        self.w13, self.w2 = w13, w2


@pytest.fixture
def garbage_buffers(monkeypatch):
    """New float buffers hold NaN, as a GPU's reused memory holds whatever was there: rows no GEMM writes show."""
    empty = torch.empty

    def nan_empty(*size, dtype=None, **kw):
        t = empty(*size, dtype=dtype, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("T,k", [(1, 2), (5, 4), (70, 3)])
@pytest.mark.parametrize("on_input", [False, True])
def test_the_forward_is_the_grouped_forward(T, k, on_input, garbage_buffers):
    schemes = SCHEMES["w8g128-w4g32"]
    E, H, N = len(schemes), 128, 128
    gen = torch.Generator().manual_seed(T * 7 + k)
    groups = expert_groups(schemes)
    tensors, dense = _tensors(groups, H, N, gen)
    scheme, t, rows = nibbles.nibble_stack(groups, tensors, E)
    stack = _Dense(_stack_dense((scheme, t), "w13"), _stack_dense((scheme, t), "w2"))
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, k, generator=gen).softmax(dim=1)
    out = nibbles.nibble_moe(x, wts, ids, rows, stack, REF, intermediate=N, weight_on_input=on_input)
    w13, w2 = dense["w13"], dense["w2"]
    if on_input:  # the router weight scales the first GEMM's input
        want = torch.zeros_like(x)
        for ti in range(T):
            for s in range(k):
                e = int(ids[ti, s])
                h = w13[e] @ (x[ti] * wts[ti, s])
                want[ti] += w2[e] @ (torch.nn.functional.silu(h[:N]) * h[N:])
    else:
        want = grouped_moe_reference(x, w13, w2, groups, wts, ids.long())
    err = float((out - want).abs().max() / want.abs().max())  # fp32 sums in another order: hi and lo apart
    assert err < 1e-5, err


def test_refusals():
    assert nibbles.servable([W8, W4, Scheme(4, 32, False)]) is None
    assert "w8g128a" in nibbles.servable([Scheme(8, 128, False), W4])
    assert "w3g128" in nibbles.servable([Scheme(3, 128), W4])
