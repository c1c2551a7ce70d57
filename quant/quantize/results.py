"""What one layer's solves produce: each module's codes, the kept parameters a fold changed, and the layer's report.

:class:`LayerResults` records every batched solve's result as it comes (one host read per batch for its checks:
non-finite weights or values, a diverged solve, the worst relative weight error) and keeps the codes on the device,
packed where the store packs them, until the layer file is written.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quant.algos.gptq import diverged_message
from quant.algos.grid import QuantizedWeight
from quant.diag.hostsync import on_device
from quant.errors import NumericalError
from quant.quantize.qstore import codes_numel, pack_codes, packs

# one batched problem: element ``b`` holds the modules ``rows[b]`` as (canonical name, row slice)
Rows = list[list[tuple[str, slice]]]


@dataclass
class LayerReport:
    """One layer's quantize record. ``mean_bits``: code bits per weight over the layer's quantized weights (all
    kinds, weighted by size). ``worst_rel_error``: the largest relative weight error ``‖Ŵ − W‖ / ‖W‖`` over the
    layer's quantized modules (``worst_module``), every kind and every algorithm alike, ``W`` being the full-precision
    weight the codes store (AWQ's: after its smoothing scales). A weight error, not an output error: GPTQ trades a
    larger one for a smaller output error."""

    layer: int
    n_modules: int = 0
    n_experts: int = 0
    mean_bits: float = 0.0
    worst_rel_error: float = 0.0
    worst_module: str = ""
    seconds: float = 0.0
    load_seconds: float = 0.0
    stats_seconds: float = 0.0
    solve_seconds: float = 0.0
    forward_seconds: float = 0.0
    rtn_fallbacks: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    resumed: bool = False
    rank_solve_seconds: list[float] = field(default_factory=list)  # several ranks: each rank's solve time


class LayerResults:
    """One layer's codes (``codes``: canonical name -> QuantizedWeight), changed kept parameters (``params``) and
    report, filled as its modules are solved."""

    def __init__(self, idx: int):
        self.codes: dict[str, QuantizedWeight] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.report = LayerReport(idx)

    @contextlib.contextmanager
    def timed(self, field_name: str, device: torch.device) -> Iterator[None]:
        """Add the block's wall time (after a device sync) to ``report.<field_name>``; under torch.profiler the
        block is a range named ``quant.<field_name>`` (its host and device totals per phase)."""
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"quant.{field_name}"):
            yield
        sync()
        setattr(self.report, field_name, getattr(self.report, field_name) + time.perf_counter() - t0)

    def record(self, qw: QuantizedWeight, rows: Rows, w: torch.Tensor | None = None,
               diverged: torch.Tensor | None = None) -> torch.Tensor:
        """Store each module's codes from a batched result; track the worst relative weight error vs ``w``.
        Non-finite source weights or quantized values, or a solve that diverged (``diverged [B]``, the solver's
        unread flags), are a NumericalError naming the module. Every module's checks come back to the host in one
        read (a read per module stalled the GPU hundreds of times a layer). Returns the dequantized batch."""
        deq = qw.dequantize()
        bad = ~torch.isfinite(deq).all(dim=2)  # [B, out]
        if w is not None:
            bad |= ~torch.isfinite(w).all(dim=2)
        parts = [(b, name, r) for b, part in enumerate(rows) for name, r in part]
        per_row = [bad.double()]  # [B, out] each: summed over each module's row slice below
        if w is not None:
            per_row += [(deq.float() - w.float()).pow(2).sum(dim=2).double(), w.float().pow(2).sum(dim=2).double()]
        if diverged is not None:
            per_row.append(diverged[:, None].expand_as(bad).double())
        sums = _slice_sums(torch.stack(per_row), [(b, r) for b, _, r in parts]).tolist()  # [P][K]: the one read
        # codes kept until the layer is written: two a byte where the store packs them (half the GPU memory; the
        # batch's int8 codes are freed with it: 11.3 -> 5.7 GB at a DeepSeek-V3 layer's end)
        codes = pack_codes(qw.q, qw.spec) if packs(qw.spec, qw.q.shape[-1]) else qw.q
        for (b, name, r), vals in zip(parts, sums, strict=True):
            if diverged is not None and vals[-1] > 0:
                raise NumericalError(f"{name}: {diverged_message()}")
            if vals[0] > 0:
                raise _non_finite(name, w[b, r] if w is not None else None)
            if w is not None:
                err = math.sqrt(vals[1] / max(vals[2], 1e-24))
                if err >= self.report.worst_rel_error:
                    self.report.worst_rel_error, self.report.worst_module = err, name
            z = None if qw.zero is None else qw.zero[b, r]
            self.codes[name] = QuantizedWeight(codes[b, r], qw.scale[b, r], z, qw.spec)
        return deq

    def finish(self, seconds: float) -> LayerReport:
        """The report with the layer's totals: modules, experts, mean bits (by code count), wall time."""
        r = self.report
        r.n_modules = len(self.codes)
        r.n_experts = len({n.split(".")[3] for n in self.codes if ".experts." in n})
        numel = {n: codes_numel(q) for n, q in self.codes.items()}
        total = sum(numel.values())
        r.mean_bits = sum(self.codes[n].spec.bits * k for n, k in numel.items()) / max(total, 1)
        r.seconds = seconds
        return r


def _slice_sums(values: torch.Tensor, parts: list[tuple[int, slice]]) -> torch.Tensor:
    """``values [K, B, out]``, parts ``(b, row slice)`` -> ``[P, K]``: each part's sum over its rows, from one
    cumulative sum (no host read)."""
    assert all(isinstance(r, slice) and r.step in (None, 1) for _, r in parts), parts
    K, B, n = values.shape
    c = torch.nn.functional.pad(values.cumsum(dim=2), (1, 0))  # [K, B, out + 1]
    idx = on_device([[b, *r.indices(n)[:2]] for b, r in parts], values.device).view(-1, 3)
    b, lo, hi = idx.unbind(1)
    return (c[:, b, hi] - c[:, b, lo]).T


def _non_finite(name: str, w: torch.Tensor | None) -> NumericalError:
    if w is not None and not bool(torch.isfinite(w).all()):
        n = int((~torch.isfinite(w)).sum())
        return NumericalError(f"{name}: {n} source weight(s) are NaN or infinite; the model folder is damaged (or "
                              "was saved from a diverged training run): re-download or repair it")
    return NumericalError(f"{name}: quantization produced NaN or infinite scales or weights (values too large for "
                          "the model dtype?); keep this module (plan.protect) or use model.dtype float32")
