"""AWQ's trial deltas as one Triton kernel. Pure tensor functions; imported lazily by ``quant.algos.awq``.

Each α of AWQ's search needs ``Δ = Q(W · s) / s − W`` for every expert, then ``‖x Δᵀ‖²``. As torch ops the delta
is some twenty passes over ``[B, O, I]`` fp32 tensors (scale, group min/max, divide, round, clamp, cast to codes,
dequantize, divide, subtract, split into bf16 halves): about 190 bytes of memory traffic per weight and α, most of
AWQ's time on a GPU once its products run on the tensor cores. One program here reads a ``[BO, group]`` tile of
``W`` once and writes ``Δ``'s bf16 halves, laid out as ``[Δ_hi | Δ_lo | Δ_hi]`` along the input dimension, so a
single bf16 product with ``[Xᵀ_hi; Xᵀ_hi; Xᵀ_lo]`` gives ``Δ Xᵀ`` to ~1e-5 relative (the ``lo · lo`` term is
dropped) with fp32 accumulation: 8 bytes per weight and α.

Every rounding step follows ``quant.algos.grid`` (min/max grid, scales rounded to the scale dtype before the
codes are chosen, round half to even, ``(q − zero) · scale`` rounded to the scale dtype), with the bit arithmetic
it shares with ``gptq_triton`` (``triton_rounding``); on a CPU (tests) the kernel runs in Triton's interpreter and
its deltas equal the torch ones bit for bit. On a GPU a division by a constant may be compiled differently by torch and Triton, so a
grid can differ by one rounding now and then: the deltas only rank the α grid, the shipped codes come from
``grid.quantize_weight`` at the chosen α.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.algos.triton_rounding import MANTISSA_DROP, interpreted, rint, round_bits
from quant.scheme import Scheme

TILE = 4096  # weights one program handles: BO rows x one group


@triton.jit
def _delta_kernel(w_ptr, s_ptr, a_ptr, n_out, n_in, sw_b, sw_o, ss_b, sa_b, sa_o,
                  QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr,
                  DROP: tl.constexpr, TINY: tl.constexpr, LIBDEVICE: tl.constexpr, BO: tl.constexpr):
    """Rows ``BO`` of one batch element, one group of ``GS`` input columns (``GP``: the next power of two):
    ``Δ = Q(W · s) / s − W`` of ``w [B, O, I]`` with ``s [B or 1, I]`` (``ss_b`` = 0 when shared), written to
    ``a [B, O, 3I]`` (bf16) as ``Δ_hi`` at column ``i``, ``Δ_lo`` at ``I + i`` and ``Δ_hi`` again at ``2I + i``."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BO + tl.arange(0, BO)
    k = tl.arange(0, GP)
    cols = tl.program_id(2) * GS + k
    inside = (rows < n_out)[:, None] & (k < GS)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    w = tl.load(w_ptr + b * sw_b + r64 * sw_o + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + b * ss_b + cols, mask=k < GS, other=1.0)
    s2 = tl.broadcast_to(s[None, :], (BO, GP))
    ws = w * s2  # padding is 0: it moves neither the max |w| nor min(w, 0) / max(w, 0)
    if SYM:
        sc = tl.math.div_rn(tl.max(tl.abs(ws), axis=1), (QMAX - QMIN) / 2)
    else:
        lo = tl.minimum(tl.min(ws, axis=1), 0.0)
        sc = tl.math.div_rn(tl.maximum(tl.max(ws, axis=1), 0.0) - lo, (QMAX - QMIN) * 1.0)
    sc = tl.maximum(round_bits(tl.maximum(sc, 1e-10), DROP), TINY)
    if SYM:
        z = tl.zeros_like(sc)
    else:
        z = tl.minimum(tl.maximum(rint(QMIN - tl.math.div_rn(lo, sc), LIBDEVICE), QMIN), QMAX)
    sc2 = tl.broadcast_to(sc[:, None], (BO, GP))
    z2 = tl.broadcast_to(z[:, None], (BO, GP))
    q = rint(tl.math.div_rn(ws, sc2) + z2, LIBDEVICE)
    q = tl.minimum(tl.maximum(q, QMIN), QMAX)
    deq = round_bits((q - z2) * sc2, DROP)  # the product is exact in fp32
    d = tl.math.div_rn(deq, s2) - w
    hi = round_bits(d, 16)
    lo_part = round_bits(d - hi, 16)  # d - hi is exact in fp32
    out = a_ptr + b * sa_b + r64 * sa_o + cols[None, :]
    tl.store(out, hi.to(tl.bfloat16), mask=inside)
    tl.store(out + n_in, lo_part.to(tl.bfloat16), mask=inside)
    tl.store(out + 2 * n_in, hi.to(tl.bfloat16), mask=inside)


def trial_deltas(w: torch.Tensor, s: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """``w [B, O, I]`` (any float dtype), ``s [B or 1, I]`` -> ``[B, O, 3I]`` bf16: ``[Δ_hi | Δ_lo | Δ_hi]`` of
    ``Δ = Q(W · s) / s − W`` (``Q``: ``grid.quantize_weight`` then ``dequantize``)."""
    B, n_out, n_in = w.shape
    gs = spec.group_size
    assert n_in % gs == 0 and s.shape[-1] == n_in and s.shape[0] in (1, B), (tuple(w.shape), tuple(s.shape), gs)
    interpret = interpreted()
    assert w.is_cuda or interpret, "the fused AWQ kernel runs on a GPU, or on a CPU under TRITON_INTERPRET=1"
    w = w.contiguous()
    s = s.float().contiguous()
    a = torch.empty(B, n_out, 3 * n_in, dtype=torch.bfloat16, device=w.device)
    gp = triton.next_power_of_2(gs)
    bo = max(1, min(64, TILE // gp, triton.next_power_of_2(n_out)))
    grid = (B, triton.cdiv(n_out, bo), n_in // gs)
    _delta_kernel[grid](
        w, s, a, n_out, n_in, w.stride(0), w.stride(1), 0 if s.shape[0] == 1 else s.stride(0), a.stride(0),
        a.stride(1), QMIN=spec.qmin, QMAX=spec.qmax, SYM=spec.symmetric, GS=gs, GP=gp,
        DROP=MANTISSA_DROP[scale_dtype], TINY=float(torch.finfo(scale_dtype).tiny), LIBDEVICE=not interpret, BO=bo,
        num_warps=4,
    )
    return a
