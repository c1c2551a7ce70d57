"""The exported GPTQ-format checkpoint read back as dense weights, for the eval of a run whose first format is gptq.

Written from the layout serving runtimes read (docs/runtimes.md, vLLM's GPTQ loaders), not from quant's writer
(``quant/export/gptq.py``), so an export bug shows up as bad eval numbers. Per quantized module (``N`` out, ``K``
in, ``G`` groups, ``b`` bits): ``qweight [K*b/32, N]`` int32 holding unsigned codes ``u`` packed along ``K``, least
significant bits first; ``qzeros [G, N*b/32]`` int32 packed along ``N`` (``checkpoint_format: gptq``: the stored
zero is one less than the zero point; ``gptq_v2``: as is); ``scales [G, N]`` fp16; ``g_idx [K]`` int32, the group of
each input column. ``W[n, k] = scales[g, n] * (u[k, n] - zero[g, n])`` with ``g = g_idx[k]``, computed in float32 (exact
for codes of up to 8 bits and fp16 scales) and rounded once to the eval dtype, which is what compressed-tensors
computes for the same codes and scales. A module's bits are the config's, overridden by the first ``dynamic``
rule whose pattern ``re.match``-es its name (``-:`` rules: kept in bf16, a plain ``.weight``).

``dense_copy`` writes the dense model to a folder transformers loads (the whole-model eval, lm-eval's hf backend).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from quant.errors import CheckpointError
from quant.models import ModelSource
from quant.models.dequant import DequantizingSource

PARTS = ("qweight", "qzeros", "scales", "g_idx")
# not copied into the dense folder: they describe the GPTQ files (quant_manifest.json: their digests)
METADATA_FILES = {"config.json", "model.safetensors.index.json", "quantize_config.json", "quant_manifest.json"}


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit fields of int32 ``words``, least significant first, laid out along ``dim``
    (``[..., M, ...]`` -> ``[..., M * 32 / bits, ...]``), as int32."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32, device=words.device) * bits).view(
        [1] * (dim + 1) + [per] + [1] * (words.dim() - dim - 1))
    fields = (words.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift: masked to the field
    shape = list(words.shape)
    shape[dim] *= per
    return fields.reshape(shape)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, v2: bool, dtype: torch.dtype) -> torch.Tensor:
    """``W [N, K]`` in ``dtype`` from one module's GPTQ tensors (module docstring)."""
    codes = unpack_int32(qweight, bits, 0)  # [K, N]
    zeros = unpack_int32(qzeros, bits, 1) + (0 if v2 else 1)  # [G, N]
    g = g_idx.long()
    w = scales[g].float() * (codes - zeros[g]).float()  # [K, N]
    return w.T.contiguous().to(dtype)


def module_bits(qcfg: dict, name: str) -> int | None:
    """Bits of module ``name`` (on-disk prefix): the base, or the first matching ``dynamic`` rule's; None if a
    ``-:`` rule keeps it."""
    for rule, override in (qcfg.get("dynamic") or {}).items():
        negative = rule.startswith("-:")
        if re.match(rule[2:] if rule[:2] in ("+:", "-:") else rule, name):
            return None if negative else int(override.get("bits", qcfg["bits"]))
    return int(qcfg["bits"])


class GptqCheckpoint(DequantizingSource):
    """An exported GPTQ checkpoint whose ``weight_map`` lists dense names (``<module>.weight``) and whose reads
    return weights dequantized in ``dtype``. ``base`` supplies the family and remote-code settings."""

    def __init__(self, path: Path, base: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu",
                 processes_per_node: int = 1):
        super().__init__(path, dtype, device, processes_per_node, display_name=f"{base.display_name} (shipped)",
                         trust_remote_code=base.trust_remote_code, family=base.family.name)
        qcfg = self.config_dict.get("quantization_config") or {}
        if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "gptq":
            raise CheckpointError(f"{path} is not a GPTQ checkpoint (config.json quantization_config.quant_method)")
        if qcfg.get("desc_act") or qcfg.get("pack_dtype", "int32") != "int32" or qcfg.get("checkpoint_format") not in (
                "gptq", "gptq_v2"):
            raise CheckpointError(f"{path}: quant reads GPTQ checkpoints with int32 packing, static groups "
                                  "(desc_act false) and checkpoint_format gptq or gptq_v2, as it writes them")
        self.qcfg, self.v2 = qcfg, qcfg["checkpoint_format"] == "gptq_v2"
        prefixes = [k.removesuffix(".qweight") for k in self.raw_map if k.endswith(".qweight")]
        missing = [f"{p}.{part}" for p in prefixes for part in PARTS if f"{p}.{part}" not in self.raw_map]
        if missing:
            raise CheckpointError(f"{path} lacks {missing[0]}; re-run the export")
        self.bits = {}
        for p in prefixes:
            bits = module_bits(qcfg, p)
            if bits is None or 32 % bits:
                raise CheckpointError(f"{path}: {p} is packed but its quantize_config rule gives it {bits} bits")
            self.bits[p + ".weight"] = bits
        self._set_parts({p + ".weight": [f"{p}.{part}" for part in PARTS] for p in prefixes})

    def _dense_shapes(self, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out = {}
        for key, (qweight, *_) in self.parts.items():
            rows, n = stored[qweight]
            out[key] = (n, rows * 32 // self.bits[key])
        return out

    def _dense_shape(self, raw: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
        rows, n = raw[self.parts[key][0]].shape
        return n, rows * 32 // self.bits[key]

    def dequantize(self, raw: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in keys:
            if k not in self.parts:
                out[k] = raw[k]
                continue
            qweight, qzeros, scales, g_idx = (raw[p] for p in self.parts[k])
            if g_idx.numel() and not 0 <= int(g_idx.min()) <= int(g_idx.max()) < scales.shape[0]:
                raise CheckpointError(f"{self.path}: {k.removesuffix('.weight')}.g_idx names groups outside its "
                                      f"{scales.shape[0]} scales; re-run the export")
            out[k] = dequantize_gptq(qweight, qzeros, scales, g_idx, self.bits[k], self.v2, self.dtype)
        return out


def dense_copy(shipped: DequantizingSource, out: Path) -> Path:
    """The dense model of ``shipped`` in ``out`` (its shard files with dense tensors, config.json without the
    quantization_config, the tokenizer and other side files): a folder ``from_pretrained`` loads as a plain
    model. One shard file's tensors in memory at a time."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    for key, file in shipped.weight_map.items():
        files.setdefault(file, []).append(key)
    for file, keys in sorted(files.items()):
        save_file({k: t.contiguous() for k, t in shipped.read_tensors(sorted(keys)).items()}, str(out / file),
                  metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(shipped.weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {k: v for k, v in shipped.config_dict.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in shipped.path.iterdir():
        if f.is_file() and f.name not in METADATA_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    return out
