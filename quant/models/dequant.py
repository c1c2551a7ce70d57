"""Model folders whose stored tensors are not the weights: each read comes back dequantized, a chunk at a time.

``DequantizingSource`` is a ``ModelSource`` that lists *dense* names (``<module>.weight``) in ``weight_map``,
``shapes()`` and ``dtypes()``, and whose ``read_tensors`` reads a module's stored parts (packed codes, block scales,
...) and returns its dense weight. Subclasses say which stored tensors make up a dense one (``parts``) and how to
dequantize them (``dequantize``, ``_dense_shape``). The steps of a read are public (``stored_names``,
``stored_staging``, ``chunks``, ``dequantize``, ``dense_views``, ``work_device``), so each can be timed alone. Used for a quantized release read as the base model (DeepSeek-V3's
FP8 block-scaled weights, ``quant.models.fp8``) and for quant's own exported checkpoint in the streamed eval
(``quant.eval.stream.ShippedCheckpoint``), so every layer walk (profile, quantize, eval) sees dense weights.

On a GPU the stored tensors (a quarter to a half of the dense bytes) are read with parallel preads, uploaded and
dequantized there ~``DEQUANT_CHUNK_BYTES`` at a time on a stream of their own, and the dense weights are copied
into the caller's buffer (the read-ahead's page-locked staging buffer): the host never dequantizes a layer.
"""

from __future__ import annotations

import contextlib
import threading
from functools import cached_property
from pathlib import Path

import torch

from quant.io.direct_read import DTYPE_NAMES
from quant.io.staging import Staging, pin_budget, views_into
from quant.models.source import ModelSource, read_safetensors

# stored bytes uploaded and dequantized at a time on a GPU: ~1 GB dense at 4 bits, plus the dequantizer's
# temporaries (int32 codes, float products) of a few GB
DEQUANT_CHUNK_BYTES = 256 << 20


class DequantizingSource(ModelSource):
    """A model folder read through a dequantizer. After ``_set_parts``: ``raw_map`` is the stored index, ``parts``
    maps each dequantized weight to its stored tensors (the stored weight first), ``weight_map`` lists dense names.

    ``dtype``: the dense weights' dtype. ``device``: where to dequantize; None picks the current CUDA device at
    each read when there is one (a rank's read-ahead thread runs under its own device), else the CPU.
    ``processes_per_node``: processes of the job on this host, which share its page-locked memory."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str | torch.device | None = None,
                 processes_per_node: int = 1, **kw):
        super().__init__(path, **kw)
        self.dtype = dtype
        self.processes_per_node = processes_per_node
        self.device = None if device is None else torch.device(device)
        self.raw_map = self.weight_map
        self.parts: dict[str, list[str]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _set_parts(self, parts: dict[str, list[str]]) -> None:
        """Dense name -> stored tensors (the stored weight first); every stored tensor of a part leaves the dense
        view, the dense name takes the stored weight's file."""
        self.parts = parts
        self.stored_quantized = bool(parts)
        stored = {k for p in parts.values() for k in p}
        self.weight_map = {k: f for k, f in self.raw_map.items() if k not in stored}
        self.weight_map.update({k: self.raw_map[p[0]] for k, p in parts.items()})

    def dequantize(self, raw: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        """The dense tensors of ``keys`` (dequantized parts, other tensors as stored) from their stored tensors."""
        raise NotImplementedError

    def _dense_shape(self, raw: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
        """Dense shape of dequantized ``key`` from its stored tensors (on the host)."""
        raise NotImplementedError

    def _dense_shapes(self, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Dense shapes of the parts from the stored shapes (headers only)."""
        raise NotImplementedError

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Dense shapes by dense name: what a rank's share of a layer is balanced on."""
        raw = super().shapes()
        dense = self._dense_shapes(raw)
        return {k: dense[k] if k in self.parts else raw[k] for k in self.weight_map}

    def dtypes(self) -> dict[str, str]:
        raw = super().dtypes()
        return {k: DTYPE_NAMES[self.dtype] if k in self.parts else raw[k] for k in self.weight_map}

    def stored_names(self, keys: list[str]) -> list[str]:
        """The stored tensors a read of dense ``keys`` reads (each part's stored tensors, other keys as they are)."""
        return [r for k in keys for r in self.parts.get(k, [k])]

    def work_device(self) -> torch.device:
        """Where reads dequantize: ``device``, else the current CUDA device, else the CPU."""
        if self.device is not None:
            return self.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def read_tensors(self, keys: list[str], device="cpu", into=None) -> dict:
        """The dense tensors of ``keys`` on ``device``, or as views of one buffer from ``into`` (the read-ahead's
        staging buffer), dequantized on the work device a chunk at a time."""
        with self._lock:  # one read at a time: they share the stored bytes' buffer (the read-ahead thread reads
            return self._read_dense(keys, device, into)  # layers while the main thread may read the embedding)

    def _read_dense(self, keys: list[str], device, into) -> dict:
        work = self.work_device()
        gpu = work.type == "cuda"

        def stored_into(n_bytes: int) -> torch.Tensor:
            # on a GPU the stored bytes go to a page-locked buffer of their own, kept for the next read: fast uploads
            # (from a fresh pageable buffer they ran at a few GB/s, and faulting its pages in cost as much again)
            buf = self.stored_staging.into(0)(n_bytes) if gpu else None
            return buf if buf is not None else torch.empty(n_bytes, dtype=torch.uint8)

        raw = read_safetensors(self.path, self.raw_map, self.stored_names(keys), "cpu", into=stored_into)
        out = self.dense_views(raw, keys, into) if into is not None else None
        dense: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream(work)) if gpu else contextlib.nullcontext():
            for chunk in self.chunks(raw, keys):
                got = self.dequantize({r: raw[r].to(work, non_blocking=gpu) for r in self.stored_names(chunk)}, chunk)
                for k, t in got.items():
                    # a kept tensor not copied would be a view of the whole stored read
                    dense[k] = (out[k].copy_(t, non_blocking=gpu) if out is not None
                                else t.to(device, copy=k not in self.parts))
                if gpu:
                    self._stream(work).synchronize()  # the chunk's GPU tensors are reused by the next one
        return dense

    @cached_property
    def stored_staging(self) -> Staging:
        """One page-locked buffer for the stored bytes of a read; a read's uploads finish (the stream is synchronized
        after each chunk) before the next read writes it."""
        return Staging(pin_budget(self.processes_per_node))

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """Dequantization's own stream per GPU: the read-ahead thread's kernels and copies do not queue behind the
        compute."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def chunks(self, raw: dict[str, torch.Tensor], keys: list[str]) -> list[list[str]]:
        """``keys`` in runs of about ``DEQUANT_CHUNK_BYTES`` of stored bytes, a module's parts never split."""
        chunks, size = [[]], 0
        for k in keys:
            if size >= DEQUANT_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(k)
            size += sum(raw[r].numel() * raw[r].element_size() for r in self.parts.get(k, [k]))
        return [c for c in chunks if c]

    def dense_views(self, raw: dict[str, torch.Tensor], keys: list[str], into) -> dict[str, torch.Tensor] | None:
        """One view per dense tensor of ``keys`` in a buffer from ``into`` (None where it declines)."""
        layout = {k: (self._dense_shape(raw, k), self.dtype) if k in self.parts else (tuple(raw[k].shape), raw[k].dtype)
                  for k in keys}
        return views_into(layout, into)
