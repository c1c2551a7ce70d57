"""Where the layer-damage pass (``quant.measure.layer_damage``) keeps what it holds, so that its device memory is
proportional to a layer, not to the model's depth.

Dimensions: L decoder layers, N samples, S sequence length, D hidden; a *stream* is one ``[N, S, D]`` tensor.

- **Clean inputs** (``CleanInputs``): every decoder layer's clean input, kept by the forward walk and read back by the
  walk back. On the device when all L of them fit beside what the walk back needs there (``plan_memory``); else in
  host memory (page-locked while that is plentiful), each uploaded once, when the walk back reaches its layer, and
  dropped from the device when no branch is valued against it any more: the device then holds ``carry + 2`` of them.
- **Working streams** (the gradients, the branches being carried, those that reach the head): on the device when they
  fit, else on the host.
- **Original experts** (``ExpertOriginals``): one MoE layer's expert weights while its schemes are written, beside the
  layer where its GPU has room (else on the host, page-locked, one buffer reused layer after layer); in the dtype the
  weights came in when that holds them exactly (a bf16 checkpoint read for an fp32 pass: half the bytes).

What must stay free on the device for the walk back comes first: ``carry + 1`` layers (the one worked on and the
``carry`` above it), one layer's original experts (in 16 bits) and ``ORIGINALS_MARGIN_BYTES`` for the forwards'
transients. The originals go beside the layer only when that margin and their round-to-nearest temporaries still fit.

- **Batches** (``FittingBatches``): the pass's forwards and backward passes run the Layerwise batch; where the device
  runs out of memory for one (a DeepSeek-V3 layer in fp32 with the one above it resident) the failed batch is rerun
  at half the rows, and the pass keeps the smaller batch from there on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quant.algos.grid import QuantSpec, quantize_weight, shared_group_size
from quant.engine.layerwise import Layerwise, free_gpu_bytes
from quant.errors import RecipeError
from quant.io.staging import host_available_bytes
from quant.models.layers import ExpertsView

log = logging.getLogger("quant.measure.layer_damage")
ORIGINALS_MARGIN_BYTES = 4 << 30  # free GPU memory left beside the originals' copy (the branch forwards' transients)
EXPERT_CHUNK = 16  # experts quantized (or checked) at once (bounds the fp32 temporaries)
COMPACT_DTYPES = (torch.bfloat16, torch.float16)  # tried, in order, for an exact smaller copy of the originals
RTN_TEMP_BYTES_PER_ELEM = 12  # fp32 copy, codes and dequantized weights of the EXPERT_CHUNK experts being written


@dataclass(frozen=True)
class PassMemory:
    """Where the pass's streams live: ``working`` for the gradients and branches; ``inputs`` for every layer's clean
    input (when it is the host, the walk back uploads each one once, ``CleanInputs``); ``pinned``: host streams
    page-locked."""

    working: torch.device
    inputs: torch.device
    pinned: bool


def layer_numel(lw: Layerwise) -> int:
    """The largest decoder layer's parameter count."""
    shapes = lw.source.shapes()
    return max(sum(torch.Size(shapes[k]).numel() for k in lw.source.layer_keys(i)) for i in range(lw.source.n_layers))


def plan_memory(lw: Layerwise, stream_bytes: int, n_inputs: int, n_working: int, carry: int) -> PassMemory:
    """``n_inputs`` clean inputs and ``n_working`` working streams of ``stream_bytes`` each, placed by ``place``
    against what the device has free now."""
    if lw.device.type != "cuda":
        return PassMemory(lw.device, lw.device, False)
    working, inputs, pinned = place(free_gpu_bytes(lw.device), layer_numel(lw), lw.dtype.itemsize, stream_bytes,
                                    n_inputs, n_working, carry, host_available_bytes())
    cpu = torch.device("cpu")
    return PassMemory(lw.device if working else cpu, lw.device if inputs else cpu, pinned)


def place(free_bytes: int, layer_numel: int, dtype_bytes: int, stream_bytes: int, n_inputs: int, n_working: int,
          carry: int, host_bytes: int) -> tuple[bool, bool, bool]:
    """(working streams on the device, clean inputs on the device, host streams page-locked). The device keeps free
    what the walk back needs there (module docstring); the working streams come next, then all the inputs if they
    fit, else their window of ``carry + 2`` (which, if it does not fit either, sends the working streams to the host
    instead). Host streams are page-locked while they take at most a quarter of ``host_bytes``."""
    room = free_bytes - (carry + 1) * layer_numel * dtype_bytes - 2 * layer_numel - ORIGINALS_MARGIN_BYTES
    working = n_working * stream_bytes <= room
    room -= n_working * stream_bytes if working else 0
    inputs = n_inputs * stream_bytes <= room
    if not inputs and (carry + 2) * stream_bytes > room:
        working = False
    on_host = (0 if inputs else n_inputs) + (0 if working else n_working)
    return working, inputs, on_host * stream_bytes <= host_bytes // 4


