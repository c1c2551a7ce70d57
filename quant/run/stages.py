"""Stage bodies: read upstream artifacts from the run directory, call the stage's module, write its artifact.

Each ``run_<stage>(recipe, source, run_dir) -> dict`` writes only its own outputs (atomically) and returns a
few numbers for the manifest. Stages never call each other; ``pipeline`` decides order and freshness.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from quant.calibration import CalibrationSet, build_calibration, load_manifest, resolve_dataset_path
from quant.errors import QuantError
from quant.io.rundir import atomic_write_text, data_digest, temp_path
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan, plan_bits
from quant.plan.summary import summarize
from quant.profile.profile import RoutingProfile, profile_routing
from quant.recipe import Recipe

log = logging.getLogger(__name__)
PARTIAL = "quantize.partial"  # the quantized store while quantize runs (kept across crashes)


def dataset_hash(dataset: str) -> str:
    """Hash of a calibration manifest and the local files it names."""
    path = resolve_dataset_path(dataset)
    h = hashlib.sha256(path.read_bytes())
    for src in load_manifest(path).sources:
        if src.path and (path.parent / src.path).is_file():
            h.update((path.parent / src.path).read_bytes())
    return h.hexdigest()[:16]


def save_calibration(calib: CalibrationSet, run_dir: Path) -> None:
    from safetensors.torch import save_file

    tmp = temp_path(run_dir / "calibration.safetensors")
    save_file({"tokens": calib.tokens.contiguous()}, str(tmp))
    tmp.replace(run_dir / "calibration.safetensors")
    meta = {"dataset": calib.manifest, "seed": calib.seed, "n_samples": len(calib.sample_ids),
            "seq_len": int(calib.tokens.shape[1]), "sample_ids": list(calib.sample_ids), "domains": list(calib.domains)}
    atomic_write_text(run_dir / "calibration.json", json.dumps(meta, indent=1))


def load_calibration(run_dir: Path) -> CalibrationSet:
    from safetensors.torch import load_file

    meta = json.loads((run_dir / "calibration.json").read_text())
    tokens = load_file(str(run_dir / "calibration.safetensors"))["tokens"]
    return CalibrationSet(tokens, tuple(meta["sample_ids"]), tuple(meta["domains"]), meta["seed"], meta["dataset"])


def _layerwise(recipe: Recipe, source: ModelSource, batch_size: int, world: World) -> Layerwise:
    return Layerwise(source, recipe.model.dtype, recipe.quantize.device, batch_size, world)


def run_calibrate(recipe: Recipe, source: ModelSource, run_dir: Path) -> dict:
    c = recipe.calibration
    calib = build_calibration(c.dataset, source.tokenizer(), c.n_samples, c.seq_len, c.seed)
    source.check_token_ids(calib.tokens, f"the calibration set {c.dataset}")
    save_calibration(calib, run_dir)
    return {"n_tokens": int(calib.tokens.numel())}


def _layer_damage(recipe: Recipe, source: ModelSource, calib: CalibrationSet, world: World) -> dict:
    """The layer-damage pass, run by this process alone (``world.alone()``)."""
    from quant.profile.layer_damage import measure_layer_damage, spread_rows

    ls = recipe.profile.layer_sensitivity
    tokens = calib.tokens[spread_rows(calib.tokens.shape[0], ls.n_samples)]
    lw = Layerwise(source, ls.dtype, recipe.quantize.device, recipe.profile.batch_size, world, narrow_experts=True)
    return measure_layer_damage(source, tokens, lw, ls.schemes, ls.method, ls.carry_layers, ls.draws,
                                seed=calib.seed).damage


def run_profile(recipe: Recipe, source: ModelSource, run_dir: Path, world: World) -> dict:
    calib = load_calibration(run_dir)
    profile = profile_routing(source, calib, _layerwise(recipe, source, recipe.profile.batch_size, world),
                              min_tokens=recipe.profile.min_tokens)
    if recipe.profile.layer_sensitivity is not None:  # one pass on the writer, its result on every rank
        profile = replace(profile, layer_damage=world.on_writer(lambda: _layer_damage(recipe, source, calib, world.alone())))
    if world.is_writer:
        tmp = temp_path(run_dir / "profile.json")
        profile.save(tmp)
        tmp.replace(run_dir / "profile.json")
    return {"moe_layers": len(profile.layers), "n_experts": profile.n_experts}


def run_plan(recipe: Recipe, source: ModelSource, run_dir: Path) -> dict:
    from quant.export import check_formats
    from quant.plan.runtimes import check_runtime
    from quant.plan.servable import serving_summary

    profile = RoutingProfile.load(run_dir / "profile.json")
    formats = recipe.export.formats
    plan = plan_bits(profile, source.modules, recipe.plan, source.n_layers, formats)
    check_runtime(plan, source, recipe.plan.target_runtime, formats)
    check_formats(plan, source, formats)
    plan = replace(plan, serving=serving_summary(plan, source, profile, formats))
    plan = replace(plan, headline=summarize(plan, source, profile).headline)
    tmp = temp_path(run_dir / "plan.json")
    plan.save(tmp)
    tmp.replace(run_dir / "plan.json")
    log.info("plan: %s", plan.headline.line())
    return {"headline": asdict(plan.headline)}


def check_eval_machine(recipe: Recipe) -> None:
    """The eval stage's recipe against this machine, before any work and without the model: the libraries its
    tasks need (``lmeval.check_installed``), a task that runs generated code where the sandbox lacks a kernel
    layer (``lmeval.check_sandboxed_tasks``)."""
    from quant.eval.lmeval import check_installed, check_sandboxed_tasks

    check_installed(recipe.eval.tasks, recipe.eval.backend)
    check_sandboxed_tasks(recipe.eval.tasks, recipe.eval.humaneval_sandbox)


def check_eval_model(recipe: Recipe, source: ModelSource) -> None:
    """The eval stage's recipe against the model, before any work (``evaluate.check_mode``), its held-out manifest
    (read and validated: its sources are tokenized only in the eval stage) and its lm-eval tasks
    (``lmeval.check_tasks``)."""
    from quant.eval.evaluate import check_mode

    check_mode(recipe.eval.mode, source)
    load_manifest(resolve_dataset_path(recipe.eval.perplexity.dataset))
    if recipe.eval.tasks:
        from quant.eval.lmeval import check_tasks

        check_tasks(recipe.eval.tasks)


def check_memory(recipe: Recipe, source: ModelSource, stage: str, ranks: int) -> None:
    """Before ``stage`` (calibrate, profile, quantize, eval) allocates: refuse when its token table and cached
    hidden states cannot fit the host's available memory."""
    from quant.forecast.estimate import check_run_memory
    from quant.io.staging import host_available_bytes
    from quant.layerwise import pick_device

    device = pick_device(recipe.eval.device if stage == "eval" else recipe.quantize.device)
    check_run_memory(recipe, source, stage, device.type == "cpu", ranks, host_available_bytes())


