"""A fused MoE layer whose experts mix two integer schemes, one GEMM launch per projection (Triton). Pure tensor code
(no vLLM): the routing alignment and the activation come in as callables (vLLM's ops inside vLLM, plain torch in
tests).

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts of the layer, ``E_g`` experts of scheme group ``g``,
``H`` hidden, ``N`` expert intermediate, ``K`` / ``Nout`` a projection's input / output size, ``pf = 32 / bits`` codes
per int32 word, ``BM`` pairs per block of the aligned routing.

The routed (token, slot) pairs are aligned once over all ``E`` experts (sorted by expert, padded to blocks of ``BM``
pairs, each block one expert's). One launch per projection then computes every block: a program reads its block's
expert, looks up the expert's scheme group and row (``expert_group [E]``, ``expert_row [E]``) and runs that group's
tile loop, whose bits and group size are compile-time constants. So a layer of W8 and W4 experts costs what a
one-scheme layer costs: one alignment, two GEMM launches, one activation and one sum, where a fused MoE call per
group pays all of them once per group.

Weights stay in the layout the checkpoint's tensors are stacked into (``quant.serve.layout``): codes ``[E_g, K / pf,
Nout]`` int32, packed along ``K`` (code ``j`` of a word at bits ``j * bits``, stored as value + 2^(bits - 1)), scales
``[E_g, K / group, Nout]``. Nothing is repacked at load. Symmetric schemes only: the scale of a tile is applied to
its partial product (each ``BK``-wide step of the ``K`` loop lies inside one scale group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quant.scheme import Scheme
from quant.serve.moe_routing import group_rows
from quant.serve.nibbles import servable as nibble_servable
from quant.serve.nibbles import unpack

MAX_GROUPS = 2


@dataclass(frozen=True)
class Projection:
    """One projection (``w13`` or ``w2``) of every scheme group: ``codes[g] [E_g, K / pf_g, Nout]`` int32 and
    ``scales[g] [E_g, K / group_g, Nout]``, in group order."""

    schemes: tuple[Scheme, ...]
    codes: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]

    def __post_init__(self):
        assert 1 <= len(self.schemes) <= MAX_GROUPS, len(self.schemes)
        assert len(self.codes) == len(self.scales) == len(self.schemes)
        K, n_out = self.in_size, self.out_size
        for s, c, sc in zip(self.schemes, self.codes, self.scales, strict=True):
            assert s.symmetric and s.bits in (4, 8), s
            assert c.dtype == torch.int32 and c.is_contiguous() and sc.is_contiguous(), (c.dtype, s)
            assert tuple(c.shape[1:]) == (K // s.pack_factor, n_out), (tuple(c.shape), s, K, n_out)
            assert tuple(sc.shape) == (c.shape[0], K // s.group_size, n_out), (tuple(sc.shape), s)

    @property
    def in_size(self) -> int:
        return self.codes[0].shape[1] * self.schemes[0].pack_factor

    @property
    def out_size(self) -> int:
        return self.codes[0].shape[2]


@dataclass(frozen=True)
class MixedLayer:
    """A layer's experts as scheme groups: each expert's group and its row in that group's stacks (``[E]`` int32)."""

    w13: Projection  # gate then up: K = H, Nout = 2N
    w2: Projection  # down: K = N, Nout = H
    expert_group: torch.Tensor
    expert_row: torch.Tensor


def servable(schemes: Sequence[Scheme]) -> str | None:
    """Why this kernel cannot run a layer of these groups' schemes, or None."""
    if not 1 <= len(schemes) <= MAX_GROUPS:
        return f"{len(schemes)} scheme groups (the mixed kernel runs 1 or {MAX_GROUPS})"
    for s in schemes:
        if not s.symmetric or s.bits not in (4, 8):
            return f"scheme {s.label} (the mixed kernel runs symmetric W4 and W8)"
    return None


KERNELS = ("marlin", "mixed", "nibbles")