def empty_stream(shape: tuple[int, ...], dtype: torch.dtype, where: torch.device, pinned: bool) -> torch.Tensor:
    """An uninitialized tensor on ``where`` (page-locked when on the host and ``pinned``)."""
    pin = pinned and where.type == "cpu" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device=where, pin_memory=pin)


class CleanInputs:
    """Every decoder layer's clean input: ``keep(idx, h)`` copies it during the forward walk; ``get(idx)`` hands it
    back on the device (uploaded on first use when it was kept on the host); ``drop(idx)`` forgets it."""

    def __init__(self, lw: Layerwise, memory: PassMemory):
        self.device, self.memory = lw.device, memory
        self.kept: dict[int, torch.Tensor] = {}
        self.on_device: dict[int, torch.Tensor] = {}

    def keep(self, idx: int, h: torch.Tensor) -> None:
        self.kept[idx] = empty_stream(h.shape, h.dtype, self.memory.inputs, self.memory.pinned)
        self.kept[idx].copy_(h, non_blocking=self.memory.pinned)

    def get(self, idx: int) -> torch.Tensor:
        if idx not in self.on_device:
            self.on_device[idx] = self.kept[idx].to(self.device, non_blocking=True)
        return self.on_device[idx]

    def drop(self, idx: int) -> None:
        self.kept.pop(idx, None)
        self.on_device.pop(idx, None)


def rtn_temp_bytes(view: ExpertsView) -> int:
    """Device bytes of the temporaries while ``EXPERT_CHUNK`` of the layer's experts are written round-to-nearest."""
    per_expert = view.gate_up[0].numel() + view.down[0].numel()
    return RTN_TEMP_BYTES_PER_ELEM * min(EXPERT_CHUNK, view.n_experts) * per_expert


def originals_device(view: ExpertsView, margin_bytes: int = ORIGINALS_MARGIN_BYTES, n_bytes: int | None = None
                     ) -> torch.device:
    """Where a layer's original expert weights (``n_bytes``, default their size in the layer) wait while its schemes
    are written: beside the layer on its GPU when that has room for them, the writes' temporaries and ``margin_bytes``
    (every write then reads them there), else on the host (each of the K writes copies them up again: on a
    DeepSeek-V3 layer, 22 GB a scheme)."""
    dev = view.gate_up.device
    if dev.type != "cuda":
        return torch.device("cpu")
    need = sum(p.numel() * p.element_size() for p in (view.gate_up, view.down)) if n_bytes is None else n_bytes
    return dev if free_gpu_bytes(dev) >= need + rtn_temp_bytes(view) + margin_bytes else torch.device("cpu")


class FittingBatches:
    """The bounded pass's layer forwards and backward passes, a batch of ``rows`` sequences at a time (the Layerwise
    batch at first; all 16 sequences at once measured no faster on Qwen3-30B-A3B layers); a batch the device has no
    memory for is run again at half the rows, and the smaller batch stays (one log line). ``lw.batch_size`` follows
    ``rows`` (the pass's other batched loops read it)."""

    def __init__(self, lw: Layerwise):
        self.lw = lw
        self.rows = lw.batch_size

    def forward(self, layer: torch.nn.Module, hidden: torch.Tensor, out: torch.Tensor,
                before: Callable[[slice], None] | None = None) -> torch.Tensor:
        """``lw.forward`` of ``hidden [n, S, D]`` into ``out`` (which may alias it: a batch's rows are written only
        once the batch has run, so a rerun reads its inputs intact); ``before(rows)`` ahead of each batch."""

        def call(r: slice) -> None:
            if before is not None:
                before(r)
            self.lw.forward(layer, hidden[r], out=out[r])

        self._each(hidden.shape[0], call)
        return out

    def each(self, n: int, call: Callable[[slice], object]) -> None:
        """``call(rows)`` over ``n`` rows in the pass's batches (halved as ``forward``'s are)."""
        self._each(n, call)

    def vjp(self, layer: torch.nn.Module, hidden: torch.Tensor, cotangent: torch.Tensor, out: torch.Tensor) -> None:
        """``lw.vjp`` of ``cotangent [R, n, S, D]`` at ``hidden [n, S, D]`` into ``out``."""
        self._each(hidden.shape[0], lambda r: self.lw.vjp(layer, hidden[r], cotangent[:, r], out=out[:, r]))

    def _each(self, n: int, call: Callable[[slice], object]) -> None:
        start = 0
        while start < n:
            rows = slice(start, min(start + self.rows, n))
            if _ran(call, rows):
                start = rows.stop
            else:
                self._halve()

    def _halve(self) -> None:
        if self.rows == 1:
            raise RecipeError("layer damage: one sequence through a layer does not fit the GPU beside the layers the "
                              "pass keeps there: set profile.layer_sensitivity.dtype to the model's dtype (half "
                              "the memory), a smaller carry_layers or n_samples, or method exact")
        self.rows = self.lw.batch_size = self.rows // 2
        log.info("layer damage: the GPU is out of memory for that batch; %d sequence(s) a batch from here on",
                 self.rows)


