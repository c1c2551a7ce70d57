"""Disk a run will write before it writes it: the quantized store (``quantized/``) and each checkpoint format.

Sizes follow the writers' layouts: the store keeps each code in half a byte (up to 4 bits, an even number of
input features) or a byte, plus a scale (model dtype) and, for an asymmetric grid, an int8 zero point per group;
a checkpoint packs ``bits`` per code (compressed-tensors' ``weight_packed`` / GPTQ's ``qweight``, int32 words),
keeps its scales (2 bytes) and packed zero points, and copies every kept tensor at its on-disk size. The estimate
is an upper bound within a few percent (headers and configs are rounded up by a fixed margin).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from quant.errors import RunDirError
from quant.models import ModelSource
from quant.plan.bitplan import BitPlan
from quant.quantize.qstore import packs
from quant.scheme import Scheme

MARGIN_BYTES = 1 << 20  # configs, manifests, reports
HEADER_BYTES = 256  # per stored tensor: its name, dtype, shape and offsets in a safetensors header


@dataclass(frozen=True)
class Footprint:
    store_bytes: int
    checkpoint_bytes: dict[str, int]  # format -> bytes

    def total(self, with_store: bool) -> int:
        return (self.store_bytes if with_store else 0) + sum(self.checkpoint_bytes.values())


def _groups(n_in: int, group_size: int) -> int:
    return 1 if group_size in (0, -1) else -(-n_in // group_size)


def estimate(source: ModelSource, plan: BitPlan, formats: tuple[str, ...], scale_bytes: int = 2) -> Footprint:
    """Bytes of the quantized store and of each export format for ``plan`` on ``source``."""
    model_bytes = sum((source.path / f).stat().st_size for f in set(source.weight_map.values()))
    quantized = plan.quantized()
    store = packed = replaced = 0
    disk_bytes = _disk_element_bytes(source, source.modules[next(iter(quantized))].disk_prefix + ".weight") \
        if quantized else 2
    for name, p in quantized.items():
        m = source.modules[name]
        G = _groups(m.in_features, p.group_size)
        zero = 0 if p.symmetric else 1
        store += store_module_bytes(m.in_features, m.out_features, p, scale_bytes)
        packed += -(-m.numel * p.bits // 32) * 4 + m.out_features * G * (2 + zero) + (4 + zero) * HEADER_BYTES
        replaced += m.numel * disk_bytes
    side = sum(f.stat().st_size for f in source.path.iterdir() if f.is_file() and f.suffix != ".safetensors")
    checkpoint = max(model_bytes - replaced, 0) + packed + side + MARGIN_BYTES
    return Footprint(store + MARGIN_BYTES, {fmt: checkpoint for fmt in formats})


def store_module_bytes(n_in: int, n_out: int, p, scale_bytes: int = 2) -> int:
    """One module's bytes in the quantized store (``p``: its ModulePlan): codes (qstore.packs: two a byte), scales,
    zero points, safetensors header entries."""
    G, zero = _groups(n_in, p.group_size), 0 if p.symmetric else 1
    codes = n_out * n_in // 2 if packs(Scheme(p.bits, p.group_size, p.symmetric), n_in) else n_out * n_in
    return codes + n_out * G * (scale_bytes + zero) + (2 + zero) * HEADER_BYTES


def _disk_element_bytes(source: ModelSource, key: str) -> int:
    from safetensors import safe_open

    sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    with safe_open(source.path / source.weight_map[key], "pt") as f:
        return sizes.get(f.get_slice(key).get_dtype(), 2)


def check_free_disk(run_dir: Path, need: Footprint, with_store: bool, existing_bytes: int = 0) -> None:
    """Raise (one line, with the bytes needed) when ``run_dir``'s file system cannot hold what is left to write."""
    total = max(need.total(with_store) - existing_bytes, 0)
    free = shutil.disk_usage(run_dir).free
    if total > free:
        parts = ([f"quantized store {_gb(need.store_bytes)}"] if with_store else []) + [
            f"{fmt} checkpoint {_gb(b)}" for fmt, b in need.checkpoint_bytes.items()]
        raise RunDirError(
            f"not enough free disk for {run_dir}: the {'quantize and export stages' if with_store else 'export stage'}"
            f" need {_gb(total)} "
            f"({', '.join(parts)}{f', minus {_gb(existing_bytes)} already written' if existing_bytes else ''}) "
            f"and {_gb(free)} is free; free space or pass --output on a larger disk"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
