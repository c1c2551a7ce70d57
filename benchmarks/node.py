"""One node, the whole pipeline (GPUs): `quant run` under torchrun on a model of real layer shapes, to full depth.

Builds (once) the random-weight model of ``benchmarks/engine.py`` with ``--layers K`` saved layers, a word-level
tokenizer over its vocabulary and two local text sets of seeded random words (calibration and held-out), writes a
recipe (the headline recipe's plan: top 20 % of experts per layer at INT8, the rest INT4, g128; GPTQ; compressed-
tensors; streamed eval proxies; no gates; the layer-sensitivity pass only with ``--layer-damage``) and runs it
twice under ``torchrun --standalone --nproc-per-node N``:

- **depth**: calibrate, profile, plan and quantize with the K saved layers tiled to ``--virtual-layers V``
  (engine.py's ``TiledSource``: layer i reads saved layer i mod K through the normal safetensors path), through
  ``quant.run.pipeline.Run`` itself. The writer rank deletes a virtual layer's file from the quantized store as soon as
  it is written (every byte is still written): 61 DeepSeek-V3 layers' codes are ~420 GB, more than the local
  disk of many 8-GPU machines. For the same reason quant's free-disk check, which counts all V layers, is skipped
  in this run.
- **breadth**: the CLI itself (``torchrun ... -m quant.cli run RECIPE``) on the K saved layers: every stage,
  export and streamed eval included, the checkpoint real and complete.

Per stage wall time and peak GPU memory (largest rank) come from each run's ``manifest.json``; the depth run also
gathers every rank's quantize peak. The model fingerprint (once per model and machine) is timed on its own before
the runs, which find it cached. ``--project-layers P`` (default V) projects a P-layer run from the measured parts
(``project``): a machine whose commands are cut at 10 minutes times V < 61 tiled layers and projects 61. Prints
JSON lines, then a table.

  python benchmarks/node.py --shape deepseek-v3 --layers 2 --virtual-layers 61 --samples 512 --seqlen 2048 \\
      --ranks 8 --workdir /data/quant-node          # one 8-GPU node, the whole depth
  python benchmarks/node.py ... --part build; ... --part depth; ... --part breadth   # one part a call
  python benchmarks/node.py --shape tiny --layers 1 --virtual-layers 3 --samples 8 --seqlen 64 --ranks 2  # CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

from quant.models.synthetic import SHAPES, TiledSource, build_model, random_words
from quant.run.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[1]
DEPTH_STAGES = STAGES[: STAGES.index("quantize") + 1]


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def write_inputs(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The model (built once), the two text sets with their manifests, the recipe: (model folder, recipe)."""
    model_dir = work / f"model-{a.shape}-{a.layers}"
    if not (model_dir / "config.json").is_file():
        t0 = time.perf_counter()
        build_model(a.shape, a.layers, model_dir, seed=0)
        say(step="build", s=round(time.perf_counter() - t0, 1))
    if not (work / "fingerprint.json").is_file():  # once per model and machine; the runs find it cached
        from quant.models import ModelSource

        t0 = time.perf_counter()
        digest = ModelSource(model_dir).fingerprint
        (work / "fingerprint.json").write_text(json.dumps({"s": time.perf_counter() - t0, "fingerprint": digest}))
    vocab = SHAPES[a.shape]["vocab_size"]
    data = work / "data"
    data.mkdir(exist_ok=True)
    # enough words for non-overlapping windows; the held-out set has its own seed
    for name, n_tokens, seed in (("calibration", (a.samples + 1) * a.seqlen, 0),
                                 ("heldout", (a.eval_samples + 1) * a.seqlen, 1)):
        (data / f"{name}.txt").write_text(random_words(n_tokens, vocab, seed))
        (data / f"{name}.yaml").write_text(yaml.safe_dump(
            {"name": f"random-{name}", "sources": [{"name": name, "kind": "text", "path": f"{name}.txt"}]}))
    recipe = yaml.safe_load((ROOT / "recipes" / "mixed_int8_int4.yaml").read_text())
    recipe.update(name=f"node-{a.shape}", description="benchmarks/node.py: the headline plan with GPTQ, streamed eval")
    recipe["model"]["path"] = str(model_dir)
    recipe["calibration"].update(dataset=str(data / "calibration.yaml"), n_samples=a.samples, seq_len=a.seqlen)
    if not a.layer_damage:  # the layer-sensitivity pass prices the servable plan (the headline's default)
        recipe.pop("profile", None)
    recipe["quantize"] = {"algorithm": "gptq", "batch_size": a.batch}
    for item in a.set:  # --set KEY=VALUE, as `quant run --set` takes them (dotted keys, YAML values)
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = recipe
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    recipe["eval"] = {"perplexity": {"dataset": str(data / "heldout.yaml"), "n_samples": a.eval_samples,
                                     "seq_len": a.seqlen}, "mode": "streamed", "batch_size": a.batch}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return model_dir, path


