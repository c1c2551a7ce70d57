"""Routed tokens grouped by expert, and per-expert matmuls over them without a Python loop over experts.

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts, ``D`` hidden, ``I`` expert intermediate,
``C`` the largest per-expert token count in a bucket (padded blocks are ``[n, C, ·]`` with zero rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.diag.hostsync import on_device

GPU_BLOCK_ELEMS = 1 << 28  # elements per padded per-expert block on a GPU (512 MB of bf16; quant estimate too)
CPU_BLOCK_ELEMS = 1 << 24


@dataclass
class Bucket:
    """Experts padded to one length: ``experts [n]`` (local ids), ``token/weight/mask [n, C]``; padded slots hold
    token index ``T`` (one past the last token) and weight 0. ``span`` is set when the experts are a contiguous
    id range, so per-expert accumulators can be updated in place."""

    experts: torch.Tensor
    token: torch.Tensor
    weight: torch.Tensor
    mask: torch.Tensor
    span: slice | None = None
    members: tuple[int, ...] = ()  # ``experts`` on the host

    def restrict(self, first: int, count: int) -> Bucket | None:
        """The bucket's experts in ``first .. first + count - 1``, renumbered from ``first``, or None. The padded
        length stays the bucket's, so each expert's sums are computed exactly as for the whole bucket."""
        lo = next((j for j, e in enumerate(self.members) if e >= first), len(self.members))
        hi = next((j for j, e in enumerate(self.members) if e >= first + count), len(self.members))
        if lo == hi:
            return None
        if lo == 0 and hi == len(self.members) and first == 0:
            return self
        span = None if self.span is None else slice(self.members[lo] - first, self.members[hi - 1] + 1 - first)
        return Bucket(self.experts[lo:hi] - first, self.token[lo:hi], self.weight[lo:hi], self.mask[lo:hi], span,
                      tuple(e - first for e in self.members[lo:hi]))

    def gather(self, x_padded: torch.Tensor) -> torch.Tensor:
        """``x_padded [T + 1, D]`` (:func:`with_zero_row`, made once for all buckets) -> ``[n, C, D]`` with zero
        rows in the padding."""
        return x_padded[self.token]

    def add_to(self, acc: torch.Tensor, values: torch.Tensor) -> None:
        """``acc[e] += values[j]`` for the bucket's experts ``e = experts[j]``: a slice add over a contiguous id
        range (an elementwise kernel; CUDA's large-row ``index_add_`` kernel took 211 ms in 707 calls over two
        Qwen3-30B-A3B layers on an H200), else ``index_add_``.
        Each expert appears once in a bucket, so both add every element once: the same sums."""
        if self.span is not None:
            acc[self.span] += values
        else:
            acc.index_add_(0, self.experts, values)

    def take(self, per_expert: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The bucket's rows of a per-expert tensor ``[E', ...]`` whose row ``e + offset`` belongs to local expert
        ``e``: a view over a contiguous id range, else a gathered copy."""
        if self.span is not None:
            return per_expert[self.span.start + offset : self.span.stop + offset]
        return per_expert[self.experts + offset]