def choose_kernel(asked: str, schemes: Sequence[Scheme]) -> str:
    """The kernel a mixed layer of these groups' schemes runs: ``asked`` (``QUANT_MOE_KERNEL``: ``marlin``, ``mixed``,
    ``nibbles``, or empty for the default ``marlin``, a Marlin MoE call per group); ValueError for another value, or
    for a kernel that cannot run this layer. ``nibbles``: one Marlin MoE call over every expert, each W8 expert as
    two 4-bit rows (``quant.serve.nibbles``)."""
    if asked not in ("", *KERNELS):
        raise ValueError(f"QUANT_MOE_KERNEL={asked!r}: use marlin (a Marlin MoE call per scheme group, the default), "
                         f"mixed (one launch per projection for at most {MAX_GROUPS} symmetric W4/W8 groups) or "
                         "nibbles (one Marlin MoE call, W8 experts split into two 4-bit rows)")
    why = {"mixed": servable, "nibbles": nibble_servable}.get(asked, lambda _: None)(schemes)
    if why is not None:
        raise ValueError(f"QUANT_MOE_KERNEL={asked} cannot run {why}")
    return asked or "marlin"


def layer_tables(groups: Sequence, n_experts: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert_group [E], expert_row [E])`` int32 of ``groups`` (``ExpertGroup``s that cover every expert), from
    ``moe_routing.group_rows``: the one group an expert's row is not -1 in, and that row."""
    rows = group_rows(groups, n_experts)  # [G, E]
    member = rows >= 0
    assert bool((member.sum(dim=0) == 1).all()), "every expert belongs to exactly one group"
    return member.int().argmax(dim=0).to(torch.int32).to(device), rows.max(dim=0).values.to(device)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# by routed pairs per expert (T * k / E) at most: the tiles measured fastest on one H100 at Qwen3-30B-A3B widths
# (benchmarks/moe_layer.py --sweep; DeepSeek-V3's widths picked the same ones but at 1,024 tokens)
CONFIGS: tuple[tuple[float, TileConfig], ...] = (
    (0.25, TileConfig(16, 64, 64, 4, 3)),
    (32.0, TileConfig(16, 128, 64, 4, 3)),
    (128.0, TileConfig(64, 64, 64, 4, 3)),
    (float("inf"), TileConfig(64, 128, 128, 8, 3)),
)


def tile_config(n_tokens: int, top_k: int, n_experts: int, configs=CONFIGS) -> TileConfig:
    """The tile shape for a batch: the first of ``configs`` whose bound on pairs per expert it is within."""
    pairs_per_expert = n_tokens * top_k / n_experts
    return next((c for bound, c in configs if pairs_per_expert <= bound), configs[-1][1])


def read_configs(text: str) -> tuple[tuple[float, TileConfig], ...]:
    """A tile table from JSON ``[[pairs_per_expert_bound, [block_m, block_n, block_k, warps, stages]], ...]``
    (what ``benchmarks/moe_layer.py --sweep`` writes for a GPU), in increasing bounds."""
    import json

    rows = json.loads(text)
    out = []
    for bound, cfg in rows:
        c = TileConfig(*(int(v) for v in cfg))
        if c.block_m not in (16, 32, 64, 128) or c.block_n not in (16, 32, 64, 128, 256) or \
                c.block_k not in (16, 32, 64, 128):
            raise ValueError(f"tile {cfg}: block_m 16/32/64/128, block_n 16..256, block_k 16..128 (powers of 2)")
        out.append((float(bound), c))
    if not out or [b for b, _ in out] != sorted(b for b, _ in out):
        raise ValueError("a tile table is a non-empty list of [bound, tile] in increasing bounds")
    return tuple(out)


