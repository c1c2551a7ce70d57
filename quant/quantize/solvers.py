"""The batched solvers the layer drivers call: ``algos/`` math behind one signature.

A solver takes ``w [B, out, in]``, the batch's Hessians ``H [B, in, in]`` (None where the algorithm needs none),
the quantization spec, the scale dtype and the recipe's ``quantize`` section, and returns the quantized batch, its
numerical repairs ``[(batch index, why)]`` and its diverged flags ``[B]`` (None, or a tensor the caller reads with
its own checks: no host read here).
"""

from __future__ import annotations

from typing import Protocol

import torch

from quant.algos.grid import QuantizedWeight
from quant.algos.rtn import rtn
from quant.recipe import QuantizeSpec
from quant.scheme import Scheme

Solved = tuple[QuantizedWeight, list[tuple[int, str]], torch.Tensor | None]


class Solver(Protocol):
    def __call__(self, w: torch.Tensor, H: torch.Tensor | None, spec: Scheme, scale_dtype: torch.dtype,
                 q: QuantizeSpec) -> Solved: ...


def solve_rtn(w: torch.Tensor, H: torch.Tensor | None, spec: Scheme, scale_dtype: torch.dtype,
              q: QuantizeSpec) -> Solved:
    """Round to nearest (``H`` unused)."""
    return rtn(w, spec, scale_dtype), [], None


def solve_gptq(w: torch.Tensor, H: torch.Tensor | None, spec: Scheme, scale_dtype: torch.dtype,
               q: QuantizeSpec) -> Solved:
    """GPTQ given ``H``, with the recipe's dampening, block size and act order."""
    from quant.algos.gptq import gptq

    res = gptq(w, H, spec, scale_dtype, dampening=q.dampening, block_size=q.block_size, act_order=q.act_order,
               with_loss=False, check_diverged=False)
    return res.weight, list(res.repairs), res.diverged
