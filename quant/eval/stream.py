"""Eval proxies that never hold a whole model: the base model and the exported checkpoint streamed layer by layer.

``ShippedCheckpoint`` is the exported compressed-tensors checkpoint seen as a ``ModelSource`` whose tensors come
back dense: each read (``load_layer`` reads one decoder layer at a time) is dequantized by compressed-tensors' own
``CompressedTensorsDequantizer.process`` from the packed tensors on disk, so what is measured is what ships.
``streamed_proxies`` runs this rank's share of the eval samples through every base layer, then every shipped layer
(``Layerwise``: one decoder layer resident at a time), keeps both models' final hidden states ``[n, S, D]`` and
scores them in token chunks (``ProxySums``): next-token NLL of both models, KL(base || quantized) and top-1
agreement are summed per chunk, never as ``[N, S, V]``, and the sums are all-reduced over ranks. The whole-model
path of ``quant.eval.evaluate`` feeds the same ``ProxySums``, so both give the same numbers for the same weights.

Dimension legend: N samples, n this rank's samples, S sequence length, D hidden size, V vocabulary, C tokens of
a chunk.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn

from quant.diag.hostsync import on_device
from quant.errors import CheckpointError
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.dequant import DequantizingSource
from quant.parallel.world import World
from quant.progress import step
from quant.serve.names import COMPRESSED_TENSORS_METHODS

log = logging.getLogger(__name__)
LOGIT_CHUNK_BYTES = 1 << 30  # float32 logits of both models (and log-softmax temporaries) per scored chunk
TEMPORARIES = 6  # [C, V] float32 tensors alive at once while scoring a chunk


class ShippedCheckpoint(DequantizingSource):
    """An exported compressed-tensors checkpoint whose ``weight_map`` lists dense names (``<module>.weight`` for a
    packed module) and whose ``read_tensors`` returns weights dequantized by compressed-tensors' own
    ``CompressedTensorsDequantizer.process``, in ``dtype``.

    ``base`` supplies the family, remote-code settings and dense shapes (the checkpoint carries the same config and
    code). ``device``: where compressed-tensors dequantizes (on a GPU, a chunk at a time into the read-ahead's
    staging buffer: compressed-tensors dequantizes ~0.7 GB/s of dense weights on two CPU cores, and a DeepSeek-V3
    layer is 23 GB).
    """

    def __init__(self, path: Path, base: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu",
                 processes_per_node: int = 1):
        super().__init__(path, dtype, device, processes_per_node, display_name=f"{base.display_name} (shipped)",
                         trust_remote_code=base.trust_remote_code, family=base.family.name)
        qcfg = self.config_dict.get("quantization_config") or {}
        if qcfg.get("quant_method") not in COMPRESSED_TENSORS_METHODS:
            raise CheckpointError(
                f"{path}: streamed eval reads compressed-tensors checkpoints, this one is "
                f"'{qcfg.get('quant_method', 'not quantized')}' (GPTQ files are read by quant.eval.shipped_gptq)"
            )
        from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
            CompressedTensorsDequantizer,
        )

        self.dequantizer = CompressedTensorsDequantizer(path, dtype=dtype)
        self.base = base
        self._set_parts({key.removesuffix("_packed"): [key, *sorted(self.dequantizer.get_dependencies(key))]
                         for key in self.raw_map if key.endswith(".weight_packed")})

    def _dense_shapes(self, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        base = self.base.shapes()
        return {k: base.get(k, stored[p[0]]) for k, p in self.parts.items()}

    def _dense_shape(self, raw: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
        return tuple(int(x) for x in raw[key + "_shape"].tolist())  # the weight_shape it stores

    def dequantize(self, raw: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        dense = self.dequantizer.process(raw)
        missing = [k for k in keys if k not in dense]
        if missing:
            raise CheckpointError(f"{self.path}: compressed-tensors did not dequantize {missing[:3]} (no config "
                                  "group targets them)")
        return {k: dense[k] for k in keys}


class ProxySums:
    """Sums over scored tokens: NLL of the base and quantized models, KL(base || quantized), top-1 agreements,
    token count (float64 on ``device``, so ranks can all-reduce them)."""

    FIELDS = ("nll_base", "nll_quant", "kl", "agree", "n_tokens")

    def __init__(self, device):
        self.t = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)

    def add(self, logits_base: torch.Tensor, logits_quant: torch.Tensor, target: torch.Tensor) -> None:
        """``logits_* [C, V]`` predicting ``target [C]``."""
        assert logits_base.shape == logits_quant.shape and logits_base.shape[0] == target.shape[0]
        lp_b = torch.log_softmax(logits_base.float(), dim=-1)
        lp_q = torch.log_softmax(logits_quant.float(), dim=-1)
        idx = target.to(lp_b.device).unsqueeze(-1)
        kl = (lp_b.exp() * (lp_b - lp_q)).sum(-1)
        agree = (lp_b.argmax(-1) == lp_q.argmax(-1)).sum().float()
        finite = torch.isfinite(lp_b).all() & torch.isfinite(lp_q).all()
        agree = torch.where(finite, agree, torch.full_like(agree, math.nan))  # argmax over NaN "agrees" everywhere
        row = torch.stack([-lp_b.gather(-1, idx).sum(), -lp_q.gather(-1, idx).sum(), kl.sum(), agree,
                           on_device(float(target.numel()), lp_b.device, torch.float32)])
        self.t += row.to(self.t)

    def score(self, hidden_base: torch.Tensor, head_base: nn.Module, hidden_quant: torch.Tensor,
              head_quant: nn.Module, tokens: torch.Tensor, device) -> None:
        """Score final-norm hidden states ``[n, S, D]`` of both models through their lm_heads against ``tokens
        [n, S]``, ``C`` positions at a time (one sample's positions per chunk, so a token's numbers never depend
        on which other samples share the rank)."""
        n, S, _ = hidden_base.shape
        assert hidden_quant.shape == hidden_base.shape and tokens.shape == (n, S)
        vocab = head_base.weight.shape[0]
        chunk = max(1, LOGIT_CHUNK_BYTES // (TEMPORARIES * 4 * vocab))
        with torch.no_grad():
            for i in range(n):
                for s in range(0, S - 1, chunk):
                    e = min(s + chunk, S - 1)
                    self.add(head_base(hidden_base[i, s:e].to(device)), head_quant(hidden_quant[i, s:e].to(device)),
                             tokens[i, s + 1 : e + 1])

    def reduce(self, world: World) -> ProxySums:
        world.all_reduce_sum(self.t)
        return self

    def metrics(self) -> dict:
        nll_b, nll_q, kl, agree, n = self.t.tolist()
        if n == 0:
            raise CheckpointError("eval scored no tokens; raise eval.perplexity.n_samples / seq_len")
        return {"perplexity": {"base": math.exp(nll_b / n), "quantized": math.exp(nll_q / n)},
                "kl": {"quantized": kl / n}, "top1_agreement": {"quantized": agree / n}, "n_tokens": int(n)}


def streamed_proxies(base: ModelSource, shipped: ModelSource, tokens: torch.Tensor, dtype: str, device,
                     batch_size: int, world: World) -> dict:
    """Perplexity, KL and top-1 agreement over ``tokens [N, S]``, this rank scoring its share of the samples (the
    ``Layerwise`` batches dealt to it, batches no larger than an even share); every rank returns the same
    (all-reduced) numbers. Every rank walks both models' layers, even without samples: with NCCL each reads its
    share of a layer and the shares are broadcast (``Layerwise``), so a node reads (and dequantizes) each layer once,
    not once per rank. An NCCL job evaluating on CPUs (NCCL cannot carry host tensors) reads whole layers on every
    rank and scores ``world.shard`` of the samples."""
    walk = layer_world(world, device)
    if walk is not world:
        tokens = tokens[world.shard(range(tokens.shape[0]))]
    sums = ProxySums(torch.device(device))
    if tokens.shape[0]:
        batch = max(1, min(batch_size, math.ceil(tokens.shape[0] / walk.size)))
        n = base.n_layers
        log.info("eval: %d layers of each model, %d samples", n, tokens.shape[0], extra=step("eval", 0, 2 * n))
        lw_base = Layerwise(base, dtype, str(device), batch, walk)
        hidden_base, head_base = lw_base.final_hidden(tokens, _progress(walk, "base", 0, n))
        mine = tokens[lw_base.my_rows()] if walk.distributed else tokens
        lw_quant = Layerwise(shipped, dtype, str(device), batch, walk)
        hidden_quant, head_quant = lw_quant.final_hidden(tokens, _progress(walk, "quantized", n, n))
        sums.score(hidden_base, head_base, hidden_quant, head_quant, mine, lw_base.device)
    return sums.reduce(world).metrics()


def _progress(world: World, model: str, before: int, n_layers: int):
    """``on_layer`` for one model's walk: a progress step per layer, counted over both models' layers, then a stop
    request honoured (every rank of the walk after the same layer)."""

    def on_layer(idx: int) -> None:
        log.info("eval: %s layer %d", model, idx, extra=step("eval", before + idx + 1, 2 * n_layers))
        world.raise_if_stopped(f"eval: {model} layer {idx}")

    return on_layer


def layer_world(world: World, device) -> World:
    """The world the eval's layer walks run in: the job's, unless it is NCCL and the eval device is not a GPU (then
    each rank walks alone)."""
    return world.alone() if world.backend == "nccl" and torch.device(str(device)).type != "cuda" else world
