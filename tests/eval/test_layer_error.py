"""Each decoder layer's output error against the base, on the base's inputs: zero for the base itself, small and
positive for a 4/8-bit checkpoint read back through compressed-tensors' dequantizer."""

from __future__ import annotations

import torch

from quant.eval.layer_error import checkpoint_layer_errors, layer_errors
from quant.models import resolve_model
from quant.recipe import parse_recipe
from quant.run.pipeline import run


def test_layer_errors_of_the_base_and_of_its_checkpoint(quant_cache, tmp_path):
    base = resolve_model("builtin:qwen3-moe-tiny")
    tokens = torch.randint(1, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    assert layer_errors(base, base, tokens, 2) == [0.0] * base.n_layers
    recipe = parse_recipe({"name": "e"}, overrides=("calibration.n_samples=4", "calibration.seq_len=32"),
                          model="builtin:qwen3-moe-tiny")
    run(recipe, tmp_path / "run", until="export")
    errs = checkpoint_layer_errors(base, tmp_path / "run" / "checkpoint", tmp_path, tokens, 2)
    assert len(errs) == base.n_layers and all(0 < e < 0.5 for e in errs), errs
    assert (tmp_path / "checkpoint-dense" / "config.json").is_file()
