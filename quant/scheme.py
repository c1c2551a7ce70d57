"""The one quantization scheme type: integer bits, group size along the input, symmetric or with zero points.

The recipe names a layer's scheme as ``w4g128`` (``Scheme.parse``), the plan gives each quantized module one, the
math of ``algos/`` and the quantize engine quantize to it, and the export writers and the vLLM plugin read it;
compressed-tensors' own types appear only where a checkpoint's config is written or read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VALID_BITS = (2, 3, 4, 8)
_NAME = re.compile(r"^w(\d+)g(\d+)$")


@dataclass(frozen=True, order=True)
class Scheme:
    """``group_size``: the group along a weight's input (in a plan and after it, the effective one, already clamped
    to the input width, never -1)."""

    bits: int
    group_size: int
    symmetric: bool = True

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def pack_factor(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits

    @property
    def label(self) -> str:
        """``w4g128`` (``w4g128a`` with zero points): how recipes, profiles and logs name a scheme."""
        return f"w{self.bits}g{self.group_size}{'' if self.symmetric else 'a'}"

    @classmethod
    def parse(cls, name: str) -> Scheme:
        """``"w4g128"`` -> the symmetric scheme of 4 bits in groups of 128: one expert scheme of a whole MoE layer,
        as recipes and profiles name it (a group of a power of two >= 8; per channel is not offered here)."""
        m = _NAME.match(str(name))
        if not m:
            raise ValueError(f"a layer scheme is written w<bits>g<group>, e.g. w4g128 or w8g32; got {name!r}")
        bits, group = int(m.group(1)), int(m.group(2))
        if bits not in VALID_BITS:
            raise ValueError(f"bits of scheme {name!r} must be one of {VALID_BITS}")
        if group < 8 or group & (group - 1):
            raise ValueError(f"group of scheme {name!r} must be a power of two >= 8 (per channel is not offered here)")
        return cls(bits, group)
