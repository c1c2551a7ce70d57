"""Where the layer-damage pass (``quant.profile.layer_damage``) keeps what it holds, so that its device memory is
proportional to a layer and its host memory does not grow with the model's depth.

Dimensions: L decoder layers, N samples, S sequence length, D hidden; a *stream* is one ``[N, S, D]`` tensor.

- **Layers**: the pass's dtype for everything but the routed experts, which stay in the checkpoint's narrower dtype
  (a bf16 checkpoint's DeepSeek-V3 layer is 23 GB, not 46 GB in fp32) and are widened as they run
  (``models.expert_compute``); a scheme's round-to-nearest is applied as they are widened, so no copy of the
  original experts is ever kept.
- **Clean inputs** (``CleanInputs``): every decoder layer's clean input, kept by the forward walk and read back by the
  walk back. On the device when all L of them fit beside what the walk back needs there (``plan_memory``); else in
  page-locked host memory while they take at most a quarter of it; else in files in the temporary directory (the
  page cache holds them while the host has room, and gives the memory back when it has not), each read back once.
  The walk back uploads each when it reaches its layer and drops it from the device when no branch is valued
  against it any more: the device then holds ``carry + 2`` of them.
- **Working streams** (the gradients, the branches being carried, those that reach the head): on the device when they
  fit, else on the host.

What must stay free on the device for the walk back comes first: ``carry + 1`` layers (the one worked on and the
``carry`` above it) and ``FORWARD_MARGIN_BYTES`` for the forwards' transients (a batch's activations, a few widened
experts and their round-to-nearest temporaries).

- **Batches** (``FittingBatches``): the pass's forwards and backward passes run the Layerwise batch; where the device
  runs out of memory for one the failed batch is rerun at half the rows, and the pass keeps the smaller batch from
  there on.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.errors import RecipeError
from quant.io.staging import host_available_bytes
from quant.io.storage import free_bytes, remove_stale
from quant.layerwise import Layerwise, free_gpu_bytes
from quant.models.layers import largest_layer_bytes

log = logging.getLogger("quant.profile.layer_damage")
FORWARD_MARGIN_BYTES = 8 << 30  # free GPU memory beside what the walk back holds (a batch forward's transients)
SPILL_PREFIX = "quant-damage-"  # + pid: the clean inputs' files (storage.remove_stale clears a killed run's)


@dataclass(frozen=True)
class PassMemory:
    """Where the pass's streams live: ``working`` for the gradients and branches; ``inputs`` for every layer's clean
    input (when it is the host, the walk back uploads each one once, ``CleanInputs``); ``pinned``: host streams
    page-locked; ``spill``: the clean inputs in files (``inputs`` is then the host, for each one read back)."""

    working: torch.device
    inputs: torch.device
    pinned: bool
    spill: bool = False


def pass_layer_bytes(lw: Layerwise) -> int:
    """The largest decoder layer's bytes as the pass holds it (routed experts narrow where ``lw`` keeps them so)."""
    return largest_layer_bytes(lw.source, lw.dtype, lw.narrow_experts)


def plan_memory(lw: Layerwise, stream_bytes: int, n_inputs: int, n_working: int, carry: int) -> PassMemory:
    """``n_inputs`` clean inputs and ``n_working`` working streams of ``stream_bytes`` each, placed by ``place``
    against what the device has free now; clean inputs that ``place`` sends to files go to the host instead where the
    temporary directory has no room for them (one log line), and the pass is refused where the host has none either."""
    if lw.device.type != "cuda":
        return PassMemory(lw.device, lw.device, False)
    host = host_available_bytes()
    working, inputs, pinned = place(free_gpu_bytes(lw.device), pass_layer_bytes(lw), stream_bytes, n_inputs,
                                    n_working, carry, host)
    cpu = torch.device("cpu")
    spill = inputs == "disk"
    need = n_inputs * stream_bytes
    if spill and free_bytes(Path(tempfile.gettempdir())) < need + FORWARD_MARGIN_BYTES:
        if need + (0 if working else n_working * stream_bytes) > host:
            raise RecipeError(f"layer damage: the {n_inputs} layers' clean inputs ({need / 1e9:.1f} GB) fit neither "
                              f"the GPU, the host's memory ({host / 1e9:.1f} GB available) nor the temporary "
                              f"directory {tempfile.gettempdir()} ({free_bytes(Path(tempfile.gettempdir())) / 1e9:.1f} "
                              "GB free): point TMPDIR at a larger disk, or lower profile.layer_sensitivity.n_samples")
        log.info("layer damage: %s has no room for the clean inputs (%.1f GB); they stay in host memory",
                 tempfile.gettempdir(), need / 1e9)
        spill = False
    return PassMemory(lw.device if working else cpu, lw.device if inputs == "device" else cpu, pinned, spill)


