"""The only owner of devices and memory: one decoder layer resident at a time, activations cached.

``Layerwise`` embeds calibration tokens, then for each decoder layer loads its weights from safetensors onto
the device, runs the cached hidden states through it in batches (stages hook in with callbacks), and hands
back the layer's outputs as the next layer's inputs. Activations live on the device when they fit in
``activation_budget_bytes``, else in (pinned) CPU memory, moved batch by batch. On a GPU the next layer's
tensors are read from disk by a background thread, with parallel reads straight into a page-locked staging
buffer (``quant.io.staging``; two of them: one uploading, one being read), while the current layer computes, so
loading leaves the critical path; with several NCCL ranks each rank reads only its share of a layer's bytes and
broadcasts it, so the disk (or page cache) is read once per node, not per GPU.

In a world of several ranks the batches are dealt out round-robin: batch ``b`` (rows ``b * batch_size ..``)
runs on rank ``b % size``, and a rank holds the activations of its own batches only (``embed`` keeps those
rows). Batches run in steps of one batch per rank; ``after_step`` is called on every rank after every step
(with or without a batch of its own), which is where ``quant.parallel.relay`` exchanges what hooks captured.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property

import torch
from torch import nn

from quant.errors import RecipeError
from quant.io.staging import Staging, copy_into, host_available_bytes, pin_budget
from quant.models import ModelSource
from quant.models.layers import (
    DTYPES,
    LayerRunner,
    build_skeleton,
    expert_slots,
    load_embedding,
    load_head,
    load_layer,
    release,
)
from quant.parallel.world import World

log = logging.getLogger(__name__)
ACTIVATION_BUDGET_BYTES = 8 << 30  # cached activations up to this size stay on the device (quant estimate too)


def pick_device(spec: str) -> torch.device:
    """``auto``: this process's GPU when there is one, else the CPU; otherwise a device this machine has (RecipeError
    for one it lacks). A CUDA device always carries its index (the rank's GPU under torchrun), since readers such as
    safetensors take a bare ``cuda`` to mean GPU 0."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise RecipeError(f"device '{spec}' is not a torch device (cpu, cuda, cuda:N, mps, xpu)") from None
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": getattr(torch.backends, "mps", None)}
    if device.type == "cpu":
        return device
    module = backend.get(device.type)
    count = (module.device_count() if hasattr(module, "device_count") else 1) if module and module.is_available() else 0
    if count == 0 or (device.index or 0) >= count:
        raise RecipeError(f"device '{spec}' is not present on this machine ({count} {device.type} device(s)); "
                          "set quantize.device / eval.device to auto or cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_memory_bytes(device: torch.device) -> int:
    """Memory a model on ``device`` can use: the GPU's total memory, or the host's available memory for CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_available_bytes()


def free_gpu_bytes(device: torch.device) -> int:
    """What a new allocation on GPU ``device`` can still take: the driver's free memory plus what torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def transfer(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` between any two devices: a dtype change happens on the GPU's side (torch converts a copy
    between host and GPU on the host, through a pageable temporary of the whole tensor), and the copy is asynchronous
    only into GPU or page-locked memory, which later copies on the same stream read in order (``x.to("cpu",
    non_blocking=True)`` hands back host memory before the transfer has landed in it)."""
    if src.device != dst.device and src.dtype != dst.dtype:
        src = src.to(dst.dtype) if src.device.type == "cuda" else src.to(dst.device, non_blocking=True)
    dst.copy_(src, non_blocking=dst.device.type == "cuda" or dst.is_pinned())


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class LayerReader:
    """A decoder layer's on-disk tensors for ``load_layer``: on a GPU read ahead (the next layer, by a thread) and,
    with several NCCL ranks, read in contiguous shares of about equal bytes, one per rank, then broadcast."""

    def __init__(self, source: ModelSource, world: World, device: torch.device, dtype: torch.dtype | None = None):
        self.source, self.world, self.device, self.dtype = source, world, device, dtype
        self.shared = world.distributed and world.backend == "nccl"
        self.prefetch = device.type == "cuda"
        self._ahead: tuple[int, Future] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._numel: dict[str, int] | None = None

    def shares(self, idx: int) -> list[list[str]]:
        """Layer ``idx``'s tensor names split into one contiguous share per rank (by element count)."""
        keys = sorted(self.source.layer_keys(idx))
        if not self.shared:
            return [keys]
        if self._numel is None:
            self._numel = {k: math.prod(shape) for k, shape in self.source.shapes().items()}
        total, out, acc = sum(self._numel[k] for k in keys), [[] for _ in range(self.world.size)], 0
        for k in keys:
            out[min(self.world.size - 1, acc * self.world.size // max(total, 1))].append(k)
            acc += self._numel[k]
        return out

    def _read(self, idx: int, device) -> dict[str, torch.Tensor]:
        """This rank's share of layer ``idx`` on ``device``; read-ahead (``device`` cpu on a GPU host) reads straight
        into staging buffer ``idx % 2`` when the source reads files (else copies what it returns into that buffer)."""
        keys = self.shares(idx)[self.world.rank if self.shared else 0]
        if not (self.prefetch and str(device) == "cpu"):
            return self.source.read_tensors(keys, device)
        with torch.cuda.device(self.device):  # this thread's CUDA calls on the rank's GPU, not on GPU 0
            tensors = self.source.read_tensors(keys, "cpu", into=self.staging.into(idx % 2))
            return tensors if self.staging.used[idx % 2] else copy_into(tensors, self.staging.into(idx % 2))

    @cached_property
    def staging(self) -> Staging:
        return Staging(self.pin_budget)

    def uploaded(self, idx: int) -> None:
        """Layer ``idx`` is on the device (its copies queued): its staging buffer may be reused after them."""
        if self.prefetch:
            self.staging.uploaded(idx % 2)

    @cached_property
    def pin_budget(self) -> int:
        """Largest read-ahead (bytes) kept in page-locked memory (``staging.pin_budget``). Two layers' worth is held
        at a time (one uploading, the next being read), so at most half the host's available memory."""
        return pin_budget(self.world.local_size)

    def take(self, idx: int, ahead: int | None = None) -> dict[str, torch.Tensor] | None:
        """Layer ``idx``'s tensors (None: ``load_layer`` reads them itself), and start reading layer ``ahead`` (default
        ``idx + 1``; ``idx - 1`` for a walk back down). On a GPU a layer not read ahead (the first) is read here, into
        its staging buffer: far faster than a read to the device."""
        ahead = idx + 1 if ahead is None else ahead
        mine = None
        if self._ahead is not None:
            ahead_idx, fut = self._ahead
            self._ahead = None
            if ahead_idx == idx:
                mine = fut.result()
            elif not fut.cancel():
                fut.exception()  # a read still running into a staging buffer ends before that buffer is reused
        if self.prefetch:
            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="quant-prefetch")
            if mine is None:  # on the read thread: CUDA's last error is per thread, a refused registration stays there
                mine = self._pool.submit(self._read, idx, "cpu").result()
            if 0 <= ahead < self.source.n_layers:
                self._ahead = (ahead, self._pool.submit(self._read, ahead, "cpu"))
        if not self.shared:
            return mine
        return self._gather(idx, mine if mine is not None else self._read(idx, self.device))

    def _gather(self, idx: int, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's share of layer ``idx`` on this rank's device (one broadcast per tensor). Routed expert tensors
        are received straight into their slots of the layer's stacked experts (``expert_slots``), so the load finds
        them stacked: the experts are on the device once, not once as received tensors and once stacked."""
        w = self.world
        metas = w.all_gather_object({k: (tuple(t.shape), t.dtype) for k, t in mine.items()})
        slots = expert_slots(self.source, idx, {k: m for meta in metas for k, m in meta.items()}, self.device,
                             self.dtype)
        out = {}
        for src, meta in enumerate(metas):
            for key, (shape, dtype) in meta.items():
                t = slots.get(key)
                if src == w.rank:
                    t = mine[key].to(self.device, non_blocking=True) if t is None else t.copy_(mine[key], non_blocking=True)
                elif t is None:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                w.broadcast_tensor(t, src)
                out[key] = t
        return out


class Layerwise:
    """Run a model layer by layer over fixed calibration tokens ``[N, S]``."""

    def __init__(self, source: ModelSource, dtype: str, device: str, batch_size: int, world: World,
                 activation_budget_bytes: int = ACTIVATION_BUDGET_BYTES, narrow_experts: bool = False):
        """``narrow_experts``: routed experts stay in the checkpoint's narrower dtype (``load_layer``); the caller
        computes them (``models.expert_compute``)."""
        self.source = source
        self.narrow_experts = narrow_experts
        self.world = world
        self.n_rows = 0  # rows of the token set last embedded (all ranks)
        self.dtype = DTYPES[dtype]
        self.device = pick_device(device)
        self.batch_size = batch_size
        self.budget = activation_budget_bytes
        self.model = build_skeleton(source, self.dtype)
        self.runner = LayerRunner(self.model, self.device, self.dtype)
        self.reader = LayerReader(source, world, self.device, None if narrow_experts else self.dtype)

    def _store(self, like_shape: tuple[int, ...]) -> torch.device:
        n_bytes = torch.Size(like_shape).numel() * torch.finfo(self.dtype).bits // 8
        return self.device if n_bytes <= self.budget or self.device.type == "cpu" else torch.device("cpu")

    def my_batches(self) -> list[slice]:
        """Row ranges (of all ``n_rows``) of this rank's batches, in order: batch ``b`` belongs to ``b % size``."""
        bs, w = self.batch_size, self.world
        return [slice(s, min(s + bs, self.n_rows)) for i, s in enumerate(range(0, self.n_rows, bs))
                if i % w.size == w.rank]

    def my_rows(self) -> torch.Tensor:
        """Indices (into all rows) of the rows this rank holds, in the order of its activations."""
        return torch.cat([torch.arange(b.start, b.stop) for b in self.my_batches()] or [torch.zeros(0, dtype=torch.long)])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[n, S, D]`` of this rank's rows of ``tokens [N, S]`` (all of them in a world of one)."""
        self.n_rows = tokens.shape[0]
        tokens = tokens[self.my_rows()] if self.world.distributed else tokens
        emb = load_embedding(self.source, self.model, self.device, self.dtype)
        D = emb.weight.shape[1]
        store = self._store((*tokens.shape, D))
        hidden = torch.empty(*tokens.shape, D, dtype=self.dtype, device=store,
                             pin_memory=store.type == "cpu" and self.device.type == "cuda")
        with torch.no_grad():
            for s in range(0, tokens.shape[0], self.batch_size):
                hidden[s : s + self.batch_size] = emb(tokens[s : s + self.batch_size].to(self.device)).to(store)
        release(emb)
        return hidden

    @contextlib.contextmanager
    def layer(self, idx: int, ahead: int | None = None) -> Iterator[nn.Module]:
        """Layer ``idx`` materialized on the device for the duration of the block; on a GPU layer ``ahead`` (default
        the next) is read meanwhile."""
        layer = load_layer(self.source, self.model, idx, self.device, self.dtype, self.reader.take(idx, ahead),
                           self.narrow_experts)
        self.reader.uploaded(idx)
        try:
            yield layer
        finally:
            release(layer)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def forward(self, layer: nn.Module, hidden: torch.Tensor, before_batch: Callable[[slice], None] | None = None,
                out: torch.Tensor | None = None, after_step: Callable[[], None] | None = None) -> torch.Tensor:
        """Run this rank's ``hidden [n, S, D]`` through ``layer`` in batches; ``before_batch(rows)`` lets hooks know
        the batch's rows (of all rows), ``after_step()`` runs after every step on every rank.

        Writes into ``out`` when given (may alias ``hidden``: each batch is read before it is overwritten).
        """
        out = torch.empty_like(hidden) if out is None else out

        def keep(rows: slice, y: torch.Tensor) -> None:
            transfer(out[rows], y)

        self._batches(layer, hidden, before_batch, keep, after_step)
        return out

    def vjp(self, layer: nn.Module, hidden: torch.Tensor, cotangent: torch.Tensor, out: torch.Tensor) -> None:
        """Vector-Jacobian products through ``layer`` at its inputs ``hidden [n, S, D]``: for each ``cotangent[r]``
        (``[R, n, S, D]``, at the layer's outputs) ``out[r] = cotangent[r] · d layer(hidden) / d hidden``, batch by
        batch (one forward with autograd per batch, then R backward passes). The layer's weights get no gradients.
        ``out`` may alias ``cotangent``: each batch is read before it is overwritten. A world of one only."""
        assert not self.world.distributed, "vjp runs in a world of one"
        frozen = [p for p in layer.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            with torch.enable_grad():
                for s in range(0, hidden.shape[0], self.batch_size):
                    rows = slice(s, s + self.batch_size)
                    x = hidden[rows].to(self.device, non_blocking=True).requires_grad_()
                    y = self.runner(layer, x)
                    cots = cotangent[:, rows].to(self.device, non_blocking=True).to(y.dtype)
                    for r in range(cots.shape[0]):
                        (grad,) = torch.autograd.grad(y, x, cots[r], retain_graph=r + 1 < cots.shape[0])
                        transfer(out[r, rows], grad)
                    del y, x
        finally:
            for p in frozen:
                p.requires_grad_(True)

    def run(self, layer: nn.Module, hidden: torch.Tensor, before_batch: Callable[[slice], None] | None = None,
            after_step: Callable[[], None] | None = None) -> None:
        """Run ``hidden`` through ``layer`` for its hooks' sake; outputs are discarded."""
        self._batches(layer, hidden, before_batch, None, after_step)

    def _batches(self, layer, hidden, before_batch, sink, after_step) -> None:
        if not self.world.distributed:  # a world of one holds every row
            self.n_rows = hidden.shape[0]
        mine = self.my_batches()
        n_steps = math.ceil(math.ceil(self.n_rows / self.batch_size) / self.world.size)
        offset = 0
        with torch.no_grad():
            for step in range(n_steps):
                if step < len(mine):
                    rows = mine[step]
                    local = slice(offset, offset + rows.stop - rows.start)
                    offset = local.stop
                    if before_batch is not None:
                        before_batch(rows)
                    y = self.runner(layer, hidden[local].to(self.device, non_blocking=True))
                    if sink is not None:
                        sink(local, y)
                if after_step is not None:
                    after_step()

    def logits_fn(self) -> tuple[nn.Module, nn.Module]:
        """Final norm and lm_head on the device (for layerwise perplexity)."""
        return load_head(self.source, self.model, self.device, self.dtype)

    def final_hidden(self, tokens: torch.Tensor, on_layer: Callable[[int], None] | None = None,
                     ) -> tuple[torch.Tensor, nn.Module]:
        """Final-norm hidden states ``[n, S, D]`` of this rank's rows (:meth:`my_rows`; all rows in a world of
        one), in the activation store, computed one decoder layer at a time, and the lm_head on the device: never
        more than one decoder layer's weights resident. ``on_layer(idx)`` after each layer (progress)."""
        hidden = self.embed(tokens)
        for idx in range(self.source.n_layers):
            with self.layer(idx) as layer:
                hidden = self.forward(layer, hidden, out=hidden)
            if on_layer is not None:
                on_layer(idx)
        norm, head = self.logits_fn()
        with torch.no_grad():
            for s in range(0, hidden.shape[0], self.batch_size):
                rows = slice(s, s + self.batch_size)
                hidden[rows] = norm(hidden[rows].to(self.device)).to(hidden.device)
        release(norm)
        return hidden, head

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-model logits ``[n, S, V]`` of this rank's rows (all rows in a world of one), computed one decoder
        layer at a time (for small token sets: every position's logits are returned)."""
        hidden, head = self.final_hidden(tokens)
        with torch.no_grad():
            return head(hidden.to(self.device))
