"""Builtin models are quant's own files: the same bytes under any transformers version."""

import json

import torch
from safetensors.torch import load_file

from quant.models import resolve_model
from quant.models.builtin import builtin_path, seeded_tensor

# builtin:qwen3-moe-tiny's fingerprint (config.json and every shard's SHA-256): a run directory made with one
# environment opens in another. Changes only with BUILTIN_VERSION (then update it here).
QWEN3_TINY_FINGERPRINT = "d8baed0f36479dd7"


def test_builtin_files_do_not_depend_on_the_transformers_version(tmp_path, monkeypatch):
    import transformers

    a = builtin_path("mixtral-tiny")
    monkeypatch.setenv("QUANT_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers, "__version__", "9.99.0")
    b = builtin_path("mixtral-tiny")
    assert a.name == b.name and a != b
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert "transformers_version" not in json.loads((b / "config.json").read_text())


def test_builtin_weights_are_drawn_by_tensor_name_and_shape():
    path = builtin_path("qwen3-moe-tiny")
    w = load_file(str(path / "model.safetensors"))
    key = "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(w[key], seeded_tensor("qwen3-moe-tiny", key, tuple(w[key].shape)).to(torch.bfloat16))
    assert torch.equal(w["model.norm.weight"], torch.ones_like(w["model.norm.weight"]))
    assert not torch.equal(w["model.layers.0.mlp.experts.0.up_proj.weight"], w["model.layers.0.mlp.experts.1.up_proj.weight"])
    assert resolve_model("builtin:qwen3-moe-tiny").fingerprint == QWEN3_TINY_FINGERPRINT
