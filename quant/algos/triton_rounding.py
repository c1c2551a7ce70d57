"""The rounding steps ``quant.algos.grid`` takes, as Triton device functions shared by the GPTQ and AWQ kernels.

A scale or a dequantized weight is rounded to the scale dtype on its fp32 bit pattern (half to even: what a
bf16/fp16 cast does for the normal numbers involved), and codes are rounded half to even: libdevice's ``rint`` on
the GPU, ``(x + 1.5 · 2^23) − 1.5 · 2^23`` (exact for |x| < 2^22) in Triton's interpreter, which has no libdevice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MANTISSA_DROP = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # fp32 mantissa bits a cast drops


def interpreted() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1`` when triton was imported) runs the kernels on CPU tensors."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def round_bits(x, DROP: tl.constexpr):
    """``x`` (fp32) rounded to ``DROP`` fewer mantissa bits, half to even, on its bit pattern (DROP = 0 leaves it)."""
    if DROP > 0:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (-(1 << DROP))
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def rint(x, LIBDEVICE: tl.constexpr):
    """Round half to even (libdevice on the GPU, the 1.5 · 2^23 trick in the interpreter)."""
    if LIBDEVICE:
        y = libdevice.rint(x)
    else:
        y = (x + 12582912.0) - 12582912.0
    return y
