"""quant.algos.grid: round trips, ranges, dtypes, and bit-exact agreement with compressed-tensors."""

from __future__ import annotations

import pytest
import torch

from quant.algos.grid import dequantize, effective_group_size, fit_grid, quantize, quantize_weight
from quant.scheme import Scheme

B, N_OUT, N_IN = 3, 16, 256


def weights(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Heavy-tailed weights with one all-zero group and one all-positive row, to exercise the edges."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(B, N_OUT, N_IN, generator=g) * torch.rand(B, N_OUT, 1, generator=g) * 0.1
    w[0, 0, :64] = 0.0
    w[1, 2] = w[1, 2].abs()
    w[2, 3, 5] = 1.5  # an outlier
    return w.to(dtype)


def specs() -> list[Scheme]:
    return [Scheme(bits, gs, sym) for bits in (2, 3, 4, 8) for gs in (32, 128, N_IN) for sym in (True, False)]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", specs(), ids=str)
def test_round_trip_error_is_at_most_half_a_step(spec: Scheme, scale_dtype: torch.dtype) -> None:
    w = weights()
    qw = quantize_weight(w, spec, scale_dtype)
    G = N_IN // spec.group_size
    assert qw.scale.dtype == scale_dtype and qw.scale.shape == (B, N_OUT, G) and (qw.scale > 0).all()
    assert qw.q.dtype == torch.int8 and int(qw.q.min()) >= spec.qmin and int(qw.q.max()) <= spec.qmax
    if spec.symmetric:
        assert qw.zero is None
    else:
        assert qw.zero.dtype == torch.int8 and qw.zero.shape == (B, N_OUT, G)
        assert int(qw.zero.min()) >= spec.qmin and int(qw.zero.max()) <= spec.qmax
    w_hat = qw.dequantize()
    assert w_hat.dtype == scale_dtype and w_hat.shape == w.shape
    step = qw.scale.float().repeat_interleave(spec.group_size, dim=-1)
    zero = 0.0 if qw.zero is None else qw.zero.float().repeat_interleave(spec.group_size, dim=-1)
    x = w / step + zero  # inside the range: rounds to a code without clamping
    inside = (x >= spec.qmin - 0.5) & (x <= spec.qmax + 0.5)
    assert inside.float().mean() > 0.99
    # the product (q - z) * s is rounded once more to the scale dtype, and the difference is taken in fp32
    rounding = w_hat.float().abs() * (torch.finfo(scale_dtype).eps / 2) + w.abs() * 2 * torch.finfo().eps
    err = (w - w_hat.float()).abs()
    assert (err[inside] <= step[inside] / 2 + rounding[inside]).all()
    assert (w_hat[0, 0, :64] == 0).all()  # zero is exactly representable, also asymmetric


@pytest.mark.parametrize("symmetric", [True, False])
def test_fp16_scales_never_underflow_to_zero(symmetric: bool) -> None:
    w = torch.zeros(1, 2, 32)
    w[0, 1] = torch.linspace(-1e-6, 1e-6, 32)
    scale, _ = fit_grid(w, Scheme(8, 32, symmetric), torch.float16)
    assert (scale > 0).all()


def test_codes_are_optimal_for_the_shipped_scale() -> None:
    """Scales are rounded to bf16 before codes are chosen: requantizing the dequantized weight is a fixpoint."""
    spec = Scheme(4, 32, symmetric=False)
    qw = quantize_weight(weights(1), spec, torch.bfloat16)
    assert torch.equal(quantize(qw.dequantize().float(), qw.scale, qw.zero, spec), qw.q)


def test_per_channel_group() -> None:
    spec = Scheme(4, effective_group_size(-1, N_IN), symmetric=True)
    assert spec.group_size == N_IN and effective_group_size(4096, N_IN) == N_IN
    qw = quantize_weight(weights(), spec, torch.bfloat16)
    assert qw.scale.shape == (B, N_OUT, 1)
    torch.testing.assert_close(qw.scale.float()[..., 0], weights().abs().amax(-1).clamp_min(1e-10) / 7.5,
                               rtol=2**-8, atol=0)


def test_input_dtype_does_not_matter_beyond_its_values() -> None:
    w = weights(2, torch.bfloat16)
    a = quantize_weight(w, Scheme(4, 64), torch.bfloat16)
    b = quantize_weight(w.float(), Scheme(4, 64), torch.bfloat16)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, N_IN])
def test_matches_compressed_tensors_bit_for_bit(symmetric: bool, group_size: int, scale_dtype: torch.dtype):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward as ct

    spec = Scheme(4, group_size, symmetric)
    w = weights(3)
    scale, zero = fit_grid(w, spec, scale_dtype)
    q = quantize(w, scale, zero, spec)
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=group_size)
    theirs = ct.dequantize(q, scale, zero, args)
    ours = dequantize(q, scale, zero, group_size)
    assert theirs.dtype == ours.dtype == scale_dtype and torch.equal(theirs, ours)
    # and their quantizer picks our codes on our grid
    ct_codes = ct.quantize(w, scale, zero, args, dtype=torch.int8)
    assert torch.equal(ct_codes, q)
