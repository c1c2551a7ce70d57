"""What the mix buys at serving time (GPU, vLLM): offline throughput of quant's checkpoints.

Builds a random-weight model of ``--shape`` (``quant.models.synthetic``: Qwen3-30B-A3B by default, DeepSeek-V3's
widths with ``--shape deepseek-v3``; ``--layers`` real decoder layers) and exports it with quant. What users ship
comes from the shipped recipes as they are, through ``quant export RECIPE --model`` (GPTQ, the recipes' own
calibration sizes; only the calibration text is random words of the model's vocabulary):

- ``headline``: ``recipes/mixed_int8_int4.yaml`` with ``plan.target_runtime=vllm-quant`` (the most used 20 % of each
  layer's experts W8, the rest W4; quant's plugin);
- ``joint``: ``recipes/joint_vllm_quant.yaml`` (a hot group and the rest per layer, by measured damage; the plugin);
- ``per-layer``: ``recipes/mixed_vllm.yaml`` (one scheme per MoE layer by measured damage; stock vLLM);
- ``uniform-w4`` / ``uniform-w8``: the headline recipe with every expert at 4 / 8 bits, for reference.

Benchmark-only plans (RTN through ``quant export`` with plans of this script, labelled so in any record):

- ``w8`` / ``w4``: every expert W8 / W4 g128; ``layers``: the first fifth of the MoE layers W8 g128, the rest W4
  g128 (4.8 bits per expert weight);
- ``experts``: the most used 20 % of each layer's experts W8 g128, the rest W4 g128 (the plugin); ``experts-seq`` and
  ``experts-overlap`` serve that checkpoint with the plugin's two scheme groups one after the other
  (``QUANT_MOE_OVERLAP=0``) and on two CUDA streams (``=1``) at every batch, where ``experts`` overlaps them at
  decode-sized batches only.

``headline-mixed`` and ``joint-mixed`` serve those checkpoints with quant's mixed-scheme kernel
(``QUANT_MOE_KERNEL=mixed``) instead of a Marlin MoE call per scheme group; ``headline-nibbles`` and
``joint-nibbles`` with the nibble stack (``QUANT_MOE_KERNEL=nibbles``: one Marlin MoE call over every expert, each W8
expert as two 4-bit rows).

Each model (and the bf16 one) is served with vLLM, CUDA graphs on, ``--processes`` times, each time by a process
of its own: for each of ``--concurrency`` (requests in flight together) and ``--shapes`` (prompt/generated tokens),
one warm-up then ``--repeats`` timed batches. Reported per point: the median over every timed batch of every
process, the slowest and the fastest, and each process's median; the stored bits of each checkpoint (scales
counted) come with its export. Prints JSON lines, then a table. Run in vLLM's environment (vLLM's own
compressed-tensors) with quant's on the path for the exports::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/serve.py --vllm-path /tmp/vsite --layers 8 --workdir /tmp/serve

``--part build`` stops after the checkpoints, ``--part serve`` serves what a build left in ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = {
    "w8": dict(policy="uniform", low_bits=8, high_bits=8, group_size=128, target_runtime="vllm"),
    "w4": dict(policy="uniform", group_size=128, target_runtime="vllm"),
    "experts": dict(policy="top_fraction", top_fraction=0.2, group_size=128, target_runtime="vllm-quant"),
}


# what users ship: checkpoints `quant export` makes from the shipped recipes as they are (GPTQ, their calibration
# sizes; only the calibration text is the model's own random words), beside the synthetic plans above
UNIFORM = ["plan.policy=uniform", "plan.target_runtime=vllm"]
RECIPES = {
    "headline": ("mixed_int8_int4.yaml", ["plan.target_runtime=vllm-quant"]),
    "joint": ("joint_vllm_quant.yaml", []),
    "per-layer": ("mixed_vllm.yaml", []),
    "uniform-w4": ("mixed_int8_int4.yaml", [*UNIFORM, "plan.low_bits=4", "plan.high_bits=4"]),
    "uniform-w8": ("mixed_int8_int4.yaml", [*UNIFORM, "plan.low_bits=8", "plan.high_bits=8"]),
}
# another model's checkpoint served with VARIANT_ENV: the plugin's Marlin groups one after the other or overlapped,
# and the plugin's checkpoints on its mixed kernel instead of a Marlin MoE call per scheme group
VARIANTS = {"experts-seq": "experts", "experts-overlap": "experts", "headline-mixed": "headline",
            "joint-mixed": "joint", "headline-nibbles": "headline", "joint-nibbles": "joint"}
VARIANT_ENV = {"experts-seq": {"QUANT_MOE_OVERLAP": "0"}, "experts-overlap": {"QUANT_MOE_OVERLAP": "1"},
               "headline-mixed": {"QUANT_MOE_KERNEL": "mixed"}, "joint-mixed": {"QUANT_MOE_KERNEL": "mixed"},
               "headline-nibbles": {"QUANT_MOE_KERNEL": "nibbles"}, "joint-nibbles": {"QUANT_MOE_KERNEL": "nibbles"}}


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def build(a: argparse.Namespace, work: Path) -> dict[str, Path]:
    """The bf16 model and its checkpoints: name -> folder."""
    import yaml

    from quant.models.synthetic import SHAPES, build_model, random_words

    model = work / "bf16"
    if not (model / "config.json").is_file():
        t0 = time.perf_counter()
        build_model(a.shape, a.layers, model, seed=0, logit_scale=4.0)
        say(step="build", s=round(time.perf_counter() - t0, 1))
    vocab = SHAPES[a.shape]["vocab_size"]
    (work / "calibration.txt").write_text(random_words(160 * 512, vocab, 0))  # the headline reads 128 x 512
    (work / "calibration.yaml").write_text(yaml.safe_dump(
        {"name": "random", "sources": [{"name": "random", "kind": "text", "path": "calibration.txt"}]}))
    n_w8 = max(1, round(a.layers / 5))
    plans = dict(PLANS, layers=dict(policy="uniform", group_size=128, granularity="per_layer", target_runtime="vllm",
                                    layer_schemes={str(i): "w8g128" for i in range(n_w8)}))
    out = {"bf16": model}

    def export(name: str) -> None:
        run = work / f"run-{name}"
        if name in RECIPES and not (run / "checkpoint" / "config.json").is_file():
            recipe, sets = RECIPES[name]
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "quant.cli", "export", str(ROOT / "recipes" / recipe), "--model", str(model),
                   "-o", str(run), "--set", f"calibration.dataset={work / 'calibration.yaml'}"]
            p = subprocess.run(cmd + [x for kv in sets for x in ("--set", kv)], cwd=ROOT, capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"quant export {recipe} ({name}) failed:\n{p.stderr[-2000:]}")
            say(step="export", model=name, recipe=recipe, s=round(time.perf_counter() - t0, 1), **_bits(run))
        elif not (run / "checkpoint" / "config.json").is_file():
            recipe = {"name": f"serve-{name}", "model": {"path": str(model), "dtype": "bfloat16"},
                      "calibration": {"dataset": str(work / "calibration.yaml"), "n_samples": 32, "seq_len": 512},
                      "plan": plans[name], "quantize": {"algorithm": "rtn"}}
            (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "quant.cli", "export", str(work / f"{name}.yaml"), "-o", str(run)],
                               cwd=ROOT, capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"quant export {name} failed:\n{p.stderr[-2000:]}")
            say(step="export", model=name, s=round(time.perf_counter() - t0, 1), **_bits(run))
        out[name] = run / "checkpoint"

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:  # the exports share the GPU
        list(pool.map(export, sorted({VARIANTS.get(n, n) for n in a.models} - {"bf16"})))
    return out | {v: out[c] for v, c in VARIANTS.items() if c in out}


def _bits(run: Path) -> dict:
    """The plan's mean expert bits (codes only) and stored bits (scales included), from plan.json."""
    plan = json.loads((run / "plan.json").read_text())["modules"]
    experts = [p for n, p in plan.items() if ".experts." in n and p["bits"]]
    code = statistics.mean(p["bits"] for p in experts)
    stored = statistics.mean(p["bits"] + 16 / p["group_size"] for p in experts)  # one bf16 scale per group
    return {"expert_bits": round(code, 3), "stored_bits": round(stored, 3)}