def mixed_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: MixedLayer, *,
              align: Callable, act: Callable, weight_on_input: bool = False,
              config: TileConfig | None = None, configs=CONFIGS) -> torch.Tensor:
    """The layer's forward: ``x [T, H]``, ``topk_* [T, k]`` -> ``[T, H]``.

    ``align(topk_ids, block_m, E) -> (sorted_ids, block_experts, n_padded)`` (vLLM's ``moe_align_block_size``
    semantics: pair ids ``t * k + slot`` sorted by expert, padding ``T * k``, blocks only for experts that have
    pairs), ``act(out [T * k, N], inp [T * k,
    2N])`` the gated activation. The router weight scales the second GEMM's output, or the first's with
    ``weight_on_input`` (as vLLM's fused MoE kernels do)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E = layer.expert_group.numel()
    N = layer.w2.in_size
    assert layer.w13.in_size == H and layer.w13.out_size == 2 * N and layer.w2.out_size == H, (H, N)
    cfg = config or tile_config(T, k, E, configs)
    sorted_ids, block_experts, n_padded = align(topk_ids, cfg.block_m, E)
    up = torch.empty((T * k, 2 * N), dtype=x.dtype, device=x.device)
    mixed_gemm(x, up, layer.w13, layer, sorted_ids, block_experts, n_padded, topk_weights, top_k=k,
               mul_weights=weight_on_input, config=cfg)
    inner = torch.empty((T * k, N), dtype=x.dtype, device=x.device)
    act(inner, up)
    down = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    mixed_gemm(inner, down, layer.w2, layer, sorted_ids, block_experts, n_padded, topk_weights, top_k=1,
               mul_weights=not weight_on_input, config=cfg)
    return down.view(T, k, H).sum(dim=1)


def mixed_gemm(a: torch.Tensor, out: torch.Tensor, proj: Projection, layer: MixedLayer, sorted_ids: torch.Tensor,
               block_experts: torch.Tensor, n_padded: torch.Tensor, topk_weights: torch.Tensor, *, top_k: int,
               mul_weights: bool, config: TileConfig) -> torch.Tensor:
    """For every block of the aligned routing below ``n_padded``: ``out[pair] = a[pair // top_k] @ W[expert]`` for
    its valid pairs (``pair < out.shape[0]``), times the pair's router weight with ``mul_weights``; ``W`` the
    dequantized weight of the block's expert in its group. ``a [M, K]``, ``out [M * top_k, Nout]``."""
    kernel = _kernel()
    K, n_out = proj.in_size, proj.out_size
    n_pairs = out.shape[0]
    assert a.shape == (n_pairs // top_k, K) and out.shape[1] == n_out and a.is_contiguous() and out.is_contiguous()
    cfg = config
    s0 = proj.schemes[0]
    s1 = proj.schemes[-1]
    bk0, bk1 = min(cfg.block_k, s0.group_size), min(cfg.block_k, s1.group_size)
    assert K % bk0 == 0 and K % bk1 == 0, (K, bk0, bk1)
    c1, sc1 = proj.codes[-1], proj.scales[-1]
    # an expert's blocks hold at least one pair each, so there are at most ``n_pairs`` blocks below ``n_padded``:
    # the grid stops there instead of at the buffer's worst case (E * (BM - 1) padding slots more)
    n_blocks = min(sorted_ids.numel() // cfg.block_m, n_pairs)
    grid = (n_blocks * _cdiv(n_out, cfg.block_n),)
    kernel[grid](
        a, out, proj.codes[0], proj.scales[0], c1, sc1, layer.expert_group, layer.expert_row, sorted_ids,
        block_experts, n_padded, topk_weights, n_pairs, K, n_out, a.stride(0),
        proj.codes[0].stride(0), proj.scales[0].stride(0), c1.stride(0), sc1.stride(0),
        TOP_K=top_k, MUL_W=mul_weights, N_GROUPS=len(proj.schemes), BITS0=s0.bits, GROUP0=s0.group_size,
        BITS1=s1.bits, GROUP1=s1.group_size, BM=cfg.block_m, BN=cfg.block_n, BK0=bk0, BK1=bk1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel():
    """The Triton kernel (its module imported on first use: Triton is needed only where the kernel runs)."""
    from quant.serve.mixed_moe_triton import gemm

    return gemm


def dequantize(codes: torch.Tensor, scales: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Slow reference: stacked codes ``[E_g, K / pf, Nout]`` and scales -> fp32 weights ``[E_g, Nout, K]``."""
    q = unpack(codes, scheme.bits).float() - (1 << (scheme.bits - 1))  # [E_g, K, Nout]
    s = scales.float().repeat_interleave(scheme.group_size, dim=1)
    return (q * s).transpose(1, 2).contiguous()
