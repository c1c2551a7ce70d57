"""quant.algos.awq: the smoothing search beats RTN where AWQ should, folds exactly, and is batched."""

from __future__ import annotations

import pytest
import torch

import quant.algos.awq as awq_module
from quant.algos.awq import AWQExtra, AWQResult, awq_search
from quant.algos.grid import quantize_weight
from quant.errors import NumericalError
from quant.scheme import Scheme

B, C, N_OUT, N_IN = 4, 96, 48, 256
SPEC = Scheme(4, 64, symmetric=True)


def outlier_activations(B: int = B, C: int = C, n_in: int = N_IN, seed: int = 0) -> torch.Tensor:
    """``[B, C, I]`` activations where 6 channels (a different set per element) are 20-50x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, n_in, generator=g)
    for b in range(B):  # test data only
        channels = torch.randperm(n_in, generator=g)[:6]
        x[b, :, channels] *= 20 + 30 * torch.rand(6, generator=g)
    return x


def weights(B: int = B, n_out: int = N_OUT, n_in: int = N_IN, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, n_out, n_in, generator=torch.Generator().manual_seed(seed)) * 0.05


def output_error(w, x, mask, w_hat, s) -> torch.Tensor:
    """Σ over real rows of ||x Wᵀ − (x / s) Ŵᵀ||², per element."""
    y = torch.bmm(x, w.transpose(1, 2))
    y_hat = torch.bmm(x / s.expand(w.shape[0], -1)[:, None, :], w_hat.float().transpose(1, 2))
    return (((y - y_hat) ** 2).sum(-1) * mask).sum(-1)


def full_mask(B: int = B, C: int = C) -> torch.Tensor:
    return torch.ones(B, C, dtype=torch.bool)


@pytest.mark.parametrize("symmetric", [True, False])
def test_beats_rtn_per_expert_on_outlier_channels(symmetric: bool) -> None:
    spec = Scheme(4, 64, symmetric)
    w, x, mask = weights(), outlier_activations(), full_mask()
    result = awq_search(w, x, mask, spec, torch.bfloat16)
    assert isinstance(result, AWQResult) and result.scales.shape == (B, N_IN)
    rtn = output_error(w, x, mask, quantize_weight(w, spec, torch.bfloat16).dequantize(), torch.ones(N_IN))
    torch.testing.assert_close(result.rtn_error, rtn)
    assert (result.error <= result.rtn_error).all()
    assert (result.error < 0.9 * result.rtn_error).all(), result.error / result.rtn_error
    assert (result.alpha > 0).all(), result.alpha


def test_shared_scale_beats_rtn_in_total() -> None:
    w, x, mask = weights(), outlier_activations(), full_mask()
    x[:, :, :3] *= 30  # the shared norm output has outliers every expert sees
    result = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=True)
    assert result.scales.shape == (N_IN,) and result.alpha.shape == (B,)
    assert (result.alpha == result.alpha[0]).all() and result.alpha[0] > 0
    assert result.error.sum() < 0.9 * result.rtn_error.sum()
    per_expert = awq_search(w, x, mask, SPEC, torch.bfloat16)
    assert per_expert.error.sum() <= result.error.sum()  # sharing can only cost


@pytest.mark.parametrize("shared", [False, True])
def test_batch_chunks_do_not_change_the_search(shared: bool) -> None:
    """The trial errors computed a few experts at a time (bounded memory) give the very same result."""
    w, x, mask = weights(), outlier_activations(), full_mask()
    whole = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=shared)
    for chunk in (1, 2, B + 1):
        part = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=shared, batch_chunk=chunk)
        assert torch.equal(part.scales, whole.scales) and torch.equal(part.weight.q, whole.weight.q)
        assert torch.equal(part.alpha, whole.alpha) and torch.allclose(part.error, whole.error)


def test_shared_search_from_tables_of_expert_chunks_equals_the_whole_search() -> None:
    """A shared search whose experts arrive in chunks (their Hessians do not fit at once): each chunk's trial
    errors, joined in expert order, then one pick, give the same s, errors and codes as awq_search over all."""
    from quant.algos.awq import pick_scales, quantize_scaled, smoothing_grid, trial_errors

    w, x, mask = weights(), outlier_activations(), full_mask()
    x[:, :, :3] *= 30
    means = ((x.abs() * mask[..., None]).sum((0, 1)) / mask.sum())[None]
    whole = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=True, channel_means=means)
    s_grid = smoothing_grid(means, 20)[1]
    tables = [trial_errors(AWQExtra(w[c], x[c], mask[c], SPEC), s_grid, torch.bfloat16, shared=True)
              for c in (slice(0, 1), slice(1, 3), slice(3, B))]
    s, best, picked = pick_scales([torch.cat(tables, dim=1)], s_grid, shared=True)
    assert best.shape == (1,) and torch.equal(s[0], whole.scales) and torch.equal(picked[0], whole.error)
    assert torch.equal(quantize_scaled(w, s, SPEC, torch.bfloat16).q, whole.weight.q)


def test_alpha_zero_without_outliers_is_rtn() -> None:
    """With the grid reduced to α = 0 the result is exactly round-to-nearest."""
    w, x, mask = weights(), outlier_activations(), full_mask()
    result = awq_search(w, x, mask, SPEC, torch.bfloat16, n_grid=1)
    rtn = quantize_weight(w, SPEC, torch.bfloat16)
    assert torch.equal(result.scales, torch.ones(B, N_IN)) and torch.equal(result.weight.q, rtn.q)
    assert torch.equal(result.error, result.rtn_error) and (result.alpha == 0).all()


@pytest.mark.parametrize("shared", [False, True])
def test_folding_reproduces_the_loss(shared: bool) -> None:
    """The caller runs (x / s) through Q(W · s): that product is exactly what the search scored."""
    w, x, mask = weights(), outlier_activations(), full_mask()
    result = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=shared)
    s = result.scales if not shared else result.scales.expand(B, N_IN)
    assert torch.equal(result.weight.q, quantize_weight(w * s[:, None, :], SPEC, torch.bfloat16).q)
    folded = torch.bmm(x / s[:, None, :], result.weight.dequantize().float().transpose(1, 2))
    assert torch.equal((((folded - torch.bmm(x, w.transpose(1, 2))) ** 2).sum(-1) * mask).sum(-1), result.error)
    # and in exact arithmetic the folding is the identity on the unquantized weights
    torch.testing.assert_close(torch.bmm(x / s[:, None, :], (w * s[:, None, :]).transpose(1, 2)),
                               torch.bmm(x, w.transpose(1, 2)), rtol=1e-5, atol=1e-5)


def test_padding_rows_are_ignored_and_empty_experts_stay_rtn() -> None:
    w, x = weights(), outlier_activations()
    mask = full_mask()
    mask[1, 40:] = False
    mask[3] = False  # an expert no calibration token reached
    junk = x.clone()
    junk[~mask] = 1e3 * torch.randn(int((~mask).sum()), N_IN)
    clean = x * mask[..., None]
    a = awq_search(w, junk, mask, SPEC, torch.bfloat16)
    b = awq_search(w, clean, mask, SPEC, torch.bfloat16)
    assert torch.equal(a.scales, b.scales) and torch.equal(a.weight.q, b.weight.q)
    torch.testing.assert_close(a.error, b.error)
    assert a.alpha[3] == 0 and torch.equal(a.scales[3], torch.ones(N_IN)) and a.error[3] == 0


def test_extra_weights_share_the_scale() -> None:
    """Shared-expert gate/up fed by the same norm: all tokens, 8 bits, quantized with the same s."""
    w, x, mask = weights(), outlier_activations(), full_mask()
    x[:, :, :3] *= 30
    shared_w = weights(1, 64, N_IN, seed=9)
    extra = AWQExtra(shared_w, x.reshape(1, B * C, N_IN), mask.reshape(1, B * C), Scheme(8, 64, False))
    result = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=True, extra=extra)
    s = result.scales
    assert torch.equal(result.extra_weight.q, quantize_weight(shared_w * s, extra.spec, torch.bfloat16).q)
    assert result.extra_weight.zero is not None and result.extra_error.shape == (1,)
    total, total_rtn = result.error.sum() + result.extra_error, result.rtn_error.sum() + result.extra_rtn_error
    assert total <= total_rtn


def test_extra_batch_must_match_unless_shared() -> None:
    extra = AWQExtra(weights(1), outlier_activations(1), full_mask(1), SPEC)
    with pytest.raises(AssertionError, match="only a shared search"):
        awq_search(weights(), outlier_activations(), full_mask(), SPEC, torch.bfloat16, extra=extra)


def test_nan_activations_raise() -> None:
    x = outlier_activations()
    x[2, 5, 7] = float("nan")
    with pytest.raises(NumericalError, match=r"batch index \[2\]"):
        awq_search(weights(), x, full_mask(), SPEC, torch.bfloat16)


def test_no_python_loop_over_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantizer calls grow with the α grid, not with B: n_grid searches plus one final quantization."""
    calls = {"n": 0}

    def counting(*args, **kwargs):
        calls["n"] += 1
        return quantize_weight(*args, **kwargs)

    monkeypatch.setattr(awq_module, "quantize_weight", counting)
    counts = []
    for n in (1, 6):
        calls["n"] = 0
        awq_search(weights(n), outlier_activations(n), full_mask(n), SPEC, torch.bfloat16, n_grid=7)
        counts.append(calls["n"])
    assert counts == [8, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_chunked_search_equals_whole_and_the_cpu(shared: bool) -> None:
    """On the GPU: the trial errors a few experts at a time give the same search as all at once, and the same
    scales as on the CPU up to fp32 reassociation in cuBLAS (the chosen alpha and codes agree)."""
    w, x, mask = weights(), outlier_activations(), full_mask()
    cpu = awq_search(w, x, mask, SPEC, torch.bfloat16, share_across_batch=shared)
    wg, xg, mg = w.cuda(), x.cuda(), mask.cuda()
    whole = awq_search(wg, xg, mg, SPEC, torch.bfloat16, share_across_batch=shared)
    for chunk in (1, 3):
        part = awq_search(wg, xg, mg, SPEC, torch.bfloat16, share_across_batch=shared, batch_chunk=chunk)
        assert torch.equal(part.scales, whole.scales) and torch.equal(part.weight.q, whole.weight.q)
    assert torch.equal(whole.alpha.cpu(), cpu.alpha)
    torch.testing.assert_close(whole.scales.cpu(), cpu.scales, rtol=1e-5, atol=0)
    assert (whole.weight.q.cpu() != cpu.weight.q).float().mean() < 1e-3
    torch.testing.assert_close(whole.error.cpu(), cpu.error, rtol=1e-3, atol=0)


def test_split_products_match_fp64_to_1e5():
    """One bf16 product of the split operands (``[a_hi | a_lo | a_hi] @ [b_hi; b_hi; b_lo]``, what the GPU runs on
    its tensor cores) agrees with the fp64 product to ~1e-5 relative; a single bf16 product is off by ~1e-3."""
    from quant.algos.awq import _split, split_cat, split_product, split_rows

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 64, 256, generator=g), torch.randn(3, 256, 48, generator=g)
    exact = torch.bmm(a.double(), b.double())
    rows = split_rows(b.transpose(1, 2), torch.ones(3, 48, dtype=torch.bool))  # b as rows [B, C, I]
    hi, lo = _split(b)
    assert torch.equal(rows, torch.cat([hi, hi, lo], dim=1))
    mask = torch.rand(3, 48, generator=g) < 0.5
    assert torch.equal(split_rows(b.transpose(1, 2), mask), rows * mask[:, None, :])  # padding rows: zeros
    rel = ((split_product(split_cat(a), rows).double() - exact).norm() / exact.norm()).item()
    single = ((torch.bmm(a.bfloat16().float(), b.bfloat16().float()).double() - exact).norm() / exact.norm()).item()
    assert rel < 3e-5 and single > 1e-3, (rel, single)


