"""Servable study on builtin:reference-moe: how much of the per-expert INT8 gain survives one scheme per MoE layer?

vLLM and SGLang run one quantization scheme per fused MoE layer. At equal average expert bits this compares the
per-expert top-20 % plan (not servable by them) with servable plans: the per-layer projection of that plan,
``layer_sensitivity`` (per-layer KL damage measured in the profile, knapsack within the budget), the same with
group sizes 32/64 on offer, uniform W4 g32, and the ``joint`` policy (up to two scheme groups per MoE layer, hot
experts by sensitivity or by routed tokens, for vLLM with quant's plugin) — each with GPTQ and RTN, at 1× and 4×
the calibration tokens (32, 128 windows of 256 tokens of license prose + CPython stdlib code, none of it held out);
at 16× (512 windows) the configurations that answer "does GPTQ beat RTN with more tokens, and does the servable
plan keep its lead" (``AT_SIZE``: uniform W4 g128, per-expert top-20 %, layer_sensitivity + g32/g64). Without the
two joint configurations the study fits 25 minutes on 2 CPU cores; they add about a third to the 1× and 4× tasks.
Metrics on the fixed held-out set of ``benchmarks/study.py`` (perplexity, KL(bf16‖q), top-1 agreement; next-line
exact match for the GPTQ checkpoints at 1×, the study's costliest metric, which separates nothing on this model).
The design (configurations, sizes) and the tables are ``studies.servable``; the calibration texts come from
``benchmarks/reference_moe/build_corpus.py --calibration-manifest``.

Runs (seed, size) tasks in ``--jobs`` worker processes of ``--threads`` threads each; ``--sizes`` and ``--configs``
(quoted configuration names) restrict what runs. Usage (repository root):

    python benchmarks/study_servable.py --seeds 0 1 2 --out study    # --damage-method exact: the quadratic pass
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from studies.servable import (
    ALGORITHMS,
    AT_SIZE,
    CONFIGS,
    DAMAGE_SAMPLES,
    SCHEMES,
    SEQ_LEN,
    SIZES,
    collect,
    report,
)

BUILD_CORPUS = Path(__file__).resolve().parent / "reference_moe" / "build_corpus.py"


def write_calibration_manifest(out: Path) -> Path:
    """The study's calibration texts (license prose + stdlib code), written by build_corpus.py into ``out``."""
    subprocess.run([sys.executable, str(BUILD_CORPUS), "--calibration-manifest", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out / "manifest.yaml"


_WORKER: dict = {}
_RTN_SEEN: dict = {}  # per worker: RTN plan -> metrics


def _init_worker(threads: int, n_lines: int) -> None:
    """Per process: threads, the model source, held-out tokens and the bf16 reference log-probs."""
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    from quant.calibration import build_calibration
    from quant.models import resolve_model
    from studies import heldout as study

    src = resolve_model("builtin:reference-moe")
    tok = AutoTokenizer.from_pretrained(src.path)
    tokens = build_calibration("calibration/heldout.yaml", tok, 16, 256, seed=0).tokens
    samples = study.nextline_samples(tok, study.heldout_code_docs(), n_lines, seed=0, max_context=256,
                                     max_line_tokens=48)
    base = study.load_model(src.path)
    _WORKER.update(src=src, tok=tok, tokens=tokens, lines=study.nextline_batch(tok, samples[:n_lines]),
                   base=study.reference(base, tokens))


def _evaluate(qdir: Path, with_lines: bool) -> dict:
    from studies import heldout as study

    w = _WORKER
    model = study.load_model(w["src"].path)
    study.apply_quantized(model, w["src"], qdir)
    out = study.proxies(model, w["tokens"], w["base"])
    if with_lines:
        out["nextline_em"] = study.nextline_greedy_match(model, w["lines"])
    return out


def _plan_record(plan, src, prof) -> dict:
    from quant.models.names import parse
    from quant.plan.runtimes import problems_for
    from quant.plan.servable import expert_storage, predicted_kl
    from quant.plan.summary import summarize

    stored, numel = expert_storage(plan, src)
    by_layer: dict[str, Counter] = {}
    for name, p in plan.modules.items():
        if (n := parse(name)).block == "experts" and n.leaf == "up":
            by_layer.setdefault(str(n.layer), Counter())[f"w{p.bits}g{p.group_size}"] += 1
    # a layer's scheme, or its scheme groups with their expert counts, the larger scheme first: w8g128x6+w4g128x26
    layers = {k: next(iter(v)) if len(v) == 1 else "+".join(f"{s}x{c}" for s, c in sorted(v.items(), reverse=True))
              for k, v in by_layer.items()}
    return {"bits": summarize(plan, src, prof).headline.avg_bits_experts, "storage_bits": stored / numel,
            "servable": not problems_for(plan, src, "vllm") and not problems_for(plan, src, "sglang"),
            "plugin": not problems_for(plan, src, "vllm-quant", ("compressed-tensors",)),
            "predicted_kl": predicted_kl(plan, src, prof), "layers": layers}


def run_task(seed: int, size: str, manifest: str, work: Path, damage_method: str = "bounded",
             configs: tuple[str, ...] = tuple(CONFIGS)) -> dict:
    """One calibration set: profile + layer damage (``damage_method``: quant.profile.layer_damage's ``bounded`` or
    ``exact``), then every configuration of ``configs`` the size runs (``AT_SIZE``) x algorithm quantized and
    evaluated."""
    from quant.calibration import build_calibration
    from quant.layerwise import Layerwise
    from quant.parallel.world import World
    from quant.plan.bitplan import plan_bits
    from quant.profile.layer_damage import measure_layer_damage, spread_rows
    from quant.profile.profile import profile_routing
    from quant.quantize.driver import quantize_model
    from quant.recipe import PlanSpec, QuantizeSpec

    src, t0, cpu0 = _WORKER["src"], time.perf_counter(), time.process_time()
    calib = build_calibration(manifest, _WORKER["tok"], SIZES[size], SEQ_LEN, seed)
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 8, world=World()))
    n = calib.tokens.shape[0]
    damage = measure_layer_damage(src, calib.tokens[spread_rows(n, DAMAGE_SAMPLES)],
                                  Layerwise(src, "float32", "cpu", 8, world=World()), SCHEMES, damage_method, seed=seed)
    prof = replace(prof, layer_damage=damage.damage)
    one = type(calib)(calib.tokens[:1], calib.sample_ids[:1], calib.domains[:1], calib.seed, calib.manifest)
    out = {"seed": seed, "size": size, "n_tokens": int(calib.tokens.numel()), "damage_method": damage_method,
           "damage_layer_forwards": damage.layer_forwards,
           "damage": {k: v.tolist() for k, v in prof.layer_damage.items()}, "results": {}}
    for name, kw in ((n, kw) for n, kw in CONFIGS.items() if n in AT_SIZE.get(size, CONFIGS) and n in configs):
        spec = PlanSpec(**{"group_size": 128, "seed": seed, **kw})
        for algo in ALGORITHMS:
            plan = plan_bits(prof, src.modules, spec, src.n_layers)
            # RTN reads no activations: one calibration window gives the same weights, and a plan seen before
            # (uniform plans at every size and seed) the same metrics
            key = (json.dumps({n: (p.bits, p.group_size) for n, p in plan.modules.items()}), size == "1x")
            if algo == "gptq" or key not in _RTN_SEEN:
                qdir = work / f"{seed}-{size}-{algo}-{abs(hash(name)) % 10**8}-{os.getpid()}"
                shutil.rmtree(qdir, ignore_errors=True)
                quantize_model(src, calib if algo == "gptq" else one, plan.quantized_schemes(), algo,
                               QuantizeSpec(algorithm=algo), Layerwise(src, "bfloat16", "cpu", 8, World()), qdir)
                metrics = _evaluate(qdir, with_lines=size == "1x" and algo == "gptq")
                shutil.rmtree(qdir, ignore_errors=True)
                if algo == "rtn":
                    _RTN_SEEN[key] = metrics
            rec = _plan_record(plan, src, prof) | (metrics if algo == "gptq" else _RTN_SEEN[key])
            out["results"][f"{name}|{algo}"] = rec
            print(f"seed {seed} {size:3s} {algo:4s} {name:34s} KL {1e3 * rec['kl']:.2f} bits {rec['bits']:.3f} "
                  f"storage {rec['storage_bits']:.3f} layers {rec['layers']}", flush=True)
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - cpu0
    print(f"seed {seed} {size} done in {out['seconds']:.0f} s ({out['cpu_seconds']:.0f} s CPU)", flush=True)
    return out


