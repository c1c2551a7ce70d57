"""Evaluate what ships: the exported checkpoint, loaded from disk by a public loader, against the base model.

Loader: ``AutoModelForCausalLM.from_pretrained`` on the compressed-tensors checkpoint when transformers can
serve the plan (one symmetric expert scheme model-wide); otherwise compressed-tensors' own
``CompressedTensorsDequantizer`` expands the checkpoint to a dense folder first (transformers 5 would load
mixed expert schemes as garbage). Proxies (always): held-out perplexity, KL(base || quantized) of next-token
distributions, top-1 agreement. Tasks (``eval.tasks``): lm-eval on both models with identical settings; base
scores are cached by model fingerprint and task settings. Gates turn deltas into pass/fail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from quant.calibration import build_calibration
from quant.errors import RecipeError
from quant.layerwise import pick_device
from quant.models import ModelSource
from quant.models.builtin import cache_root
from quant.models.layers import DTYPES
from quant.plan import BitPlan
from quant.recipe import Recipe
from quant.storage import remove_stale

log = logging.getLogger(__name__)
PROXY_METRICS = ("perplexity", "kl", "top1_agreement")


def _load(path: Path, dtype, device, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


@contextmanager
def servable_checkpoint(checkpoint: Path, plan: BitPlan, source: ModelSource):
    """A folder transformers loads correctly: the checkpoint itself, or its compressed-tensors dequantization."""
    from quant.runtimes import problems_for

    if not problems_for(plan, source, "transformers"):
        yield checkpoint, "transformers"
        return
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    remove_stale(Path(tempfile.gettempdir()), "quant-dense-")  # left by killed runs
    tmp = Path(tempfile.mkdtemp(prefix=f"quant-dense-{os.getpid()}-"))
    try:
        convert_checkpoint(checkpoint, tmp, CompressedTensorsDequantizer(checkpoint), device="cpu")
        yield tmp, "compressed-tensors-dequantize"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def logprobs(model, tokens: torch.Tensor, batch: int, device) -> torch.Tensor:
    """Next-token log-probabilities ``[N, S-1, V]`` (float32 on CPU)."""
    out = []
    with torch.no_grad():
        for s in range(0, tokens.shape[0], batch):
            logits = model(tokens[s : s + batch].to(device)).logits[:, :-1].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return torch.cat(out)


def proxies(base_lp: torch.Tensor, quant_lp: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Perplexities, mean KL(base || quant) per token, top-1 agreement from two log-prob tensors."""
    target = tokens[:, 1:].unsqueeze(-1)
    nll_b = -base_lp.gather(-1, target).mean().item()
    nll_q = -quant_lp.gather(-1, target).mean().item()
    kl = (base_lp.exp() * (base_lp - quant_lp)).sum(-1).mean().item()
    agree = (base_lp.argmax(-1) == quant_lp.argmax(-1)).float().mean().item()
    if not (torch.isfinite(base_lp).all() and torch.isfinite(quant_lp).all()):
        agree = math.nan  # argmax over NaN rows "agrees" everywhere; a broken model must not look perfect
    return {"perplexity": {"base": math.exp(nll_b), "quantized": math.exp(nll_q)},
            "kl": {"quantized": kl}, "top1_agreement": {"quantized": agree}, "n_tokens": int(target.numel())}