def _prune(store: list[Path], keep: int, n_layers: int, done: threading.Event) -> None:
    """Delete the store's files of layers ``keep .. n_layers - 1`` once written (their recorded digest, the writer's
    last step, is there), until ``done``; one last sweep after it."""
    from quant.quantize.qstore import digest_file, layer_file, remove_layer

    while True:
        last = done.wait(0.5)
        for folder in store:
            for idx in range(keep, n_layers):
                if last or digest_file(layer_file(folder, idx)).is_file():
                    remove_layer(layer_file(folder, idx))
        if last:
            return


class _DamagePhases(logging.Handler):
    """When the layer-damage pass's progress lines came: each phase's seconds (bounded: the clean walk, the walk back
    with its branches; exact: its one walk) and the whole pass's, from the lines' times, for a depth run that times
    the pass inside its profile stage."""

    PHASES = ("clean through", "back through", "exact: branches through")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: dict[str, float] = {}
        self.first: float | None = None
        self.end: float | None = None
        self.back: list[float] = []  # when each layer of the walk back was done
        self.halved: list[str] = []  # FittingBatches' lines: the batch the device had no room for, halved

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if self.first is None and msg.startswith("layer damage:"):
            self.first = record.created
        for phase in self.PHASES:
            if phase in msg:
                self.last[phase] = record.created
        if "back through" in msg:
            self.back.append(record.created)
        if "out of memory" in msg:
            self.halved.append(msg)
        if msg.startswith("layer damage (") and self.first is not None:  # the pass's closing summary
            self.end = record.created

    def seconds(self) -> dict[str, float]:
        if self.first is None:
            return {}
        out, start = {}, self.first
        for phase in self.PHASES:
            if phase in self.last:
                out[phase.split()[0].rstrip(":")] = round(self.last[phase] - start, 1)
                start = self.last[phase]
        if self.end is not None:
            out["pass"] = round(self.end - self.first, 1)
        if self.back and "clean through" in self.last:  # each layer of the walk back, from the last layer down
            times = [self.last["clean through"], *self.back]
            out["back_per_layer"] = [round(b - a, 1) for a, b in zip(times, times[1:], strict=False)]
        if self.halved:
            out["halved"] = self.halved
        return out