def check_disk(recipe: Recipe, source: ModelSource, run_dir: Path, stage: str) -> None:
    """Before ``quantize`` (or ``export`` alone): refuse when the run directory's disk cannot hold the quantized
    store and the checkpoints (layers already in ``quantize.partial/`` count as written)."""
    from quant.forecast.footprint import check_free_disk, estimate

    plan = BitPlan.load(run_dir / "plan.json")
    need = estimate(source, plan, recipe.export.formats, scale_bytes=2 if recipe.model.dtype != "float32" else 4)
    partial = run_dir / PARTIAL
    written = sum(f.stat().st_size for f in partial.glob("layer_*.safetensors")) if stage == "quantize" else 0
    check_free_disk(run_dir, need, with_store=stage == "quantize", existing_bytes=written)


def written_plan(run_dir: Path) -> BitPlan | None:
    """The run directory's plan, None when it is missing or unreadable (the plan stage, redone, says why)."""
    try:
        return BitPlan.load(run_dir / "plan.json")
    except (QuantError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def planned(recipe: Recipe, source: ModelSource, run_dir: Path) -> BitPlan:
    """The plan the plan stage would write now from the run's profile, as far as its modules go:
    they are a pure function of the profile and the recipe (no headline or serving notes; nothing is written)."""
    profile = RoutingProfile.load(run_dir / "profile.json")
    return plan_bits(profile, source.modules, recipe.plan, source.n_layers,
                     recipe.export.formats)


def plan_schemes(plan: BitPlan) -> dict:
    """What export and eval read of a plan: each module's bits (None: kept), group size and symmetry. The
    checkpoint's config and tensors follow from them and the quantized store; eval reads them to tell whether
    transformers loads the checkpoint as it is. Not the rules' prose, the headline or the serving notes."""
    return {"modules": {n: [p.bits, p.group_size, p.symmetric] for n, p in plan.modules.items()}}


def _partial_dir(recipe: Recipe, run_dir: Path, plan: BitPlan) -> Path:
    """``quantize.partial/`` kept across crashes when its key (what quantize reads of the plan, the quantize
    section, tokens) still matches."""
    partial = run_dir / PARTIAL
    key = hashlib.sha256(data_digest(plan_schemes(plan)).encode() + recipe.section_hash("quantize").encode()
                         + (run_dir / "calibration.safetensors").read_bytes()).hexdigest()[:16]
    if partial.exists() and (not (partial / "key").is_file() or (partial / "key").read_text() != key):
        shutil.rmtree(partial)
    partial.mkdir(exist_ok=True)
    (partial / "key").write_text(key)
    return partial


def _publish_partial(partial: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)


def run_quantize(recipe: Recipe, source: ModelSource, run_dir: Path, world: World) -> dict:
    """Layer files go to ``quantize.partial/`` (kept across crashes, keyed by the plan); renamed when done.
    Every rank runs this; the writer alone touches the run directory."""
    from quant.quantize.driver import quantize_model

    plan = BitPlan.load(run_dir / "plan.json")
    partial = world.on_writer(lambda: _partial_dir(recipe, run_dir, plan))
    # the engine's vocabulary: each quantized module's grid (the plan's), and the algorithm's name (the recipe's)
    reports = quantize_model(source, load_calibration(run_dir), plan.quantized_schemes(), recipe.quantize.algorithm,
                             recipe.quantize, _layerwise(recipe, source, recipe.quantize.batch_size, world), partial)
    world.on_writer(lambda: _publish_partial(partial, run_dir / "quantized"))
    return {"layers": len(reports), "rtn_fallbacks": sum(len(r.rtn_fallbacks) for r in reports),
            "resumed_layers": sum(r.resumed for r in reports)}


def run_export(recipe: Recipe, source: ModelSource, run_dir: Path, world: World) -> dict:
    """Every rank writes its share of each checkpoint's shard files; the writer alone finishes each checkpoint."""
    from quant.export import export_all, served_by

    plan = BitPlan.load(run_dir / "plan.json")
    written = export_all(source, plan, recipe, run_dir, world)
    return {"formats": list(written), "served_by": served_by(plan, source, recipe)}


def run_eval(recipe: Recipe, source: ModelSource, run_dir: Path, world: World) -> dict:
    """eval.json; lm-eval's own results beside it when eval.tasks name any (an earlier run's removed when not)."""
    from quant.eval.evaluate import LM_EVAL_RESULTS, evaluate_run

    result = evaluate_run(recipe, source, run_dir, world)
    if world.is_writer:
        for name in LM_EVAL_RESULTS.values() if not recipe.eval.tasks else ():
            (run_dir / name).unlink(missing_ok=True)
        tmp = temp_path(run_dir / "eval.json")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(run_dir / "eval.json")
    failed = [f"{g['name']} {g['observed']:.4g} vs limit {g['limit']:.4g}" for g in result["gates"] if not g["passed"]]
    return {"passed": not failed, "failed_gates": failed}


def run_card(recipe: Recipe, source: ModelSource, run_dir: Path) -> dict:
    """Each checkpoint's model card, written once, after eval (``card.write_cards``)."""
    from quant.card import write_cards

    write_cards(recipe, source, run_dir)
    return {}


def run_report(recipe: Recipe, source: ModelSource, run_dir: Path) -> dict:
    from quant.report import write_report

    write_report(recipe, source, run_dir)
    return {}


def output_bytes(stage: str, recipe: Recipe, source: ModelSource, run_dir: Path) -> int:
    """About how many bytes ``stage`` writes (for the disk-full message): tokens, the quantized store, the
    checkpoints (``footprint.estimate``), or the dense copy eval may make in the temp dir; 1 MB for the rest."""
    if stage in ("quantize", "export"):
        from quant.forecast.footprint import estimate

        fp = estimate(source, BitPlan.load(run_dir / "plan.json"), recipe.export.formats)
        return fp.store_bytes if stage == "quantize" else sum(fp.checkpoint_bytes.values())
    if stage == "calibrate":
        return recipe.calibration.n_samples * recipe.calibration.seq_len * 8
    if stage == "eval":
        return sum((source.path / f).stat().st_size for f in set(source.weight_map.values()))
    return 1 << 20
