"""Checkpoint writers (compressed-tensors, GPTQ), model card, and readers for ``quant inspect``."""

from __future__ import annotations

from pathlib import Path

from quant.export.writer import CARD, add_to_manifest, checkpoint_digest
from quant.models import ModelSource
from quant.plan import BitPlan
from quant.recipe import Recipe

__all__ = ["CARD", "checkpoint_digest", "checkpoint_dirs", "export_all", "write_cards"]


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


def write_cards(recipe: Recipe, source: ModelSource, run_dir: Path) -> None:
    """The model card (README.md) of every exported checkpoint, from the plan summary, eval and runtime checks;
    its SHA-256 is added to the checkpoint's manifest, so what is published is what was written."""
    import json
    from importlib.metadata import version

    from quant.export.card import RUNTIMES, render_card
    from quant.plan_summary import summarize
    from quant.profile import RoutingProfile
    from quant.rundir import atomic_write_text
    from quant.runtimes import problems_for

    plan = BitPlan.load(run_dir / "plan.json")
    summary = summarize(plan, source, RoutingProfile.load(run_dir / "profile.json"))
    ev = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").is_file() else None
    for fmt, folder in checkpoint_dirs(recipe).items():
        problems = {rt: problems_for(plan, source, rt, (fmt,)) for rt in RUNTIMES}
        card = render_card(recipe, source, summary, ev, problems, version("moe-quant"), fmt=fmt)
        atomic_write_text(run_dir / folder / CARD, card)
        add_to_manifest(run_dir / folder, CARD)