class _Progress(logging.Handler):
    """Every INFO line of quant's loggers printed as it comes (the writer rank's), with the seconds since the run
    began and since the logger's previous line: a run cut off at a call's limit shows which stage and layer it
    reached, and at what seconds per layer."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.t0 = time.perf_counter()
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        now = time.perf_counter()
        since = now - self.last.get(record.name, self.t0)
        self.last[record.name] = now
        print(f"progress {now - self.t0:8.1f} s (+{since:6.1f}) {record.name.removeprefix('quant.')}: "
              f"{record.getMessage()}", flush=True)


def depth_worker(a: argparse.Namespace) -> None:
    """One rank of the depth run: the pipeline up to quantize on the tiled source; rank 0 writes the result."""
    from quant.layerwise import pick_device
    from quant.parallel.world import close_world, exit_process, init_world
    from quant.recipe import load_recipe
    from quant.run import stages
    from quant.run.pipeline import Run

    recipe = load_recipe(a.recipe)
    device = pick_device(recipe.quantize.device)
    world = init_world(device.type)
    run_dir = Path(a.run_dir)
    run = Run(recipe, run_dir, world)
    run.__dict__["source"] = TiledSource(Path(recipe.model.path), a.virtual_layers)  # the cached_property's slot
    # the check counts V layers of codes and checkpoints; this run keeps K layers' codes and writes no checkpoint
    stages.check_disk = lambda *args, **kwargs: None
    done = threading.Event()
    pruner = threading.Thread(target=_prune, args=([run_dir / "quantize.partial", run_dir / "quantized"],
                                                   a.layers, a.virtual_layers, done), daemon=True)
    if world.is_writer:
        pruner.start()
    if world.is_writer:
        quant_log = logging.getLogger("quant")
        quant_log.addHandler(_Progress())
        quant_log.setLevel(min(quant_log.getEffectiveLevel(), logging.INFO))
    phases = _DamagePhases()
    damage_log = logging.getLogger("quant.profile.layer_damage")
    damage_log.addHandler(phases)
    damage_log.setLevel(min(damage_log.getEffectiveLevel(), logging.INFO))
    t0 = time.perf_counter()
    try:
        run.execute(until="quantize")
    finally:
        done.set()
        if world.is_writer:
            pruner.join()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0  # reset when quantize began
    peaks = world.all_gather_object(round(peak / 1e9, 2))
    if world.is_writer:
        stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        Path(a.result).write_text(json.dumps({"wall_s": wall, "quantize_peak_gb_per_rank": peaks,
                                              "layer_damage_s": phases.seconds(),
                                              # the allocator's cache flushes and failed allocations, whole run
                                              "cuda_alloc_retries": stats.get("num_alloc_retries"),
                                              "cuda_ooms": stats.get("num_ooms")}))
    close_world(world)
    exit_process(0)


def torchrun(n: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    env = dict(os.environ)
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    subprocess.run(cmd, env=env, check=True)


def stage_table(run_dir: Path) -> dict[str, dict]:
    """stage -> wall_s, peak GB (largest rank), ranks, from the run's manifest."""
    m = json.loads((run_dir / "manifest.json").read_text())["stages"]
    return {s: {"wall_s": m[s]["wall_s"], "peak_gb": round((m[s].get("peak_memory_bytes") or 0) / 1e9, 2),
                "ranks": m[s].get("ranks", 1)} for s in STAGES if m.get(s, {}).get("status") == "done"}