def serve_points(path: str, a: argparse.Namespace) -> list[dict]:
    """One model in this process: every (concurrency, shape) point, median of the repeats (runs under vLLM)."""
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    longest = max(i + o for i, o in a.shapes)
    t0 = time.perf_counter()
    # CUDA graphs for the batch sizes the points decode at (all requests of a point run to the same length)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=longest + 8, seed=0,
              gpu_memory_utilization=0.85, max_num_seqs=max(a.concurrency), enable_prefix_caching=False,
              compilation_config={"cudagraph_capture_sizes": sorted(set(a.concurrency))})
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    rows = []
    for n_in, n_out in a.shapes:
        sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0, detokenize=False)
        for conc in a.concurrency:
            times = []
            for rep in range(a.repeats + 1):  # the first is the warm-up
                ids = torch.randint(10, a.vocab - 1, (conc, n_in), generator=g).tolist()
                t = time.perf_counter()
                res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
                dt = time.perf_counter() - t
                assert all(len(r.outputs[0].token_ids) == n_out for r in res)
                if rep:
                    times.append(dt)
            s = statistics.median(times)
            rows.append({"concurrency": conc, "in": n_in, "out": n_out, "s": round(s, 3),
                         "out_tok_s": round(conc * n_out / s, 1), "load_s": round(load_s, 1),
                         "times": [round(t, 4) for t in times]})
            say(model=path, **rows[-1])
    return rows