def _ran(call: Callable[[slice], object], rows: slice) -> bool:
    """Whether ``call(rows)`` ran; False, with the cache given back, when the device had no memory for it (returned
    outside the handler, so the failed batch's tensors are gone before a retry)."""
    try:
        call(rows)
        return True
    except torch.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()
    return False


def compact_dtype(weights: tuple[torch.Tensor, ...]) -> torch.dtype:
    """The smallest of ``COMPACT_DTYPES`` (narrower than the weights') that holds every value of ``weights`` exactly,
    checked a few experts at a time; else their own dtype."""
    own = weights[0].dtype
    for dt in COMPACT_DTYPES:
        if torch.finfo(dt).bits >= torch.finfo(own).bits:
            continue
        if all(torch.equal(w[s : s + EXPERT_CHUNK].to(dt).to(own), w[s : s + EXPERT_CHUNK])
               for w in weights for s in range(0, w.shape[0], EXPERT_CHUNK)):
            return dt
    return own


class ExpertOriginals:
    """One MoE layer's experts written at each scheme in turn (``write``), the originals restored on exit. The
    originals wait where ``originals_device`` says, in ``compact_dtype``; on the host in ``host`` buffers (a dict the
    pass keeps, so that layer after layer reuses the same page-locked memory)."""

    def __init__(self, view: ExpertsView, host: dict[tuple, torch.Tensor] | None = None):
        self.view = view
        params = (view.gate_up.data, view.down.data)
        dt = compact_dtype(params)
        n_bytes = sum(p.numel() for p in params) * dt.itemsize
        where = originals_device(view, n_bytes=n_bytes)
        self.originals = tuple(_copy(p, where, dt, host, slot) for slot, p in enumerate(params))

    def write(self, bits: int, group: int) -> None:
        """Put round-to-nearest copies of the original expert weights into the layer, a few experts at a time, one
        group size for the layer's projections (as the plan resolves it)."""
        group = shared_group_size(group, (self.originals[0].shape[2], self.originals[1].shape[2]))
        for param, orig in ((self.view.gate_up, self.originals[0]), (self.view.down, self.originals[1])):
            spec = QuantSpec(bits, group)
            for s in range(0, orig.shape[0], EXPERT_CHUNK):
                chunk = orig[s : s + EXPERT_CHUNK].to(param.device, param.dtype, non_blocking=True)
                param.data[s : s + EXPERT_CHUNK] = quantize_weight(chunk, spec, chunk.dtype).dequantize()

    def __enter__(self) -> ExpertOriginals:
        return self

    def __exit__(self, *exc) -> None:
        for param, orig in zip((self.view.gate_up, self.view.down), self.originals, strict=True):
            param.data.copy_(orig)
        self.view, self.originals = None, None  # the view holds the layer's expert weights


def _copy(p: torch.Tensor, where: torch.device, dt: torch.dtype, host: dict[tuple, torch.Tensor] | None,
          slot: int) -> torch.Tensor:
    if where.type != "cpu" or p.device.type == "cpu" or host is None:
        return p.to(where, dt, copy=True)
    key = (slot, tuple(p.shape), dt)
    if key not in host:
        host[key] = torch.empty(p.shape, dtype=dt, pin_memory=True)
    return host[key].copy_(p)
