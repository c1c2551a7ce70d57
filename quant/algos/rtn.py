"""Round-to-nearest: the baseline. ``w [B, out, in]`` -> QuantizedWeight; needs no calibration statistics."""

from __future__ import annotations

import torch

from quant.algos.grid import QuantizedWeight, quantize_weight
from quant.scheme import Scheme


def rtn(w: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    assert w.ndim == 3, f"expected [B, out, in], got {tuple(w.shape)}"
    return quantize_weight(w, spec, scale_dtype)
