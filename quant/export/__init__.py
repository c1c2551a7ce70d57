"""Checkpoint writers (compressed-tensors, GPTQ) and readers for ``quant inspect``.

The ``export`` stage calls this package: it writes each checkpoint (``export_all``) without its model card, which
the ``card`` stage (``quant.card``) adds once ``eval`` has measured the checkpoint on disk.
"""

from __future__ import annotations

from pathlib import Path

from quant.export.writer import CARD, LM_EVAL_FILES, checkpoint_digest
from quant.models import ModelSource
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan
from quant.recipe import Recipe

__all__ = ["CARD", "LM_EVAL_FILES", "check_formats", "checkpoint_digest", "checkpoint_dirs", "export_all",
           "served_by"]


def checkpoint_dirs(recipe: Recipe) -> dict[str, str]:
    """Format -> run-dir-relative folder: the first format is ``checkpoint``, others ``checkpoint-<format>``."""
    return {fmt: "checkpoint" if i == 0 else f"checkpoint-{fmt}" for i, fmt in enumerate(recipe.export.formats)}


def check_formats(plan: BitPlan, source: ModelSource, formats: tuple[str, ...]) -> None:
    """Raise PlanError if a checkpoint format cannot hold the plan (called at plan time, before quantizing)."""
    if "gptq" in formats:
        from quant.export.gptq import check_gptq_plan

        check_gptq_plan(plan, source)


def export_all(source: ModelSource, plan: BitPlan, recipe: Recipe, run_dir: Path, world: World) -> dict[str, Path]:
    """Every format's checkpoint; under torchrun each rank writes its share of every checkpoint's shard files."""
    from quant.export.compressed_tensors import write_compressed_tensors
    from quant.export.gptq import write_gptq

    writers = {"compressed-tensors": write_compressed_tensors, "gptq": write_gptq}
    max_bytes = int(recipe.export.max_shard_gb * 1e9)
    extra = {"recipe": recipe.name, "base_model": source.display_name, "model_fingerprint": source.fingerprint}
    return {fmt: writers[fmt](source, plan, run_dir / "quantized", run_dir / folder, max_bytes, world, extra)
            for fmt, folder in checkpoint_dirs(recipe).items()}


def served_by(plan: BitPlan, source: ModelSource, recipe: Recipe) -> dict[str, list[str]]:
    """Run-dir-relative checkpoint folder -> the runtimes its card names that serve it (``quant publish`` uploads
    only a folder some runtime serves)."""
    from quant.plan.runtimes import CHECKED_RUNTIMES, problems_for

    return {folder: [rt for rt in CHECKED_RUNTIMES if not problems_for(plan, source, rt, (fmt,))]
            for fmt, folder in checkpoint_dirs(recipe).items()}
