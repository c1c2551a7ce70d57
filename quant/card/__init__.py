"""The card stage: each exported checkpoint's model card (``README.md``), written after eval has measured the
checkpoint on disk, with eval's numbers, the plan's headline and the runtime checks (``render``: formatting only).

The card stage is the only writer of the card, of lm-eval's results copied beside it (``LM_EVAL_FILES``) and of
their entries in the checkpoint's SHA-256 manifest; export writes a checkpoint without them, and its identity
(``checkpoint_digest``) leaves them out.
"""

from __future__ import annotations

from pathlib import Path

from quant.export import checkpoint_dirs
from quant.export.writer import CARD, LM_EVAL_FILES, add_to_manifest
from quant.models import ModelSource
from quant.plan.bitplan import BitPlan
from quant.recipe import Recipe

__all__ = ["runtime_notes", "write_cards"]


def lm_eval_results(run_dir: Path, ev: dict | None) -> dict[str, Path]:
    """``base`` / ``quantized`` -> lm-eval's own results JSON in the run directory, where the eval stage ran lm-eval
    tasks (none when eval.json records no task: a file left by an earlier run with tasks is not current)."""
    from quant.eval.evaluate import LM_EVAL_RESULTS

    if not (ev or {}).get("tasks"):
        return {}
    return {which: run_dir / name for which, name in LM_EVAL_RESULTS.items() if (run_dir / name).is_file()}


def copy_lm_eval_results(results: dict[str, Path], checkpoint: Path) -> None:
    """lm-eval's results into the checkpoint (``LM_EVAL_FILES``), each added to its manifest; those of models
    not evaluated with tasks now are removed, file and entry, so a checkpoint never carries stale results."""
    import shutil

    from quant.export.writer import remove_from_checkpoint

    for which, name in LM_EVAL_FILES.items():
        if which in results:
            shutil.copyfile(results[which], checkpoint / name)
            add_to_manifest(checkpoint, name)
        else:
            remove_from_checkpoint(checkpoint, name)


def write_cards(recipe: Recipe, source: ModelSource, run_dir: Path) -> None:
    """The model card (README.md) of every exported checkpoint, from the recipe, the plan's headline, eval.json
    and the runtime checks, beside lm-eval's own results when eval ran tasks (``LM_EVAL_FILES``, the card's
    per-task table read from them); each file's SHA-256 is added to the checkpoint's manifest, so what is
    published is what was written."""
    import json

    from quant import version
    from quant.card.render import render_card
    from quant.eval.lmeval import task_records
    from quant.io.rundir import atomic_write_text
    from quant.plan.runtimes import CHECKED_RUNTIMES, gptqmodel_kernel_problem, problems_for
    from quant.plan.summary import scheme_counts

    plan = BitPlan.load(run_dir / "plan.json")
    ev = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").is_file() else None
    results = lm_eval_results(run_dir, ev)
    tasks = list((ev or {}).get("tasks", {}))
    lm_eval = {which: task_records(json.loads(path.read_text()), tasks) for which, path in results.items()}
    for fmt, folder in checkpoint_dirs(recipe).items():
        problems = {rt: problems_for(plan, source, rt, (fmt,)) for rt in CHECKED_RUNTIMES}
        backend = "TORCH" if fmt == "gptq" and gptqmodel_kernel_problem(plan) else None
        card = render_card(recipe, source, plan.headline, ev, problems, version(), fmt=fmt,
                           runtime_notes=runtime_notes(plan, source, fmt), gptqmodel_backend=backend,
                           serving=plan.serving, schemes=scheme_counts(plan, source), lm_eval=lm_eval)
        copy_lm_eval_results(results, run_dir / folder)
        atomic_write_text(run_dir / folder / CARD, card)
        add_to_manifest(run_dir / folder, CARD)


def runtime_notes(plan: BitPlan, source: ModelSource, fmt: str) -> dict[str, str]:
    """Warnings the card shows per runtime: where a runtime would load the checkpoint without an error and compute
    wrong outputs (read from their code, docs/runtimes.md), and which GPTQModel backend the plan needs."""
    from quant.plan.runtimes import expert_schemes_by_layer, gptqmodel_kernel_problem, problems_for

    by_layer = expert_schemes_by_layer(plan, source)
    notes = {}
    mixed = any(len(s) > 1 for s in by_layer.values())
    if mixed:  # as vLLM 0.26.0 and transformers 5.17 did with such checkpoints (tests/serve, tests/integration)
        plugin = ("vLLM with quant's plugin serves it (above)." if not problems_for(plan, source, "vllm-quant", (fmt,))
                  else "")
        notes["vllm"] = (
            "Stock vLLM refuses this checkpoint by name (`quant_method: moe-quant-mixed`: \"Unknown quantization "
            f"method\"). {plugin}".strip() if fmt == "compressed-tensors" else
            "vLLM fails to load this checkpoint (its `dynamic` rules are per MoE layer, and the experts' tensors of "
            "other bits do not fit); serve the compressed-tensors export with quant's plugin."
        )
    if fmt == "compressed-tensors" and mixed:
        notes["transformers"] = ("**Do not load this checkpoint with transformers**: it skips the unknown method "
                                 "`moe-quant-mixed` and leaves every quantized weight uninitialised (a load "
                                 "report, no error).")
    elif fmt == "compressed-tensors" and len(set().union(*by_layer.values())) > 1:
        notes["transformers"] = ("**transformers 5.x loads this checkpoint without an error and computes wrong "
                                 "outputs**: it decompresses every expert of the model with one scheme.")
    if fmt == "gptq" and (kernel := gptqmodel_kernel_problem(plan)):
        notes["gptqmodel"] = kernel
    return notes
