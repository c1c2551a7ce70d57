"""Tensors captured on every rank's calibration batch, handed to the ranks that consume them in global batch order.

Calibration batches are dealt out round-robin (batch ``b`` runs on rank ``b % size``, see ``Layerwise``), so the
batches of one step are ``step * size + r`` for ``r = 0 .. size - 1``. Hooks ``put`` what they capture on a
channel; after each step ``flush`` hands every payload to each channel's consumers, rank by rank, i.e. in
global batch order. A consumer therefore accumulates exactly the sequence of additions a single process makes,
and its sums are bit-identical at any world size (the reason this exists rather than an all-reduce of partial
sums, whose rounding depends on the split).

With one rank ``put`` consumes at once (nothing is held back) and ``flush`` does nothing: one code path. A relay
made ``local`` does the same at any world size: every rank consumes its own batches only, and the caller combines
the ranks' partial sums after the pass (``quantize.statistics: reduce``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quant.parallel.world import World

Consume = Callable[..., None]


class Channel:
    """One stream of payloads (tuples of tensors, one per batch) from a hook to its consumers."""

    def __init__(self, relay: Relay, consume: Consume | None, consumers: frozenset[int]):
        self.relay, self.consume, self.consumers = relay, consume, consumers
        self.pending: tuple[torch.Tensor, ...] | None = None
        self.closed = False

    def put(self, *tensors: torch.Tensor) -> None:
        if self.closed:
            return
        if not self.relay.world.distributed or self.relay.local:
            if self.consume is not None:
                self.consume(*tensors)
            return
        assert self.pending is None, "one payload per channel per batch"
        self.pending = tensors

    def close(self) -> None:
        """Stop taking payloads (the hook is gone); the channel still takes part in later flushes, empty. The
        consumer is dropped: a closed channel must not keep its statistics (GBs of Hessian sums) alive."""
        self.closed = True
        self.consume = None
        self.pending = None


class Relay:
    """The channels of one pass over the calibration batches. Every rank must create the same channels in the
    same order (same model code, same decisions) and call :meth:`flush` after every step, batch or not."""

    def __init__(self, world: World, local: bool = False):
        self.world, self.local = world, local
        self.channels: list[Channel] = []

    def channel(self, consume: Consume | None, consumers: set[int] | frozenset[int] | None = None) -> Channel:
        """``consume(*tensors)`` is called on this rank for every payload, in global batch order, when this rank
        is in ``consumers`` (default: every rank); pass ``consume=None`` on ranks that only forward."""
        everyone = frozenset(range(self.world.size))
        ch = Channel(self, consume, everyone if consumers is None else frozenset(consumers))
        self.channels.append(ch)
        return ch

    def flush(self) -> None:
        """Deliver this step's payloads: for each source rank in order, each channel in order."""
        if not self.world.distributed or self.local:
            return
        w = self.world
        local = [ch.pending for ch in self.channels]
        for ch in self.channels:
            ch.pending = None
        meta = w.all_gather_object([None if p is None else [(tuple(t.shape), t.dtype) for t in p] for p in local])
        for src in range(w.size):
            for i, ch in enumerate(self.channels):
                if meta[src][i] is None:
                    continue
                payload = self._move(ch, src, local[i], meta[src][i])
                if payload is not None and w.rank in ch.consumers and ch.consume is not None:
                    ch.consume(*payload)

    def _move(self, ch: Channel, src: int, mine, meta) -> tuple[torch.Tensor, ...] | None:
        """``src``'s payload on this rank when this rank consumes it (None otherwise): a broadcast when every rank
        consumes, else point-to-point to each consumer."""
        w = self.world
        if src == w.rank:
            out = tuple(mine)
            sends = [c for c in sorted(ch.consumers) if c != src]
            if len(sends) == w.size - 1:
                for t in out:
                    w.broadcast_tensor(_on(t, w), src)
            else:
                for c in sends:
                    for t in out:
                        w.send_tensor(_on(t, w), c)
            return out
        if w.rank not in ch.consumers and len(ch.consumers - {src}) != w.size - 1:
            return None
        bufs = tuple(torch.empty(shape, dtype=dtype, device=w.device) for shape, dtype in meta)
        for b in bufs:
            if len(ch.consumers - {src}) == w.size - 1:
                w.broadcast_tensor(b, src)
            else:
                w.recv_tensor(b, src)
        return bufs


def _on(t: torch.Tensor, w: World) -> torch.Tensor:
    return t.to(w.device).contiguous()
