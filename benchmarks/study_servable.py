"""Servable study on builtin:reference-moe: how much of the per-expert INT8 gain survives one scheme per MoE layer?

vLLM and SGLang run one quantization scheme per fused MoE layer. At equal average expert bits this compares the
per-expert top-20 % plan (not servable by them) with servable plans: the per-layer projection of that plan,
``layer_sensitivity`` (per-layer KL damage measured in the profile, knapsack within the budget), the same with
group sizes 32/64 on offer, and uniform W4 g32 — each with GPTQ and RTN, at 1× and 4× the calibration tokens
(32, 128 windows of 256 tokens of license prose + CPython stdlib code, none of it held out); at 16× (512 windows)
the configurations that answer "does GPTQ beat RTN with more tokens, and does the servable plan keep its lead"
(``AT_SIZE``: uniform W4 g128, per-expert top-20 %, layer_sensitivity + g32/g64), so the study fits 25 minutes
on 2 CPU cores. Metrics on the fixed held-out set of ``benchmarks/study.py`` (perplexity, KL(bf16‖q), top-1
agreement; next-line exact match for the GPTQ checkpoints at 1×, the study's costliest metric, which separates
nothing on this model).

Runs (seed, size) tasks in ``--jobs`` worker processes of ``--threads`` threads each. Usage:

    python benchmarks/study.py --study servable --seeds 0 1 2 --out study
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

SIZES = {"1x": 32, "4x": 128, "16x": 512}  # calibration windows of 256 tokens
SEQ_LEN = 256
BUDGET_BITS = 4.75  # the per-expert plan's average: 6 of 32 experts per layer at 8 bits, at group 128
SCHEMES = ("w4g128", "w4g64", "w4g32", "w8g128")
DAMAGE_SAMPLES = 16
LAYER = dict(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=BUDGET_BITS)
CONFIGS = {  # name -> PlanSpec kwargs (attention 8-bit g128, router/embeddings/lm_head bf16 everywhere)
    "uniform W4 g128": dict(policy="uniform", low_bits=4, high_bits=4),
    "per-expert top-20%": dict(top_fraction=0.2, high_bits=8, low_bits=4),
    "per-layer projection of top-20%": dict(top_fraction=0.2, ranking="global", granularity="per_layer"),
    "layer_sensitivity W4/W8 g128": dict(LAYER),
    "layer_sensitivity + g32/g64": dict(LAYER, layer_group_sizes=(32, 64)),
    "uniform W4 g32": dict(policy="uniform", low_bits=4, high_bits=4, group_size=32),
}
REFERENCE, BASELINE = "per-expert top-20%", "uniform W4 g128"
AT_SIZE = {"16x": (BASELINE, REFERENCE, "layer_sensitivity + g32/g64")}  # size -> configurations run (default: all)
ALGORITHMS = ("gptq", "rtn")
PROSE_SHARE = 0.4  # license prose; at 16x (52 k tokens) it stays within the ~57 k tokens the licenses hold
CODE_CHARS = 1_500_000  # ~400 k tokens of stdlib code, 5x what the 16x set draws


def write_calibration_manifest(out: Path) -> Path:
    """License prose and CPython stdlib code, as calibration/bundled.yaml but larger: the texts
    benchmarks/reference_moe/build_corpus.py collects (Debian's /usr/share/common-licenses, this Python's stdlib)
    without the held-out evaluation sources and anything sharing lines with them; all licenses and the first
    CODE_CHARS characters of code in hash order, as the JSONL sources of a calibration manifest."""
    sys.path.insert(0, str(REPO / "benchmarks" / "reference_moe"))
    import build_corpus as bc
    import yaml

    excluded: list[dict] = []
    docs = bc.dedupe(bc.collect_stdlib(excluded) + bc.collect_licenses(excluded), excluded)
    bc.assign_splits(docs, seed=0, fraction=0.03, min_per_domain=8)  # marks what shares lines with held-out text
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for domain, prefix, weight in (("prose", "licenses/", PROSE_SHARE), ("code", "stdlib/", 1 - PROSE_SHARE)):
        pool = sorted((d for d in docs if d.path.startswith(prefix) and d.path not in bc.FORCED_HELDOUT
                       and "shares lines" not in d.reason),
                      key=lambda d: hashlib.sha256(d.path.encode()).hexdigest())
        kept, chars = [], 0
        for d in pool:
            if chars >= CODE_CHARS:
                break
            kept.append(json.dumps({"text": d.text, "path": d.path}))
            chars += len(d.text)
        (out / f"{domain}.jsonl").write_text("\n".join(kept) + "\n")
        sources.append({"name": domain, "kind": "jsonl", "path": f"{domain}.jsonl", "weight": weight})
    manifest = {"name": "licenses-stdlib", "description": "license prose + stdlib code (study)",
                "sources": sources}
    (out / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return out / "manifest.yaml"


_WORKER: dict = {}
_RTN_SEEN: dict = {}  # per worker: RTN plan -> metrics


def _init_worker(threads: int, n_lines: int) -> None:
    """Per process: threads, the model source, held-out tokens and the bf16 reference log-probs."""
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    import study
    from quant.calibration import build_calibration
    from quant.models import resolve_model

    src = resolve_model("builtin:reference-moe")
    tok = AutoTokenizer.from_pretrained(src.path)
    tokens = build_calibration("calibration/heldout.yaml", tok, 16, 256, seed=0).tokens
    samples = study.nextline_samples(tok, study.heldout_code_docs(), n_lines, seed=0, max_context=256,
                                     max_line_tokens=48)
    base = study.load_model(src.path)
    _WORKER.update(src=src, tok=tok, tokens=tokens, lines=study.nextline_batch(tok, samples[:n_lines]),
                   base=study.reference(base, tokens))


def _evaluate(qdir: Path, with_lines: bool) -> dict:
    import study
    w = _WORKER
    model = study.load_model(w["src"].path)
    study.apply_quantized(model, w["src"], qdir)
    out = study.proxies(model, w["tokens"], w["base"])
    if with_lines:
        out["nextline_em"] = study.nextline_greedy_match(model, w["lines"])
    return out


def _plan_record(plan, src, prof) -> dict:
    from quant.plan.runtimes import problems_for
    from quant.plan.servable import expert_storage, predicted_kl
    from quant.plan.summary import summarize

    stored, numel = expert_storage(plan, src)
    by_layer: dict[str, set] = {}
    for name, p in plan.modules.items():
        if ".experts." in name and name.endswith(".up"):
            by_layer.setdefault(name.split(".")[1], set()).add(f"w{p.bits}g{p.group_size}")
    layers = {k: v.pop() if len(v) == 1 else "mixed" for k, v in by_layer.items()}
    return {"bits": summarize(plan, src, prof)["headline"]["avg_bits_experts"], "storage_bits": stored / numel,
            "servable": not problems_for(plan, src, "vllm") and not problems_for(plan, src, "sglang"),
            "predicted_kl": predicted_kl(plan, src, prof), "layers": layers}


def run_task(seed: int, size: str, manifest: str, work: Path) -> dict:
    """One calibration set: profile + layer damage, then every configuration x algorithm quantized and evaluated."""
    from quant.calibration import build_calibration
    from quant.dist.world import World
    from quant.engine.layerwise import Layerwise
    from quant.engine.quantize import quantize_model
    from quant.measure.layer_damage import measure_layer_damage, spread_rows
    from quant.measure.profile import profile_routing
    from quant.plan.bitplan import plan_bits
    from quant.recipe import PlanSpec, QuantizeSpec

    src, t0, cpu0 = _WORKER["src"], time.perf_counter(), time.process_time()
    calib = build_calibration(manifest, _WORKER["tok"], SIZES[size], SEQ_LEN, seed)
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 8, world=World()))
    n = calib.tokens.shape[0]
    prof.layer_damage = measure_layer_damage(src, calib.tokens[spread_rows(n, DAMAGE_SAMPLES)],
                                             Layerwise(src, "float32", "cpu", 8, world=World()), SCHEMES)
    one = type(calib)(calib.tokens[:1], calib.sample_ids[:1], calib.domains[:1], calib.seed, calib.manifest)
    out = {"seed": seed, "size": size, "n_tokens": int(calib.tokens.numel()),
           "damage": {k: v.tolist() for k, v in prof.layer_damage.items()}, "results": {}}
    for name, kw in ((n, kw) for n, kw in CONFIGS.items() if n in AT_SIZE.get(size, CONFIGS)):
        spec = PlanSpec(**{"group_size": 128, "seed": seed, **kw})
        for algo in ALGORITHMS:
            plan = plan_bits(prof, src.modules, spec, algo, src.n_layers)
            # RTN reads no activations: one calibration window gives the same weights, and a plan seen before
            # (uniform plans at every size and seed) the same metrics
            key = (json.dumps({n: (p.bits, p.group_size) for n, p in plan.modules.items()}), size == "1x")
            if algo == "gptq" or key not in _RTN_SEEN:
                qdir = work / f"{seed}-{size}-{algo}-{abs(hash(name)) % 10**8}-{os.getpid()}"
                shutil.rmtree(qdir, ignore_errors=True)
                quantize_model(src, calib if algo == "gptq" else one, plan.quantized_specs(), plan.algorithm,
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


def run(seeds: list[int], out: Path, jobs: int, threads: int, n_lines: int, sizes: dict[str, int]) -> dict:
    import multiprocessing as mp

    work, done_dir = out / "work", out / "tasks"
    manifest = str(write_calibration_manifest(work / "calib"))
    done_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(seed, size, manifest, work) for size in sizes for seed in seeds  # 1x first: a stopped run has its table
             if not (done_dir / f"{seed}-{size}.json").is_file()]  # a finished task is kept: rerun to resume
    t0, load0 = time.perf_counter(), os.getloadavg()
    with mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(threads, n_lines)) as pool:
        for result in pool.imap_unordered(_run_task, tasks):  # the first failure stops the study
            (done_dir / f"{result['seed']}-{result['size']}.json").write_text(json.dumps(result))
    data = collect(seeds, out, sizes, jobs=jobs, threads=threads, wall_seconds=time.perf_counter() - t0,
                   load_average_start_end=[load0, os.getloadavg()])
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(done_dir, ignore_errors=True)
    return data


def collect(seeds: list[int], out: Path, sizes: dict[str, int], **meta) -> dict:
    """servable.json from the finished tasks in ``out/tasks`` (``--report-only`` on a stopped run: the tasks
    finished so far, the others listed under ``missing``)."""
    done_dir = out / "tasks"
    names = [f"{seed}-{size}" for size in sizes for seed in seeds]
    results = [json.loads((done_dir / f"{n}.json").read_text()) for n in names if (done_dir / f"{n}.json").is_file()]
    data = {"seeds": seeds, "sizes": sizes, "seq_len": SEQ_LEN, "budget_bits": BUDGET_BITS, "schemes": SCHEMES,
            "damage_samples": DAMAGE_SAMPLES, "at_size": AT_SIZE,
            "task_cpu_seconds": sum(t["cpu_seconds"] for t in results), **meta,
            "missing": [n for n in names if not (done_dir / f"{n}.json").is_file()], "tasks": results}
    (out / "servable.json").write_text(json.dumps(data, indent=1))
    return data


def _values(data: dict, size: str, key: str, metric: str) -> list[float]:
    """Per seed (ascending), where that size ran the configuration and measured the metric."""
    return [t["results"][key][metric] for t in sorted(data["tasks"], key=lambda t: t["seed"])
            if t["size"] == size and metric in t["results"].get(key, {})]


def _recovered(data: dict, size: str, key: str) -> list[float]:
    """Per seed: share of the per-expert plan's KL gain over uniform W4 g128 (same algorithm) this one keeps."""
    algo = key.split("|")[1]
    base, ref = _values(data, size, f"{BASELINE}|{algo}", "kl"), _values(data, size, f"{REFERENCE}|{algo}", "kl")
    mine = _values(data, size, key, "kl")
    if not mine:
        return []
    return [(b - m) / (b - r) for b, r, m in zip(base, ref, mine, strict=True)]


