"""Checkpoint writers (compressed-tensors, GPTQ), model card, and readers for ``quant inspect``."""

from __future__ import annotations

from pathlib import Path

from quant.models import ModelSource
from quant.plan import BitPlan
from quant.recipe import Recipe


def checkpoint_dirs(recipe: Recipe) -> dict[str, str]:
    """Format -> run-dir-relative folder: the first format is ``checkpoint``, others ``checkpoint-<format>``."""
    return {fmt: "checkpoint" if i == 0 else f"checkpoint-{fmt}" for i, fmt in enumerate(recipe.export.formats)}


def export_all(source: ModelSource, plan: BitPlan, recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    from quant.export.compressed_tensors import write_compressed_tensors
    from quant.export.gptq import write_gptq

    writers = {"compressed-tensors": write_compressed_tensors, "gptq": write_gptq}
    max_bytes = int(recipe.export.max_shard_gb * 1e9)
    extra = {"recipe": recipe.name, "base_model": source.display_name, "model_fingerprint": source.fingerprint}
    return {fmt: writers[fmt](source, plan, run_dir / "quantized", run_dir / folder, max_bytes, extra)
            for fmt, folder in checkpoint_dirs(recipe).items()}