def place(free_bytes: int, layer_bytes: int, stream_bytes: int, n_inputs: int, n_working: int, carry: int,
          host_bytes: int) -> tuple[bool, str, bool]:
    """(working streams on the device, where the clean inputs go: ``device``, ``host`` or ``disk``, host streams
    page-locked). The device keeps free what the walk back needs there (module docstring); the working streams come
    next, then all the inputs if they fit, else their window of ``carry + 2`` (which, if it does not fit either,
    sends the working streams to the host instead). Inputs off the device stay in host memory while they take at
    most a quarter of ``host_bytes``, else go to files; host streams are page-locked while they take at most a
    quarter of it."""
    room = free_bytes - (carry + 1) * layer_bytes - FORWARD_MARGIN_BYTES
    working = n_working * stream_bytes <= room
    room -= n_working * stream_bytes if working else 0
    on_device = n_inputs * stream_bytes <= room
    if not on_device and (carry + 2) * stream_bytes > room:
        working = False
    inputs = "device" if on_device else "host" if n_inputs * stream_bytes <= host_bytes // 4 else "disk"
    on_host = (n_inputs if inputs == "host" else 0) + (0 if working else n_working)
    return working, inputs, on_host * stream_bytes <= host_bytes // 4


def empty_stream(shape: tuple[int, ...], dtype: torch.dtype, where: torch.device, pinned: bool) -> torch.Tensor:
    """An uninitialized tensor on ``where`` (page-locked when on the host and ``pinned``)."""
    pin = pinned and where.type == "cpu" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device=where, pin_memory=pin)


class CleanInputs:
    """Every decoder layer's clean input: ``keep(idx, h)`` copies it during the forward walk; ``get(idx)`` hands it
    back on the device (uploaded on first use when it was kept on the host or in a file); ``drop(idx)`` forgets it.
    A context manager: on exit the files are gone (a killed run's go with the next run's ``remove_stale``)."""

    def __init__(self, lw: Layerwise, memory: PassMemory):
        self.device, self.memory = lw.device, memory
        self.kept: dict[int, torch.Tensor | _Spilled] = {}
        self.on_device: dict[int, torch.Tensor] = {}
        self.dir: Path | None = None
        self._buffer: torch.Tensor | None = None  # one stream in host memory (page-locked): the files' way in and out
        if memory.spill:
            tmp = Path(tempfile.gettempdir())
            remove_stale(tmp, SPILL_PREFIX)
            self.dir = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=tmp))

    def __enter__(self) -> CleanInputs:
        return self

    def __exit__(self, *exc) -> None:
        self.kept.clear()
        self.on_device.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def keep(self, idx: int, h: torch.Tensor) -> None:
        if self.dir is not None:
            self.kept[idx] = self._write(idx, h)
            return
        self.kept[idx] = empty_stream(h.shape, h.dtype, self.memory.inputs, self.memory.pinned)
        self.kept[idx].copy_(h, non_blocking=self.memory.pinned)

    def get(self, idx: int) -> torch.Tensor:
        if idx not in self.on_device:
            kept = self.kept[idx]
            if isinstance(kept, _Spilled):  # read into the one host buffer, uploaded before the next read
                self.on_device[idx] = self._read(kept).to(self.device, copy=True)
            else:
                self.on_device[idx] = kept.to(self.device, non_blocking=True)
        return self.on_device[idx]

    def drop(self, idx: int) -> None:
        kept = self.kept.pop(idx, None)
        self.on_device.pop(idx, None)
        if isinstance(kept, _Spilled):
            kept.path.unlink(missing_ok=True)

    def _host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self._buffer is None or self._buffer.shape != shape or self._buffer.dtype != dtype:
            self._buffer = empty_stream(shape, dtype, torch.device("cpu"), True)
        return self._buffer

    def _write(self, idx: int, h: torch.Tensor) -> _Spilled:
        buf = self._host_buffer(h.shape, h.dtype)
        buf.copy_(h)  # synchronous: the file is written from it next
        spilled = _Spilled(self.dir / f"{idx}.bin", h.shape, h.dtype)
        with open(spilled.path, "wb") as f:
            f.write(buf.view(torch.uint8).numpy().data)
        return spilled

    def _read(self, spilled: _Spilled) -> torch.Tensor:
        buf = self._host_buffer(spilled.shape, spilled.dtype)
        with open(spilled.path, "rb") as f:
            if f.readinto(buf.view(torch.uint8).numpy().data) != buf.numel() * buf.element_size():
                raise RuntimeError(f"layer damage: {spilled.path} came back short (the temporary directory changed)")
        return buf


@dataclass(frozen=True)
class _Spilled:
    """A clean input kept in a file."""

    path: Path
    shape: torch.Size
    dtype: torch.dtype


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
