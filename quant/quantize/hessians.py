"""Second-moment statistics for GPTQ, accumulated with hooks while calibration batches run through a layer.

``H = mean over tokens of x xᵀ`` (fp32) per input: one per nn.Linear, and per expert for the fused experts —
``gate_up [E, D, D]`` (gate and up share an input, so one Hessian serves both) and ``down [E, I, I]``.
Expert statistics are batched: routed tokens are grouped into buckets of experts with similar load, padded
to ``[n, C, ·]`` (routing skew costs at most 1.5x padding) and reduced with ``bmm``. Options: gate-weighted (each routed token weighted by its routing weight, MoEQuant's AGQ) and
all-experts (every token through every expert; routed outputs are unaffected because only the statistics
see the extra tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from quant.diag.hostsync import HostCopy, on_device
from quant.models.layers import ExpertsView
from quant.parallel.relay import Relay
from quant.parallel.world import World
from quant.quantize.routing import (
    Bucket,
    chunk_budget,
    count_ids,
    expert_intermediate,
    load_buckets,
    with_zero_row,
)


def _native(x: torch.Tensor) -> bool:
    """bf16/fp16 activations on a GPU are multiplied as they are with fp32 output: products of 8/11-bit
    significands are exact in fp32, so nothing is converted or copied to fp32 first. Elsewhere rows go in fp32."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _fp32_out(rows: torch.Tensor) -> dict:
    return {} if rows.dtype == torch.float32 else {"out_dtype": torch.float32}


def _gram(rows: torch.Tensor) -> torch.Tensor:
    """``rows [n, C, d]`` -> ``rowsᵀ rows [n, d, d]`` in fp32."""
    return torch.bmm(rows.transpose(1, 2), rows, **_fp32_out(rows))


def _gram_into(acc: torch.Tensor, rows: torch.Tensor) -> None:
    """``acc [n, d, d] += rowsᵀ rows`` in place, for ``rows [n, C, d]``."""
    torch.baddbmm(acc, rows.transpose(1, 2), rows, out=acc, **_fp32_out(rows))


def _add_gram(acc: torch.Tensor, b: Bucket, rows: torch.Tensor, temp_bytes: int = 1 << 30) -> None:
    """``acc[e] += rowsᵀ rows`` for the bucket's experts: in place over a contiguous id range, else through
    an fp32 temporary of at most ``temp_bytes`` at a time."""
    if b.span is not None:
        _gram_into(acc[b.span], rows)
        return
    d = rows.shape[-1]
    step = max(1, temp_bytes // (4 * d * d))
    for s in range(0, rows.shape[0], step):
        acc.index_add_(0, b.experts[s : s + step], _gram(rows[s : s + step]))


class LinearStats:
    """Running ``Σ x xᵀ`` and token count of one nn.Linear's input.

    Linears that are called on the very same input tensor (q/k/v, MLA's q_a and kv_a, a shared expert's gate
    and up) share one accumulator when their stats are made by :func:`linear_stats`: the first module to see an
    input accumulates it and the others follow it, checked on every call.

    Inputs go through a ``Relay`` channel: with several ranks each batch's input reaches the consuming rank(s),
    which accumulate in global batch order; ranks that do not consume hold no sums."""

    def __init__(self, module: nn.Linear, relay: Relay, name: str = "", last: list | None = None,
                 consumers: set[int] | None = None):
        n = module.in_features
        self.name = name
        mine = consumers is None or relay.world.rank in consumers
        dev = module.weight.device
        self._partial = relay.world if relay.local and relay.world.distributed else None  # sums to add over ranks
        self.sum = torch.zeros(n, n, dtype=torch.float32, device=dev) if mine else None
        self.abs_sum = torch.zeros(n, dtype=torch.float32, device=dev) if mine else None
        self.n = 0
        self.leader: LinearStats | None = None
        self._seen_own = False
        self._last = last if last is not None else [None, None]  # [input tensor, the stats that took it]
        self.channel = relay.channel(self._accumulate if mine else None, consumers)
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, _m, args) -> None:
        x = args[0]
        seen, owner = self._last
        if seen is x and owner is not self:
            if self.leader is None and not self._seen_own:
                self.leader = owner
            if self.leader is not owner:
                raise RuntimeError(f"{self.name}: shares its input with {owner.name} on some calls only")
            return
        if self.leader is not None:
            raise RuntimeError(f"{self.name}: stopped sharing its input with {self.leader.name}")
        self._last[0], self._last[1] = x, self
        self._seen_own = True
        self.channel.put(x.reshape(-1, x.shape[-1]))

    def _accumulate(self, x: torch.Tensor) -> None:
        _gram_into(self.sum[None], (x if _native(x) else x.float())[None])
        self.abs_sum += x.abs().sum(dim=0, dtype=torch.float32)
        self.n += x.shape[0]

    def remove(self) -> None:
        self.handle.remove()
        self.channel.close()
        self.channel.close()
        self._last[0] = self._last[1] = None

    def _sum_over_ranks(self) -> None:
        """With a ``local`` relay each rank summed its own batches: add the ranks' sums (a collective). Followers
        hold no sums of their own."""
        world = self._partial
        if world is None or self.leader is not None or self.sum is None:
            return
        world.all_reduce_sum(self.sum)
        world.all_reduce_sum(self.abs_sum)
        self.n = int(world.all_reduce_sum(on_device([self.n], self.sum.device)).item())

    def hessian(self) -> torch.Tensor:
        if self.leader is not None:
            return self.leader.hessian()
        return self.sum / max(self.n, 1)

    def mean_abs(self) -> torch.Tensor:
        if self.leader is not None:
            return self.leader.mean_abs()
        return self.abs_sum / max(self.n, 1)


