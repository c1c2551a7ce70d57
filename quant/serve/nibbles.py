"""A fused MoE layer of W8 and W4 experts as one 4-bit weight stack: each W8 expert split into the two nibbles of
its codes, so one Marlin MoE GEMM per projection runs every expert. Pure tensor code (no vLLM): the kernels come in
as ``moe_routing.MoeOps``.

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts of the layer, ``R`` rows of the nibble stack (one per
W4 expert, two per W8 expert), ``H`` hidden, ``N`` expert intermediate, ``K`` / ``Nout`` a projection's input /
output size, ``g`` the stack's group size.

A symmetric 8-bit code ``q`` is stored as ``u = q + 128`` in ``[0, 255]``; its high nibble ``h = u >> 4`` and low
nibble ``l = u & 15`` give ``q = 16 (h - 8) + l``. So an 8-bit expert projection is the sum of two 4-bit projections
with zero points, ``(code - zero) * scale``:

- hi: codes ``h``, zero point 8, scales ``16 s``;
- lo: codes ``l``, zero point 0, scales ``s``;

and a symmetric 4-bit expert (stored as ``v + 8``) is that form with zero point 8 and its own scales. Every row is
then an asymmetric 4-bit expert in compressed-tensors' stacked layout (``quant.serve.layout``): codes ``[R, K / 8,
Nout]``, scales ``[R, K / g, Nout]``, zero points ``[R, K / g, Nout / 8]``, which vLLM converts to Marlin's layout
like any asymmetric W4 checkpoint. Bytes stay those of the checkpoint (a W8 expert is two W4 rows); scales of a
coarser group size are repeated to the finest one in the layer.

The forward gives each token's slot ``j`` two slots ``2j``, ``2j + 1``: the expert's W4 or hi row, and its lo row
(a W8 expert) or the id ``R``, which the alignment leaves out. One alignment and one GEMM per projection run every
pair. The gate/up outputs of a slot's two pairs are added before the activation (a W8 expert's halves are one
linear map); the down GEMM reads activation row ``t * k + j`` for both pairs (pair // 2), and the sum over the
``2k`` slots adds them again. Rows of left-out pairs are zeroed, since no GEMM writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quant.scheme import Scheme
from quant.serve.moe_routing import MoeOps, block_size_m

KINDS = ("weight_packed", "weight_scale", "weight_zero_point")


@dataclass(frozen=True)
class NibbleRows:
    """Each expert's rows in the nibble stack: ``first [E]`` (its W4 row or its hi row) and ``second [E]`` (its lo
    row, or ``n_rows`` where it has none), int32."""

    first: torch.Tensor
    second: torch.Tensor
    n_rows: int


def servable(schemes: Sequence[Scheme]) -> str | None:
    """Why a layer of these schemes has no nibble stack, or None: W4 (with or without zero points) and symmetric W8
    experts only."""
    for s in schemes:
        if s.bits not in (4, 8) or (s.bits == 8 and not s.symmetric):
            return f"{s.label} experts (the nibble stack holds W4 and symmetric W8 experts)"
    return None


def stack_scheme(schemes: Sequence[Scheme]) -> Scheme:
    """The stack's scheme: 4 bits with zero points, at the finest group size of the layer."""
    return Scheme(4, min(s.group_size for s in schemes), symmetric=False)


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[E, K / pf, Nout]`` int32 words (code ``j`` at bits ``j * bits``) -> ``[E, K, Nout]`` int32 stored codes."""
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int32, device=codes.device) * bits
    q = (codes.unsqueeze(2) >> shifts[None, None, :, None]) & ((1 << bits) - 1)
    return q.flatten(1, 2)


def pack4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Stored 4-bit codes (0..15, int32) packed 8 to an int32 word along ``dim`` (code ``j`` at bits ``4j``)."""
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 8, 8).long()
    words = (c << (torch.arange(8, device=c.device) * 4)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the bit pattern as int32
    return words.to(torch.int32).movedim(-1, dim)


def split_w8(codes: torch.Tensor, chunk: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """W8 codes ``[E, K / 4, Nout]`` -> the hi and lo nibble codes, each ``[E, K / 8, Nout]`` int32 (``chunk``
    experts at a time: the unpacked codes of a whole group would take 16x its bytes)."""
    hi, lo = [], []
    for i in range(0, codes.shape[0], chunk):
        u = unpack(codes[i:i + chunk], 8)
        hi.append(pack4(u >> 4, 1))
        lo.append(pack4(u & 15, 1))
    return torch.cat(hi), torch.cat(lo)


def zero_points(like: torch.Tensor, group: int, code: int) -> torch.Tensor:
    """Zero points ``[R, K / group, Nout / 8]`` (packed along ``Nout``), every one ``code``, for codes ``like``."""
    R, K, n_out = like.shape[0], like.shape[1] * 8, like.shape[2]
    full = torch.full((R, K // group, n_out), code, dtype=torch.int32, device=like.device)
    return pack4(full, 2)


def _finer(t: torch.Tensor, group: int, to: int) -> torch.Tensor:
    """Per-group tensors along dim 1 (scales, or unpacked zero points) repeated from ``group`` to ``to``."""
    return t if group == to else t.repeat_interleave(group // to, dim=1)


def _rows(scheme: Scheme, t: dict, side: str, g: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One group's (codes, scales, zero points) in the stack's form: one tuple for a W4 group, two (hi, lo) for W8."""
    codes, scales = t[(side, "weight_packed")], t[(side, "weight_scale")]
    scales = _finer(scales, scheme.group_size, g)
    if scheme.bits == 8:
        hi, lo = split_w8(codes)
        return [(hi, scales * 16, zero_points(hi, g, 8)), (lo, scales, zero_points(lo, g, 0))]
    if scheme.symmetric:
        return [(codes, scales, zero_points(codes, g, 8))]
    zeros = unpack(t[(side, "weight_zero_point")].transpose(1, 2), 4).transpose(1, 2)  # [E_g, K / group, Nout]
    return [(codes, scales, pack4(_finer(zeros, scheme.group_size, g), 2))]


def nibble_stack(groups: Sequence, tensors: Sequence[dict], n_experts: int) -> tuple[Scheme, dict, NibbleRows]:
    """The layer's scheme groups (``ExpertGroup``s covering every expert) and their stacked checkpoint tensors (keyed
    by (side, kind), ``layout.stacked_shapes``) -> the stack's scheme, its tensors (same keys) and each expert's
    rows. Rows are in group order, a W8 group's hi rows before its lo rows."""
    why = servable([grp.scheme for grp in groups])
    assert why is None, why
    scheme = stack_scheme([grp.scheme for grp in groups])
    first, second = [0] * n_experts, [-1] * n_experts
    parts: dict[str, list] = {"w13": [], "w2": []}
    at = 0
    for grp, t in zip(groups, tensors, strict=True):
        for side in parts:
            parts[side] += _rows(grp.scheme, t, side, scheme.group_size)
        n = len(grp.experts)
        for i, e in enumerate(grp.experts):
            first[e] = at + i
            if grp.scheme.bits == 8:
                second[e] = at + n + i
        at += n * (2 if grp.scheme.bits == 8 else 1)
    out = {(side, kind): torch.cat([p[j] for p in ps]).contiguous()
           for side, ps in parts.items() for j, kind in enumerate(KINDS)}
    dev = out[("w13", "weight_packed")].device
    second = [at if r < 0 else r for r in second]
    return scheme, out, NibbleRows(torch.tensor(first, dtype=torch.int32).to(dev),
                                   torch.tensor(second, dtype=torch.int32).to(dev), at)  # once, at load


def nibble_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, rows: NibbleRows, stack,
               ops: MoeOps, *, intermediate: int, weight_on_input: bool, workspace=None) -> torch.Tensor:
    """The fused MoE forward of a layer held as one nibble stack (``stack``, what ``ops.gemm`` takes as its group):
    ``x [T, H]``, ``topk_* [T, k]``; returns ``[T, H]``. ``ops.align`` must leave out pairs of id ``rows.n_rows``."""
    T, H = x.shape
    k = topk_ids.shape[1]
    N = intermediate
    ids = torch.stack((rows.first[topk_ids], rows.second[topk_ids]), dim=2).view(T, 2 * k)
    weights = topk_weights.repeat_interleave(2, dim=1)  # [T, 2k]: both pairs of a slot carry its router weight
    block_m = block_size_m(T, k, rows.first.numel())
    sorted_ids, block_rows, n_padded = ops.align(ids, block_m, rows.n_rows)
    cache = torch.empty(T * 2 * k * max(2 * N, H), dtype=x.dtype, device=x.device)
    up = cache[: T * 2 * k * 2 * N].view(T * 2 * k, 2 * N)
    up.view(T * k, 2, 2 * N)[:, 1].zero_()  # lo pairs of W4 experts: no GEMM writes them
    ops.gemm(x, up, stack, "w13", sorted_ids, block_rows, n_padded, weights, block_m, 2 * k, weight_on_input,
             T, 2 * N, H, workspace)
    act = torch.empty((T * k, N), dtype=x.dtype, device=x.device)
    ops.act(act, up.view(T * k, 2, 2 * N).sum(dim=1))
    down = cache[: T * 2 * k * H].view(T * 2 * k, H)  # over ``up``, which the sum has read
    down.view(T * k, 2, H)[:, 1].zero_()
    ops.gemm(act, down, stack, "w2", sorted_ids, block_rows, n_padded, weights, block_m, 2, not weight_on_input,
             T * k, H, N, workspace)
    return down.view(T, 2 * k, H).sum(dim=1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """Slow reference: a stack's codes ``[R, K / 8, Nout]``, scales ``[R, K / g, Nout]`` and zero points ``[R, K / g,
    Nout / 8]`` -> fp32 weights ``[R, Nout, K]``, ``(code - zero) * scale``."""
    z = unpack(zeros.transpose(1, 2), 4).transpose(1, 2)  # [R, K / g, Nout]
    q = unpack(codes, 4) - z.repeat_interleave(group, dim=1)
    return (q.float() * scales.float().repeat_interleave(group, dim=1)).transpose(1, 2).contiguous()