def serve(a: argparse.Namespace, models: dict[str, Path]) -> dict[str, list[dict]]:
    """Each model served by a process of its own in vLLM's environment."""
    from quant.serve.vllm_plugin import checkout_entry_point

    plugin = checkout_entry_point(Path(a.workdir) / "plugin")  # the plugin, as an installed quant registers it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([a.vllm_path, str(plugin), str(ROOT)]),
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    results = {}
    for name, path in models.items():
        out = Path(a.workdir) / f"points-{name}.json"
        from quant.models.synthetic import SHAPES

        cmd = [sys.executable, __file__, "--one", str(path), "--out", str(out),
               "--vocab", str(SHAPES[a.shape]["vocab_size"]),
               "--concurrency", *map(str, a.concurrency), "--shapes", *[f"{i}/{o}" for i, o in a.shapes],
               "--repeats", str(a.repeats)]
        runs = []
        for _ in range(a.processes):  # each a process of its own: the spread includes what a new engine varies in
            out.unlink(missing_ok=True)
            p = subprocess.run(cmd, env=env | VARIANT_ENV.get(name, {}), capture_output=True, text=True)
            if p.returncode or not out.is_file():
                say(model=name, error=(p.stderr.strip().splitlines() or ["?"])[-1])
                break
            runs.append(json.loads(out.read_text()))
        if not runs:
            continue
        results[name] = merge_processes(runs)
        if a.results:  # after every model: a run cut off by a time limit keeps what it measured
            Path(a.results).write_text(json.dumps(results, indent=1))
    return results


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """One row per point from each process's rows: the median over every timed batch of every process, the spread
    (slowest and fastest batch) and each process's own median, in output tokens per second."""
    out = []
    for rows in zip(*runs, strict=True):
        first = rows[0]
        rate = [first["concurrency"] * first["out"] / t for r in rows for t in r["times"]]
        out.append({**{k: first[k] for k in ("concurrency", "in", "out")}, "out_tok_s": round(statistics.median(rate), 1),
                    "min_tok_s": round(min(rate), 1), "max_tok_s": round(max(rate), 1),
                    "process_tok_s": [r["out_tok_s"] for r in rows], "load_s": [r["load_s"] for r in rows]})
    return out


def table(results: dict[str, list[dict]]) -> None:
    names = list(results)
    keys = [(r["concurrency"], r["in"], r["out"]) for r in next(iter(results.values()), [])]
    print("\nout tok/s, median (slowest-fastest batch) over processes and repeats; CUDA graphs")
    print(" " * 38 + "  ".join(f"{n:>21}" for n in names))
    for c, i, o in keys:
        cells = []
        for n in names:
            row = next((r for r in results[n] if (r["concurrency"], r["in"], r["out"]) == (c, i, o)), None)
            cells.append(f"{row['out_tok_s']:>7.0f} ({row['min_tok_s']:.0f}-{row['max_tok_s']:.0f})".rjust(21)
                         if row else f"{'-':>21}")
        print(f"  {c:>4} requests, {i:>4}/{o:<4} tokens          " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a quant.models.synthetic shape")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["headline", "joint", "per-layer", "uniform-w4", "uniform-w8", "bf16"],
                    help=f"recipe checkpoints {sorted(RECIPES)}, synthetic plans {sorted(PLANS) + ['layers']}, "
                         f"variants {sorted(VARIANTS)}, bf16")
    ap.add_argument("--results", help="JSON file the results are written to after each model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--processes", type=int, default=2, help="serve each model this many times, a process each")
    ap.add_argument("--shapes", nargs="+", default=["128/128", "1024/128"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-path", default="/tmp/vsite")
    ap.add_argument("--workdir", default="/tmp/quant-serve")
    ap.add_argument("--part", choices=["all", "build", "serve"], default="all")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.shapes = [tuple(int(x) for x in s.split("/")) for s in a.shapes]
    if a.one:  # in vLLM's environment: vLLM and torch only
        Path(a.out).write_text(json.dumps(serve_points(a.one, a)))
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    models = build(a, work) if a.part != "serve" else (
        {"bf16": work / "bf16"} | {n: work / f"run-{VARIANTS.get(n, n)}" / "checkpoint" for n in a.models if n != "bf16"})
    if a.part == "build":
        return
    results = serve(a, {n: models[n] for n in a.models if n in models})
    (work / "serve.json").write_text(json.dumps(results, indent=1))
    table(results)


if __name__ == "__main__":
    main()
