"""Where a vLLM engine's first load of a quant checkpoint spends its time, on a fresh machine and then warm.

For each model, one process with empty caches (vLLM's, torch.compile's and Inductor's, Triton's, the CUDA driver's
JIT cache, ``XDG_CACHE_HOME``), then a second process that finds those caches filled: both build the engine the way
``vllm serve`` does (CUDA graphs on) and time it, and the phases vLLM logs (weight loading, Dynamo, Inductor
compilation, graph capture, engine warm-up) are read from its log. The checkpoints are ``benchmarks/serve.py``'s
(its ``--part build``: RTN exports of a random-weight Qwen3-30B-A3B-shaped model, a benchmark-only path): ``layers``
(one scheme per MoE layer, stock vLLM) and ``experts`` (per-expert bits, quant's plugin), beside ``bf16``::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/cold_load.py --vllm-path /tmp/vsite --workdir /tmp/serve

Prints one JSON line per load, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vLLM's own log lines for its load phases -> the name reported
PHASES = {
    "weights": re.compile(r"Loading weights took ([\d.]+) ?s"),
    "model_load": re.compile(r"Model loading took [\d.]+ ?GiB (?:memory )?and ([\d.]+) ?s"),
    "dynamo": re.compile(r"Dynamo bytecode transform time: ([\d.]+) ?s"),
    "compile": re.compile(r"torch\.compile takes ([\d.]+) ?s in total"),
    "graphs": re.compile(r"Graph capturing finished in ([\d.]+) ?sec"),
    "engine_init": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) ?s"),
}
CACHE_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME")
ONE = """
import sys, time
t0 = time.perf_counter()
from vllm import LLM
t1 = time.perf_counter()
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, seed=0,
          gpu_memory_utilization=0.85, max_num_seqs=256, enable_prefix_caching=False)
t2 = time.perf_counter()
print(f"QUANT_LOAD import={t1 - t0:.2f} engine={t2 - t1:.2f}", flush=True)
"""


def load_once(path: Path, env: dict) -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", ONE, str(path)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    log = p.stdout + p.stderr
    row = {"wall_s": round(wall, 1)}
    if m := re.search(r"QUANT_LOAD import=([\d.]+) engine=([\d.]+)", log):
        row |= {"import_s": float(m[1]), "engine_s": float(m[2])}
    else:
        row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:300]
    for name, rx in PHASES.items():
        found = [float(x) for x in rx.findall(log)]
        if found:
            row[name + "_s"] = round(sum(found), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-path", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--models", nargs="+", default=["layers", "experts", "bf16"])
    a = ap.parse_args()
    work = Path(a.workdir)
    from quant.serve.vllm_plugin import checkout_entry_point

    plugin = checkout_entry_point(work / "plugin")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([a.vllm_path, str(plugin), str(ROOT)]),
            "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    paths = {"bf16": work / "bf16", **{n: work / f"run-{n}" / "checkpoint" for n in ("layers", "experts", "w4", "w8")}}
    rows = []
    for name in a.models:
        caches = Path(tempfile.mkdtemp(prefix=f"cold-{name}-", dir=work))
        env = base | {v: str(caches / v.lower()) for v in CACHE_VARS}
        for state in ("cold", "warm"):
            row = {"model": name, "state": state, **load_once(paths[name], env)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = ["wall_s", "import_s", "engine_s", *(k + "_s" for k in PHASES)]
    print("| model | load | " + " | ".join(k[:-2] for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['model']} | {r['state']} | " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
