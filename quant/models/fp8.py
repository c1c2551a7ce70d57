"""FP8 releases with block scales read as the model they stand for: DeepSeek-V3/R1/V3.1, Kimi-K2, Qwen3-*-FP8.

Such a release stores each linear weight ``W [out, in]`` as ``float8_e4m3fn`` codes with a float32
``<module>.weight_scale_inv [ceil(out / bo), ceil(in / bi)]``, one per ``bo x bi`` block (config.json:
``quantization_config = {"quant_method": "fp8", "weight_block_size": [bo, bi], ...}``); the weight is
``codes * scale`` block by block (block ``(i, j)``: rows ``i*bo..``, columns ``j*bi..``, cut at the edges), which is
what DeepSeek's ``fp8_cast_bf16.py`` writes to disk (transformers' FP8 dequantization agrees where the blocks divide
a weight; it derives other blocks from the scale grid). ``Fp8BlockSource`` does it at read time, a chunk at a time on the GPU,
so a 671 B release is quantized without a 1.3 TB bf16 copy first; every stage sees bf16 weights (profile,
calibration forward, GPTQ/AWQ statistics, the streamed eval's base model), and tensors the plan keeps ship in
bf16. Dimension legend: O out-features, I in-features.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from quant.errors import ModelError
from quant.models.dequant import DequantizingSource
from quant.models.source import ModelSource, fp8_block_size, fp8_dense_dtype, layer_of_key

log = logging.getLogger(__name__)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_SUFFIX = "_scale_inv"


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                      ) -> torch.Tensor:
    """``codes [O, I]`` (FP8) times ``scale [ceil(O/bo), ceil(I/bi)]`` block by block, in float32, cast to ``dtype``."""
    (O, I), (bo, bi) = codes.shape, block
    assert scale.shape == (math.ceil(O / bo), math.ceil(I / bi)), (codes.shape, scale.shape, block)
    full = scale.float().repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :I]
    return (codes.float() * full).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's own format for ``weight [O, I]``: (``float8_e4m3fn`` codes, float32 scale per block = the
    block's max |w| / 448). For building FP8 test models and benchmarks."""
    (O, I), (bo, bi) = weight.shape, block
    w = weight.float()
    padded = torch.zeros(math.ceil(O / bo) * bo, math.ceil(I / bi) * bi, device=w.device)
    padded[:O, :I] = w
    amax = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).abs().amax(dim=(1, 3))
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    full = scale.repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :I]
    return (w / full).to(torch.float8_e4m3fn), scale


class Fp8BlockSource(DequantizingSource):
    """A block-scaled FP8 release whose reads return weights in the config's dtype (bf16 for DeepSeek-V3).

    Every stored ``X.weight`` with an ``X.weight_scale_inv`` beside it is dequantized; other tensors (norms,
    embedding, lm_head, router) are read as stored. An FP8 tensor without its scale, or a scale of the wrong shape,
    is a ModelError when the folder is opened. A folder whose config still declares FP8 but whose weights are bf16
    (``fp8_cast_bf16.py`` output with the original config.json) is read as stored."""

    def __init__(self, path: Path, device: str | torch.device | None = None, **kw):
        super().__init__(path, torch.bfloat16, device, **kw)
        self.block = fp8_block_size(self.config_dict)
        if self.block is None:
            raise ModelError(f"{self.path}: quantization_config is not FP8 with weight_block_size [rows, cols]")
        self.dtype = fp8_dense_dtype(self.config_dict)
        raw_shapes, raw_dtypes = ModelSource.shapes(self), ModelSource.dtypes(self)
        parts = {k: [k, k + SCALE_SUFFIX] for k in self.raw_map if k + SCALE_SUFFIX in self.raw_map}
        for k, (codes, scale) in parts.items():
            shape = raw_shapes[codes]
            want = tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=False))
            if raw_dtypes[codes] not in FP8_DTYPES or len(shape) != 2 or raw_shapes[scale] != want:
                raise ModelError(f"{self.path}: {k} is {raw_dtypes[codes]} {list(raw_shapes[codes])} with a scale of "
                                 f"{list(raw_shapes[scale])}; a {self.block[0]}x{self.block[1]}-block FP8 weight "
                                 f"needs F8_E4M3 codes and a {list(want)} scale; re-download the model")
        unscaled = sorted(k for k, d in raw_dtypes.items() if d in FP8_DTYPES and k not in parts)
        if unscaled:
            raise ModelError(f"{self.path}: {unscaled[0]} is stored in FP8 without a {unscaled[0]}{SCALE_SUFFIX} "
                             "block scale; quant reads FP8 releases with block scales only")
        self._set_parts(parts)
        if parts:
            log.info("%s: %d FP8 weights with %dx%d block scales, dequantized to %s as they are read",
                     self.display_name, len(parts), *self.block, str(self.dtype).removeprefix("torch."))
        else:
            log.info("%s: config.json declares FP8 weights but the stored weights are not FP8 (a dequantized copy "
                     "with the release's config): read as stored", self.display_name)

    def _dense_shapes(self, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {k: stored[k] for k in self.parts}

    def _dense_shape(self, raw: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
        return tuple(raw[key].shape)

    def dequantize(self, raw: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: dequantize_blocks(raw[k], raw[k + SCALE_SUFFIX], self.block, self.dtype) if k in self.parts
                else raw[k] for k in keys}


def write_fp8_release(source: ModelSource, out: Path, block: tuple[int, int] = (128, 128), device="cpu") -> Path:
    """``source`` (unquantized) as its FP8 release would store it: every decoder layer's 2-D linear weight but the
    router's (``mlp.gate``) as ``float8_e4m3fn`` codes with a float32 ``weight_scale_inv`` per block, the rest as
    stored; config.json gains DeepSeek's ``quantization_config``. For tests and benchmarks (no release is
    downloadable offline); ``device``: where the blocks are scaled."""
    import json
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in source.path.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    tensors = source.read_tensors(list(source.weight_map))
    stored: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if (t.dim() == 2 and key.endswith(".weight") and layer_of_key(key) is not None
                and not key.endswith(".mlp.gate.weight")):
            codes, scale = quantize_blocks(t.to(device), block)
            stored[key], stored[key + SCALE_SUFFIX] = codes.cpu(), scale.cpu()
        else:
            stored[key] = t.contiguous()
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = dict(source.config_dict, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
