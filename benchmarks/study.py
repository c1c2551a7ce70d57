"""Quality study on builtin:reference-moe: does frequency-based INT8 beat the controls at equal bits?

For each calibration seed: calibrate (bundled prose + code, 32 × 256 tokens), profile, then for every
configuration plan → quantize with quant's engine → evaluate the quantized weights in memory against bf16 on
held-out text (calibration/heldout.yaml, fixed tokens): perplexity, KL(bf16 ‖ quant) per token, top-1
agreement, and next-line exact match on held-out Python (CPython glob.py + string.py, never trained on).
Mixed policies all give 6 of 32 experts per layer 8 bits (18.75 %), so their average expert bits are equal;
attention is 8-bit in every quantized configuration; router, embeddings, lm_head bf16. Writes study.json,
STUDY.md's tables and a plot. The held-out metrics are ``studies.heldout``'s; the servable study (one scheme
per MoE layer) is ``benchmarks/study_servable.py``. Usage (CPU, ~15 minutes on 2 cores, repository root):

    python benchmarks/study.py --seeds 0 1 2 --out study
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from quant.calibration import build_calibration
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.plan.summary import summarize
from quant.profile.profile import profile_routing
from quant.quantize.driver import quantize_model
from quant.recipe import PlanSpec, QuantizeSpec
from studies.heldout import (
    apply_quantized,
    heldout_code_docs,
    load_model,
    metrics,
    nextline_batch,
    nextline_samples,
    reference,
)

MIXED = dict(top_fraction=0.2, high_bits=8, low_bits=4)
# name -> (plan spec kwargs, quantize spec kwargs); None = the bf16 model itself
CONFIGS: dict[str, tuple[dict, dict] | None] = {
    "bf16": None,
    "uniform INT8 (RTN)": (dict(policy="uniform", low_bits=8, high_bits=8), dict(algorithm="rtn")),
    "uniform INT4 (RTN)": (dict(policy="uniform", low_bits=4, high_bits=4), dict(algorithm="rtn")),
    "uniform INT4 (GPTQ)": (dict(policy="uniform", low_bits=4, high_bits=4), dict(algorithm="gptq")),
    "top-20% by tokens (GPTQ)": (dict(MIXED), dict(algorithm="gptq")),
    "random 20% (GPTQ)": (dict(MIXED, policy="random"), dict(algorithm="gptq")),
    "inverse 20% (GPTQ)": (dict(MIXED, policy="inverse"), dict(algorithm="gptq")),
    "top-20% by routing-weight mass (GPTQ)": (dict(MIXED, score="weight_mass"), dict(algorithm="gptq")),
    "top-20% by W4 sensitivity (GPTQ)": (dict(MIXED, policy="sensitivity"), dict(algorithm="gptq")),
    "per_layer projection of top-20% tokens (GPTQ)": (dict(MIXED, ranking="global", granularity="per_layer"),
                                                      dict(algorithm="gptq")),
    "top-20% by tokens, GPTQ all-expert calibration": (dict(MIXED), dict(algorithm="gptq", all_experts=True)),
    "top-20% by tokens, GPTQ gate-weighted Hessians": (dict(MIXED), dict(algorithm="gptq", gate_weighted=True)),
    "top-20% by tokens (RTN)": (dict(MIXED), dict(algorithm="rtn")),
    "random 20% (RTN)": (dict(MIXED, policy="random"), dict(algorithm="rtn")),
}


def run(seeds: list[int], out: Path, n_lines: int) -> dict:
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    src = resolve_model("builtin:reference-moe")
    tok = AutoTokenizer.from_pretrained(src.path)
    eval_tokens = build_calibration("calibration/heldout.yaml", tok, 16, 256, seed=0).tokens
    samples = nextline_samples(tok, heldout_code_docs(), n_lines, seed=0, max_context=256, max_line_tokens=48)
    lines = nextline_batch(tok, samples[:n_lines])
    base = load_model(src.path)
    base_ref = reference(base, eval_tokens)
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    bits: dict[str, float] = {}
    bf16 = metrics(base, eval_tokens, base_ref, lines)
    once: dict[str, dict] = {}  # configurations that do not read calibration data (uniform RTN)
    for seed in seeds:
        t0 = time.perf_counter()
        calib = build_calibration("calibration/bundled.yaml", tok, 32, 256, seed)
        prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 8, world=World()))
        for name, cfg in CONFIGS.items():
            if cfg is None:
                results[name].append(dict(bf16))
                continue
            plan_kw, q_kw = cfg
            if name in once:
                results[name].append(dict(once[name]))
                continue
            spec = PlanSpec(group_size=128, seed=seed, **plan_kw)
            plan = plan_bits(prof, src.modules, spec, src.n_layers)
            bits[name] = summarize(plan, src, prof).headline.avg_bits_experts
            qdir = out / "work" / f"{seed}-{len(results[name])}-{abs(hash(name)) % 10**8}"
            shutil.rmtree(qdir, ignore_errors=True)
            quantize_model(src, calib, plan.quantized_schemes(), q_kw["algorithm"], QuantizeSpec(**q_kw),
                           Layerwise(src, "bfloat16", "cpu", 8, World()), qdir)
            model = load_model(src.path)
            apply_quantized(model, src, qdir)
            results[name].append(metrics(model, eval_tokens, base_ref, lines))
            shutil.rmtree(qdir, ignore_errors=True)
            if plan_kw.get("policy") == "uniform" and q_kw["algorithm"] == "rtn":
                once[name] = results[name][-1]
            print(f"seed {seed} {name:52s} {json.dumps({k: round(v, 4) for k, v in results[name][-1].items()})}",
                  flush=True)
        print(f"seed {seed} done in {time.perf_counter() - t0:.0f}s", flush=True)
    data = {"seeds": seeds, "n_eval_tokens": int(eval_tokens.numel()), "n_nextline": int(lines[0].shape[0]),
            "avg_expert_bits": bits, "results": results}
    (out / "study.json").write_text(json.dumps(data, indent=1))
    return data


def _ms(values: list[float], digits: int) -> str:
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def table(data: dict) -> str:
    rows = ["| configuration | avg expert bits | perplexity | KL(bf16‖q) ×1e3 | top-1 agreement | next-line EM |",
            "|---|---|---|---|---|---|"]
    for name, runs in data["results"].items():
        b = data["avg_expert_bits"].get(name, 16)
        rows.append(f"| {name} | {b:.2f} | {_ms([r['ppl'] for r in runs], 3)} | "
                    f"{_ms([1e3 * r['kl'] for r in runs], 2)} | {_ms([r['top1'] for r in runs], 4)} | "
                    f"{_ms([r['nextline_em'] for r in runs], 3)} |")
    return "\n".join(rows)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in data["results"] if n != "bf16"]
    kls = [[1e3 * r["kl"] for r in data["results"][n]] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    ax.barh(range(len(names)), [statistics.fmean(k) for k in kls],
            xerr=[statistics.stdev(k) if len(k) > 1 else 0 for k in kls], color="tab:blue", alpha=0.7)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("KL(bf16 ‖ quantized) per token ×1e3 (mean ± std over calibration seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--out", default="study")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = run(a.seeds, out, a.lines)
    (out / "table.md").write_text(table(data) + "\n")
    plot(data, out / "study_kl.png")
    print(table(data))


if __name__ == "__main__":
    main()
