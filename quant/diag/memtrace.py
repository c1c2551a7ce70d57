"""Live tensor bytes on any device: the peak of what torch ops allocate inside a block, and what was alive at it.

``torch.cuda.max_memory_allocated`` says how high a GPU run went, not why. :class:`LiveBytes` answers both, on
CPUs too (so a scaled-down run of a giant shape can be traced in CI or on a laptop): a ``TorchDispatchMode`` that
sees every op's outputs, counts each new storage once (outputs that share an input's storage are views or
in-place results, not allocations), and releases it when the storage itself is freed (a finalizer on torch's
storage object, which lives as long as the storage: a tensor re-wrapped as an ``nn.Parameter`` still counts). At each new peak
(``step`` bytes above the last one recorded) it keeps the live bytes per allocation site: the innermost frame of
the code under study (``package``; default this package) that made the op, ``file.py:line function``.

What it does not see: tensors made outside the block or without an op (safetensors loads, ``torch.frombuffer``),
and buffers a kernel allocates for itself (cuBLAS/LAPACK workspaces, the caching allocator's rounding). Those are
what a GPU run adds on top; the sites tell which code holds the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # meta, sparse, functional wrappers
        return None


@dataclass
class Peak:
    """The peak live bytes and, per allocation site, what was alive then (largest first)."""

    bytes: int = 0
    sites: list[tuple[str, int]] = field(default_factory=list)

    def table(self, top: int = 12, unit: float = 1e9, scale: float = 1.0) -> str:
        """Text table of the peak's largest sites, in ``unit`` bytes times ``scale`` (e.g. a shape's scale factor)."""
        lines = [f"peak {self.bytes * scale / unit:.3f}"]
        lines += [f"  {n * scale / unit:9.3f}  {site}" for site, n in self.sites[:top]]
        rest = sum(n for _, n in self.sites[top:])
        if rest:
            lines.append(f"  {rest * scale / unit:9.3f}  ({len(self.sites) - top} more sites)")
        return "\n".join(lines)


def package_root(package: str | None) -> str:
    """The folder whose source lines name sites (allocations here, host reads in ``hostsync``): ``package``, by
    default this package."""
    return (package or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).rstrip(os.sep) + os.sep


def caller_site(root: str, skip: str) -> str | None:
    """``"file.py:line function"`` of the innermost frame of the calling stack whose file lies under ``root`` and is
    not named ``skip`` (the tracer's own module), or None."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(root) and os.path.basename(path) != skip:
            return f"{os.path.basename(path)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return None


def _peak(total: int, live) -> Peak:
    """A :class:`Peak` of ``total`` bytes from the live ``(nbytes, site)`` pairs, summed per site."""
    by_site: Counter[str] = Counter()
    for nbytes, site in live:
        by_site[site] += nbytes
    return Peak(total, by_site.most_common())


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` -> ``m.peak`` (:class:`Peak`; its sites are a snapshot taken within ``step``
    bytes of the peak), ``m.current``, and ``m.phase_peaks`` for blocks run inside ``with m.phase(label)``. Only
    the thread that entered is traced; other threads' ops pass through."""

    def __init__(self, package: str | None = None, step: int = 1 << 20):
        super().__init__()
        self._root = package_root(package)
        self._step = step
        self._live: dict[int, tuple[int, str]] = {}  # data_ptr -> (nbytes, site)
        self._thread = threading.get_ident()
        self._phase: str | None = None
        self.current = 0
        self.peak = Peak()
        self.phase_peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """The peak live bytes while inside the block go to ``phase_peaks[label]`` (the largest over every entry)."""
        outer, self._phase = self._phase, label
        self.phase_peaks[label] = max(self.phase_peaks.get(label, 0), self.current)
        try:
            yield
        finally:
            self._phase = outer

    def _site(self) -> str:
        return caller_site(self._root, "memtrace.py") or "(outside)"

    def _release(self, ptr: int) -> None:
        entry = self._live.pop(ptr, None)
        if entry is not None:
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if threading.get_ident() != self._thread:
            return out
        inputs = {st.data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                  for st in [_storage(a)] if st is not None}
        grew = False
        for t in tree_flatten(out)[0]:
            st = _storage(t) if isinstance(t, torch.Tensor) and not t.is_meta else None  # meta: no bytes
            if st is None or st.nbytes() == 0:
                continue
            ptr = st.data_ptr()
            if ptr in self._live or ptr in inputs:  # known, or a view / in-place result of a tensor made outside
                continue
            self._live[ptr] = (st.nbytes(), self._site())
            self.current += st.nbytes()
            weakref.finalize(st, self._release, ptr)
            grew = True
        if grew:
            if self._phase is not None and self.current > self.phase_peaks.get(self._phase, 0):
                self.phase_peaks[self._phase] = self.current
            if self.current >= self.peak.bytes + self._step or (self.current > self.peak.bytes and not self.peak.sites):
                self.peak = _peak(self.current, self._live.values())
            elif self.current > self.peak.bytes:
                self.peak.bytes = self.current
        return out


def peak_from_snapshot(snapshot: dict, device: int, package: str | None = None, step: int = 1 << 28) -> Peak:
    """The same table for a CUDA run: replay ``torch.cuda.memory._snapshot()``'s trace of ``device`` (recorded with
    ``torch.cuda.memory._record_memory_history(stacks="python")``), live bytes per site at the peak. What was
    allocated before the trace began counts as one ``(before the trace)`` site; unlike :class:`LiveBytes` this sees
    every block of the caching allocator (kernel workspaces, collectives' buffers made by torch) but not memory
    outside it (NCCL's own). Sites are a snapshot within ``step`` bytes of the peak."""
    root = package_root(package)
    events = snapshot["device_traces"][device]
    allocated = sum(b["size"] for seg in snapshot["segments"] if seg["device"] == device
                    for b in seg["blocks"] if b["state"] == "active_allocated")
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in events
              if e["action"] in ("alloc", "free_completed"))
    live: dict[int, tuple[int, str]] = {}
    base = allocated - net
    current, peak = base, Peak(base, [("(before the trace)", base)])
    for e in events:
        if e["action"] == "alloc":
            site = next((f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in e.get("frames", ())
                         if f["filename"].startswith(root)), "(outside)")
            live[e["addr"]] = (e["size"], site)
            current += e["size"]
            if current >= peak.bytes + step:
                peak = _peak(current, [(base, "(before the trace)"), *live.values()])
            elif current > peak.bytes:
                peak.bytes = current
        elif e["action"] == "free_completed":
            current -= live.pop(e["addr"], (e["size"], ""))[0]
    return peak


class CudaTrace:
    """``with CudaTrace() as t: ...`` -> ``t.peak``: :func:`peak_from_snapshot` of the current CUDA device over the
    block (None where there is no GPU). The allocator keeps up to ``max_entries`` events with Python stacks (about
    a kilobyte of host memory each)."""

    def __init__(self, max_entries: int = 1_000_000, step: int = 1 << 28):
        self.max_entries, self.step = max_entries, step
        self.peak: Peak | None = None

    def __enter__(self) -> CudaTrace:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=self.max_entries)
        return self

    def __exit__(self, *exc) -> None:
        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.peak = peak_from_snapshot(snapshot, torch.cuda.current_device(), step=self.step)
