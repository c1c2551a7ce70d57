"""The only owner of devices and memory: one decoder layer resident at a time, activations cached.

``Layerwise`` embeds calibration tokens, then for each decoder layer loads its weights from safetensors onto
the device, runs the cached hidden states through it in batches (stages hook in with callbacks), and hands
back the layer's outputs as the next layer's inputs. Activations live on the device when they fit in
``activation_budget_bytes``, else in (pinned) CPU memory, moved batch by batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from quant.errors import RecipeError
from quant.models import ModelSource
from quant.models.layers import (
    DTYPES,
    LayerRunner,
    build_skeleton,
    load_embedding,
    load_head,
    load_layer,
    release,
)

log = logging.getLogger(__name__)


def pick_device(spec: str) -> torch.device:
    """``auto`` (cuda when present, else cpu) or a device this machine has; RecipeError for one it lacks."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    return device


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_memory_bytes(device: torch.device) -> int:
    """Memory a model on ``device`` can use: the GPU's total memory, or the host's available memory for CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Layerwise:
    """Run a model layer by layer over fixed calibration tokens ``[N, S]``."""

    def __init__(self, source: ModelSource, dtype: str, device: str, batch_size: int,
                 activation_budget_bytes: int = 8 << 30):
        self.source = source
        self.dtype = DTYPES[dtype]
        self.device = pick_device(device)
        self.batch_size = batch_size
        self.budget = activation_budget_bytes
        self.model = build_skeleton(source, self.dtype)
        self.runner = LayerRunner(self.model, self.device, self.dtype)

    def _store(self, like_shape: tuple[int, ...]) -> torch.device:
        n_bytes = torch.Size(like_shape).numel() * torch.finfo(self.dtype).bits // 8
        return self.device if n_bytes <= self.budget or self.device.type == "cpu" else torch.device("cpu")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
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
    def layer(self, idx: int) -> Iterator[nn.Module]:
        """Layer ``idx`` materialized on the device for the duration of the block."""
        layer = load_layer(self.source, self.model, idx, self.device, self.dtype)
        try:
            yield layer
        finally:
            release(layer)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def forward(self, layer: nn.Module, hidden: torch.Tensor,
                before_batch: Callable[[slice], None] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``hidden [N, S, D]`` through ``layer`` in batches; ``before_batch(rows)`` lets hooks know the rows.

        Writes into ``out`` when given (may alias ``hidden``: each batch is read before it is overwritten).
        """
        out = torch.empty_like(hidden) if out is None else out

        def keep(rows: slice, y: torch.Tensor) -> None:
            out[rows] = y.to(out.device, non_blocking=True)

        self._batches(layer, hidden, before_batch, keep)
        return out

    def run(self, layer: nn.Module, hidden: torch.Tensor, before_batch: Callable[[slice], None] | None = None) -> None:
        """Run ``hidden`` through ``layer`` for its hooks' sake; outputs are discarded."""
        self._batches(layer, hidden, before_batch, None)

    def _batches(self, layer, hidden, before_batch, sink) -> None:
        with torch.no_grad():
            for s in range(0, hidden.shape[0], self.batch_size):
                rows = slice(s, s + self.batch_size)
                if before_batch is not None:
                    before_batch(rows)
                y = self.runner(layer, hidden[rows].to(self.device, non_blocking=True))
                if sink is not None:
                    sink(rows, y)

    def logits_fn(self) -> tuple[nn.Module, nn.Module]:
        """Final norm and lm_head on the device (for layerwise perplexity)."""
        return load_head(self.source, self.model, self.device, self.dtype)

    def final_hidden(self, tokens: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
        """Final-norm hidden states ``[N, S, D]`` (in the activation store) computed one decoder layer at a time,
        and the lm_head on the device: never more than one decoder layer's weights resident."""
        hidden = self.embed(tokens)
        for idx in range(self.source.n_layers):
            with self.layer(idx) as layer:
                hidden = self.forward(layer, hidden, out=hidden)
        norm, head = self.logits_fn()
        with torch.no_grad():
            for s in range(0, hidden.shape[0], self.batch_size):
                rows = slice(s, s + self.batch_size)
                hidden[rows] = norm(hidden[rows].to(self.device)).to(hidden.device)
        release(norm)
        return hidden, head

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-model logits ``[N, S, V]`` computed one decoder layer at a time (for small token sets: every
        position's logits are returned)."""
        hidden, head = self.final_hidden(tokens)
        with torch.no_grad():
            return head(hidden.to(self.device))
