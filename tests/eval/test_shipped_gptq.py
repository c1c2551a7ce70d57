"""The exported GPTQ checkpoint read back: dense weights equal to the quantized store's, bit for bit (symmetric v1
zeros and asymmetric gptq_v2 zeros), kept modules as stored, a dense copy transformers loads as a plain model."""

from __future__ import annotations

import json

import pytest
import torch

from quant.errors import CheckpointError
from quant.eval.shipped_gptq import GptqCheckpoint, dense_copy, unpack_int32
from quant.models import resolve_model
from quant.quantize.qstore import dequantize_2d, layer_file, read_layer
from quant.recipe import load_recipe
from quant.run.pipeline import run
from tests.conftest import REPO

HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=4", "calibration.seq_len=32", "plan.group_size=32", "export.formats=[gptq]")
RUNS = {"qwen3-sym": ("qwen3-moe-tiny", (), "gptq"), "olmoe-asym": ("olmoe-tiny", ("plan.symmetric=false",), "gptq_v2")}


@pytest.fixture(scope="module", params=list(RUNS))
def exported(request, tmp_path_factory):
    name, extra, fmt = RUNS[request.param]
    model = f"builtin:{name}"
    d = tmp_path_factory.mktemp("gptq") / request.param
    run(load_recipe(HEADLINE, overrides=FAST + extra, model=model), d, until="export")
    assert json.loads((d / "checkpoint" / "config.json").read_text())["quantization_config"]["checkpoint_format"] == fmt
    return resolve_model(model), d


def test_unpack_takes_fields_least_significant_first_along_the_dim():
    words = torch.tensor([[0x76543210, -0x1]], dtype=torch.int32)  # -1: every field all ones (sign bit included)
    assert unpack_int32(words, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7] + [15] * 8]
    assert unpack_int32(words.T.contiguous(), 8, 0)[:, 0].tolist() == [0x10, 0x32, 0x54, 0x76] + [255] * 4


def test_gptq_reads_are_the_stores_dequantized_weights(exported):
    src, d = exported
    shipped = GptqCheckpoint(d / "checkpoint", src, torch.bfloat16)
    assert set(shipped.weight_map) == set(src.weight_map) and shipped.shapes() == src.shapes()
    by_prefix = {m.disk_prefix: n for n, m in src.modules.items()}
    checked = 0
    for layer in range(src.n_layers):
        stored = read_layer(layer_file(d / "quantized", layer))
        keys = [k for k in shipped.weight_map if k.startswith(f"model.layers.{layer}.")]
        got = shipped.read_tensors(keys)
        for key in keys:
            name = by_prefix.get(key.removesuffix(".weight"))
            if name in stored:
                assert key in shipped.parts and torch.equal(got[key], dequantize_2d(stored[name])), key
                checked += 1
            else:
                assert key not in shipped.parts
                assert torch.equal(got[key], src.read_tensors([key])[key]), key
    assert checked > 0


def test_the_dense_copy_loads_as_a_plain_model(exported, tmp_path):
    from safetensors.torch import load_file

    src, d = exported
    shipped = GptqCheckpoint(d / "checkpoint", src, torch.bfloat16)
    out = dense_copy(shipped, tmp_path / "dense")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() and not (out / "quantize_config.json").exists()
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(src.weight_map)
    some = sorted(shipped.parts)[0]
    assert torch.equal(tensors[some], shipped.read_tensors([some])[some])


def test_a_checkpoint_that_is_not_gptq_is_refused(exported):
    src, _ = exported
    with pytest.raises(CheckpointError, match="not a GPTQ checkpoint"):
        GptqCheckpoint(src.path, src, torch.bfloat16)
