"""Run artifacts -> ``report.md``, ``metrics.json`` and PNG plots. Formatting only: every number comes from an
artifact (profile, plan, quantize layer reports, eval, manifest)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from quant.io.rundir import atomic_write_text
from quant.io.storage import cache_root
from quant.models import ModelSource
from quant.plan.bitplan import KEEP_BITS, BitPlan, by_bits
from quant.plan.servable import runtime_titles, same_size
from quant.plan.summary import BITS_TERMS, PlanSummary, summarize
from quant.profile.profile import RoutingProfile, ratio_text
from quant.recipe import Recipe


def _scheme(p) -> tuple:
    return (KEEP_BITS, 0, True) if p.keep else (p.bits, p.group_size, p.symmetric)


def _scheme_label(schemes: tuple) -> str:
    """One expert's schemes (gate, up, down) as the legend names them: ``W4 g32``, ``bf16 (kept)``, or
    ``W8 g32 gate/up, W4 g32 down`` when its projections differ."""
    def one(s: tuple) -> str:
        if s[0] == KEEP_BITS:
            return "bf16 (kept)"
        group = "per channel" if s[1] == -1 else f"g{s[1]}"
        return f"W{s[0]} {group}{'' if s[2] else ' asym'}"

    gate, up, down = schemes
    if gate == up == down:
        return one(gate)
    return f"{one(gate)} gate/up, {one(down)} down" if gate == up else f"{one(gate)} gate, {one(up)} up, {one(down)} down"


def scheme_grid(plan: BitPlan, source: ModelSource, profile: RoutingProfile) -> tuple[torch.Tensor, list[str]]:
    """``[L, E]`` index of each expert's scheme into the returned labels (bits and group size of its
    projections), labels in ascending bits then group size."""
    per: dict[tuple[int, int], dict[str, tuple]] = {}
    for name, m in source.modules.items():
        if m.kind == "expert":
            per.setdefault((m.layer, m.expert), {})[name.rsplit(".", 1)[1]] = _scheme(plan.modules[name])
    keys = {k: tuple(v.get(p, (0, 0, True)) for p in ("gate", "up", "down")) for k, v in per.items()}
    order = sorted(set(keys.values()), key=lambda s: (max(x[0] for x in s), [(-x[0], x[1]) for x in s]))
    grid = torch.full((len(profile.layers), profile.n_experts), -1, dtype=torch.long)
    for (layer, e), s in keys.items():
        grid[profile.row(layer), e] = order.index(s)
    return grid, [_scheme_label(s) for s in order]


def _bit_map(plan: BitPlan, source: ModelSource, profile: RoutingProfile, path: Path) -> str:
    """Each expert's scheme (bits and group size), one colour per scheme named in the legend."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid, labels = scheme_grid(plan, source, profile)
    palette = [plt.get_cmap("tab10")(i % 10) for i in range(len(labels))]
    fig, ax = plt.subplots(figsize=(8, 3 + 0.15 * len(profile.layers)))
    ax.imshow(grid.numpy(), aspect="auto", cmap=ListedColormap(palette), vmin=-0.5, vmax=len(labels) - 0.5,
              interpolation="nearest")
    ax.set(title="Scheme of each expert (expert id order)", xlabel="expert", ylabel="MoE layer #",
           yticks=range(len(profile.layers)), yticklabels=profile.layers)
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in zip(palette, labels, strict=True)],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="scheme", title_fontsize=8)
    return _save(fig, path)


