"""Host memory for uploads to the GPU: page-locked staging buffers that a layer is read into ahead of its use.

A copy to the GPU from pageable memory makes the host wait for the queued kernels and runs at a fraction of the
link's speed; from page-locked memory it is asynchronous and runs at ~55 GB/s on an H200 host. ``Staging`` holds
two buffers (one being read into while the other uploads); ``copy_into`` puts tensors that were computed rather
than read (e.g. dequantized on a CPU) into one, ``views_into`` lays out tensors a GPU will write there (dequantized
on the GPU, copied back). Owned and used by ``quant.layerwise``.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


ALIGN_BYTES = 64  # each tensor's offset in a shared buffer (any dtype's alignment)


def aligned_offsets(n_bytes: list[int]) -> tuple[list[int], int]:
    """Offsets of consecutive blocks of ``n_bytes`` in one buffer, each ``ALIGN_BYTES``-aligned, and its size."""
    offsets, total = [], 0
    for n in n_bytes:
        offsets.append(total)
        total += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, total


def views_at(buf: torch.Tensor, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], offsets: list[int]
             ) -> dict[str, torch.Tensor]:
    """``name: (shape, dtype)`` as views of ``uint8`` buffer ``buf`` at ``offsets`` (in ``layout``'s order)."""
    return {key: buf[off : off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (key, (shape, dtype)), off in zip(layout.items(), offsets, strict=True)}


def views_into(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], into: Callable[[int], torch.Tensor | None]
               ) -> dict[str, torch.Tensor] | None:
    """One uninitialized view per ``name: (shape, dtype)`` of one ``uint8`` buffer from ``into(total bytes)``, laid
    out by ``aligned_offsets``; None when ``into`` declines."""
    offsets, total = aligned_offsets([math.prod(shape) * dtype.itemsize for shape, dtype in layout.values()])
    buf = into(total) if layout else None
    return None if buf is None else views_at(buf, layout, offsets)


def copy_into(tensors: dict[str, torch.Tensor], into: Callable[[int], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """``tensors`` (CPU) copied into one ``uint8`` buffer from ``into(total bytes)`` (``views_into``), returned as its
    views; as they are when ``into`` declines (None). For tensors a source computes rather than reads (e.g.
    dequantized ones on a CPU) into a staging buffer, so that their upload is asynchronous too."""
    views = views_into({k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}, into)
    if views is None:
        return tensors
    for key, t in tensors.items():
        views[key].copy_(t)
    return views


class Staging:
    """Page-locked host buffers for read-ahead, reused layer after layer: buffer ``idx % 2`` holds layer ``idx``, so
    one is read into while the other uploads. Each is pinned at its size in whole pages with ``cudaHostRegister``
    (torch's pinned allocator rounds an allocation up to a power of two: 32 GB for a 23 GB DeepSeek-V3 layer, 64 GB
    for the pair) and replaced by a larger one when a larger layer comes. A buffer is written again only after the
    uploads queued from it have finished (``uploaded`` records an event after a layer's copies; ``into`` waits on
    it)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.used = [False, False]
        self.refused = False  # CUDA refused a registration: every later read declines at once (no retry per layer)
        self._registered: list[torch.Tensor] = []  # unpinned when this object goes (they live until then)
        weakref.finalize(self, _unregister, self._registered).atexit = False  # at exit the process frees them

    def into(self, slot: int) -> Callable[[int], torch.Tensor | None]:
        """The ``into`` of ``ModelSource.read_tensors`` for buffer ``slot`` (None: over budget). ``used[slot]`` says
        afterwards whether the read went into the buffer (a source that computes its tensors never calls it)."""
        self.used[slot] = False

        def alloc(n_bytes: int) -> torch.Tensor | None:
            if n_bytes > self.budget or self.refused:
                return None
            if self.events[slot] is not None:
                self.events[slot].synchronize()
            buf = self.bufs[slot]
            if buf is None or buf.numel() < n_bytes:
                if buf is not None:  # its uploads are done (above): unpinned, freed with its last view
                    self._registered[:] = [b for b in self._registered if b is not buf]  # (no tensor ==)
                    _unregister([buf])
                self.bufs[slot] = None
                buf = page_locked(n_bytes)
                if buf is None:
                    self.refused = True
                    return None
                self._registered.append(buf)
                self.bufs[slot] = buf
            self.used[slot] = True
            return buf[:n_bytes]

        return alloc

    def uploaded(self, slot: int) -> None:
        """Layer uploads from buffer ``slot`` are queued on the current stream: it is free once they finish."""
        if self.bufs[slot] is not None:
            self.events[slot] = torch.cuda.Event()
            self.events[slot].record()


def host_available_bytes() -> int:
    """The host's available memory (``MemAvailable``), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_total_bytes() -> int:
    """The host's memory: its physical memory, or the cgroup's limit (a container, a Slurm job) when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def pin_budget(processes_per_node: int) -> int:
    """Largest buffer (bytes) one process pins for reads: a quarter of the host's available memory per process on
    the node (``processes_per_node``, the world's ``local_size``: a DeepSeek-V3 layer, 23 GB, on a 128 GB host with
    one GPU; a rank's 1/8 share on an 8-GPU node)."""
    return host_available_bytes() // (4 * max(1, processes_per_node))


def page_locked(n_bytes: int) -> torch.Tensor | None:
    """A CPU ``uint8`` buffer of at least ``n_bytes`` on pages of its own, page-locked by ``cudaHostRegister`` (None,
    with a warning, when CUDA refuses). Registration is per page, so a buffer sharing a page with another registered
    one would be refused: the buffer is page-aligned inside a slightly larger allocation. Its pages are faulted in
    first by a fill that runs on every core (the registration would fault them one by one on one core)."""
    page = mmap.PAGESIZE
    size = -(-n_bytes // page) * page
    raw = torch.empty(size + page, dtype=torch.uint8)
    buf = raw[-raw.data_ptr() % page :][:size]
    buf.zero_()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), size, 1)  # cudaHostRegisterPortable: pinned for every context
    if err != cudart.cudaError.success:
        log.warning("cudaHostRegister of %d bytes failed (%s); read-ahead reads into pageable memory instead "
                    "(slower, synchronous uploads)", size, err)
        return None
    return buf


def _unregister(bufs: list[torch.Tensor]) -> None:
    for buf in bufs:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    bufs.clear()