def _ms(values: list[float], digits: int, scale: float = 1.0, unit: str = "") -> str:
    if not values:
        return "—"
    m = statistics.fmean(values) * scale
    s = (statistics.stdev(values) if len(values) > 1 else 0.0) * scale
    return f"{m:.{digits}f} ± {s:.{digits}f}{unit}"


def _keys(data: dict) -> list[str]:
    """Every configuration|algorithm any task ran, in CONFIGS order."""
    ran = {k for t in data["tasks"] for k in t["results"]}
    return [f"{n}|{a}" for n in CONFIGS for a in ALGORITHMS if f"{n}|{a}" in ran]


def table_1x(data: dict) -> str:
    rows = ["| configuration | algorithm | vLLM/SGLang | avg expert bits | stored bits/weight | perplexity | "
            "KL(bf16‖q) ×1e3 | top-1 agreement | next-line EM | per-expert KL gain kept |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key in _keys(data):
        name, algo = key.split("|")
        v = lambda m, key=key: _values(data, "1x", key, m)  # noqa: E731
        rows.append(f"| {name} | {algo.upper()} | {'yes' if v('servable')[0] else 'no'} | {_ms(v('bits'), 2)} | "
                    f"{_ms(v('storage_bits'), 3)} | {_ms(v('ppl'), 3)} | {_ms(v('kl'), 2, 1e3)} | {_ms(v('top1'), 4)} | "
                    f"{_ms(v('nextline_em'), 3)} | {_ms(_recovered(data, '1x', key), 0, 100, ' %')} |")
    return "\n".join(rows)


def table_scaling(data: dict) -> str:
    sizes = list(data["sizes"])
    head = " | ".join(f"KL ×1e3 {s}" for s in sizes) + " | " + " | ".join(f"gain kept {s}" for s in sizes)
    rows = [f"| configuration | algorithm | {head} | perplexity {sizes[-1]} |", "|---|---|" + "---|" * (2 * len(sizes) + 1)]
    for key in _keys(data):
        name, algo = key.split("|")
        kl = " | ".join(_ms(_values(data, s, key, "kl"), 2, 1e3) for s in sizes)
        kept = " | ".join(_ms(_recovered(data, s, key), 0, 100, " %") for s in sizes)
        rows.append(f"| {name} | {algo.upper()} | {kl} | {kept} | {_ms(_values(data, sizes[-1], key, 'ppl'), 3)} |")
    return "\n".join(rows)


def table_estimator(data: dict) -> str:
    """Predicted KL (sum of single-layer calibration KLs, RTN) against the held-out KL of the RTN checkpoints."""
    rows = ["| configuration (RTN) | predicted KL ×1e3 (calibration, sum of layers) | held-out KL ×1e3 | ratio |",
            "|---|---|---|---|"]
    for key in (k for k in _keys(data) if k.endswith("|rtn")):
        pred = [t["results"][key]["predicted_kl"] for t in data["tasks"] if t["size"] == "1x"]
        meas = _values(data, "1x", key, "kl")
        if any(p is None for p in pred):
            continue
        ratio = [p / m for p, m in zip(pred, meas, strict=True)]
        rows.append(f"| {key.split('|')[0]} | {_ms(pred, 2, 1e3)} | {_ms(meas, 2, 1e3)} | {_ms(ratio, 2)} |")
    return "\n".join(rows)


def table_layers(data: dict) -> str:
    """Which scheme each MoE layer got, per configuration and calibration set (GPTQ plans)."""
    rows = ["| configuration | size | seed | layer schemes (0..7) |", "|---|---|---|---|"]
    for key in (k for k in _keys(data) if k.endswith("|gptq") and "layer" in k):
        for t in sorted(data["tasks"], key=lambda t: (list(data["sizes"]).index(t["size"]), t["seed"])):
            if key not in t["results"]:
                continue
            layers = t["results"][key]["layers"]
            rows.append(f"| {key.split('|')[0]} | {t['size']} | {t['seed']} | "
                        f"{' '.join(layers[k] for k in sorted(layers, key=int))} |")
    return "\n".join(rows)


def damage_table(data: dict) -> str:
    rows = ["| scheme | " + " | ".join(f"layer {i}" for i in range(len(data["tasks"][0]["damage"][SCHEMES[0]])))
            + " | sum |", "|---|" + "---|" * (len(data["tasks"][0]["damage"][SCHEMES[0]]) + 1)]
    first = [t for t in data["tasks"] if t["size"] == "1x"]
    for s in data["schemes"]:
        per = list(zip(*[t["damage"][s] for t in first], strict=True))
        rows.append(f"| {s} | " + " | ".join(f"{1e3 * statistics.fmean(v):.2f}" for v in per)
                    + f" | {1e3 * sum(statistics.fmean(v) for v in per):.2f} |")
    return "\n".join(rows)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in _keys(data) if k.endswith("|gptq")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(data["sizes"])
    for i, size in enumerate(data["sizes"]):
        rows = [(j, [1e3 * x for x in _values(data, size, k, "kl")]) for j, k in enumerate(keys)]
        rows = [(j, v) for j, v in rows if v]  # configurations this size ran
        ax.barh([j + i * width for j, _ in rows], [statistics.fmean(v) for _, v in rows], height=width,
                xerr=[statistics.stdev(v) if len(v) > 1 else 0 for _, v in rows], label=f"{size} calibration", alpha=0.8)
    ax.set_yticks([j + width for j in range(len(keys))], [k.split("|")[0] for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("KL(bf16 ‖ quantized) per token ×1e3, GPTQ (mean ± std over calibration seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(data: dict, out: Path) -> str:
    missing = [f"**Partial: tasks (seed-size) not finished: {', '.join(data['missing'])}.**"] if data["missing"] else []
    text = "\n\n".join(missing + [f"### 1x calibration ({data['sizes']['1x']} × {data['seq_len']} tokens)", table_1x(data),
                        "### Calibration tokens: 1x, 4x, 16x", table_scaling(data),
                        "### Per-layer damage measured in the profile (1x, mean over seeds), KL ×1e3",
                        damage_table(data), "### Predicted vs measured KL", table_estimator(data),
                        "### Layer schemes chosen", table_layers(data)])
    (out / "servable_table.md").write_text(text + "\n")
    plot(data, out / "servable_kl.png")
    return text


def main(seeds: list[int], out: Path, jobs: int, threads: int, n_lines: int, sizes: list[str],
         report_only: bool = False) -> None:
    """Run the study (resuming finished tasks) and write its tables; ``report_only``: tables of the finished tasks."""
    if report_only:
        print(report(collect(seeds, out, {s: SIZES[s] for s in sizes}), out))
        return
    data = run(seeds, out, jobs, threads, n_lines, {s: SIZES[s] for s in sizes})
    print(report(data, out))
    print(f"wall time {data['wall_seconds']:.0f} s (this invocation), tasks' CPU time {data['task_cpu_seconds']:.0f} s "
          f"({jobs} jobs x {threads} threads)")
