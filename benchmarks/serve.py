"""What the mix buys at serving time (GPU, vLLM): offline throughput and request latency of quant's checkpoints.

Builds a random-weight model of Qwen3-30B-A3B layer shapes (``quant.models.synthetic``; ``--layers`` real decoder
layers, as many as the disk takes beside the checkpoints), exports it with quant (RTN, ``quant export``) as

- ``w8``: every expert W8 g128; ``w4``: every expert W4 g128;
- ``layers``: one scheme per MoE layer at the headline's stored bits (the first fifth of the MoE layers W8 g128, the
  rest W4 g128: 4.8 bits per expert weight, what vLLM serves stock);
- ``experts``: the headline plan, the most used 20 % of each layer's experts W8 g128 and the rest W4 g128 (served by
  quant's vLLM plugin, ``quant_method: moe-quant-mixed``); ``experts-seq`` and ``experts-overlap`` serve the same
  checkpoint with the plugin's two scheme groups one after the other (``QUANT_MOE_OVERLAP=0``) and on two CUDA
  streams (``=1``) at every batch, where ``experts`` overlaps them at decode-sized batches only;

and serves each (and the bf16 model) with vLLM, CUDA graphs on, one process per model: for each of ``--concurrency``
(requests in flight together) and ``--shapes`` (prompt/generated tokens), one warm-up then ``--repeats`` timed
batches; the median is reported. Prints JSON lines, then a table. Run in vLLM's environment (vLLM's own
compressed-tensors) with quant's on the path for the exports::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/serve.py --vllm-path /tmp/vsite --layers 5 --workdir /tmp/serve

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


VARIANTS = {"experts-seq": "experts", "experts-overlap": "experts"}  # another model's checkpoint, with VARIANT_ENV
VARIANT_ENV = {"experts-seq": {"QUANT_MOE_OVERLAP": "0"}, "experts-overlap": {"QUANT_MOE_OVERLAP": "1"}}


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
    (work / "calibration.txt").write_text(random_words(33 * 512, vocab, 0))
    (work / "calibration.yaml").write_text(yaml.safe_dump(
        {"name": "random", "sources": [{"name": "random", "kind": "text", "path": "calibration.txt"}]}))
    n_w8 = max(1, round(a.layers / 5))
    plans = dict(PLANS, layers=dict(policy="uniform", group_size=128, granularity="per_layer", target_runtime="vllm",
                                    layer_schemes={str(i): "w8g128" for i in range(n_w8)}))
    out = {"bf16": model}

    def export(name: str) -> None:
        run = work / f"run-{name}"
        if not (run / "checkpoint" / "config.json").is_file():
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
    stored = statistics.mean(p["bits"] + 16 / p["group_size"] for p in experts)
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
                         "out_tok_s": round(conc * n_out / s, 1), "load_s": round(load_s, 1)})
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
        p = subprocess.run(cmd, env=env | VARIANT_ENV.get(name, {}), capture_output=True, text=True)
        if p.returncode or not out.is_file():
            say(model=name, error=(p.stderr.strip().splitlines() or ["?"])[-1])
            continue
        results[name] = json.loads(out.read_text())
        if a.results:  # after every model: a run cut off by a time limit keeps what it measured
            Path(a.results).write_text(json.dumps(results, indent=1))
    return results


def table(results: dict[str, list[dict]]) -> None:
    names = list(results)
    keys = [(r["concurrency"], r["in"], r["out"]) for r in next(iter(results.values()), [])]
    print("\nout tok/s (median of repeats; CUDA graphs)   " + "  ".join(f"{n:>9}" for n in names))
    for c, i, o in keys:
        cells = []
        for n in names:
            row = next((r for r in results[n] if (r["concurrency"], r["in"], r["out"]) == (c, i, o)), None)
            cells.append(f"{row['out_tok_s']:>9.0f}" if row else f"{'-':>9}")
        print(f"  {c:>4} requests, {i:>4}/{o:<4} tokens          " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a quant.models.synthetic shape")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["experts", "layers", "w4", "bf16", "w8"])
    ap.add_argument("--results", help="JSON file the results are written to after each model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
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
