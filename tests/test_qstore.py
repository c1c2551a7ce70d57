"""The quantized store's files: the background writer writes exactly what write_layer writes, and a failed write
surfaces at the next wait instead of being lost."""

from __future__ import annotations

import pytest
import torch

from quant.algos.grid import QuantSpec, quantize_weight
from quant.qstore import LayerWriter, read_layer, read_params, write_layer


def _results():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 64, generator=g)
    qw = quantize_weight(w, QuantSpec(4, 32, False), torch.bfloat16)
    return {f"layers.0.experts.{e}.up": type(qw)(qw.q[e], qw.scale[e], qw.zero[e], qw.spec) for e in range(3)}


def test_background_writer_writes_the_same_bytes_as_write_layer(tmp_path):
    results, params = _results(), {"post_attention_layernorm.weight": torch.ones(64, dtype=torch.bfloat16)}
    write_layer(tmp_path / "a.safetensors", results, params)
    writer = LayerWriter(background=True)
    writer.submit(tmp_path / "b.safetensors", results, params)
    writer.wait()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    back = read_layer(tmp_path / "b.safetensors")
    assert all(torch.equal(back[n].q, results[n].q) and torch.equal(back[n].zero, results[n].zero) for n in results)
    assert torch.equal(read_params(tmp_path / "b.safetensors")["post_attention_layernorm.weight"], params[
        "post_attention_layernorm.weight"])


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    writer = LayerWriter(background=True)
    writer.submit(tmp_path / "missing-dir" / "layer.safetensors", _results(), {})
    with pytest.raises(Exception, match="No such file|not found|missing-dir"):
        writer.wait()
    writer.wait()  # the error is reported once