def _task_cache_key(source: ModelSource, recipe: Recipe) -> str:
    e = recipe.eval
    blob = json.dumps([source.fingerprint, e.tasks, e.limit, e.num_fewshot, e.batch_size, e.backend,
                       e.max_gen_toks, recipe.model.dtype], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _run_tasks(recipe: Recipe, source: ModelSource, quant_dir: Path, device) -> dict:
    from quant.lmeval import run_lm_eval

    e = recipe.eval
    kw = dict(limit=e.limit, num_fewshot=e.num_fewshot, batch_size=e.batch_size, seed=1234, device=str(device),
              backend=e.backend, max_gen_toks=e.max_gen_toks, trust_remote_code=source.trust_remote_code)
    cache = cache_root() / "eval" / f"base-{_task_cache_key(source, recipe)}.json"
    if cache.is_file():
        base = json.loads(cache.read_text())
    else:
        base = {k: asdict(v) for k, v in run_lm_eval(source.path, list(e.tasks), **kw).items()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(base))
    quant = {k: asdict(v) for k, v in run_lm_eval(quant_dir, list(e.tasks), **kw).items()}
    return {t: {"metric": quant[t]["metric"], "base": base[t]["value"], "quantized": quant[t]["value"],
                "delta": quant[t]["value"] - base[t]["value"], "stderr": quant[t]["stderr"], "n": quant[t]["n"]}
            for t in quant}


def gate_results(recipe: Recipe, proxy: dict, tasks: dict) -> list[dict]:
    """Every configured gate with its observed value and limit; unknown gate names are recipe errors."""
    out = []
    for name, g in recipe.eval.gates.items():
        if name == "perplexity":
            b, q = proxy["perplexity"]["base"], proxy["perplexity"]["quantized"]
            observed, limit, kind = (q - b) / b, g.max_rel_increase, "max_rel_increase"
        elif name in ("kl", "top1_agreement"):
            observed, limit, kind = proxy[name]["quantized"], g.max_value, "max_value"
        elif name in tasks or f"quant_{name}" in tasks:
            task = tasks[name] if name in tasks else tasks[f"quant_{name}"]
            observed, limit, kind = -task["delta"] * 100.0, g.max_drop, "max_drop (points)"
        else:
            raise RecipeError(f"eval.gates.{name}: no such metric; gate perplexity, kl or one of eval.tasks {list(tasks)}")
        if limit is None:
            raise RecipeError(f"eval.gates.{name}: set {kind.split()[0]}")
        passed = observed >= limit if name == "top1_agreement" else observed <= limit
        out.append({"name": name, "kind": kind, "observed": observed, "limit": limit,
                    "passed": bool(passed) and math.isfinite(observed)})  # NaN never passes
    bad = [k for k in ("perplexity", "kl", "top1_agreement") for v in proxy[k].values() if not math.isfinite(v)]
    if bad:  # always on: non-finite proxies mean a broken checkpoint, gates configured or not
        out.append({"name": "finite_proxies", "kind": "count of NaN/Inf proxy values", "observed": float(len(bad)),
                    "limit": 0.0, "passed": False})
    return out


def evaluate_run(recipe: Recipe, source: ModelSource, run_dir: Path) -> dict:
    plan = BitPlan.load(run_dir / "plan.json")
    device = pick_device(recipe.eval.device)
    dtype = DTYPES[recipe.model.dtype]
    p = recipe.eval.perplexity
    tokens = build_calibration(p.dataset, source.tokenizer(), p.n_samples, p.seq_len, seed=0).tokens
    base = _load(source.path, dtype, device, source.trust_remote_code)
    base_lp = logprobs(base, tokens, recipe.eval.batch_size, device)
    del base
    with servable_checkpoint(run_dir / "checkpoint", plan, source) as (path, loader):
        quant = _load(path, dtype, device, source.trust_remote_code)
        proxy = proxies(base_lp, logprobs(quant, tokens, recipe.eval.batch_size, device), tokens)
        del quant
        tasks = _run_tasks(recipe, source, path, device) if recipe.eval.tasks else {}
    gates = gate_results(recipe, proxy, tasks)
    log.info("eval: ppl %.3f -> %.3f, KL %.4f, top-1 %.3f, gates %s", proxy["perplexity"]["base"],
             proxy["perplexity"]["quantized"], proxy["kl"]["quantized"], proxy["top1_agreement"]["quantized"],
             "passed" if all(g["passed"] for g in gates) else "FAILED")
    return {"loader": loader, "proxies": proxy, "tasks": tasks, "gates": gates,
            "passed": all(g["passed"] for g in gates)}
