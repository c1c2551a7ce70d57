"""The one place where stage order lives: calibrate -> profile -> plan -> quantize -> export -> eval -> card -> report.

Each stage is a function of typed inputs that writes its artifact into the run directory. The pipeline hashes
every stage's inputs (recipe sections, model fingerprint, upstream outputs by content, or only the part of an
upstream artifact the stage reads: ``READS``); a stage whose inputs did not change and whose outputs are intact is
skipped, so rerunning a killed run resumes it, and a plan redone with new notes but the same module schemes leaves
the checkpoint and its evaluation alone. ``force`` redoes a
stage and everything after it. A stage that raises is recorded as failed and its outputs removed; a full disk or
an unwritable path becomes one line naming the path.

Under torchrun every rank runs the pipeline: the writer (rank 0) alone claims the run directory, decides which
stages are fresh, writes the manifest and runs the single-rank stages while the other ranks wait;
``profile``, ``quantize``, ``export`` and ``eval`` (``DISTRIBUTED``) run on every rank. Between stages a stop request
(signal, stop file) ends the run, resumable.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from quant.errors import GateFailed, QuantError, RunDirError, StopRequested
from quant.io.rundir import RunDir, data_digest, environment_error, hash_path
from quant.layerwise import peak_memory_bytes, pick_device, reset_peak_memory
from quant.models import ModelSource, resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import SCHEMA_VERSION as PLAN_SCHEMA
from quant.profile.profile import SCHEMA_VERSION as PROFILE_SCHEMA
from quant.progress import step as progress_step
from quant.recipe import Recipe
from quant.run import stages

log = logging.getLogger(__name__)

STAGES = ("calibrate", "profile", "plan", "quantize", "export", "eval", "card", "report")
# stage -> (recipe sections (or top-level keys) it reads, upstream stages whose outputs it reads, its outputs)
DEPENDS = {
    "calibrate": (("model", "calibration"), (), ("calibration.safetensors", "calibration.json")),
    "profile": (("model", "profile"), ("calibrate",), ("profile.json",)),
    # the plan reads the export formats (they decide group units and whom the plan serves)
    "plan": (("plan", "export.formats"), ("profile",), ("plan.json",)),
    "quantize": (("model", "quantize"), ("calibrate", "plan"), ("quantized",)),
    "export": (("export",), ("plan", "quantize"), ()),  # outputs: one folder per format
    "eval": (("model", "eval"), ("plan", "export"), ("eval.json",)),
    # the model card: what was done (recipe), the plan's headline, eval's numbers; outputs: each checkpoint's README.md
    "card": (("model", "plan", "quantize", "export", "eval"), ("plan", "export", "eval"), ()),
    "report": (("report", "eval", "description", "quantize.algorithm"), ("profile", "plan", "quantize", "export", "eval"),
               ("report.md", "metrics.json")),
}
# stages that read the model's tokenizer files (tokenize, or copy them into the checkpoint): the fingerprint covers
# weights and config only, so a changed tokenizer redoes them
TOKENIZES = ("calibrate", "export", "eval")
# (stage, upstream stage) -> what the stage reads of that upstream's artifact, where that is less than all of it:
# its freshness hashes this view (``data_digest``), not the upstream's files, so an upstream redone with other notes
# leaves it alone. quantize, export and eval read the plan's module schemes (the
# checkpoint follows from them and the quantized store, eval from the checkpoint); none reads the plan's headline,
# serving notes (the predicted KL moves with the profile's damage figures) or rules' prose. The card and the report
# print the plan's headline and serving notes: they read all of it, as every other stage reads its upstreams.
READS = {("quantize", "plan"): stages.plan_schemes, ("export", "plan"): stages.plan_schemes,
         ("eval", "plan"): stages.plan_schemes}
# upstream named in READS -> (its artifact as the run directory holds it, None when missing or unreadable; the
# artifact as it would write it now, made without any work from its own upstreams' artifacts and the recipe: the
# plan's modules are a pure function of the profile and the recipe). A preview reads the latter to
# tell, before any work, whether a stage reading the upstream through READS will be redone.
ARTIFACTS = {"plan": (stages.written_plan, stages.planned)}
# stages every rank runs (``run_<stage>(..., world)``); the others run on the writer alone
DISTRIBUTED = ("profile", "quantize", "export", "eval")
STOP_FILE = "STOP"  # touch RUN_DIR/STOP to stop a run after the layer in hand (Slurm job scripts do)
# Versioned artifacts: one written under another schema_version (by another quant version) counts as missing, so
# its stage is redone instead of the next stage failing to load it.
SCHEMAS = {"profile.json": PROFILE_SCHEMA, "plan.json": PLAN_SCHEMA}


def schema_current(path: Path, version: int) -> bool:
    """``path`` holds a JSON artifact of ``schema_version`` ``version`` (False when missing or unreadable)."""
    try:
        return json.loads(path.read_text()).get("schema_version") == version
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class Preview:
    """What a run will do, known before any work: the recipe values that changed since the run directory's last
    run (``key: old -> new``), the stages it will redo, those that are up to date, and those (``maybe``) redone
    only if what they read of a redone stage's new artifact (``READS``) differs from what they read before, which is
    known only once that stage has run (a plan made from a profile that is itself redone)."""

    run_dir: Path
    changed: tuple[str, ...]
    redo: tuple[str, ...]
    fresh: tuple[str, ...]
    new: bool
    maybe: tuple[str, ...] = ()

    def line(self) -> str:
        if self.new:
            return f"{self.run_dir}: a new run: {', '.join(self.redo)}"
        what = f"recipe changed since the last run ({'; '.join(self.changed)})" if self.changed else "recipe unchanged"
        if not self.redo:
            return f"{self.run_dir}: {what}; up to date, nothing to redo"
        maybe = (f"; {', '.join(self.maybe)} only if what they read of the redone stages' outputs changes"
                 if self.maybe else "")
        fresh = f" (up to date: {', '.join(self.fresh)})" if self.fresh else ""
        return f"{self.run_dir}: {what}; will redo {', '.join(self.redo)}{maybe}{fresh}"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def _shown(v) -> str:
    if isinstance(v, list | tuple):
        return f"[{', '.join(_shown(x) for x in v)}]"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def recipe_changes(old: dict | None, new: dict) -> tuple[str, ...]:
    """Dotted recipe keys whose values differ between two resolved recipes, as ``key: old -> new``."""
    if not old:
        return ()
    a, b = _flat(old), _flat(new)
    keys = list(b) + [k for k in a if k not in b]
    unset = object()
    return tuple(f"{k}: {_shown(a.get(k, '(unset)'))} -> {_shown(b.get(k, '(unset)'))}" for k in keys
                 if a.get(k, unset) != b.get(k, unset))


def check_devices(recipe: Recipe) -> None:
    for device in {recipe.quantize.device, recipe.eval.device}:
        pick_device(device)


def check_machine(recipe: Recipe, until: str = "report") -> None:
    """What this machine must have for a run of ``recipe`` up to ``until``, checked without the model or any work
    (``quant validate`` too): the devices named, the optional libraries and the sandbox the eval stage needs."""
    check_devices(recipe)
    if STAGES.index(until) >= STAGES.index("eval"):
        stages.check_eval_machine(recipe)


@dataclass
class RunResult:
    run_dir: Path
    ran: list[str]
    skipped: list[str]
    passed: bool | None


def share_fingerprint(world: World, source: ModelSource) -> str:
    """The writer's model fingerprint, set on every rank's ``source``. A fingerprint reads every shard whole the
    first time (digests are cached per machine, by stat): computed by each rank, the nodes of a multi-node job with
    node-local caches would each read the whole model from shared storage, eight ranks at a time, for a value the
    writer already has."""
    fingerprint = world.on_writer(lambda: source.fingerprint)
    source.__dict__["fingerprint"] = fingerprint  # the cached_property's slot
    return fingerprint


def _view_digest(stage: str, upstream: str, artifact) -> str | None:
    """The digest of what ``stage`` reads of ``upstream``'s ``artifact`` (``READS``); None without an artifact."""
    return None if artifact is None else data_digest(READS[stage, upstream](artifact))


