"""Integer grids: group-wise scales and zero points, quantize, dequantize. Pure tensor functions.

Shapes: weights are ``[B, out, in]`` (B = a batch of experts or 1), groups run along ``in``:
``scale, zero: [B, out, in // group_size]``. Codes are signed ``int8`` in ``[-2^(b-1), 2^(b-1) - 1]``
(compressed-tensors' convention; the GPTQ writer shifts them to unsigned).

Dequantization is defined exactly as compressed-tensors does it: ``(q - zero) * scale`` computed in the
scale's dtype. Scales are rounded to that dtype *before* the codes are chosen, so the codes are optimal for
the scale that ships and every exporter reproduces the pipeline's weights bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.scheme import Scheme

_MIN_SCALE = 1e-10


@dataclass
class QuantizedWeight:
    """Codes ``q [B, out, in]`` (int8), ``scale [B, out, G]`` (scale dtype), ``zero [B, out, G]`` (int8) or None."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: Scheme

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, self.spec.group_size)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether every value of batch element ``b`` of ``t [B, ...]`` is finite (on ``t``'s device, no
    host read)."""
    return torch.isfinite(t).flatten(1).all(1)


def effective_group_size(group_size: int, in_features: int) -> int:
    """-1 means one group per row; larger than the row means the row."""
    return in_features if group_size == -1 or group_size > in_features else group_size


def shared_group_size(requested: int, widths) -> int:
    """One group size for modules of input widths ``widths`` that must share a scheme: the largest power of two
    <= ``requested`` (> 0) dividing every width."""
    group = requested
    while group > 1 and any(w % group for w in widths):
        group //= 2
    return group


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    B, out, n_in = w.shape
    assert n_in % group_size == 0, f"in_features {n_in} not divisible by group size {group_size}"
    return w.reshape(B, out, n_in // group_size, group_size)


def fit_grid(w: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max grid per group of ``w [B, out, in]`` -> ``scale [B, out, G]`` (scale_dtype), ``zero`` or None."""
    assert w.ndim == 3, f"expected [B, out, in], got {tuple(w.shape)}"
    g = _grouped(w.float(), spec.group_size)
    levels = spec.qmax - spec.qmin
    if spec.symmetric:
        scale = g.abs().amax(dim=-1) / (levels / 2)
        return _to_scale_dtype(scale, scale_dtype), None
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = _to_scale_dtype((hi - lo) / levels, scale_dtype)
    zero = torch.round(spec.qmin - lo / scale.float()).clamp(spec.qmin, spec.qmax).to(torch.int8)
    return scale, zero


def _to_scale_dtype(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Cast, then floor at the dtype's smallest normal number: an all-zero group must not get scale 0 (fp16 would
    round a tiny fp32 floor to 0 and the codes to NaN)."""
    return scale.clamp_min(_MIN_SCALE).to(scale_dtype).clamp_min(torch.finfo(scale_dtype).tiny)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: Scheme) -> torch.Tensor:
    """Codes of ``w [B, out, in]`` on the given grid (round half to even, clamped), as int8."""
    g = _grouped(w.float(), spec.group_size)
    x = g / scale.float().unsqueeze(-1)
    if zero is not None:
        x = x + zero.float().unsqueeze(-1)
    q = torch.round(x).clamp(spec.qmin, spec.qmax)
    return q.reshape(w.shape).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``(q - zero) * scale`` in the scale's dtype, exactly as compressed-tensors decompresses."""
    g = _grouped(q, group_size).to(scale.dtype)
    if zero is not None:
        g = g - zero.to(scale.dtype).unsqueeze(-1)
    return (g * scale.unsqueeze(-1)).reshape(q.shape)


def quantize_weight(w: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Round-to-nearest on a min/max grid: the baseline every other algorithm must beat."""
    scale, zero = fit_grid(w, spec, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zero, spec), scale, zero, spec)
