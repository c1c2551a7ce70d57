"""The servable study's design and its tables (STUDY.md, ``benchmarks/study_servable.py`` runs it).

At equal average expert bits on builtin:reference-moe: the per-expert top-20 % plan (not servable by vLLM/SGLang)
against servable plans (one scheme per MoE layer) and the ``joint`` policy's (up to two scheme groups per MoE layer,
served by vLLM with quant's plugin), each with GPTQ and RTN, at several calibration sizes and seeds.
A task (seed, size) gives ``{"seed", "size", "damage", "results": {"<configuration>|<algorithm>": metrics}}``;
``collect`` gathers the finished ones into ``servable.json``, the tables and ``report`` read that. The share of the
per-expert plan's KL gain a plan keeps (``recovered``) is per seed, against that seed's own baseline and reference.
A study may run only some configurations (``--configs``): a table has a column only for what was measured (no
per-expert reference: no reference column; no reference or no baseline: no share of the gain kept).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SIZES = {"1x": 32, "4x": 128, "16x": 512}  # calibration windows of 256 tokens
SEQ_LEN = 256
BUDGET_BITS = 4.75  # the per-expert plan's average: 6 of 32 experts per layer at 8 bits, at group 128
SCHEMES = ("w4g128", "w4g64", "w4g32", "w8g128")
DAMAGE_SAMPLES = 16
LAYER = dict(policy="layer_sensitivity", granularity="per_layer", budget_avg_bits=BUDGET_BITS)
JOINT = dict(policy="joint", budget_avg_bits=BUDGET_BITS)  # up to two scheme groups per MoE layer (vllm-quant)
CONFIGS = {  # name -> PlanSpec kwargs (attention 8-bit g128, router/embeddings/lm_head bf16 everywhere)
    "uniform W4 g128": dict(policy="uniform", low_bits=4, high_bits=4),
    "per-expert top-20%": dict(top_fraction=0.2, high_bits=8, low_bits=4),
    "per-layer projection of top-20%": dict(top_fraction=0.2, ranking="global", granularity="per_layer"),
    "layer_sensitivity W4/W8 g128": dict(LAYER),
    "layer_sensitivity + g32/g64": dict(LAYER, layer_group_sizes=(32, 64)),
    "uniform W4 g32": dict(policy="uniform", low_bits=4, high_bits=4, group_size=32),
    "joint (by sensitivity) + g32/g64": dict(JOINT, layer_group_sizes=(32, 64)),
    "joint (by tokens) + g32/g64": dict(JOINT, layer_group_sizes=(32, 64), split_by="tokens"),
}
REFERENCE, BASELINE = "per-expert top-20%", "uniform W4 g128"
AT_SIZE = {"16x": (BASELINE, REFERENCE, "layer_sensitivity + g32/g64")}  # size -> configurations run (default: all)
ALGORITHMS = ("gptq", "rtn")


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


def by_seed(data: dict, size: str, key: str, metric: str) -> dict[int, float]:
    """Seed (ascending) -> the metric, where that size ran the configuration and measured the metric."""
    return {t["seed"]: t["results"][key][metric] for t in sorted(data["tasks"], key=lambda t: t["seed"])
            if t["size"] == size and metric in t["results"].get(key, {})}


def values(data: dict, size: str, key: str, metric: str) -> list[float]:
    """Per seed (ascending), where that size ran the configuration and measured the metric."""
    return list(by_seed(data, size, key, metric).values())


def measured(data: dict, size: str, name: str) -> bool:
    """Whether some algorithm's run of configuration ``name`` measured KL at ``size``."""
    return any(values(data, size, f"{name}|{a}", "kl") for a in ALGORITHMS)


def gain_measured(data: dict, size: str) -> bool:
    """Whether ``size`` measured the baseline and the per-expert reference, which the share of the gain kept needs."""
    return measured(data, size, BASELINE) and measured(data, size, REFERENCE)


def recovered(data: dict, size: str, key: str) -> list[float]:
    """Per seed: share of the per-expert plan's KL gain over uniform W4 g128 (same algorithm) this one keeps; only
    seeds that measured this plan, the baseline and the reference (none: empty)."""
    algo = key.split("|")[1]
    base, ref = (by_seed(data, size, f"{n}|{algo}", "kl") for n in (BASELINE, REFERENCE))
    return [(base[s] - m) / (base[s] - ref[s]) for s, m in by_seed(data, size, key, "kl").items()
            if s in base and s in ref]