def project(depth: dict, breadth: dict, fingerprint_s: float, k: int, v: int, p: int) -> dict:
    """Seconds for a P-layer model: the depth run's profile and quantize x P / V; the breadth run's export and eval
    and the fingerprint x P / K (each goes layer by layer or byte by byte; their fixed parts, embeddings and the LM
    head, are scaled with them, so the projection errs long); calibrate, plan, card, report and the depth run's time
    outside its stages (process start, the run directory, the cached fingerprint) as measured."""
    outside = depth["wall_s"] - sum(depth["stages"][s]["wall_s"] for s in DEPTH_STAGES)
    d, b = depth["stages"], breadth["stages"]
    parts = {"fingerprint": fingerprint_s * p / k, "setup": outside, "calibrate": d["calibrate"]["wall_s"],
             "profile": d["profile"]["wall_s"] * p / v, "plan": d["plan"]["wall_s"],
             "quantize": d["quantize"]["wall_s"] * p / v, "export": b["export"]["wall_s"] * p / k,
             "eval": b["eval"]["wall_s"] * p / k, "card": b["card"]["wall_s"], "report": b["report"]["wall_s"]}
    return {"layers": p, "parts_s": parts, "total_s": sum(parts.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=2, help="K: layers saved on disk")
    ap.add_argument("--virtual-layers", type=int, default=61, help="V: the depth run's layers (saved ones tiled)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--keep", action="store_true", help="keep both run directories (default: delete each after use)")
    ap.add_argument("--depth-worker", action="store_true")
    ap.add_argument("--layer-damage", action="store_true",
                    help="keep the headline recipe's layer-sensitivity pass (profile.layer_sensitivity) in the runs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for the runs (repeatable), e.g. profile.layer_sensitivity.carry_layers=0")
    ap.add_argument("--recipe", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--result", default="")
    ap.add_argument("--project-layers", type=int, default=0, help="P: the projection's depth (default V)")
    ap.add_argument("--part", default="all", choices=["build", "depth", "breadth", "all"],
                    help="one part per call where a machine limits a command's time; the table once both ran")
    a = ap.parse_args()
    if a.depth_worker:
        return depth_worker(a)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="quant-node-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, recipe = write_inputs(a, work)
    if a.part in ("depth", "all"):
        say(depth=run_depth(a, work, recipe))
    if a.part in ("breadth", "all"):
        say(breadth=run_breadth(a, work, recipe))
    if (work / "depth.json").is_file() and (work / "breadth.json").is_file():
        depth, breadth = (json.loads((work / f"{p}.json").read_text()) for p in ("depth", "breadth"))
        fingerprint_s = json.loads((work / "fingerprint.json").read_text())["s"]
        out = {"shape": a.shape, "ranks": a.ranks, "saved_layers": a.layers, "virtual_layers": a.virtual_layers,
               "tokens": f"{a.samples} x {a.seqlen}", "gpu": torch.cuda.get_device_name(0)
               if torch.cuda.is_available() else "cpu", "depth": depth, "breadth": breadth,
               "fingerprint_s": fingerprint_s, "projection": project(depth, breadth, fingerprint_s, a.layers,
                                                                     a.virtual_layers, a.project_layers or a.virtual_layers)}
        (work / "node.json").write_text(json.dumps(out, indent=1))
        print_table(out)


def run_depth(a: argparse.Namespace, work: Path, recipe: Path) -> dict:
    """The depth run under torchrun; its result (``depth.json``) with the manifest's stages and per-layer times."""
    run_dir, result = work / "run-depth", work / "depth.json"
    shutil.rmtree(run_dir, ignore_errors=True)
    result.unlink(missing_ok=True)
    torchrun(a.ranks, [__file__, "--depth-worker", "--recipe", str(recipe), "--run-dir", str(run_dir),
                       "--result", str(result), "--layers", str(a.layers), "--virtual-layers", str(a.virtual_layers)])
    depth = json.loads(result.read_text()) | {"stages": stage_table(run_dir)}
    depth["layer_seconds"] = [round(r["seconds"], 2) for r in
                              json.loads((run_dir / "quantized" / "layers.json").read_text())]
    depth["stored_layer_files"] = sorted(p.name for p in (run_dir / "quantized").glob("layer_*.safetensors"))
    result.write_text(json.dumps(depth))
    if not a.keep:
        shutil.rmtree(run_dir)  # the breadth run's disk
    return depth


def run_breadth(a: argparse.Namespace, work: Path, recipe: Path) -> dict:
    """`quant run` itself under torchrun on the saved layers; its result (``breadth.json``)."""
    run_dir, result = work / "run-breadth", work / "breadth.json"
    shutil.rmtree(run_dir, ignore_errors=True)
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    torchrun(a.ranks, ["-m", "quant.cli", "run", str(recipe), "--output", str(run_dir)])
    breadth = {"wall_s": time.perf_counter() - t0, "stages": stage_table(run_dir)}
    ev = json.loads((run_dir / "eval.json").read_text())
    breadth["eval"] = {k: ev[k] for k in ("proxy_mode", "proxy_mode_reason", "world_size", "proxies") if k in ev}
    result.write_text(json.dumps(breadth))
    if not a.keep:
        shutil.rmtree(run_dir)
    return breadth


def print_table(out: dict) -> None:
    k, v, n = out["saved_layers"], out["virtual_layers"], out["ranks"]
    d, b, p = out["depth"]["stages"], out["breadth"]["stages"], out["projection"]
    print(f"\n{out['shape']}, {n} rank(s), {out['tokens']} tokens, {out['gpu']}")
    print(f"{'stage':10} {'depth s':>9} {'/layer':>7} {'breadth s':>10} {'/layer':>7} {'peak GB':>8}  ({v} tiled | {k} saved)")
    for s in STAGES:
        row, peak = [], max(d.get(s, {}).get("peak_gb", 0), b.get(s, {}).get("peak_gb", 0))
        for stages, layers in ((d, v), (b, k)):
            w = stages.get(s, {}).get("wall_s")
            row.append(f"{w:9.1f} {w / layers:7.2f}" if w is not None else f"{'':9} {'':7}")
        print(f"{s:10} {row[0]} {' ' + row[1]} {peak:8.1f}")
    print(f"quantize peak GB per rank (CUDA): {out['depth']['quantize_peak_gb_per_rank']}")
    print(f"projection, {p['layers']} layers on {n} rank(s): " + ", ".join(f"{s} {t:.0f} s" for s, t in p["parts_s"].items())
          + f" = {p['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