def with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``x [T, D]`` -> ``[T + 1, D]`` whose last row (the padding slots' token index ``T``) is zero."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def _partition(load: list[int], width: int, max_elems: int, max_waste: float) -> list[list[int]]:
    """Expert ids in buckets: contiguous id ranges when padding each range to its busiest expert costs at most
    ``max_waste`` times the real rows (near-uniform routing), else experts sorted by load and cut where the
    padded area would exceed ``max_waste`` times the bucket's rows (skewed routing). Each bucket's
    ``[n, C, width]`` block stays within ``max_elems`` unless one expert alone exceeds it."""
    total = sum(load)
    ranges, cur, cur_max = [], [], 0
    for e, c in enumerate(load):
        if cur and (len(cur) + 1) * max(cur_max, c) * width > max_elems:
            ranges.append(cur)
            cur, cur_max = [], 0
        cur.append(e)
        cur_max = max(cur_max, c)
    ranges.append(cur)
    area = sum(len(r) * max(load[e] for e in r) for r in ranges)
    if area <= max_waste * total:
        return [r for r in ranges if any(load[e] for e in r)]
    by_load = sorted((e for e in range(len(load)) if load[e]), key=lambda e: -load[e])
    buckets, i = [], 0
    while i < len(by_load):
        C, rows, j = load[by_load[i]], load[by_load[i]], i + 1
        while (j < len(by_load) and (j - i + 1) * C * width <= max_elems
               and (j - i + 1) * C <= max_waste * (rows + load[by_load[j]])):
            rows += load[by_load[j]]
            j += 1
        buckets.append(sorted(by_load[i:j]))
        i = j
    return buckets


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of ``0 .. n-1`` occurs in ``ids`` (values in range), as ``torch.bincount(ids, minlength=n)``
    but without its host read of ``ids.max()`` on a GPU."""
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(top_idx: torch.Tensor, top_w: torch.Tensor, n_experts: int, first_expert: int = 0,
                   counts: tuple[torch.Tensor, list[int]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The routed assignments of experts ``first_expert .. first_expert + n_experts - 1`` sorted by expert, tokens
    ascending within an expert: ``(token [N], weight [N], counts [n_experts], counts on the host)``. One host
    read (the counts, which every caller needs to cut its blocks), none when the caller has counted already
    (``counts``: the experts' counts on the device and on the host, e.g. read back asynchronously); other experts'
    assignments sort past the end."""
    T, k = top_idx.shape
    flat_e = top_idx.reshape(-1) - first_expert
    key = torch.where((flat_e >= 0) & (flat_e < n_experts), flat_e, n_experts)  # others: one bin past the end
    if counts is None:
        device_counts = count_ids(key, n_experts + 1)[:n_experts]
        counts = device_counts, device_counts.tolist()
    order = torch.argsort(key, stable=True)  # stable: ascending assignment index, so ascending token, per expert
    order = order[: sum(counts[1])]
    return order // k, top_w.reshape(-1)[order], *counts


def load_buckets(top_idx: torch.Tensor, top_w: torch.Tensor, n_experts: int, first_expert: int = 0,
                 width: int = 1, max_elems: int = 1 << 28, max_waste: float = 1.5,
                 counts: tuple[torch.Tensor, list[int]] | None = None) -> tuple[torch.Tensor, list[Bucket]]:
    """Routed assignments of experts ``first_expert ..`` grouped into buckets of experts padded to one length.

    Padding every expert to the busiest one's count wastes work in proportion to the routing skew (hot experts
    take 3-10x the mean in real models); :func:`_partition` bounds the waste. Experts without tokens are left
    out. Tokens keep ascending order within an expert. Returns the counts ``[E]`` too. ``counts``: already
    counted (:func:`sort_by_expert`).
    """
    T = top_idx.shape[0]
    s_token, s_weight, counts, host = sort_by_expert(top_idx, top_w, n_experts, first_expert, counts)
    starts = torch.cumsum(counts, 0) - counts
    buckets: list[Bucket] = []
    for members in _partition(host, width, max_elems, max_waste):  # empty when nothing was routed here
        ids = on_device(members, top_idx.device)
        ar = torch.arange(max(host[e] for e in members), device=top_idx.device)
        mask = ar[None, :] < counts[ids, None]
        pos = (starts[ids, None] + ar[None, :]).clamp_max(len(s_token) - 1)
        span = slice(members[0], members[-1] + 1) if members[-1] - members[0] + 1 == len(members) else None
        buckets.append(Bucket(ids, torch.where(mask, s_token[pos], T), torch.where(mask, s_weight[pos], 0), mask,
                              span, tuple(members)))
    return counts, buckets


def expert_intermediate(xg: torch.Tensor, gate_up: torch.Tensor, act) -> torch.Tensor:
    """``xg [E, C, D]``, ``gate_up [E, 2I, D]`` -> ``act(gate) * up`` ``[E, C, I]`` (the down-proj input)."""
    h = torch.bmm(xg, gate_up.transpose(1, 2).to(xg.dtype))
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def expert_output(a: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``a [E, C, I]``, ``down [E, D, I]`` -> ``[E, C, D]`` (before routing weights)."""
    return torch.bmm(a, down.transpose(1, 2).to(a.dtype))

def chunk_budget(device: torch.device) -> int:
    """Elements per padded per-expert block: ``GPU_BLOCK_ELEMS`` on a GPU, ``CPU_BLOCK_ELEMS`` on a CPU."""
    return GPU_BLOCK_ELEMS if device.type == "cuda" else CPU_BLOCK_ELEMS
