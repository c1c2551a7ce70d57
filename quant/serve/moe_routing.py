"""One routing for every scheme group of a fused MoE layer. Pure tensor code (no vLLM): the kernels come in as
``MoeOps`` (vLLM's Marlin MoE ops inside vLLM, plain-torch references in tests).

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts of the layer, ``G`` scheme groups, ``H`` hidden, ``N``
expert intermediate, ``B`` blocks of the aligned routing, ``P = B * block_m`` its padded slots.

The routed (token, slot) pairs are aligned once over all ``E`` experts: sorted by expert and padded to blocks of
``block_m`` pairs, each block one expert's. Each group's GEMM launch gets the same aligned pairs with its own block
expert ids: the block's row in that group's weight stack, or ``-1`` for a block of another group's expert, which the
Marlin MoE kernel skips. So every pair is computed by exactly one group and lands in its own row of one shared
intermediate: one activation over all of them and one sum over the ``k`` slots follow, where a call per group would
align, activate and sum once per group and add the groups' outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeOps:
    """The kernels of one fused MoE forward.

    - ``align(topk_ids [T, k], block_m, E) -> (sorted_ids [P], block_experts [B], n_padded [1])``: pairs sorted by
      expert (pair id ``t * k + slot``; padding slots hold ``T * k``), the expert of each block, the padded pair count
      (entries past it are not read);
    - ``gemm(a, out, group, proj, sorted_ids, block_rows, n_padded, topk_weights, block_m, top_k, mul_weights,
      size_m, size_n, size_k, workspace)``: for each block whose row is not ``-1``, ``out[pair] = a[pair // top_k] @
      W[row]`` (times the pair's router weight if ``mul_weights``), ``proj`` ``"w13"`` or ``"w2"``;
    - ``act(out [T * k, N], inp [T * k, 2N])``: the gated activation.
    """

    align: Callable
    gemm: Callable
    act: Callable


def block_size_m(n_tokens: int, top_k: int, n_experts: int) -> int:
    """Pairs per block for ``n_tokens`` tokens routed to ``top_k`` of ``n_experts`` experts: the smallest block that
    the mean expert's pairs fill to 90 % (vLLM's Marlin MoE rule, so a layer splits into the blocks vLLM would use)."""
    for b in (8, 16, 32, 48):
        if n_tokens * top_k / n_experts / b < 0.9:
            return b
    return 64


def group_rows(groups: Sequence, n_experts: int, device=None) -> torch.Tensor:
    """``[G, E]`` int32: each expert's row in group ``g``'s weight stack, ``-1`` where it is not of group ``g``."""
    table = torch.full((len(groups), n_experts), -1, dtype=torch.int32)
    for gi, g in enumerate(groups):
        table[gi, list(g.experts)] = torch.arange(len(g.experts), dtype=torch.int32)
    return table.to(device)


def split_blocks(block_experts: torch.Tensor, n_padded: torch.Tensor, rows: torch.Tensor,
                 block_m: int) -> torch.Tensor:
    """``[G, B]`` int32: each block's row in each group's stack, ``-1`` for other groups' blocks and for the entries
    past ``n_padded`` (whatever they hold). One Triton launch on a GPU (no host sync, so CUDA graphs capture it)."""
    assert block_experts.dim() == 1 and rows.dim() == 2, (block_experts.shape, rows.shape)
    if block_experts.is_cuda:
        return _split_blocks_triton(block_experts, n_padded, rows, block_m)
    G, E = rows.shape
    B = block_experts.numel()
    valid = torch.arange(B, device=block_experts.device) < n_padded.reshape(()).long() // block_m
    e = torch.where(valid, block_experts.long(), 0).clamp(0, E - 1)
    return torch.where(valid[None, :], rows[:, e], -1).to(torch.int32)


_KERNEL: dict = {}


def _split_blocks_triton(block_experts, n_padded, rows, block_m: int) -> torch.Tensor:
    if "split" not in _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def split(experts_ptr, n_padded_ptr, rows_ptr, out_ptr, n_blocks_max, n_experts, block_m,
                  N_GROUPS: tl.constexpr, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = i < n_blocks_max
            valid = inside & (i < tl.load(n_padded_ptr) // block_m)
            e = tl.load(experts_ptr + i, mask=valid, other=0)
            e = tl.minimum(tl.maximum(e, 0), n_experts - 1)
            for g in tl.static_range(N_GROUPS):
                r = tl.load(rows_ptr + g * n_experts + e, mask=valid, other=-1)
                tl.store(out_ptr + g * n_blocks_max + i, r, mask=inside)

        _KERNEL["split"] = split
    G, E = rows.shape
    B = block_experts.numel()
    out = torch.empty((G, B), dtype=torch.int32, device=block_experts.device)
    BLOCK = 256
    _KERNEL["split"][(triton_cdiv(B, BLOCK),)](block_experts, n_padded, rows, out, B, E, block_m, N_GROUPS=G,
                                             BLOCK=BLOCK)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def each_group(fn: Callable, n_groups: int, side, workspaces: Sequence) -> None:
    """``fn(group_index, workspace)`` for every group: one after another on the current stream, or, with a ``side``
    stream, every group after the first on it beside the first (joined before returning, so CUDA graphs capture both
    and nothing either stream frees is reused while the other reads it)."""
    if side is None or n_groups == 1:
        for gi in range(n_groups):
            fn(gi, workspaces[0])
        return
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for gi in range(1, n_groups):
            fn(gi, workspaces[1])
    fn(0, workspaces[0])
    main.wait_stream(side)


def shared_routing_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, groups: Sequence,
                       rows: torch.Tensor, ops: MoeOps, *, intermediate: int, weight_on_input: bool,
                       workspaces: Sequence, side=None) -> torch.Tensor:
    """The fused MoE forward of a layer whose experts fall in ``groups`` (each one weight stack): ``x [T, H]``,
    ``topk_* [T, k]``, ``rows = group_rows(groups, E)``; returns ``[T, H]``. ``side``: a second CUDA stream the
    groups after the first run their GEMMs on, beside the first group's."""
    T, H = x.shape
    k = topk_ids.shape[1]
    N = intermediate
    E = rows.shape[1]
    block_m = block_size_m(T, k, E)
    sorted_ids, block_experts, n_padded = ops.align(topk_ids, block_m, E)
    block_rows = split_blocks(block_experts, n_padded, rows, block_m)
    cache13 = torch.empty(T * k * max(2 * N, H), dtype=x.dtype, device=x.device)
    up = cache13[: T * k * 2 * N].view(T * k, 2 * N)  # every pair's row written by its group's launch
    each_group(lambda gi, ws: ops.gemm(x, up, groups[gi], "w13", sorted_ids, block_rows[gi], n_padded, topk_weights,
                                       block_m, k, weight_on_input, T, 2 * N, H, ws), len(groups), side, workspaces)
    act = torch.empty((T * k, N), dtype=x.dtype, device=x.device)
    ops.act(act, up)
    down = cache13[: T * k * H].view(T * k, H)  # over ``up``, which the activation has read
    each_group(lambda gi, ws: ops.gemm(act, down, groups[gi], "w2", sorted_ids, block_rows[gi], n_padded,
                                       topk_weights, block_m, 1, not weight_on_input, T * k, H, N, ws),
               len(groups), side, workspaces)
    return down.view(T, k, H).sum(dim=1)
