"""Quality study on builtin:reference-moe: does frequency-based INT8 beat the controls at equal bits?

For each calibration seed: calibrate (bundled prose + code, 32 × 256 tokens), profile, then for every
configuration plan → quantize with quant's engine → evaluate the quantized weights in memory against bf16 on
held-out text (calibration/heldout.yaml, fixed tokens): perplexity, KL(bf16 ‖ quant) per token, top-1
agreement, and next-line exact match on held-out Python (CPython glob.py + string.py, never trained on).
Mixed policies all give 6 of 32 experts per layer 8 bits (18.75 %), so their average expert bits are equal;
attention is 8-bit in every quantized configuration; router, embeddings, lm_head bf16. Writes study.json,
STUDY.md's tables and a plot. Usage (CPU, ~15 minutes on 2 cores):

    python benchmarks/study.py --seeds 0 1 2 --out study
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "reference_moe"))

from evaluate_reference import nextline_samples  # noqa: E402

from quant.calibration import build_calibration  # noqa: E402
from quant.dist.world import World  # noqa: E402
from quant.engine.layerwise import Layerwise  # noqa: E402
from quant.engine.qstore import layer_file, load_into_layer  # noqa: E402
from quant.engine.quantize import quantize_model  # noqa: E402
from quant.eval.evaluate import _final_hidden  # noqa: E402
from quant.eval.stream import ProxySums  # noqa: E402
from quant.measure.profile import profile_routing  # noqa: E402
from quant.models import resolve_model  # noqa: E402
from quant.plan.bitplan import plan_bits  # noqa: E402
from quant.plan.summary import summarize  # noqa: E402
from quant.recipe import PlanSpec, QuantizeSpec  # noqa: E402

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


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def apply_quantized(model, src, qdir: Path) -> None:
    """Put the stored dequantized weights (and AWQ-changed kept tensors) into a float model."""
    for layer in range(src.n_layers):
        load_into_layer(src, model.model.layers[layer], layer, layer_file(qdir, layer))


@torch.no_grad()
def nextline_greedy_match(model, batch: tuple[torch.Tensor, ...]) -> float:
    """Share of held-out lines that greedy decoding reproduces exactly, from one teacher-forced forward: every
    token of ``"\n" + line`` after the context is the model's argmax given the true prefix, and the argmax after
    the line's last token starts a new line (a token beginning with a newline, or EOS)."""
    ids, mask, span, ends_line = batch
    pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    ok = ((pred[:, :-1] == ids[:, 1:]) | ~span[:, 1:]).all(dim=1)
    return (ok & ends_line[pred[:, -1]]).float().mean().item()


def nextline_batch(tok, samples: list[dict]) -> tuple[torch.Tensor, ...]:
    """Left-padded ``context + "\n" + line`` ids, attention mask, mask of the line's tokens, and [V] whether a
    token ends the line (its text starts with a newline, or it is EOS)."""
    rows = [(smp["context_ids"], tok("\n" + smp["target"], add_special_tokens=False)["input_ids"]) for smp in samples]
    width = max(len(c) + len(t) for c, t in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    span = torch.zeros_like(ids, dtype=torch.bool)
    for r, (c, t) in enumerate(rows):
        seq = c + t
        ids[r, width - len(seq):] = torch.tensor(seq)
        mask[r, width - len(seq):] = 1
        span[r, width - len(t):] = True
    ends_line = torch.tensor([tok.decode([i]).startswith("\n") for i in range(len(tok))])
    ends_line[tok.eos_token_id] = True
    return ids, mask, span, ends_line


def heldout_code_docs() -> list[dict]:
    """The held-out Python file of calibration/heldout.yaml, split back into its modules."""
    text = (REPO / "calibration/data/heldout-python-code.txt").read_text()
    parts = [p for p in text.split("# ---- ") if p.strip()]
    return [{"path": p.split(" ", 1)[0], "domain": "code", "text": "# ---- " + p} for p in parts]


def reference(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    """The bf16 model's final-norm hidden states on the held-out tokens and its lm_head (what the proxies compare)."""
    return _final_hidden(model, tokens, 16, "cpu"), model.get_output_embeddings()


def proxies(model, tokens: torch.Tensor, base: tuple[torch.Tensor, torch.nn.Module]) -> dict:
    """The pipeline's own eval proxies (quant.eval.stream.ProxySums) of ``model`` against the bf16 reference."""
    sums = ProxySums("cpu")
    sums.score(*base, *reference(model, tokens), tokens, "cpu")
    p = sums.metrics()
    return {"ppl": p["perplexity"]["quantized"], "kl": p["kl"]["quantized"], "top1": p["top1_agreement"]["quantized"]}


def metrics(model, tokens, base, lines) -> dict:
    """The pipeline's own proxies against bf16, plus next-line exact match."""
    return proxies(model, tokens, base) | {"nextline_em": nextline_greedy_match(model, lines)}


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
            plan = plan_bits(prof, src.modules, spec, q_kw["algorithm"], src.n_layers)
            bits[name] = summarize(plan, src, prof)["headline"]["avg_bits_experts"]
            qdir = out / "work" / f"{seed}-{len(results[name])}-{abs(hash(name)) % 10**8}"
            shutil.rmtree(qdir, ignore_errors=True)
            quantize_model(src, calib, plan.quantized_specs(), plan.algorithm, QuantizeSpec(**q_kw),
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
    ap.add_argument("--study", choices=("selection", "servable"), default="selection",
                    help="selection: expert-selection policies (study.json); servable: one scheme per MoE layer "
                         "(servable.json, benchmarks/study_servable.py)")
    ap.add_argument("--jobs", type=int, default=2, help="servable: worker processes")
    ap.add_argument("--threads", type=int, default=1, help="servable: torch threads per worker")
    ap.add_argument("--sizes", nargs="+", default=["1x", "4x", "16x"], help="servable: calibration sizes")
    ap.add_argument("--report-only", action="store_true",
                    help="servable: tables of the tasks finished so far (a stopped run), without running any")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.study == "servable":
        import study_servable

        study_servable.main(a.seeds, out, a.jobs, a.threads, a.lines, a.sizes, a.report_only)
        return
    data = run(a.seeds, out, a.lines)
    (out / "table.md").write_text(table(data) + "\n")
    plot(data, out / "study_kl.png")
    print(table(data))


if __name__ == "__main__":
    main()