def _run_task(args: tuple) -> dict:
    return run_task(*args)


def run(seeds: list[int], out: Path, jobs: int, threads: int, n_lines: int, sizes: dict[str, int],
        damage_method: str = "bounded", configs: tuple[str, ...] = tuple(CONFIGS)) -> dict:
    import multiprocessing as mp

    work, done_dir = out / "work", out / "tasks"
    manifest = str(write_calibration_manifest(work / "calib"))
    done_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(seed, size, manifest, work, damage_method, configs) for size in sizes for seed in seeds  # 1x first: a stopped run has its table
             if not (done_dir / f"{seed}-{size}.json").is_file()]  # a finished task is kept: rerun to resume
    t0, load0 = time.perf_counter(), os.getloadavg()
    with mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(threads, n_lines)) as pool:
        for result in pool.imap_unordered(_run_task, tasks):  # the first failure stops the study
            (done_dir / f"{result['seed']}-{result['size']}.json").write_text(json.dumps(result))
    data = collect(seeds, out, sizes, jobs=jobs, threads=threads, wall_seconds=time.perf_counter() - t0,
                   load_average_start_end=[load0, os.getloadavg()], configs=list(configs))
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(done_dir, ignore_errors=True)
    return data


def main() -> None:
    """Run the study (resuming finished tasks) and write its tables; ``--report-only``: tables of the finished tasks."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lines", type=int, default=200, help="held-out lines for next-line exact match")
    ap.add_argument("--out", default="study")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help="calibration sizes")
    ap.add_argument("--damage-method", choices=("bounded", "exact"), default="bounded",
                    help="the layer-damage pass (profile.layer_sensitivity.method)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                    help="configurations to run (quoted names of studies.servable.CONFIGS; default: all)")
    ap.add_argument("--report-only", action="store_true",
                    help="tables of the tasks finished so far (a stopped run), without running any")
    a = ap.parse_args()
    seeds, out, jobs, threads, n_lines, sizes = a.seeds, Path(a.out), a.jobs, a.threads, a.lines, a.sizes
    out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        print(report(collect(seeds, out, {s: SIZES[s] for s in sizes}), out))
        return
    data = run(seeds, out, jobs, threads, n_lines, {s: SIZES[s] for s in sizes}, a.damage_method, tuple(a.configs))
    print(report(data, out))
    print(f"wall time {data['wall_seconds']:.0f} s (this invocation), tasks' CPU time {data['task_cpu_seconds']:.0f} s "
          f"({jobs} jobs x {threads} threads)")


if __name__ == "__main__":
    main()