def _ms(xs: list[float], digits: int, scale: float = 1.0, unit: str = "") -> str:
    """Mean ± standard deviation over seeds (a dash when none measured it)."""
    if not xs:
        return "—"
    m = statistics.fmean(xs) * scale
    s = (statistics.stdev(xs) if len(xs) > 1 else 0.0) * scale
    return f"{m:.{digits}f} ± {s:.{digits}f}{unit}"


def keys_run(data: dict) -> list[str]:
    """Every configuration|algorithm any task ran, in CONFIGS order."""
    ran = {k for t in data["tasks"] for k in t["results"]}
    return [f"{n}|{a}" for n in CONFIGS for a in ALGORITHMS if f"{n}|{a}" in ran]


def _served_by(v) -> str:
    """``yes``: stock vLLM and SGLang serve the plan; ``plugin``: only vLLM with quant's plugin (vllm-quant)."""
    return "yes" if v("servable")[0] else "plugin" if v("plugin") and v("plugin")[0] else "no"


def table_1x(data: dict) -> str:
    gain = gain_measured(data, "1x")
    rows = ["| configuration | algorithm | vLLM/SGLang | avg expert bits | stored bits/weight | perplexity | "
            "KL(bf16‖q) ×1e3 | top-1 agreement | next-line EM |" + (" per-expert KL gain kept |" if gain else ""),
            "|" + "---|" * (9 + gain)]
    for key in keys_run(data):
        name, algo = key.split("|")
        v = lambda m, key=key: values(data, "1x", key, m)  # noqa: E731
        kept = f" {_ms(recovered(data, '1x', key), 0, 100, ' %')} |" if gain else ""
        rows.append(f"| {name} | {algo.upper()} | {_served_by(v)} | {_ms(v('bits'), 2)} | "
                    f"{_ms(v('storage_bits'), 3)} | {_ms(v('ppl'), 3)} | {_ms(v('kl'), 2, 1e3)} | {_ms(v('top1'), 4)} | "
                    f"{_ms(v('nextline_em'), 3)} |{kept}")
    return "\n".join(rows)


def best_per_layer(data: dict, size: str, algo: str) -> str | None:
    """The configuration stock vLLM/SGLang serve (one scheme per MoE layer) with the least mean KL at ``size``."""
    served = [k for k in keys_run(data) if k.endswith(f"|{algo}") and values(data, size, k, "kl")
              and all(values(data, size, k, "servable"))]
    return min(served, key=lambda k: statistics.fmean(values(data, size, k, "kl")), default=None)


def table_joint(data: dict, size: str) -> str:
    """Per algorithm and seed: held-out KL ×1e3 (stored bits per expert weight) of the per-expert reference (a column
    only where ``size`` measured it), the best per-layer plan and each joint plan ``size`` measured, with the joint
    plan's change against the best per-layer plan; then the mean. A dash where an algorithm or seed lacks one."""
    ref = [REFERENCE] if measured(data, size, REFERENCE) else []
    joints = [n for n, kw in CONFIGS.items() if kw.get("policy") == "joint" and measured(data, size, n)]
    rows = []
    for algo in ALGORITHMS:
        best = best_per_layer(data, size, algo)
        if best is None or not any(values(data, size, f"{n}|{algo}", "kl") for n in joints):
            continue
        if not rows:
            rows = ["| algorithm | seed | " + " | ".join([*ref, best.split("|")[0]] + [f"{n} | change" for n in joints])
                    + " |", "|---|---|" + "---|" * (len(ref) + 1 + 2 * len(joints))]
        rows += _joint_rows(data, size, algo, [f"{n}|{algo}" for n in ref], best, [f"{n}|{algo}" for n in joints])
    return "\n".join(rows)