def linear_stats(modules: dict[str, nn.Linear], relay: Relay,
                 consumers: set[int] | None = None) -> dict[str, LinearStats]:
    """Statistics for several linears of one layer, modules fed the same input tensor sharing one sum.
    ``consumers``: the ranks that accumulate (default every rank)."""
    last: list = [None, None]
    return {name: LinearStats(m, relay, name, last, consumers) for name, m in modules.items()}


def close_linear_stats(stats: dict[str, LinearStats], world: World) -> None:
    """End the pass of :func:`linear_stats`: hooks removed, the sharing of inputs agreed over ranks
    (:func:`agree_leaders`) and, with a ``local`` relay, each accumulator's sums added over ranks."""
    for st in stats.values():
        st.remove()
    agree_leaders(stats, world)
    for st in stats.values():
        st._sum_over_ranks()


def agree_leaders(stats: dict[str, LinearStats], world: World) -> None:
    """Which linears share an input is seen by the hooks, so a rank that ran no calibration batch (more ranks than
    batches) saw none of it: every rank takes the sharing from the first rank that saw some. Call after the pass."""
    mine = {n: s.leader.name for n, s in stats.items() if s.leader is not None}
    saw = any(s._seen_own for s in stats.values())
    agreed = next((m for m, seen in world.all_gather_object((mine, saw)) if seen), mine)
    for name, leader in agreed.items():
        stats[name].leader = stats[leader]


