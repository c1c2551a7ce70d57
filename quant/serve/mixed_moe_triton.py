"""The Triton kernel of ``quant.serve.mixed_moe`` (imported lazily by it): one launch computes every block of an
aligned MoE routing, each block with its expert's scheme group's tile loop (bits and group size compile-time
constants per group).

Legend: ``BM`` pairs per block, ``BN`` output columns per program, ``BK`` input columns per step of the ``K``
loop (at most the group size: one scale row per step), ``PF = 32 / BITS`` codes per int32 word.
"""

import triton
import triton.language as tl


@triton.jit
def group_tile(acc, a_ptr, stride_am, a_rows, pair_ok, b_ptr, s_ptr, row, offs_n, n_ok, K, n_out,
               stride_be, stride_se, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BK // PF
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    offs_k = tl.arange(0, BK)
    offs_w = tl.arange(0, BKW)
    shifts = tl.arange(0, PF) * BITS
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + row * stride_be + offs_w[:, None] * n_out + offs_n[None, :]
    s_ptrs = s_ptr + row * stride_se + offs_n
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs + k0, mask=pair_ok[:, None], other=0.0)
        words = tl.load(b_ptrs + (k0 // PF) * n_out, mask=n_ok[None, :], other=0)
        codes = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BKW, PF, BN]: K index w * PF + j
        w = (tl.reshape(codes, (BK, BN)) - OFFSET).to(a.dtype)
        scale = tl.load(s_ptrs + (k0 // GROUP) * n_out, mask=n_ok, other=0.0).to(tl.float32)
        acc += tl.dot(a, w, out_dtype=tl.float32) * scale[None, :]
    return acc


@triton.jit
def gemm(a_ptr, out_ptr, b0_ptr, s0_ptr, b1_ptr, s1_ptr, group_ptr, row_ptr, sorted_ptr, experts_ptr,
         n_padded_ptr, weights_ptr, n_pairs, K, n_out, stride_am, stride_be0, stride_se0, stride_be1, stride_se1,
         TOP_K: tl.constexpr, MUL_W: tl.constexpr, N_GROUPS: tl.constexpr, BITS0: tl.constexpr,
         GROUP0: tl.constexpr, BITS1: tl.constexpr, GROUP1: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK0: tl.constexpr, BK1: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_out, BN)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BM >= tl.load(n_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    pair_ok = pairs < n_pairs
    a_rows = tl.where(pair_ok, pairs // TOP_K, 0)
    expert = tl.load(experts_ptr + pid_m)
    grp = tl.load(group_ptr + expert)
    row = tl.load(row_ptr + expert).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < n_out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if N_GROUPS == 1:
        acc = group_tile(acc, a_ptr, stride_am, a_rows, pair_ok, b0_ptr, s0_ptr, row, offs_n, n_ok, K, n_out,
                         stride_be0, stride_se0, BITS0, GROUP0, BN, BK0)
    elif grp == 0:
        acc = group_tile(acc, a_ptr, stride_am, a_rows, pair_ok, b0_ptr, s0_ptr, row, offs_n, n_ok, K, n_out,
                         stride_be0, stride_se0, BITS0, GROUP0, BN, BK0)
    else:
        acc = group_tile(acc, a_ptr, stride_am, a_rows, pair_ok, b1_ptr, s1_ptr, row, offs_n, n_ok, K, n_out,
                         stride_be1, stride_se1, BITS1, GROUP1, BN, BK1)
    if MUL_W:
        acc = acc * tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * n_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])
