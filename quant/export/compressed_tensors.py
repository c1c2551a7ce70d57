"""compressed-tensors checkpoint (``pack-quantized``), written with the library's own packing and config types.

One config group per (bits, group size, symmetry). Where one fused MoE layer's experts carry different schemes,
``quant_method`` is ``moe-quant-mixed`` (``quant.serve.names``): the tensors and config groups are the same, but
only quant's vLLM plugin (``quant.serve``) serves such a layer, and stock vLLM refuses the name rather than load
it with one scheme. Targets are anchored ``re:`` regexes over the on-disk module
names the runtimes see (per-expert names such as ``model.layers.3.mlp.experts.17.up_proj``; Mixtral's
``block_sparse_moe.experts.17.w3``). Kept Linear weights (router, lm_head, any ``keep`` module) are listed
in ``ignore``. Per quantized module the checkpoint holds ``weight_packed`` (int32), ``weight_scale``
(model dtype, ``[out, in / group]``), ``weight_shape`` and, for asymmetric schemes, ``weight_zero_point``
(packed along the output dimension), exactly what ``PackedQuantizationCompressor`` writes.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from quant.export.targets import name_regexes
from quant.export.writer import write_checkpoint
from quant.models import ModelSource
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan
from quant.plan.runtimes import expert_schemes_by_layer
from quant.quantize.qstore import packed_words, with_codes
from quant.serve.names import QUANT_METHOD

log = logging.getLogger(__name__)


def _group_key(bits: int, group: int, sym: bool) -> str:
    return f"w{bits}_g{group}_{'sym' if sym else 'asym'}"


def quantization_config(source: ModelSource, plan: BitPlan) -> dict:
    """compressed-tensors ``quantization_config`` for config.json."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    modules = source.modules
    universe = [m.disk_prefix for m in modules.values()]
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, p in plan.quantized().items():
        groups[(p.bits, p.group_size, p.symmetric)].append(modules[name].disk_prefix)
    config_groups = {}
    for (bits, group, sym), prefixes in sorted(groups.items()):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group)
        config_groups[_group_key(bits, group, sym)] = QuantizationScheme(
            targets=["re:" + r for r in name_regexes(prefixes, universe)], weights=args, format="pack-quantized"
        )
    kept = [modules[n].disk_prefix for n, p in plan.modules.items() if p.keep and n != "embed"]
    ignore = ["re:" + r for r in name_regexes(kept, universe)] if kept else []
    cfg = QuantizationConfig(config_groups=config_groups, format="pack-quantized",
                             quantization_status="compressed", ignore=ignore)
    out = cfg.model_dump(exclude_none=True)
    if any(len(s) > 1 for s in expert_schemes_by_layer(plan, source).values()):
        # experts of one fused MoE layer differ: only quant's vLLM plugin serves that; stock vLLM refuses the name
        # (one scheme per fused layer would load the other experts wrong), the tensors are compressed-tensors'
        out["quant_method"] = QUANT_METHOD
    return out


def compress_module(qw) -> dict[str, torch.Tensor]:
    """One stored module (2-D codes, or as ``read_layer(packed=True)`` returns them) -> its checkpoint tensors,
    packed by compressed-tensors. W4 codes the store keeps two a byte already are its ``weight_packed`` words
    (``qstore.packed_words``; a test checks them against ``pack_to_int32``) and are taken as they are."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    words = packed_words(qw)
    if words is None:
        qw = with_codes(qw)
    out = {
        "weight_packed": pack_to_int32(qw.q, qw.spec.bits) if words is None else words,
        "weight_scale": qw.scale,
        "weight_shape": torch.tensor([qw.q.shape[0], qw.q.shape[1] if words is None else 8 * words.shape[1]]),
    }
    if qw.zero is not None:
        out["weight_zero_point"] = pack_to_int32(qw.zero, qw.spec.bits, packed_dim=0)
    return out


def write_compressed_tensors(source: ModelSource, plan: BitPlan, qdir: Path, out: Path, max_shard_bytes: int,
                             world: World, extra_manifest: dict | None = None) -> Path:
    """Write the checkpoint to ``out`` atomically (each rank of ``world`` its share of the shards); returns ``out``."""
    config = json.loads((source.path / "config.json").read_text())
    config["quantization_config"] = quantization_config(source, plan)
    write_checkpoint(source, plan, qdir, out, max_shard_bytes, compress_module, {"config.json": config},
                     {"format": "compressed-tensors", **(extra_manifest or {})}, world)
    if world.is_writer:
        log.info("wrote compressed-tensors checkpoint %s", out)
    return out
