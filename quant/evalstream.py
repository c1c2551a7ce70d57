"""Eval proxies that never hold a whole model: the base model and the exported checkpoint streamed layer by layer.

``ShippedCheckpoint`` is the exported compressed-tensors checkpoint seen as a ``ModelSource`` whose tensors come
back dense: each read (``load_layer`` reads one decoder layer at a time) is dequantized by compressed-tensors' own
``CompressedTensorsDequantizer.process`` from the packed tensors on disk, so what is measured is what ships.
``streamed_proxies`` runs this rank's share of the eval samples through every base layer, then every shipped layer
(``Layerwise``: one decoder layer resident at a time), keeps both models' final hidden states ``[n, S, D]`` and
scores them in token chunks (``ProxySums``): next-token NLL of both models, KL(base || quantized) and top-1
agreement are summed per chunk, never as ``[N, S, V]``, and the sums are all-reduced over ranks. The whole-model
path of ``quant.evaluate`` feeds the same ``ProxySums``, so both give the same numbers for the same weights.

Dimension legend: N samples, n this rank's samples, S sequence length, D hidden size, V vocabulary, C tokens of
a chunk.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn

from quant.dist import SINGLE, World
from quant.errors import CheckpointError
from quant.hostsync import on_device
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.source import read_safetensors

log = logging.getLogger(__name__)
LOGIT_CHUNK_BYTES = 1 << 30  # float32 logits of both models (and log-softmax temporaries) per scored chunk
TEMPORARIES = 6  # [C, V] float32 tensors alive at once while scoring a chunk


class ShippedCheckpoint(ModelSource):
    """An exported compressed-tensors checkpoint whose ``weight_map`` lists dense names (``<module>.weight`` for a
    packed module) and whose ``read_tensors`` returns dequantized weights in ``dtype``.

    ``base`` supplies the family and remote-code settings (the checkpoint carries the same config and code).
    """

    def __init__(self, path: Path, base: ModelSource, dtype: torch.dtype):
        super().__init__(path, display_name=f"{base.display_name} (shipped)",
                         trust_remote_code=base.trust_remote_code, family=base.family.name)
        qcfg = self.config_dict.get("quantization_config") or {}
        if qcfg.get("quant_method") != "compressed-tensors":
            raise CheckpointError(
                f"{path}: streamed eval reads compressed-tensors checkpoints, this one is "
                f"'{qcfg.get('quant_method', 'not quantized')}'; list compressed-tensors first in export.formats"
            )
        from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
            CompressedTensorsDequantizer,
        )

        self.dequantizer = CompressedTensorsDequantizer(path, dtype=dtype)
        self.raw_map = self.weight_map
        self.parts: dict[str, list[str]] = {}  # dense weight name -> its packed tensors (the packed weight first)
        for key in self.raw_map:
            if key.endswith(".weight_packed"):
                deps = self.dequantizer.get_dependencies(key)
                self.parts[key.removesuffix("_packed")] = [key, *sorted(deps)]
        packed = {k for parts in self.parts.values() for k in parts}
        self.weight_map = {k: f for k, f in self.raw_map.items() if k not in packed}
        self.weight_map.update({k: self.raw_map[parts[0]] for k, parts in self.parts.items()})

    def read_tensors(self, keys: list[str], device="cpu", into=None) -> dict:
        """The dense (dequantized) tensors of ``keys``; ``into`` is not used: they are computed, not read."""
        raw = read_safetensors(self.path, self.raw_map, [r for k in keys for r in self.parts.get(k, [k])], device)
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
                     batch_size: int, world: World = SINGLE) -> dict:
    """Perplexity, KL and top-1 agreement over ``tokens [N, S]``, this rank scoring its ``world.shard`` of the
    samples; every rank returns the same (all-reduced) numbers."""
    mine = tokens[world.shard(range(tokens.shape[0]))]
    lw_base = Layerwise(base, dtype, str(device), batch_size)
    sums = ProxySums(lw_base.device)
    if mine.shape[0]:
        hidden_base, head_base = lw_base.final_hidden(mine)
        lw_quant = Layerwise(shipped, dtype, str(device), batch_size)
        hidden_quant, head_quant = lw_quant.final_hidden(mine)
        sums.score(hidden_base, head_base, hidden_quant, head_quant, mine, lw_base.device)
    return sums.reduce(world).metrics()