def pyplot():
    """matplotlib's pyplot on the Agg backend, its font cache and configuration under quant's cache
    (``MPLCONFIGDIR``, unless set: matplotlib would write them to ~/.cache/matplotlib and ~/.config/matplotlib, outside
    the run directory and quant's cache)."""
    os.environ.setdefault("MPLCONFIGDIR", str(cache_root() / "matplotlib"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(plan: BitPlan, source: ModelSource, profile: RoutingProfile, out: Path) -> list[str]:
    plt = pyplot()

    share = profile.share()
    order = torch.argsort(share, dim=1, descending=True)
    files = []
    fig, ax = plt.subplots(figsize=(8, 3 + 0.15 * len(profile.layers)))
    im = ax.imshow(share.gather(1, order).numpy(), aspect="auto", cmap="viridis")
    ax.set(title="Routing share per expert (each row sorted)", xlabel="expert rank in layer", ylabel="MoE layer #",
           yticks=range(len(profile.layers)), yticklabels=profile.layers)
    fig.colorbar(im, ax=ax, label="share of routed tokens")
    files.append(_save(fig, out / "routing_heatmap.png"))
    files.append(_bit_map(plan, source, profile, out / "bit_map.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    sorted_share = torch.sort(share, dim=1, descending=True).values
    frac = torch.arange(1, profile.n_experts + 1) / profile.n_experts
    for i, layer in enumerate(profile.layers):
        ax.plot(frac.numpy(), sorted_share[i].cumsum(0).numpy(), alpha=0.6, label=f"layer {layer}" if i < 8 else None)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="uniform")
    ax.set(title="Cumulative routed traffic", xlabel="top fraction of experts", ylabel="fraction of tokens served")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "traffic_curve.png"))
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def _eval_lines(ev: dict) -> list[str]:
    px = ev["proxies"]
    lines = ["| metric | base | quantized | delta |", "|---|---|---|---|"]
    pb, pq = px["perplexity"]["base"], px["perplexity"]["quantized"]
    lines.append(f"| held-out perplexity | {pb:.3f} | {pq:.3f} | {pq - pb:+.3f} ({100 * (pq - pb) / pb:+.2f}%) |")
    lines.append(f"| KL(base‖quant) per token | 0 | {px['kl']['quantized']:.5f} | |")
    lines.append(f"| top-1 agreement | 1 | {px['top1_agreement']['quantized']:.4f} | |")
    for t, r in ev["tasks"].items():
        err = f" ± {r['stderr']:.4f}" if r["stderr"] is not None else ""
        lines.append(f"| {t} ({r['metric']}, n={r['n']}) | {r['base']:.4f} | {r['quantized']:.4f}{err} "
                     f"| {100 * r['delta']:+.2f} pts |")
    if ev["tasks"]:
        lines += ["", "lm-eval's own results (task configs and versions, n-shot, sample counts): base "
                  "[lm_eval_base.json](lm_eval_base.json), quantized [lm_eval_quantized.json](lm_eval_quantized.json)."]
    lines += ["", f"Loaded through: `{ev['loader']}` (from the exported checkpoint on disk)."]
    if "proxy_mode" in ev:
        how = "streamed layer by layer" if ev["proxy_mode"] == "streamed" else "whole models"
        lines.append(f"Proxies computed on {how} ({ev['proxy_mode_reason']}), {ev['world_size']} rank(s).")
    lines.append("")
    if ev["gates"]:
        lines += ["| gate | observed | limit | status |", "|---|---|---|---|"]
        lines += [f"| {g['name']} ({g['kind']}) | {g['observed']:.4g} | {g['limit']:.4g} | "
                  f"{'pass' if g['passed'] else '**FAIL**'} |" for g in ev["gates"]]
    return lines


def _plan_lines(summary: PlanSummary) -> list[str]:
    h = summary.headline
    terms = ("expert bits", "bits over all weights", "traffic-weighted expert bits")
    lines = [f"- expert bits: **{h.avg_bits_experts}**; bits over all weights: {h.avg_bits_all}; traffic-weighted "
             f"expert bits: {h.traffic_weighted_bits}",
             f"- checkpoint size estimate: {h.size_gb * 1000:.2f} MB",
             f"- expert projections by bits: {h.experts_by_bits()}",
             f"- routed traffic by bits: {h.traffic_by_bits()}",
             "", "; ".join(f"{t.capitalize() if i == 0 else t}: {BITS_TERMS[t]}" for i, t in enumerate(terms)) + ".",
             "", "| layer | modules by bits | traffic share by bits | traffic-weighted expert bits |", "|---|---|---|---|"]
    lines += [f"| {r['layer']} | {by_bits(r['modules_by_bits'])} | "
              f"{by_bits(r['traffic_share_by_bits'], lambda v: f'{100 * v:.1f}%')} | {r['traffic_weighted_bits']} |"
              for r in summary.per_layer]
    return lines


WORST_ERROR = ("worst rel. error: per layer, the largest relative weight error ‖Ŵ − W‖ / ‖W‖ over its quantized "
               "modules (experts, attention, shared experts, dense MLPs; every algorithm alike), W being the "
               "full-precision weight the codes store (AWQ's after its smoothing scales). A weight error, not an "
               "output error: GPTQ accepts a larger one for a smaller output error (see KL above).")


def _quantize_lines(layers: list[dict]) -> list[str]:
    lines = [f"Layer bits: {BITS_TERMS['layer bits']}. {WORST_ERROR}", "",
             "| layer | modules | experts | layer bits | worst rel. error | module | seconds | RTN fallbacks |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['n_modules']} | {r['n_experts']} | {r['mean_bits']:.2f} | "
              f"{r['worst_rel_error']:.4f} | `{r['worst_module']}` | {r['seconds']:.2f} | {len(r['rtn_fallbacks'])} |"
              for r in layers]
    repairs = [x for r in layers for x in r["repairs"]]
    return lines + (["", f"Numerical repairs: {len(repairs)}"] + [f"- {x}" for x in repairs[:20]] if repairs else [])


def _experts_text(experts: list[tuple[int, int]], most: int = 12) -> str:
    """``layer 1 expert 3, layer 2 expert 0, …``: (layer, expert) pairs as text, the first ``most`` of them."""
    return ", ".join(f"layer {layer} expert {e}" for layer, e in experts[:most]) + (", …" if len(experts) > most else "")


def _routing_lines(profile: RoutingProfile, min_tokens: int) -> list[str]:
    cold, supers = profile.cold_experts(min_tokens), profile.super_experts(50.0)
    ratios = ", ".join(f"layer {layer}: {ratio_text(r)}" for layer, r in zip(profile.layers,
                                                                            profile.max_min_ratio().tolist(), strict=True))
    entropy = ", ".join(f"layer {layer}: {x:.3f}" for layer, x in zip(profile.layers, profile.entropy().tolist(),
                                                                      strict=True))
    lines = [f"- routing entropy per MoE layer (1 = uniform): {entropy}",
             f"- most / least used expert (routed tokens) per MoE layer: {ratios}",
             f"- cold experts (fewer than {max(min_tokens, 1)} routed tokens, profile.min_tokens): {len(cold)}"
             + (f" ({_experts_text(cold)})" if cold else ""),
             "- super-expert candidates (max down-proj output > 50 × median): "
             + (f"{len(supers)} ({_experts_text(supers)})" if supers else "none")]
    stability = profile.rank_stability()
    if stability:
        lines.append("- rank stability between calibration domains (mean over layers): " + "; ".join(
            f"{pair}: Spearman {v['spearman']:.3f}, top-20% overlap {v['top_overlap']:.2f}"
            for pair, v in stability.items()))
    return lines


def _kl(value: float | None) -> str:
    return "not predictable (a scheme the profile did not measure)" if value is None else f"{value:.4g}"


def serving_lines(serving: dict) -> list[str]:
    """Whether vLLM/SGLang serve the plan and, from the profile's per-layer damage, the best plan they serve."""
    if not serving:
        return ["Not recorded (plan written by an older quant)."]
    problems = serving["problems"]
    blocked = [rt for rt, p in problems.items() if p]
    lines = [f"- not servable by {', '.join(blocked)}: {problems[blocked[0]][0]}" if blocked
             else f"- servable by {' and '.join(problems)} (one scheme per MoE layer)"]
    if not serving.get("damage_measured"):
        return lines + ["- set `profile.layer_sensitivity` to measure per-layer damage and price the best plan "
                        "vLLM/SGLang serve at this size"]
    alt = serving.get("best_servable")
    lines.append(f"- this plan's predicted KL on the calibration proxy: {_kl(serving['predicted_kl'])} "
                 f"(stored expert bits {serving['expert_storage_bits']:.3f})")
    if alt is None:
        return lines + ["- no plan of measured schemes that vLLM or SGLang serve at this model's widths fits this "
                        "plan's size"]
    schemes = ", ".join(f"{layer}: {s}" for layer, s in alt["layers"].items())
    who = "/".join(runtime_titles(alt))
    lines.append(f"- best plan {who} serve within this size (`plan.policy: layer_sensitivity`): predicted KL "
                 f"{alt['predicted_kl']:.4g} (stored expert bits {alt['expert_storage_bits']:.3f}); layers {schemes}")
    if blocked and serving["predicted_kl"] is not None:
        d = alt["predicted_kl"] - serving["predicted_kl"]
        if not same_size(alt["expert_storage_bits"], serving["expert_storage_bits"]):
            verdict = ("not at equal size: no plan of whole-layer schemes fills this plan's storage, so part of the "
                       "difference is the bits it leaves unspent")
        else:
            verdict = (f"this plan is predicted better by that much: the price of serving it with {who}" if d > 0
                       else "the servable plan is predicted at least as good")
        lines.append(f"- servable plan minus this plan, predicted KL: {d:+.4g} ({verdict})")
    return lines + ["", "Calibration proxy: the sum over MoE layers of the KL of the model output when only that "
                    "layer's experts are quantized (round-to-nearest, measured in the profile on calibration "
                    "tokens); experts mixing schemes within a layer are weighted by their share of its W4 error."]


def _description_lines(description: str) -> list[str]:
    """The recipe's own description, quoted as written (``--set`` overrides may have changed what it describes)."""
    text = " ".join(description.split())
    return [f"Recipe description (as written in the recipe file): {text}", ""] if text else []


def write_report(recipe: Recipe, source: ModelSource, run_dir: Path) -> None:
    profile = RoutingProfile.load(run_dir / "profile.json")
    plan = BitPlan.load(run_dir / "plan.json")
    ev = json.loads((run_dir / "eval.json").read_text())
    layers = json.loads((run_dir / "quantized" / "layers.json").read_text())
    summary = summarize(plan, source, profile)
    plots = plot_all(plan, source, profile, run_dir) if recipe.report.plots else []
    status = "PASSED" if ev["passed"] else "FAILED"
    lines = [f"# quant run `{recipe.name}` — gates {status}", "",
             f"Model `{source.display_name}` ({source.family.name}, fingerprint `{source.fingerprint}`); "
             f"algorithm `{recipe.quantize.algorithm}`; policy `{plan.policy}`, granularity `{plan.granularity}`, "
             f"target runtime `{plan.target_runtime}`.", ""] + _description_lines(recipe.description)
    lines += ["## Evaluation", ""] + _eval_lines(ev)
    lines += ["", "## Plan", ""] + _plan_lines(summary)
    lines += ["", "## Serving with vLLM / SGLang", ""] + serving_lines(plan.serving)
    lines += ["", "## Routing", ""] + _routing_lines(profile, recipe.profile.min_tokens)
    lines += [""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Quantization", ""] + _quantize_lines(layers)
    atomic_write_text(run_dir / "metrics.json", json.dumps({"plan": asdict(summary.headline), "eval": ev,
                                                                 "serving": plan.serving}, indent=1))
    atomic_write_text(run_dir / "report.md", "\n".join(lines) + "\n")