def _joint_rows(data: dict, size: str, algo: str, ref: list[str], best: str, mine: list[str]) -> list[str]:
    """``table_joint``'s rows of one algorithm: one per seed that ran ``best``, then the mean."""
    kl = {c: by_seed(data, size, c, "kl") for c in (*ref, best, *mine)}
    bits = {c: by_seed(data, size, c, "storage_bits") for c in kl}

    def cell(c: str, seed: int) -> str:
        return f"{1e3 * kl[c][seed]:.2f} ({bits[c][seed]:.3f})" if seed in kl[c] else "—"

    def change(c: str, seed: int) -> str:
        return f"{100 * (kl[c][seed] / kl[best][seed] - 1):+.1f} %" if seed in kl[c] else "—"

    rows = [f"| {algo.upper()} | {seed} | "
            + " | ".join([cell(c, seed) for c in (*ref, best)] + [f"{cell(c, seed)} | {change(c, seed)}" for c in mine])
            + " |" for seed in kl[best]]
    means = [_ms(list(kl[c].values()), 2, 1e3) for c in (*ref, best)]
    means += [f"{_ms(list(kl[c].values()), 2, 1e3)} | "
              f"{_ms([k / kl[best][s] - 1 for s, k in kl[c].items() if s in kl[best]], 1, 100, ' %')}" for c in mine]
    return [*rows, f"| {algo.upper()} | mean | " + " | ".join(means) + " |"]


def table_scaling(data: dict) -> str:
    sizes = list(data["sizes"])
    gains = [s for s in sizes if gain_measured(data, s)]  # the share of the gain kept: where it can be computed
    head = " | ".join([f"KL ×1e3 {s}" for s in sizes] + [f"gain kept {s}" for s in gains])
    rows = [f"| configuration | algorithm | {head} | perplexity {sizes[-1]} |",
            "|---|---|" + "---|" * (len(sizes) + len(gains) + 1)]
    for key in keys_run(data):
        name, algo = key.split("|")
        cells = [_ms(values(data, s, key, "kl"), 2, 1e3) for s in sizes]
        cells += [_ms(recovered(data, s, key), 0, 100, " %") for s in gains]
        cells.append(_ms(values(data, sizes[-1], key, "ppl"), 3))
        rows.append(f"| {name} | {algo.upper()} | {' | '.join(cells)} |")
    return "\n".join(rows)


def table_estimator(data: dict) -> str:
    """Predicted KL (sum of single-layer calibration KLs, RTN) against the held-out KL of the RTN checkpoints."""
    rows = ["| configuration (RTN) | predicted KL ×1e3 (calibration, sum of layers) | held-out KL ×1e3 | ratio |",
            "|---|---|---|---|"]
    for key in (k for k in keys_run(data) if k.endswith("|rtn")):
        pred = [t["results"][key]["predicted_kl"] for t in data["tasks"] if t["size"] == "1x"]
        meas = values(data, "1x", key, "kl")
        if any(p is None for p in pred):
            continue
        ratio = [p / m for p, m in zip(pred, meas, strict=True)]
        rows.append(f"| {key.split('|')[0]} | {_ms(pred, 2, 1e3)} | {_ms(meas, 2, 1e3)} | {_ms(ratio, 2)} |")
    return "\n".join(rows)


def table_layers(data: dict) -> str:
    """Which scheme each MoE layer got, per configuration and calibration set (GPTQ plans)."""
    rows = ["| configuration | size | seed | layer schemes (0..7) |", "|---|---|---|---|"]
    for key in (k for k in keys_run(data) if k.endswith("|gptq") and ("layer" in k or "joint" in k)):
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
    from quant.report import pyplot

    plt = pyplot()

    keys = [k for k in keys_run(data) if k.endswith("|gptq")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(data["sizes"])
    for i, size in enumerate(data["sizes"]):
        rows = [(j, [1e3 * x for x in values(data, size, k, "kl")]) for j, k in enumerate(keys)]
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
    joint = [x for size in data["sizes"] if (t := table_joint(data, size))
             for x in (f"### Joint plans against the best per-layer plan ({size}): KL ×1e3 (stored bits)", t)]
    text = "\n\n".join(missing + [f"### 1x calibration ({data['sizes']['1x']} × {data['seq_len']} tokens)", table_1x(data),
                        *joint, f"### Calibration tokens: {', '.join(data['sizes'])}", table_scaling(data),
                        "### Per-layer damage measured in the profile (1x, mean over seeds), KL ×1e3",
                        damage_table(data), "### Predicted vs measured KL", table_estimator(data),
                        "### Layer schemes chosen", table_layers(data)])
    (out / "servable_table.md").write_text(text + "\n")
    plot(data, out / "servable_kl.png")
    return text
