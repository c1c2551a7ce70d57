"""Host syncs, found on any device: the calls that would make the host wait for a GPU, by the source line that made them.

A GPU run whose kernels take 1.2 s per layer can take 2.2 s when the host stops thousands of times to read a value
back (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, a boolean-mask index, ``nonzero``): each stop drains the
queue of launched kernels, and the next kernels start only after Python has gone on. torch's own
``torch.cuda.set_sync_debug_mode`` needs a GPU; :class:`HostSyncs` counts the same calls on a CPU run (where they
cost nothing), so a test can bound them and a scaled-down run can name them.

Counted: ops that return a host value or a data-dependent shape (``aten._local_scalar_dense`` behind ``item`` and
``bool``, ``nonzero``, ``masked_select``, ``unique``, ``bincount`` (CUDA reads its min and max), ``repeat_interleave``
without a given output size, indexing with a boolean mask), and ``Tensor.tolist`` / ``Tensor.cpu`` / ``Tensor.numpy`` on any tensor (on a
GPU they copy to the host). Not counted: host-to-device copies (asynchronous from pinned memory) and syncs inside
kernels' own code.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quant.diag.memtrace import caller_site, package_root

_aten = torch.ops.aten
_ALWAYS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
           _aten._unique2.default, _aten.unique_consecutive.default, _aten.unique_dim.default}
_UNLESS_SIZED = {_aten.repeat_interleave.Tensor: "output_size", _aten.repeat_interleave.self_Tensor: "output_size",
                 _aten.bincount.default: None}
_INDEX = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default}
_METHODS = ("tolist", "cpu", "numpy")


def _needs_host(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func in _UNLESS_SIZED:
        key = _UNLESS_SIZED[func]
        return key is None or kwargs.get(key) is None
    if func in _INDEX:  # a boolean mask index becomes nonzero inside the kernel
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
    return False


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as s: ...`` -> ``s.sites``: Counter of ``"file.py:line function (what)"`` -> calls, the
    innermost frame under ``package`` (default this package); ``s.total``. Only the entering thread is counted."""

    def __init__(self, package: str | None = None):
        super().__init__()
        self._root = package_root(package)
        self._thread = threading.get_ident()
        self._saved: dict[str, object] = {}
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _count(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            return
        self.sites[f"{caller_site(self._root, 'hostsync.py') or '(outside)'} ({what})"] += 1

    def __enter__(self) -> HostSyncs:
        for name in _METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **kw):
                self._count(_name)
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _needs_host(func, args, kwargs):
            self._count(func.__name__.split(".")[0])
        return func(*args, **kwargs)


def on_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list of ints, a number, a CPU tensor) as a tensor on ``device`` without making the host wait:
    a copy to a GPU from pageable memory first synchronizes the stream (what ``torch.tensor(values, device=cuda)``
    does), one from page-locked memory is queued like a kernel. Use it for every index list a GPU path builds.
    ``dtype`` applies to Python values; a tensor keeps its own."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values for the host, without waiting now: a non-blocking copy into page-locked memory and
    an event. :meth:`tolist` waits for that copy alone, so a consumer that asks one batch later (after the next
    batch's kernels were queued) finds it done and the GPU never drains. On a CPU it is the tensor itself."""

    def __init__(self, t: torch.Tensor):
        if t.is_cuda:
            self.values = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.values.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values, self.event = t, None

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()
