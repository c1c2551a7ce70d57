"""How far each decoder layer of a quantized checkpoint moves from the base model's, on the base model's inputs.

``layer_errors``: per layer ``||Y_q - Y|| / ||Y - X||`` where X is the base model's input hidden states to the layer
(the same for both), Y the base layer's output and Y_q the quantized layer's: the error relative to what the
layer's residual branch adds. Layers are walked one at a time (``Layerwise``), so any size of model fits.
``dense_copy``: a compressed-tensors checkpoint dequantized to a dense folder by compressed-tensors' own
dequantizer (what transformers loads when it cannot load the checkpoint itself; any writer's checkpoint).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.parallel.world import World


def dense_copy(checkpoint: Path, out: Path, device: str | torch.device = "cpu") -> Path:
    """``checkpoint`` (compressed-tensors) dequantized into the dense folder ``out`` on ``device``; returns ``out``."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    convert_checkpoint(checkpoint, out, CompressedTensorsDequantizer(checkpoint), device=device)
    return out


def layer_errors(base: ModelSource, quantized: ModelSource, tokens: torch.Tensor, batch: int,
                 device: str = "cpu", dtype: str = "bfloat16") -> list[float]:
    """Per decoder layer ``||Y_q - Y|| / ||Y - X||`` with the base model's inputs ``X`` fed to both layers
    (``quantized``: a dense model folder, e.g. ``dense_copy``'s)."""
    lw_b, lw_q = Layerwise(base, dtype, device, batch, World()), Layerwise(quantized, dtype, device, batch, World())
    hidden = lw_b.embed(tokens)
    errs = []
    for i in range(base.n_layers):
        with lw_b.layer(i) as lb:
            y = lw_b.forward(lb, hidden)
        with lw_q.layer(i) as lq:
            yq = lw_q.forward(lq, hidden)
        errs.append(((yq.float() - y.float()).norm() / (y.float() - hidden.float()).norm()).item())
        hidden = y
    return errs


def checkpoint_layer_errors(base: ModelSource, checkpoint: Path, work: Path, tokens: torch.Tensor, batch: int,
                            device: str = "cpu") -> list[float]:
    """``layer_errors`` of a compressed-tensors checkpoint (any writer's: quant's, llm-compressor's), dequantized by
    compressed-tensors into ``work/<checkpoint name>-dense`` (replaced if there)."""
    dense = work / f"{checkpoint.name}-dense"
    shutil.rmtree(dense, ignore_errors=True)
    return layer_errors(base, ModelSource(dense_copy(checkpoint, dense, device)), tokens, batch, device)
