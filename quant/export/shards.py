"""A checkpoint's tensors and shard files, planned before anything is written, so that any number of ranks write
disjoint shard files of the checkpoint one process writes, byte for byte.

The plan lists every checkpoint tensor (name, shape, dtype, where it comes from) in the order of the source's keys
(layers ascending, then the rest); shards are filled in that order up to ``max_shard_bytes`` (a tensor larger than
that gets a shard of its own; a quantized module's parts stay in one shard) and named ``model.safetensors`` when
there is one, else ``model-XXXXX-of-YYYYY.safetensors``. A quantized module's tensors are planned by running the format's own packing
on a zero module of the same shapes, once per distinct (shapes, dtypes, scheme), so the plan cannot drift from the
writer; every written tensor is checked against its plan. Shards go to ranks longest first onto the least-loaded
rank (``dist.assign``), so every rank computes the same assignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.algos.grid import QuantizedWeight
from quant.errors import CheckpointError, NumericalError
from quant.io.direct_read import DTYPE_NAMES, TORCH_DTYPES
from quant.models import ModelSource
from quant.models.headers import DTYPE_BYTES
from quant.models.source import layer_of_key
from quant.parallel.world import assign
from quant.plan.bitplan import BitPlan
from quant.quantize.qstore import layer_file, read_layer, read_layout, read_params
from quant.scheme import Scheme


@dataclass(frozen=True)
class Planned:
    """One tensor of the checkpoint: ``name`` holds ``part`` of quantized ``module``'s packing (``part`` None: the
    source tensor ``key``, or the quantize stage's changed copy of it, as is)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name
    key: str
    layer: int | None
    module: str | None = None
    part: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Shard:
    file: str
    tensors: tuple[Planned, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _source_order(key: str) -> tuple:
    layer = layer_of_key(key)
    return layer is None, layer or 0, key


def plan_tensors(source: ModelSource, plan: BitPlan, qdir: Path, module_tensors: Callable) -> list[Planned]:
    """Every checkpoint tensor in writing order: a quantized module's ``module_tensors(stored)`` parts in place of its
    weight, every other source tensor as it is (shapes and dtypes from the store's and the source's headers)."""
    by_prefix = {m.disk_prefix: n for n, m in source.modules.items()}
    quantized = plan.quantized()
    shapes, dtypes = source.shapes(), source.dtypes()
    layouts: dict[int | None, dict] = {}
    probes: dict[tuple, list[tuple[str, tuple[int, ...], str]]] = {}
    out = []
    for key in sorted(source.weight_map, key=_source_order):
        layer = layer_of_key(key)
        prefix = key.removesuffix(".weight")
        name = by_prefix.get(prefix) if key.endswith(".weight") else None
        if name is None or name not in quantized:
            out.append(Planned(key, tuple(shapes[key]), dtypes[key], key, layer))
            continue
        if layer not in layouts:
            path = layer_file(qdir, layer)
            layouts[layer] = read_layout(path) if path.is_file() else {}
        if name not in layouts[layer]:
            raise CheckpointError(f"the quantized store {qdir} lacks {name}, which the plan quantizes; rerun the "
                                  "quantize stage (quant run ... --force quantize)")
        layout = layouts[layer][name]
        if layout not in probes:
            probes[layout] = _probe(layout, module_tensors)
        out += [Planned(f"{prefix}.{part}", shape, dtype, key, layer, name, part) for part, shape, dtype in probes[layout]]
    return out


def _probe(layout: tuple[Scheme, tuple], module_tensors: Callable) -> list[tuple[str, tuple[int, ...], str]]:
    """(part, shape, dtype) of what ``module_tensors`` makes of a stored module of this layout (a zero module)."""
    spec, parts = layout
    q, scale, zero = (None if p is None else torch.zeros(p[0], dtype=TORCH_DTYPES[p[1]]) for p in parts)
    packed = module_tensors(QuantizedWeight(q, scale, zero, spec))
    return [(part, tuple(t.shape), DTYPE_NAMES[t.dtype]) for part, t in packed.items()]


def plan_shards(tensors: list[Planned], max_shard_bytes: int) -> list[Shard]:
    """Consecutive tensors in files of at most ``max_shard_bytes`` (a larger tensor alone in its file). A quantized
    module's parts (codes, scales, zero points, shape) are never split over files: loaders resolve a module's parts
    from the file of its codes (compressed-tensors' converter refused a file holding only another module's scale)."""
    units = [list(g) for _, g in groupby(tensors, key=lambda t: t.module if t.module is not None else ("", t.name))]
    groups: list[list[Planned]] = []
    size = 0
    for unit in units:
        nbytes = sum(t.nbytes for t in unit)
        if not groups or (groups[-1] and size + nbytes > max_shard_bytes):
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += nbytes
    groups = groups or [[]]
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [Shard(name, tuple(g)) for name, g in zip(names, groups, strict=True)]


def shard_owners(shards: list[Shard], n_ranks: int) -> list[int]:
    """The rank that writes each shard: balanced by bytes, the same on every rank."""
    return assign([float(s.nbytes) for s in shards], [0.0] * n_ranks)


def index(shards: list[Shard]) -> dict | None:
    """``model.safetensors.index.json``'s content, None for a single file."""
    if len(shards) == 1:
        return None
    weight_map = {t.name: s.file for s in shards for t in s.tensors}
    return {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}


def write_shard(shard: Shard, source: ModelSource, qdir: Path, module_tensors: Callable, directory: Path) -> Path:
    """Make ``shard``'s tensors (one layer's store read at a time) and write them to ``directory / shard.file``."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, group in groupby(shard.tensors, key=lambda t: t.layer):
        tensors.update(_layer_tensors(list(group), layer, source, qdir, module_tensors))
    path = directory / shard.file
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _layer_tensors(planned: list[Planned], layer: int | None, source: ModelSource, qdir: Path,
                   module_tensors: Callable) -> dict[str, torch.Tensor]:
    path = layer_file(qdir, layer)
    modules = {t.module for t in planned if t.module is not None}
    stored = read_layer(path, names=modules, packed=True) if modules else {}  # module_tensors takes packed codes
    kept = [t.key for t in planned if t.module is None]
    params = {}
    if kept and path.is_file():
        params = {source.family.disk_key(layer, k): v for k, v in read_params(path).items()}
    from_source = source.read_tensors([k for k in kept if k not in params]) if kept else {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for t in planned:
        if t.module is not None:
            if t.module not in packed:
                packed[t.module] = module_tensors(stored[t.module])
            tensor = packed[t.module][t.part]
        elif t.key in params:
            tensor = params[t.key].to(TORCH_DTYPES[t.dtype])
        else:
            tensor = from_source[t.key]
        out[t.name] = _checked(t, tensor)
    return out


def _checked(t: Planned, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the shard holds it; a floating-point tensor with NaN or infinite values is refused."""
    assert (tuple(tensor.shape), DTYPE_NAMES.get(tensor.dtype)) == (t.shape, t.dtype), (
        f"{t.name}: made {tuple(tensor.shape)} {tensor.dtype}, planned {t.shape} {t.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise NumericalError(f"{t.name} holds NaN or infinite values; a checkpoint must not ship them (is the "
                             "source model damaged?)")
    return tensor.contiguous().cpu()