def _device() -> torch.device:
    """Where the fused kernel runs: the GPU, or Triton's interpreter on CPU-only machines (conftest)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("spec", [Scheme(4, 64, True), Scheme(4, 32, False), Scheme(8, 64, False),
                                  Scheme(4, 48, False)], ids=["w4-sym-g64", "w4-asym-g32", "w8-asym", "g48"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_trial_deltas_equal_the_torch_quantizer(shared: bool, spec: Scheme, scale_dtype) -> None:
    """The kernel's ``[Δ_hi | Δ_lo | Δ_hi]`` with ``Δ = Q(W·s)/s − W`` equals the same thing from
    ``grid.quantize_weight`` (the shipped quantizer) and torch casts: bit for bit in the interpreter. On a GPU,
    where torch divides by a Python constant through its reciprocal (scale = max / 7.5), an fp32 scale can differ
    in its last bit: there every ``Δ`` agrees to 1e-5 of the weights' range but for a code or two at a rounding
    boundary. Rows that are not a multiple of the program's tile, a group that is not a power of two (48), an
    all-zero group and bf16 weights are included."""
    from quant.algos.awq import quantize_scaled, smoothing_grid, split_cat
    from quant.algos.awq_triton import trial_deltas

    dev = _device()
    w = (weights(3, n_out=70, n_in=192) * 3).bfloat16()
    w[1, 5, :48] = 0  # an all-zero group: the scale's floor
    x = outlier_activations(3, n_in=192)
    means = x.abs().mean(dim=1)
    s = smoothing_grid(means.mean(0, keepdim=True) if shared else means, 5)[1][3]  # α = 0.75
    ref = split_cat(quantize_scaled(w, s, spec, scale_dtype).dequantize().float() / s[:, None, :] - w.float())
    got = trial_deltas(w.to(dev), s.to(dev), spec, scale_dtype).cpu()
    assert got.shape == (3, 70, 3 * 192) and got.dtype == torch.bfloat16
    n = 192
    assert torch.equal(got[..., 2 * n :], got[..., :n])
    if dev.type == "cpu":
        assert torch.equal(got, ref)
        return
    delta = [t[..., :n].float() + t[..., n : 2 * n].float() for t in (got, ref)]
    off = (delta[0] - delta[1]).abs() > 1e-5 * w.float().abs().max()
    assert off.sum() <= 2, off.sum()


@pytest.mark.parametrize("shared", [False, True])
def test_split_trial_errors_pick_what_fp32_picks(shared: bool):
    """The GPU's trial errors (fused deltas and one split product, ``‖Δ xᵀ‖²``) equal the fp32 ones to 1e-4
    relative on Hessian rows (``x = Lᵀ``, as quantize passes them), on activations and on activations with padding
    rows, and the search picks the same α."""
    from quant.algos.awq import smoothing_grid, trial_errors
    from quant.quantize.awq_layer import rows_from_hessian

    w, x = weights(), outlier_activations()
    rows = rows_from_hessian(x.transpose(1, 2) @ x)
    padded = torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(3)) < 0.7
    for xs, mask in ((x, full_mask()), (rows, torch.ones(rows.shape[:2], dtype=torch.bool)), (x * 7, padded)):
        part = AWQExtra(w, xs, mask, SPEC)
        on = AWQExtra(*(t.to(_device()) for t in (w, xs, part.mask)), SPEC)  # the kernel's device
        means = x.abs().mean(dim=1)
        means = means.mean(0, keepdim=True) if shared else means
        _, grid = smoothing_grid(means, 20)
        fp32 = trial_errors(part, grid, torch.bfloat16, shared, split=False)
        fast = trial_errors(on, grid.to(_device()), torch.bfloat16, shared, split=True).cpu()
        torch.testing.assert_close(fast, fp32, rtol=1e-4, atol=0)
        pick = (lambda e: e.sum(1).argmin()) if shared else (lambda e: e.argmin(0))
        assert torch.equal(pick(fast), pick(fp32))
