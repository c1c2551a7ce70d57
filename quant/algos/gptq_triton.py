"""GPTQ's column loop as one Triton kernel per lazy block. Pure tensor functions; imported lazily by ``gptq``.

Dimensions: ``B`` batch (experts), ``O`` output rows, ``I`` input columns, ``w`` columns of one block (``<= BW``).

GPTQ treats the rows of ``W`` independently given ``U``: a column's rounding error only moves the later columns
of the same row. So one program owns ``BO`` rows of one batch element and runs a whole block's columns with that
``[BW, BO]`` tile in registers: per column it reads the column, quantizes it (grid fitted at a group start, or
read from precomputed grids), writes the codes and the scaled error, and applies the rank-1 update to the tile.
One launch replaces the ~15 small kernels per column of the torch loop, so the solve is bound by arithmetic (the
lazy ``bmm`` updates between blocks and the Cholesky factorization), not by launches.

Every rounding step reproduces ``quant.algos.grid`` exactly: IEEE division (``div_rn``), round half to even, the
dequantized value ``(q - zero) * scale`` rounded to the scale dtype by bit arithmetic (round to nearest even on
the fp32 pattern, which is what a bf16/fp16 cast does for the normal numbers a scale or a dequantized weight can
be). The only difference to the torch loop is that the rank-1 update ``w - u * e`` may be contracted to one
fused multiply-add on the GPU (one rounding instead of two), which moves an fp32 tie at a rounding boundary now
and then: the codes of such a row take another, equally good path (on an H200, DeepSeek-V3 gate/up experts:
99.994% equal codes, Hessian-weighted error equal to 5e-7 relative; BENCHMARKS.md, tests/algos/test_gptq_triton.py).

On a CPU (tests) the same kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported); ``quant.algos.gptq`` uses it there only when asked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.algos.grid import all_finite, fit_grid
from quant.algos.triton_rounding import MANTISSA_DROP, interpreted, rint, round_bits
from quant.scheme import Scheme

BLOCK_COLUMNS = 128  # the widest block one launch handles (the tile's BW)
ROWS_PER_PROGRAM = 32  # BO: tile rows of one program
NUM_WARPS = 2


@triton.jit(do_not_specialize=["i1", "width"])
def _block_kernel(w_ptr, u_ptr, q_ptr, e_ptr, s_ptr, z_ptr, g_ptr, i1, width, n_out,
                  sw_b, sw_i, su_b, su_i, sq_b, sq_i, se_b, se_i, ss_b, ss_g, sg_b,
                  QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, FIT: tl.constexpr, GS: tl.constexpr,
                  DROP: tl.constexpr, TINY: tl.constexpr, LIBDEVICE: tl.constexpr, BW: tl.constexpr,
                  BO: tl.constexpr):
    """Columns ``i1 .. i1 + width - 1`` of ``Wt [B, I, O]`` (fp32, updated in place) for rows ``BO`` of one batch
    element. ``U [B, I, I]``; codes into ``qt [B, I, O]`` (int8); scaled errors into ``err [B, BW, O]``; grids
    ``scale, zero [B, G, O]`` (fp32) are fitted and written at group starts (FIT) or read at group ``gidx [B, I]``.
    Rounding (``triton_rounding``): ``rint`` is libdevice's on the GPU and ``(x + 1.5 * 2^23) - 1.5 * 2^23``
    (half to even for |x| < 2^22) in the interpreter; a value is rounded to the scale dtype on its fp32 bit pattern
    (``DROP`` mantissa bits, half to even; DROP = 0 for fp32 scales)."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BO + tl.arange(0, BO)
    cols = tl.arange(0, BW)
    rmask = rows < n_out
    cmask = cols < width
    w_tile = w_ptr + b * sw_b + (i1 + cols)[:, None] * sw_i + rows[None, :]
    w = tl.load(w_tile, mask=cmask[:, None] & rmask[None, :], other=0.0)
    u_row = u_ptr + b * su_b + i1 * su_i + i1
    s = tl.full([BO], 1.0, tl.float32)
    z = tl.zeros([BO], tl.float32)
    for j in range(width):
        if FIT:
            if j % GS == 0:  # grid.fit_grid on the tile's columns j .. j + GS - 1, every earlier update applied
                group = (cols[:, None] >= j) & (cols[:, None] < j + GS)
                if SYM:
                    s = tl.math.div_rn(tl.max(tl.where(group, tl.abs(w), 0.0), axis=0), (QMAX - QMIN) / 2)
                else:
                    lo = tl.min(tl.where(group, w, 0.0), axis=0)
                    s = tl.math.div_rn(tl.max(tl.where(group, w, 0.0), axis=0) - lo, (QMAX - QMIN) * 1.0)
                s = tl.maximum(s, 1e-10)
                s = tl.maximum(round_bits(s, DROP), TINY)
                grid_at = b * ss_b + ((i1 + j) // GS) * ss_g + rows
                tl.store(s_ptr + grid_at, s, mask=rmask)
                if not SYM:
                    z = tl.minimum(tl.maximum(rint(QMIN - tl.math.div_rn(lo, s), LIBDEVICE), QMIN), QMAX)
                    tl.store(z_ptr + grid_at, z, mask=rmask)
        else:
            grid_at = b * ss_b + tl.load(g_ptr + b * sg_b + i1 + j).to(tl.int64) * ss_g + rows
            s = tl.load(s_ptr + grid_at, mask=rmask, other=1.0)
            if not SYM:
                z = tl.load(z_ptr + grid_at, mask=rmask, other=0.0)
        wj = tl.sum(tl.where(cols[:, None] == j, w, 0.0), axis=0)
        q = tl.minimum(tl.maximum(rint(tl.math.div_rn(wj, s) + z, LIBDEVICE), QMIN), QMAX)
        deq = round_bits((q - z) * s, DROP)  # the product is exact in fp32 (<= 8 + 11 significant bits)
        e = tl.math.div_rn(wj - deq, tl.load(u_row + j * su_i + j))
        u = tl.load(u_row + j * su_i + cols, mask=cmask & (cols >= j), other=0.0)
        w = w - u[:, None] * e[None, :]
        tl.store(q_ptr + b * sq_b + (i1 + j) * sq_i + rows, q.to(tl.int8), mask=rmask)
        tl.store(e_ptr + b * se_b + j * se_i + rows, e, mask=rmask)
    tl.store(w_tile, w, mask=cmask[:, None] & rmask[None, :])


def column_block(Wt: torch.Tensor, U: torch.Tensor, qt: torch.Tensor, err: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, gidx: torch.Tensor | None, i1: int, i2: int, spec: Scheme,
                 scale_dtype: torch.dtype) -> None:
    """GPTQ columns ``i1 .. i2 - 1`` in place on ``Wt [B, I, O]`` (fp32, contiguous rows), given ``U [B, I, I]``.

    Writes codes ``qt[:, i1:i2]`` (int8 ``[B, I, O]``) and scaled errors ``err[:, :i2 - i1]`` (fp32
    ``[B, >= i2 - i1, O]``). Grids: ``gidx [B, I]`` (int32) names each column's group in ``scale, zero [B, G, O]``
    (fp32; read), or None to fit every ``spec.group_size`` columns from ``i1`` on and write them there.
    """
    B, n_in, n_out = Wt.shape
    width = i2 - i1
    assert 0 < width <= BLOCK_COLUMNS and err.shape[1] >= width and Wt.stride(2) == 1 and U.stride(2) == 1
    assert qt.stride(2) == 1 and err.stride(2) == 1 and scale.stride(2) == 1 and zero.stride() == scale.stride()
    fit = gidx is None
    assert not fit or (i1 % spec.group_size == 0 and (width % spec.group_size == 0 or i2 == n_in))
    if gidx is None:
        gidx = torch.zeros(1, 1, dtype=torch.int32, device=Wt.device)
    interpret = interpreted()
    assert Wt.is_cuda or interpret, "the fused GPTQ kernel runs on a GPU, or on a CPU under TRITON_INTERPRET=1"
    grid = (B, triton.cdiv(n_out, ROWS_PER_PROGRAM))
    _block_kernel[grid](
        Wt, U, qt, err, scale, zero, gidx, i1, width, n_out,
        Wt.stride(0), Wt.stride(1), U.stride(0), U.stride(1), qt.stride(0), qt.stride(1), err.stride(0),
        err.stride(1), scale.stride(0), scale.stride(1), gidx.stride(0),
        QMIN=spec.qmin, QMAX=spec.qmax, SYM=spec.symmetric, FIT=fit, GS=spec.group_size,
        DROP=MANTISSA_DROP[scale_dtype], TINY=float(torch.finfo(scale_dtype).tiny), LIBDEVICE=not interpret,
        BW=BLOCK_COLUMNS, BO=ROWS_PER_PROGRAM, num_warps=NUM_WARPS,
    )


def quantize_columns(W: torch.Tensor, U: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype, block_size: int,
                     grids: tuple[torch.Tensor, torch.Tensor | None] | None, perm: torch.Tensor | None):
    """GPTQ's column loop on ``W [B, O, I]`` (fp32, processing order) with ``U [B, I, I]``; the fused counterpart
    of ``gptq._quantize_columns``. ``grids``: static ``(scale, zero) [B, O, G]`` of the original column order,
    column ``j`` using group ``perm[:, j] // group_size`` (``perm`` None: ``j // group_size``), or None to fit each
    group when it starts. -> codes ``[B, O, I]`` (processing order), ``scale, zero [B, O, G]`` (None unless fitted
    here), ``diverged [B]`` (NaN/Inf in the updated weights; not read here)."""
    from quant.algos.gptq import _blocks

    B, n_out, n_in = W.shape
    gs = spec.group_size
    Wt = W.transpose(1, 2).contiguous()
    qt = torch.empty(B, n_in, n_out, dtype=torch.int8, device=W.device)
    err = torch.empty(B, BLOCK_COLUMNS, n_out, dtype=torch.float32, device=W.device)
    fitted = grids is None
    if fitted:
        scale = torch.empty(B, n_in // gs, n_out, dtype=torch.float32, device=W.device)
        zero = scale if spec.symmetric else torch.empty_like(scale)
    else:
        scale = grids[0].float().transpose(1, 2).contiguous()
        zero = scale if grids[1] is None else grids[1].float().transpose(1, 2).contiguous()
    order = torch.arange(n_in, device=W.device).expand(B, n_in) if perm is None else perm
    gidx = (order // gs).to(torch.int32).contiguous()
    for i1, i2 in _blocks(n_in, gs, min(block_size, BLOCK_COLUMNS)):
        if fitted and gs > i2 - i1 and i1 % gs == 0:  # a group wider than the block: fitted at its start
            s, z = fit_grid(Wt[:, i1 : i1 + gs].transpose(1, 2), spec, scale_dtype)
            scale[:, i1 // gs] = s[..., 0].float()
            if z is not None:
                zero[:, i1 // gs] = z[..., 0].float()
        wide = fitted and gs > i2 - i1
        column_block(Wt, U, qt, err, scale, zero, None if fitted and not wide else gidx, i1, i2, spec, scale_dtype)
        if i2 < n_in:
            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].transpose(1, 2), err[:, : i2 - i1], alpha=-1)
    diverged = ~all_finite(Wt)
    if not fitted:
        return qt.transpose(1, 2).contiguous(), None, None, diverged
    zero_out = None if spec.symmetric else zero.transpose(1, 2).to(torch.int8)
    return qt.transpose(1, 2).contiguous(), scale.transpose(1, 2).to(scale_dtype), zero_out, diverged
