"""The Hugging Face model card (``README.md``) of a quantized checkpoint. Formatting only: every number comes
from the plan's headline and the eval result passed in, every serving claim from the runtime check.

Front matter: ``base_model`` when the model path looks like a hub id (``ORG/NAME``, not a builtin or a local
folder), ``license`` copied from the source model (its README front matter, else ``config.json``), ``tags``
and ``library_name`` (only a library the runtime check found able to serve the checkpoint). Body: what was
done (from the resolved recipe, never its free-text description), the plan, the evaluation with gate status (and
the lm-eval results files the checkpoint carries, linked, with each task's version, n-shot and sample count), how
to serve it with each runtime (a snippet only where the runtime check found no problem, warnings where a runtime
would load the checkpoint silently wrong), and the tool version.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from quant.export.writer import LM_EVAL_FILES
from quant.models import ModelSource
from quant.models.source import layer_of_key
from quant.plan.bitplan import Headline
from quant.plan.policies import policy as registered_policy
from quant.plan.runtimes import CHECKED_RUNTIMES, GPTQMODEL_NEEDS_GPTQ, TRANSFORMERS_NO_GPTQ
from quant.plan.servable import runtime_titles, same_size
from quant.recipe import Recipe

RUNTIME_NAMES = {"vllm-quant": "vLLM with quant's plugin", "vllm": "vLLM", "sglang": "SGLang",
                 "transformers": "transformers", "gptqmodel": "GPTQModel"}
# what a checkpoint format rules out regardless of the plan
FORMAT_PROBLEMS = {("gptq", "transformers"): TRANSFORMERS_NO_GPTQ, ("compressed-tensors", "gptqmodel"): GPTQMODEL_NEEDS_GPTQ,
                   ("gptq", "vllm-quant"): "quant's vLLM plugin serves the compressed-tensors export"}
# front matter library_name: the first runtime (hub library) that can serve the checkpoint; none if none can
LIBRARY_FOR = (("transformers", "transformers"), ("vllm", "vllm"))
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_id(model_path: str) -> str | None:
    """``model_path`` if it names a hub repository (``ORG/NAME`` that is not a local folder), else None."""
    if model_path.startswith("builtin:") or not _HUB_ID.match(model_path) or Path(model_path).expanduser().exists():
        return None
    return model_path


def source_license(source: ModelSource) -> str | None:
    """The source model's license: README front matter ``license``, else ``config.json``'s, else None."""
    readme = source.path / "README.md"
    if readme.is_file():
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", readme.read_text(errors="replace"), re.S)
        if m:
            try:
                meta = yaml.safe_load(m.group(1))
            except yaml.YAMLError:
                meta = None
            if isinstance(meta, dict) and meta.get("license"):
                return str(meta["license"])
    lic = source.config_dict.get("license")
    return str(lic) if lic else None


def _servable(runtime_problems: dict[str, list[str]], fmt: str, rt: str) -> bool:
    return rt in runtime_problems and not runtime_problems[rt] and (fmt, rt) not in FORMAT_PROBLEMS


def _front_matter(recipe: Recipe, source: ModelSource, fmt: str, runtime_problems: dict[str, list[str]]) -> str:
    """The hub's metadata block, made by ``huggingface_hub.ModelCardData`` (the fields the hub indexes: base model
    and its relation, license, library, pipeline tag, tags; ``quantization``: the format, tool and algorithm)."""
    from huggingface_hub import ModelCardData

    base = hub_id(recipe.model.path)
    library = next((lib for rt, lib in LIBRARY_FOR if _servable(runtime_problems, fmt, rt)), None)
    data = ModelCardData(
        base_model=base or None, base_model_relation="quantized" if base else None, license=source_license(source),
        library_name=library, pipeline_tag="text-generation",
        tags=["quantized", "mixture-of-experts", fmt, "moe-quant"],
        quantization={"format": fmt, "tool": "moe-quant", "algorithm": recipe.quantize.algorithm})
    return "---\n" + data.to_yaml() + "\n---\n"


def _schemes_line(recipe: Recipe, schemes: dict[str, dict[str, int]] | None) -> str:
    """The schemes the checkpoint holds, per module kind (its config.json's groups), and the recipe's request."""
    p = recipe.plan
    asked = ("per channel" if p.group_size == -1 else f"group size {p.group_size}") + (
        ", symmetric" if p.symmetric else ", asymmetric (zero points)")
    if not schemes:
        return f"- grid (recipe): {asked}"
    held = "; ".join(f"{kind} {', '.join(f'{s} ×{n}' for s, n in by.items())}" for kind, by in schemes.items())
    return (f"- schemes (what config.json holds): {held} (recipe: {asked}, the largest group; each set of modules "
            "that must share a scheme, such as the experts of one MoE layer, gets the largest power of two up to it "
            "that divides all their input widths)")


def _what(recipe: Recipe, source: ModelSource, fmt: str, schemes: dict[str, dict[str, int]] | None = None) -> list[str]:
    p, q = recipe.plan, recipe.quantize
    policy = f"`{p.policy}`{registered_policy(p.policy).describe(p)}"
    # the recipe's free-text description is not repeated: --set overrides (e.g. the algorithm) may contradict it
    lines = [f"`{source.display_name}` ({source.family.name}) quantized by moe-quant with recipe `{recipe.name}`."]
    left_out = sorted({layer_of_key(k) for k in source.left_out})
    return lines + [
        "",
        f"- algorithm: `{q.algorithm}`",
        f"- policy: {policy}; experts at {p.high_bits} (high) or {p.low_bits} (low) bits",
        f"- granularity: `{p.granularity}` ({'one scheme per MoE layer' if p.granularity == 'per_layer' else 'bits chosen per expert'})",
        _schemes_line(recipe, schemes),
        f"- format: `{fmt}`; target runtime: `{p.target_runtime}`",
    ] + ([f"- not included: the source's multi-token-prediction layer(s) {', '.join(map(str, left_out))} "
          "(`num_nextn_predict_layers`; not part of the forward): MTP speculative decoding needs a separate draft "
          "model"] if left_out else [])


def _plan(h: Headline) -> list[str]:
    lines = [
        f"- expert bits (code bits per routed-expert weight, scales not counted): **{h.avg_bits_experts}**; bits over "
        f"all weights: {h.avg_bits_all}",
        f"- traffic-weighted expert bits (what a routed token reads): {h.traffic_weighted_bits}",
        f"- checkpoint size: {h.size_gb} GB ({h.size_gb * 1000:.1f} MB)",
        "",
        "| bits | % of expert projections | share of routed traffic |",
        "|---|---|---|",
    ]
    for b, pct in sorted(h.expert_pct_by_bits.items()):
        label = "16 (kept)" if b == 16 else str(b)
        share = h.traffic_share_by_bits.get(b)
        lines.append(f"| {label} | {pct}% | {'-' if share is None else f'{100 * share:.1f}%'} |")
    return lines


def _gate_cell(gates: list[dict], *names: str) -> str:
    hits = [g for g in gates if g["name"] in names]
    if not hits:
        return "no gate"
    return "; ".join(f"{'pass' if g['passed'] else '**FAILED**'} ({g['kind']} {g['limit']:.4g}, observed "
                     f"{g['observed']:.4g})" for g in hits)


def _eval(ev: dict | None) -> list[str]:
    if ev is None:
        return ["Not evaluated."]
    px, gates = ev["proxies"], ev.get("gates", [])
    pb, pq = px["perplexity"]["base"], px["perplexity"]["quantized"]
    lines = ["| metric | base | quantized | delta | gate |", "|---|---|---|---|---|",
             f"| held-out perplexity | {pb:.4f} | {pq:.4f} | {pq - pb:+.4f} ({100 * (pq - pb) / pb:+.2f}%) | "
             f"{_gate_cell(gates, 'perplexity')} |",
             f"| KL(base ‖ quantized) per token | 0 | {px['kl']['quantized']:.4g} | "
             f"{px['kl']['quantized']:+.4g} | {_gate_cell(gates, 'kl')} |",
             f"| top-1 agreement with base | 1 | {px['top1_agreement']['quantized']:.4g} | "
             f"{px['top1_agreement']['quantized'] - 1:+.4g} | {_gate_cell(gates, 'top1_agreement')} |"]
    for task, r in ev.get("tasks", {}).items():
        names = (task, task.removeprefix("quant_"))
        lines.append(f"| {task} ({r['metric']}, n={r['n']}) | {r['base']:.4f} | {r['quantized']:.4f} | "
                     f"{100 * r['delta']:+.2f} pts | {_gate_cell(gates, *names)} |")
    failed = [g["name"] for g in gates if not g["passed"]]
    verdict = (f"**Quality gates FAILED: {', '.join(failed)}.**" if failed
               else "All quality gates passed." if gates else "No quality gates were set.")
    return lines + ["", verdict, "", f"Evaluated from the exported checkpoint on disk (loader: `{ev.get('loader', '?')}`)."]


def _both(values: list) -> str:
    """One cell for a figure of the base and the quantized model's results: the value, or ``base / quantized``."""
    shown = ["-" if v is None else str(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _lm_eval(lm_eval: dict[str, dict[str, dict]] | None) -> list[str]:
    """lm-eval's own results files in this folder, linked, and per task what they record (``task_records``):
    version, n-shot, samples scored, the headline metric of the base and the quantized model."""
    if not lm_eval:
        return []
    which = [w for w in ("base", "quantized") if w in lm_eval]
    links = ", ".join(f"{w} model [{LM_EVAL_FILES[w]}]({LM_EVAL_FILES[w]})" for w in which)
    lines = ["", "### lm-eval", "",
             f"lm-eval's own results (task configs, versions, n-shot, sample counts), in this folder: {links}.", "",
             f"| task | version | n-shot | samples | metric | {' | '.join(which)} |",
             "|---|---|---|---|---|" + "---|" * len(which)]
    for task in lm_eval[which[-1]]:
        rows = [lm_eval[w][task] for w in which if task in lm_eval[w]]
        cells = [_both([r[k] for r in rows]) for k in ("version", "n_shot", "n", "metric")]
        scores = [f"{lm_eval[w][task]['value']:.4f}" if task in lm_eval[w] else "-" for w in which]
        lines.append(f"| {task} | {' | '.join(cells)} | {' | '.join(scores)} |")
    return lines


def _snippet(runtime: str, repo: str, trust: bool, backend: str | None = None, quant_flag: str = "") -> list[str]:
    flag, kw = (" --trust-remote-code", ", trust_remote_code=True") if trust else ("", "")
    if runtime == "vllm-quant":  # what tests/serve/test_vllm.py serves on vLLM 0.26.0
        q, qkw = (f" --quantization {quant_flag}", f', quantization="{quant_flag}"') if quant_flag else ("", "")
        return ["```bash", "pip install vllm==0.26.0 && pip install --no-deps moe-quant  # registers quant's plugin",
                f"vllm serve {repo}{flag}{q}", "```", "```python", "from vllm import LLM",
                f'llm = LLM(model="{repo}"{kw}{qkw})', 'print(llm.generate(["Hello"])[0].outputs[0].text)', "```"]
    if runtime == "vllm":
        return ["```bash", f"vllm serve {repo}{flag}", "```", "```python", "from vllm import LLM",
                f'llm = LLM(model="{repo}"{kw})', 'print(llm.generate(["Hello"])[0].outputs[0].text)', "```"]
    if runtime == "sglang":
        return ["```bash", f"python -m sglang.launch_server --model-path {repo}{flag}", "```"]
    if runtime == "transformers":
        return ["```python", "# pip install compressed-tensors", "import torch",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f'tok = AutoTokenizer.from_pretrained("{repo}"{kw})',
                f'model = AutoModelForCausalLM.from_pretrained("{repo}", dtype=torch.bfloat16{kw})', "```"]
    imports, kw = ("GPTQModel, BACKEND", f"{kw}, backend=BACKEND.{backend}") if backend else ("GPTQModel", kw)
    return ["```python", f"from gptqmodel import {imports}", f'model = GPTQModel.load("{repo}"{kw})',
            'print(model.tokenizer.decode(model.generate("Hello")[0]))', "```"]


def _servable_alternative(serving: dict | None, runtime_problems: dict[str, list[str]]) -> list[str]:
    """When vLLM/SGLang cannot serve this plan: the best plan they serve at its size and the predicted price."""
    alt = (serving or {}).get("best_servable")
    if alt is None or not any(runtime_problems.get(rt) for rt in ("vllm", "sglang")):
        return []
    ours = serving.get("predicted_kl")
    versus = f" against this checkpoint's {ours:.4g}" if ours is not None else ""
    who = " and ".join(runtime_titles(alt))
    size = ("" if same_size(alt["expert_storage_bits"], serving["expert_storage_bits"]) else
            f" It stores {alt['expert_storage_bits']:.3f} bits per expert weight against this checkpoint's "
            f"{serving['expert_storage_bits']:.3f} (no plan of whole-layer schemes fills this size), so the two are "
            "not compared at equal size.")
    return [f"vLLM and SGLang run one scheme per MoE layer. The best such plan {who} serve within this checkpoint's "
            f"size (quant's `layer_sensitivity` policy, e.g. `recipes/mixed_vllm.yaml`) has a predicted KL of "
            f"{alt['predicted_kl']:.4g}{versus} on the calibration proxy (sum of per-layer KLs measured on "
            f"calibration tokens).{size}", ""]


def _serving(runtime_problems: dict[str, list[str]], fmt: str, repo: str, trust: bool,
             notes: dict[str, str], gptqmodel_backend: str | None, serving: dict | None = None) -> list[str]:
    lines = _servable_alternative(serving, runtime_problems)
    for rt in CHECKED_RUNTIMES:
        lines += [f"### {RUNTIME_NAMES[rt]}", ""]
        if rt not in runtime_problems:
            lines += ["Compatibility was not checked for this runtime.", ""]
            continue
        if rt in notes:
            lines += [notes[rt], ""]
        reasons = list(runtime_problems[rt])
        extra = FORMAT_PROBLEMS.get((fmt, rt))
        if extra and extra not in reasons:
            reasons.append(extra)
        backend = gptqmodel_backend if rt == "gptqmodel" else None
        # a plain compressed-tensors checkpoint takes the plugin only when asked for by name
        flag = "moe-quant-mixed" if rt == "vllm-quant" and runtime_problems.get("vllm") else ""
        lines += ([f"not servable: {'; '.join(reasons)}"] if reasons else _snippet(rt, repo, trust, backend, flag)) + [""]
    return lines


def render_card(recipe: Recipe, source: ModelSource, headline: Headline, eval_result: dict | None,
                runtime_problems: dict[str, list[str]], tool_version: str, *, fmt: str | None = None,
                repo_id: str | None = None, runtime_notes: dict[str, str] | None = None,
                gptqmodel_backend: str | None = None, serving: dict | None = None,
                schemes: dict[str, dict[str, int]] | None = None,
                lm_eval: dict[str, dict[str, dict]] | None = None) -> str:
    """README.md for the checkpoint of format ``fmt`` (default: the recipe's first export format, i.e. the run's
    ``checkpoint/``). ``headline``: the plan's figures (``BitPlan.headline``). ``runtime_problems``:
    runtime -> reasons it cannot serve the checkpoint (empty list: servable); ``library_name`` is the first of
    transformers / vLLM that can. ``runtime_notes``: runtime -> a line shown in its section (warnings).
    ``gptqmodel_backend``: the ``BACKEND`` member the GPTQModel snippet must name (its default kernel cannot run
    the plan). ``repo_id`` goes into the snippets (default ``ORG/NAME``). ``serving``: the plan's
    ``quant.plan.servable.serving_summary`` (names the best plan vLLM/SGLang serve when they cannot serve this one).
    ``schemes``: ``quant.plan.summary.scheme_counts`` of the plan, listed as what the checkpoint holds.
    ``lm_eval``: ``base`` / ``quantized`` -> ``quant.eval.lmeval.task_records`` of lm-eval's results files that the
    checkpoint carries (``LM_EVAL_FILES``), linked and tabulated under the evaluation."""
    fmt = fmt or recipe.export.formats[0]
    repo = repo_id or "ORG/NAME"
    title = repo_id.split("/")[-1] if repo_id else f"{source.display_name.split('/')[-1]} ({recipe.name})"
    lines = [_front_matter(recipe, source, fmt, runtime_problems), f"# {title}", "", "## What this is", ""]
    lines += _what(recipe, source, fmt, schemes)
    lines += ["", "## Plan", ""] + _plan(headline)
    lines += ["", "## Evaluation", ""] + _eval(eval_result) + _lm_eval(lm_eval)
    lines += ["", "## Serving", ""] + _serving(runtime_problems, fmt, repo, recipe.model.trust_remote_code,
                                               runtime_notes or {}, gptqmodel_backend, serving)
    lines += ["## Provenance", "", f"Made with moe-quant {tool_version} (`quant run`)."]
    return "\n".join(lines) + "\n"
