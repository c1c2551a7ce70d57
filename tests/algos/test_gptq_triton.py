"""The fused Triton column loop (quant.algos.gptq_triton) and the GEMM-based inverse Cholesky factor
(quant.algos.cholesky), against the torch loop, the per-matrix reference and fp64.

On a CPU the kernel runs in Triton's interpreter (numpy, no fused multiply-add): there it must reproduce the torch
loop bit for bit. The GPU tier (the ``gpu``-marked tests below) runs the compiled kernel against the same references."""

from __future__ import annotations

import pytest
import torch

from quant.algos import grid
from quant.algos.cholesky import lower_inverse_factor, upper_inverse_factor
from quant.algos.gptq import gptq
from quant.scheme import Scheme

from .test_gptq import N_IN, N_OUT, correlated_hessians, random_weights, reference_gptq, row_errors


def _interpreter() -> None:
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton's interpreter is off (conftest turns it on where there is no GPU); the gpu-marked "
                    "tests of this file run the compiled kernel")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n_threads)


@pytest.mark.parametrize("n,base", [(40, 8), (97, 16), (192, 512)])
def test_lower_inverse_factor_equals_fp64(n: int, base: int) -> None:
    """The recursion on halves (odd sizes, several levels) gives L⁻¹ of A = L Lᵀ to fp32 accuracy."""
    A = correlated_hessians(3, n, seed=n)
    A += 0.01 * torch.diagonal(A, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    M, info = lower_inverse_factor(A, base=base)
    ref = torch.linalg.inv(torch.linalg.cholesky(A.double()))
    assert (info == 0).all()
    assert torch.equal(M.triu(1), torch.zeros_like(M))  # exactly lower triangular
    assert ((M.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_upper_inverse_factor_is_gptqs_u_and_flags_failures() -> None:
    """U from the reversed Hessian is the upper Cholesky factor of H⁻¹ (GPTQ's U); an indefinite element fails
    alone and the others are unaffected."""
    n = 96
    H = correlated_hessians(3, n, seed=5)
    H += 0.01 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    H[1] = -H[1]
    U, ok = upper_inverse_factor(H.flip(-2, -1), base=16)
    assert ok.tolist() == [True, False, True]
    for b in (0, 2):
        ref = torch.linalg.cholesky(torch.linalg.inv(H[b].double()), upper=True)
        assert ((U[b].double() - ref).norm() / ref.norm()).item() < 1e-5
    alone, _ = upper_inverse_factor(H[[0]].flip(-2, -1), base=16)
    assert torch.equal(alone[0], U[0])


CASES = [(4, 32, True, "act_order", torch.bfloat16), (8, 64, False, "act_order", torch.float16),
         (4, 32, False, "dynamic", torch.bfloat16), (8, 64, True, "dynamic", torch.float16),
         (4, -1, True, "dynamic", torch.bfloat16), (4, 64, False, "static", torch.bfloat16)]


@pytest.mark.parametrize("bits,group_size,symmetric,grids,scale_dtype", CASES)
def test_triton_loop_in_interpreter_equals_torch_loop(bits, group_size, symmetric, grids, scale_dtype) -> None:
    """Interpreted, the fused kernel reproduces the torch loop exactly: codes, grids, loss. Covers grids fitted
    in the kernel at group starts, a group wider than the block (fitted between launches), static grids in
    act-order (per-element column order) and both scale dtypes' rounding."""
    _interpreter()
    B = 2
    spec = Scheme(bits, grid.effective_group_size(group_size, N_IN), symmetric)
    w, H = random_weights(B, seed=11).to(scale_dtype), correlated_hessians(B, N_IN, seed=12)
    options = {"act_order": grids == "act_order", "static_groups": grids == "static", "block_size": 48}
    ours = gptq(w, H, spec, scale_dtype, kernel="triton", **options)
    torch_loop = gptq(w, H, spec, scale_dtype, kernel="torch", **options)
    assert torch.equal(ours.weight.q, torch_loop.weight.q)
    assert torch.equal(ours.weight.scale, torch_loop.weight.scale) and ours.weight.scale.dtype == scale_dtype
    assert (ours.weight.zero is None) == symmetric
    if not symmetric:
        assert torch.equal(ours.weight.zero, torch_loop.weight.zero)
    assert torch.equal(ours.loss, torch_loop.loss)


def test_triton_loop_matches_reference_with_dead_inputs_and_unseen_expert() -> None:
    """Repairs happen before the kernel: a dead input column is zero, an expert without tokens is RTN."""
    _interpreter()
    spec = Scheme(4, 64, symmetric=True)
    w, H = random_weights(3, seed=13), correlated_hessians(3, N_IN, seed=14)
    H[0, 7, :] = H[0, :, 7] = 0.0
    H[2] = 0.0
    res = gptq(w, H, spec, torch.bfloat16, kernel="triton", act_order=True)
    assert set(dict(res.repairs)) == {0, 2} and (res.weight.q[0, :, 7] == 0).all()
    assert torch.equal(res.weight.q[2], grid.quantize_weight(w[2:], spec, torch.bfloat16).q[0])
    ref = reference_gptq(w[1], H[1], spec, torch.bfloat16, act_order=True)
    rows = (res.weight.q[1] != ref.q[0]).any(dim=-1)
    assert rows.sum() <= N_OUT // 16
    ours, theirs = (row_errors(w[1], q.dequantize()[i], H[1]) for q, i in ((res.weight, 1), (ref, 0)))
    torch.testing.assert_close(ours[~rows], theirs[~rows], rtol=1e-4, atol=0)


GPU_CASES = [(4, 128, True, "act_order", torch.bfloat16), (8, 64, False, "dynamic", torch.bfloat16),
             (4, -1, True, "dynamic", torch.float16), (4, 128, False, "static", torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size,symmetric,grids,scale_dtype", GPU_CASES)
def test_gpu_solves_match_the_reference(bits, group_size, symmetric, grids, scale_dtype) -> None:
    """On the GPU, the compiled fused loop and the CUDA-graph torch loop against the per-matrix fp32 reference
    (Algorithm 1 of the paper, on the CPU): the Hessian-weighted error of every element within 0.1%, and nearly all
    codes equal (a row leaves the reference's path only at an fp32 rounding tie: the GPU contracts the rank-1
    update to a fused multiply-add, and cuBLAS/cuSOLVER reassociate the lazy updates and the factorization)."""
    pytest.importorskip("triton")
    B, n_out, n_in = 3, 256, 512
    spec = Scheme(bits, grid.effective_group_size(group_size, n_in), symmetric)
    w = random_weights(B, n_out, n_in, seed=21).to(scale_dtype)
    H = correlated_hessians(B, n_in, n_tokens=2048, seed=22)
    options = {"act_order": grids == "act_order", "static_groups": grids == "static"}
    refs = [reference_gptq(w[b], H[b], spec, scale_dtype, **options) for b in range(B)]
    ref_loss = torch.stack([row_errors(w[b], r.dequantize()[0], H[b]).sum() for b, r in enumerate(refs)])
    ref_q = torch.cat([r.q for r in refs])
    for kernel in ("triton", "torch"):
        res = gptq(w.cuda(), H.cuda(), spec, scale_dtype, kernel=kernel, **options)
        q = res.weight.q.cpu()
        loss = torch.stack([row_errors(w[b], res.weight.dequantize()[b].cpu(), H[b]).sum() for b in range(B)])
        assert ((loss - ref_loss).abs() / ref_loss).max() <= 1e-3, (kernel, loss, ref_loss)
        assert (q != ref_q).float().mean() <= 0.02, (kernel, (q != ref_q).float().mean())
        torch.testing.assert_close(res.loss.cpu(), loss, rtol=1e-3, atol=0)
        if grids != "dynamic":
            assert torch.equal(res.weight.scale.cpu(), torch.cat([r.scale for r in refs]))


@pytest.mark.gpu
def test_gpu_inverse_factor_equals_fp64_and_isolates_failures() -> None:
    """The recursion on the GPU (cuBLAS products, cuSOLVER blocks) at a size with three levels."""
    n = 1024
    H = correlated_hessians(3, n, n_tokens=2048, seed=23)
    H += 0.01 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    H[2] = -H[2]
    U, ok = upper_inverse_factor(H.flip(-2, -1).cuda(), base=128)
    assert ok.tolist() == [True, True, False]
    for b in (0, 1):
        ref = torch.linalg.cholesky(torch.linalg.inv(H[b].double()), upper=True)
        assert ((U[b].double().cpu() - ref).norm() / ref.norm()).item() < 1e-4