class Run:
    """One recipe applied to one run directory."""

    def __init__(self, recipe: Recipe, run_dir: Path, world: World):
        self.recipe = recipe
        self.dir = RunDir(run_dir)
        self.world = world
        world.stop.file = self.dir.path / STOP_FILE

    @cached_property
    def source(self) -> ModelSource:
        m = self.recipe.model
        return resolve_model(m.path, trust_remote_code=m.trust_remote_code, family=m.family,
                             processes_per_node=self.world.local_size)

    def identity(self) -> dict:
        return {"recipe": self.recipe.name, "model": self.recipe.model.path,
                "fingerprint": self.source.fingerprint}

    def input_hash(self, stage: str, m: dict, reads: dict | None = None) -> str:
        """``reads``: upstream -> what ``stage`` will read of it once it is redone (a preview's, ``_verdict``), in
        place of what it reads of it now."""
        sections, upstream, _ = DEPENDS[stage]
        reads = reads or {}
        blob = {
            "recipe": self.recipe.section_hash(*sections),
            "model": self.source.fingerprint,
            "upstream": {u: reads[u] if u in reads else self._upstream(stage, u, m) for u in upstream},
        }
        if stage == "calibrate":
            blob["dataset"] = stages.dataset_hash(self.recipe.calibration.dataset)
        if stage in TOKENIZES:
            blob["tokenizer"] = self.source.tokenizer_digest()
        return data_digest(blob)

    def _upstream(self, stage: str, upstream: str, m: dict):
        """What ``stage`` reads of ``upstream``'s outputs now: the digest of its view (``READS``) of the artifact in
        the run directory, else the outputs as recorded."""
        if (stage, upstream) in READS:
            return _view_digest(stage, upstream, ARTIFACTS[upstream][0](self.dir.path))
        return m["stages"].get(upstream, {}).get("outputs")

    def outputs(self, stage: str) -> list[str]:
        """Run-dir-relative outputs: export's are the checkpoint folders, eval's include lm-eval's own results when
        it ran tasks, card's are the model card in each checkpoint folder and, when eval ran tasks, the copies of
        lm-eval's results beside it."""
        from quant.export import CARD, LM_EVAL_FILES, checkpoint_dirs

        if stage == "export":
            return list(checkpoint_dirs(self.recipe).values())
        if stage == "card":
            names = (CARD, *LM_EVAL_FILES.values()) if self.recipe.eval.tasks else (CARD,)
            return [f"{d}/{name}" for d in checkpoint_dirs(self.recipe).values() for name in names]
        if stage == "eval" and self.recipe.eval.tasks:
            from quant.eval.evaluate import LM_EVAL_RESULTS

            return list(DEPENDS[stage][2]) + list(LM_EVAL_RESULTS.values())
        return list(DEPENDS[stage][2])

    def output_hashes(self, stage: str) -> dict[str, str | None]:
        """What each output holds now (None: missing or damaged). A checkpoint counts by the SHA-256 manifest it
        carries, verified file by file (digests cached by stat, so an unchanged checkpoint is not re-read). A
        versioned artifact of another schema (``SCHEMAS``) counts as missing."""
        if stage == "export":
            from quant.export import checkpoint_digest

            return {o: checkpoint_digest(self.dir.path / o) for o in self.outputs(stage)}
        return {o: self._output_hash(o) for o in self.outputs(stage)}

    def _output_hash(self, output: str) -> str | None:
        path = self.dir.path / output
        if output in SCHEMAS and not schema_current(path, SCHEMAS[output]):
            return None
        return hash_path(path)

    def check_arguments(self, until: str, force: str | None) -> None:
        """What fails before any work, on every rank: stage names and devices."""
        if until not in STAGES:
            raise RunDirError(f"unknown stage '{until}'; stages: {', '.join(STAGES)}")
        if force is not None and force not in STAGES and force != "all":
            raise RunDirError(f"--force takes a stage name or 'all', got '{force}'; stages: {', '.join(STAGES)}")
        check_devices(self.recipe)

    def check_model(self, until: str) -> None:
        """What fails before any work, on the writer (it resolves the model): what the eval stage needs of this
        machine (``check_machine``) and of the model."""
        if STAGES.index(until) >= STAGES.index("eval"):
            stages.check_eval_machine(self.recipe)
            stages.check_eval_model(self.recipe, self.source)

    def preview(self, until: str = "report", force: str | None = None, m: dict | None = None,
                previous: dict | None = None) -> Preview:
        """The stages a run will redo and the recipe values changed since the last run, from the manifest ``m``
        (default: the run directory's, read only; a run directory that would refuse the run raises)."""
        if m is None:
            self.check_arguments(until, force)
            self.check_model(until)
            self.dir.check_entries()
            previous = self.dir.manifest()
            refusal = self.dir.refusal(previous, self.identity(), force is not None)
            if refusal is not None:
                raise RunDirError(refusal)
            same = previous.get("identity") == self.identity()
            m = {"stages": previous.get("stages", {}) if same else {}}
        first_forced = 0 if force == "all" else (STAGES.index(force) if force else len(STAGES))
        todo = STAGES[: STAGES.index(until) + 1]
        redo: list[str] = []
        maybe: list[str] = []
        for i, stage in enumerate(todo):
            verdict = "redo" if i >= first_forced else self._verdict(stage, m, redo, maybe)
            if verdict != "fresh":
                (redo if verdict == "redo" else maybe).append(stage)
        new = not any(s.get("status") == "done" for s in m["stages"].values())
        return Preview(self.dir.path, recipe_changes((previous or {}).get("recipe"), self.recipe.model_dump(mode="json")),
                       tuple(redo), tuple(s for s in todo if s not in redo + maybe), new, tuple(maybe))

    def _verdict(self, stage: str, m: dict, redo: list[str], maybe: list[str]) -> str:
        """``redo`` when ``stage`` will be redone once the stages in ``redo`` are: its inputs changed, or an upstream
        it reads all of is redone (its new outputs taken to differ); ``maybe`` when that turns on what a redone upstream writes and is not known
        before it runs (an upstream read through ``READS`` whose own upstreams are redone, or an upstream that is
        ``maybe`` itself); ``fresh`` when it stays up to date. What it will read of an upstream redone from
        artifacts in place is made now (``ARTIFACTS``), so a preview says what the run will do."""
        reads, unknown = {}, False
        for u in (u for u in DEPENDS[stage][1] if u in redo + maybe):
            if (stage, u) not in READS and u in redo:
                return "redo"
            if (stage, u) not in READS or any(v in redo + maybe for v in DEPENDS[u][1]):
                unknown = True
                continue
            try:
                reads[u] = _view_digest(stage, u, ARTIFACTS[u][1](self.recipe, self.source, self.dir.path))
            except (QuantError, OSError, ValueError):  # the upstream stage itself will say what is wrong
                return "redo"
        if not self.dir.is_fresh(m, stage, self.input_hash(stage, m, reads), lambda: self.output_hashes(stage)):
            return "redo"
        return "maybe" if unknown else "fresh"

    def execute(self, until: str = "report", force: str | None = None) -> RunResult:
        w = self.world
        self.check_arguments(until, force)

        def claim() -> dict:  # on the writer, which resolves the model first (a hub model downloads once)
            self.check_model(until)  # a recipe the model cannot serve fails before any work
            previous = self.dir.manifest()
            m = self.dir.claim(self.identity(), force=force is not None)
            p = self.preview(until, force, m, previous)
            log.log(logging.WARNING if p.changed else logging.INFO, "%s", p.line())
            m["recipe"] = self.recipe.model_dump(mode="json")
            self.dir.save_manifest(m)
            return m

        m = w.on_writer(claim)
        share_fingerprint(w, self.source)
        first_forced = 0 if force == "all" else (STAGES.index(force) if force else len(STAGES))
        ran, skipped = [], []
        todo = STAGES[: STAGES.index(until) + 1]
        for i, stage in enumerate(todo):
            fresh, h = w.on_writer(lambda i=i, stage=stage: self._decide(stage, i < first_forced, m))
            if fresh:
                skipped.append(stage)
                log.info("stage %s: up to date, skipped", stage)
                continue
            if stage in ("calibrate", "profile", "quantize", "eval"):  # before it allocates
                w.on_writer(lambda stage=stage: stages.check_memory(self.recipe, self.source, stage, w.size))
            if stage == "quantize" or (stage == "export" and "quantize" not in ran):
                w.on_writer(lambda stage=stage: stages.check_disk(self.recipe, self.source, self.dir.path, stage))
            position = (i, len(todo))
            if stage in DISTRIBUTED:
                self._run_stage(stage, h, m, position)
            else:
                w.on_writer(lambda stage=stage, h=h, p=position: self._run_stage(stage, h, m, p))
            ran.append(stage)
            if i + 1 < len(todo):
                w.raise_if_stopped(f"stage {stage}")
        passed = w.on_writer(lambda: self._finish(m, until))
        return RunResult(self.dir.path, ran, skipped, passed)

    def _decide(self, stage: str, may_skip: bool, m: dict) -> tuple[bool, str]:
        h = self.input_hash(stage, m)
        return may_skip and self.dir.is_fresh(m, stage, h, lambda: self.output_hashes(stage)), h

    def _finish(self, m: dict, until: str) -> bool | None:
        passed = m["stages"].get("eval", {}).get("passed")
        m["passed"] = passed
        self.dir.save_manifest(m)
        if passed is False and STAGES.index(until) >= STAGES.index("eval"):
            failed = m["stages"]["eval"].get("failed_gates", [])
            raise GateFailed(f"quality gates failed: {'; '.join(failed)} (see {self.dir.path / 'report.md'})")
        return passed

    def _run_stage(self, stage: str, input_hash: str, m: dict, position: tuple[int, int]) -> None:
        """Run one stage (on every rank when it is distributed, else on the writer alone); the writer records it:
        done, stopped, or failed (its outputs removed). ``position``: (stages before it, stages in this invocation)
        for the progress display."""
        w, distributed, (i, n) = self.world, stage in DISTRIBUTED, position
        log.info("stage %s: running", stage, extra=progress_step("run", i, n, "stages", eta=False))
        device = pick_device(self.recipe.quantize.device)
        reset_peak_memory(device)
        if w.is_writer:
            upstream = {u: m["stages"].get(u, {}).get("outputs") for u in DEPENDS[stage][1]}
            self.dir.mark(m, stage, status="running", input_hash=input_hash, upstream=upstream)
        t0 = time.perf_counter()
        fn = getattr(stages, f"run_{stage}")
        try:
            info = (fn(self.recipe, self.source, self.dir.path, w) if distributed
                    else fn(self.recipe, self.source, self.dir.path)) or {}
            peak = w.max_over_ranks(peak_memory_bytes(device)) if distributed else peak_memory_bytes(device)
            if w.is_writer:
                self.dir.mark(m, stage, status="done", input_hash=input_hash, wall_s=round(time.perf_counter() - t0, 3),
                              peak_memory_bytes=peak, device=str(device), ranks=w.size if distributed else 1,
                              outputs=self.output_hashes(stage), **info)
        except StopRequested:
            if w.is_writer:
                self.dir.mark(m, stage, status="stopped")
            raise
        except BaseException as e:
            if w.is_writer:
                self._record_failure(stage, m, e)
            raise
        if w.is_writer:
            log.info("stage %s: done in %.1fs", stage, m["stages"][stage]["wall_s"],
                     extra=progress_step("run", i + 1, n, "stages", eta=False))

    def _record_failure(self, stage: str, m: dict, error: BaseException) -> None:
        """Mark ``stage`` failed (interrupted) and remove its outputs; a full disk or unwritable path is raised as
        one line naming it."""
        self.dir.fail(m, stage, error, self.outputs(stage))
        plain = environment_error(error, self.dir.path,
                                  lambda: stages.output_bytes(stage, self.recipe, self.source, self.dir.path))
        if plain is not None:
            raise plain from None


def preview(recipe: Recipe, run_dir: Path, until: str = "report", force: str | None = None) -> Preview:
    """What ``run`` would do (``Run.preview``), reading the run directory only."""
    return Run(recipe, run_dir, World()).preview(until, force)


def run(recipe: Recipe, run_dir: Path, until: str = "report", force: str | None = None,
        world: World | None = None) -> RunResult:
    """Apply ``recipe`` to ``run_dir`` up to stage ``until`` in ``world`` (the CLI's process group; None: this
    process alone, a fresh world of one whose stop flag is this run's)."""
    world = World() if world is None else world
    try:
        return Run(recipe, run_dir, world).execute(until=until, force=force)
    except OSError as e:  # a full disk or unwritable path outside a stage (manifest writes)
        plain = environment_error(e, Path(run_dir))
        if plain is None:
            raise
        raise plain from None