class ExpertStats:
    """Per-expert Hessians of the fused experts' two inputs, from the experts module's pre-hook.

    Only experts ``first .. first + count - 1`` are accumulated, so a layer whose Hessians do not fit in memory
    at once (DeepSeek-V3: 256 × 7168² fp32 = 52 GB) is handled in chunks, one calibration pass per chunk, and
    ranks accumulate the experts they own. Routed tokens are bucketed over *all* experts and each bucket then
    restricted to the range, so an expert's sums do not depend on which range it was accumulated in. The
    routed tokens go through a ``Relay`` channel (``consumers``: the ranks accumulating some range this pass).
    ``hessians=False`` keeps only counts, routing-weight sums and the gate/up input's ``Σ |x|`` (no Hessians, no
    down input): what AWQ's shared gate/up search needs of every expert before any chunk's Hessians.
    """

    def __init__(self, view: ExpertsView, gate_weighted: bool, all_experts: bool, first: int = 0,
                 count: int | None = None, need_down: bool = True, *, relay: Relay,
                 consumers: set[int] | None = None, hessians: bool = True):
        count = view.n_experts - first if count is None else count
        E, D, I = count, view.gate_up.shape[2], view.intermediate
        dev = view.gate_up.device
        need_down = need_down and hessians
        self.view, self.gate_weighted, self.all_experts, self.need_down = view, gate_weighted, all_experts, need_down
        self.first, self.count = first, count
        self.sum_gu = torch.zeros(E, D, D, dtype=torch.float32, device=dev) if hessians else None
        self.sum_down = torch.zeros(E, I, I, dtype=torch.float32, device=dev) if need_down else None
        self.abs_gu = torch.zeros(E, D, dtype=torch.float32, device=dev)
        self.abs_down = torch.zeros(E, I, dtype=torch.float32, device=dev)
        self.weight_sum = torch.zeros(E, dtype=torch.float64, device=dev)
        self.counts = torch.zeros(E, dtype=torch.long, device=dev)
        self._normalized = False
        self._pending: tuple | None = None
        self._partial = relay.world if relay.local and relay.world.distributed else None  # sums to add over ranks
        self.channel = relay.channel(self._consume if count else None, consumers)
        self.handle = view.on_route(self.channel.put)

    def _consume(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        """Count the batch's routing now and start its counts' copy to the host; its sums are added when the next
        batch arrives (or at :meth:`remove`): cutting the buckets needs the counts on the host, and reading them at
        once would make the host wait for the GPU every batch. The batches' order is kept, so are the sums."""
        E = self.view.n_experts
        routed = count_ids(idx, E)
        self.counts += routed[self.first : self.first + self.count]
        if self.all_experts:
            idx = torch.arange(E, device=idx.device).expand(x.shape[0], E)
            w = torch.ones(idx.shape, dtype=x.dtype, device=x.device)
            routed = count_ids(idx, E)
        previous, self._pending = self._pending, (x, idx, w, routed, HostCopy(routed))
        if previous is not None:
            self._add_batch(*previous)

    def _flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._add_batch(*pending)

    @torch.no_grad()  # also when the last batch is added at remove(), outside the caller's forward
    def _add_batch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, routed: torch.Tensor,
                   host: HostCopy) -> None:
        E = self.view.n_experts
        width = max(self.view.gate_up.shape[1:])
        _, buckets = load_buckets(idx, w, E, width=width, max_elems=chunk_budget(x.device),
                                  counts=(routed, host.tolist()))
        x_padded = with_zero_row(x)
        for bucket in buckets:
            mine = bucket.restrict(self.first, self.count)
            if mine is not None:
                self._accumulate(x_padded, mine)

    def _accumulate(self, x_padded: torch.Tensor, b: Bucket) -> None:
        """Add one bucket's ``Σ x xᵀ`` (and the down input's) to its experts' sums; gate-weighted rows are
        scaled by √w in fp32 and reduced in full fp32."""
        xg = b.gather(x_padded)
        row_w = b.weight.float() if self.gate_weighted else b.mask.float()
        b.add_to(self.weight_sum, row_w.sum(dim=1).double())
        a = expert_intermediate(xg, b.take(self.view.gate_up, self.first), self.view.act) if self.need_down else None
        if not _native(xg) or self.gate_weighted:
            sqrt_w = row_w.sqrt().unsqueeze(-1)
            xg = xg.float() * sqrt_w
            a = None if a is None else a.float() * sqrt_w
        if self.sum_gu is not None:
            _add_gram(self.sum_gu, b, xg)
        b.add_to(self.abs_gu, xg.abs().sum(dim=1, dtype=torch.float32))
        if a is not None:
            _add_gram(self.sum_down, b, a)
            b.add_to(self.abs_down, a.abs().sum(dim=1, dtype=torch.float32))

    def restrict(self, first: int, count: int) -> None:
        """Keep experts ``first .. first + count - 1`` (within this range): views of their rows."""
        self._flush()
        assert self.first <= first and first + count <= self.first + self.count and not self._normalized
        rows = slice(first - self.first, first - self.first + count)
        for name in ("sum_gu", "sum_down", "abs_gu", "abs_down", "weight_sum", "counts"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[rows])
        self.first, self.count = first, count

    def mean_abs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """mean |x| per input channel, per expert: gate/up input ``[E, D]``, down input ``[E, I]``."""
        self._flush()
        denom = self.weight_sum.clamp_min(1e-12).float()[:, None]
        return self.abs_gu / denom, self.abs_down / denom

    def hessians(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``Σ x xᵀ / Σ weight`` per expert, normalized in place: the sums become the Hessians (a second copy was
        the largest single term at the GPTQ peak, 15.8 GB on a DeepSeek-V3 chunk). Call after the pass; later
        calls return the same tensors."""
        self._flush()
        if not self._normalized:
            denom = self.weight_sum.clamp_min(1e-12).float().view(-1, 1, 1)
            self.sum_gu.div_(denom)
            if self.sum_down is not None:
                self.sum_down.div_(denom)
            self._normalized = True
        return self.sum_gu, self.sum_down

    def remove(self) -> None:
        """End the pass: no more batches; the last one's sums are added, and with a ``local`` relay (each rank
        summed its own batches) the ranks' sums are added in place (a collective: every rank removes its
        statistics in the same order). Removing again changes nothing."""
        self.handle.remove()
        self.channel.close()
        self._flush()
        world, self._partial = self._partial, None  # once: a second remove() adds nothing
        if world is not None:
            for t in (self.sum_gu, self.sum_down, self.abs_gu, self.abs_down, self.weight_sum, self.counts):
                if t is not None:
                    world.all_reduce_sum(t)
