"""Evaluate what ships: the exported checkpoint, read from disk by a public loader, against the base model.

Proxies (always): held-out perplexity, KL(base || quantized) of next-token distributions, top-1 agreement,
computed in token chunks by ``evalstream.ProxySums`` and split over ranks by samples. Two paths (``eval.mode``):
- ``streamed``: both models layer by layer (``evalstream``): the base from its safetensors, the checkpoint
  dequantized one layer at a time by compressed-tensors' own decompressor; memory ~ one decoder layer plus the
  eval activations, for models of any size.
- ``whole``: ``AutoModelForCausalLM.from_pretrained`` on the compressed-tensors checkpoint when transformers can
  serve the plan (one symmetric expert scheme model-wide); otherwise compressed-tensors' own
  ``CompressedTensorsDequantizer`` expands the checkpoint to a dense folder first (transformers 5 would load
  mixed expert schemes as garbage). Faster for small models.
``auto`` (default) takes ``whole`` when the dense model fits in half the eval device's memory (and a mixed plan's
dense copy fits the temporary folder's free disk), else ``streamed``; eval.json records which and why.
The checkpoint evaluated is the first of ``export.formats``; a GPTQ-format one is read back by
``shipped_gptq.GptqCheckpoint`` (streamed), or as its dense copy (whole, lm-eval's hf backend).
Tasks (``eval.tasks``): lm-eval on both models with identical settings, on the writer rank; base scores are
cached by model fingerprint and task settings. Gates turn deltas into pass/fail.
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
from quant.errors import CheckpointError, RecipeError
from quant.eval.shipped_gptq import GptqCheckpoint, dense_copy
from quant.eval.stream import ProxySums, ShippedCheckpoint, streamed_proxies
from quant.io.storage import remove_stale
from quant.layerwise import device_memory_bytes, pick_device
from quant.models import ModelSource
from quant.models.builtin import cache_root
from quant.models.dequant import DequantizingSource
from quant.models.layers import DTYPES
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan
from quant.recipe import EvalSpec, Recipe

log = logging.getLogger(__name__)


def _load(path: Path, dtype, device, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to(device).eval()
    with torch.no_grad():  # compressed-tensors decompresses on the first forward (a hook on the top-level model)
        model(torch.zeros(1, 1, dtype=torch.long, device=device))
    return model


def checkpoint_format(checkpoint: Path) -> str:
    """``gptq`` or ``compressed-tensors``: the quant_method of an exported checkpoint's config.json."""
    from quant.models.source import read_json_object

    qcfg = read_json_object(checkpoint / "config.json", "re-run the export", CheckpointError).get("quantization_config")
    return "gptq" if isinstance(qcfg, dict) and qcfg.get("quant_method") == "gptq" else "compressed-tensors"


def shipped_checkpoint(checkpoint: Path, source: ModelSource, dtype: torch.dtype, device,
                       processes_per_node: int = 1) -> DequantizingSource:
    """The exported checkpoint as a source of dense weights, read by its format's reader (``processes_per_node``:
    the world's ``local_size``, which sizes the page-locked read buffers)."""
    reader = GptqCheckpoint if checkpoint_format(checkpoint) == "gptq" else ShippedCheckpoint
    return reader(checkpoint, source, dtype, device, processes_per_node)


def needs_dense_copy(checkpoint: Path, plan: BitPlan, source: ModelSource) -> bool:
    """Whether transformers needs a dense copy to load the checkpoint correctly (GPTQ files always; a
    compressed-tensors checkpoint when transformers cannot serve its plan)."""
    from quant.plan.runtimes import problems_for

    return checkpoint_format(checkpoint) == "gptq" or bool(problems_for(plan, source, "transformers"))


@contextmanager
def servable_checkpoint(checkpoint: Path, plan: BitPlan, source: ModelSource, dtype: torch.dtype = torch.bfloat16):
    """A folder transformers loads correctly: the checkpoint itself, or its dense copy in the temporary folder
    (compressed-tensors' dequantization, or the GPTQ files read back by ``shipped_gptq``)."""
    if not needs_dense_copy(checkpoint, plan, source):
        yield checkpoint, "transformers"
        return
    from quant.eval.layer_error import dense_copy as ct_dense_copy

    remove_stale(Path(tempfile.gettempdir()), "quant-dense-")  # left by killed runs
    tmp = Path(tempfile.mkdtemp(prefix=f"quant-dense-{os.getpid()}-"))
    try:
        if checkpoint_format(checkpoint) == "gptq":
            dense_copy(GptqCheckpoint(checkpoint, source, dtype, "cpu"), tmp)
            yield tmp, "gptq-dequantize"
            return
        yield ct_dense_copy(checkpoint, tmp, "cpu"), "compressed-tensors-dequantize"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def final_hidden(model, tokens: torch.Tensor, batch: int, device) -> torch.Tensor:
    """Final-norm hidden states ``[n, S, D]`` of a whole transformers model, ``batch`` samples at a time."""
    out = []
    with torch.no_grad():
        for s in range(0, tokens.shape[0], batch):
            out.append(model.get_decoder()(tokens[s : s + batch].to(device)).last_hidden_state)
    return torch.cat(out)


def whole_proxies(base_path: Path, quant_path: Path, tokens: torch.Tensor, dtype, device, batch: int,
                  trust_remote_code: bool, world: World) -> dict:
    """The proxies with each model loaded whole (one at a time), this rank scoring its share of the samples."""
    mine = tokens[world.shard(range(tokens.shape[0]))]
    sums = ProxySums(device)
    if mine.shape[0]:
        base = _load(base_path, dtype, device, trust_remote_code)
        hidden_base, head_base = final_hidden(base, mine, batch, device), base.get_output_embeddings()
        del base
        quant = _load(quant_path, dtype, device, trust_remote_code)
        hidden_quant, head_quant = final_hidden(quant, mine, batch, device), quant.get_output_embeddings()
        del quant
        sums.score(hidden_base, head_base, hidden_quant, head_quant, mine, device)
    return sums.reduce(world).metrics()


WHOLE_MAX_MEMORY_FRACTION = 0.5  # auto: whole-model eval when the dense model fits in this share of the device


def dense_bytes(source: ModelSource, dtype: torch.dtype) -> int:
    """Bytes of the whole model in ``dtype`` (from safetensors headers)."""
    return sum(math.prod(s) for s in source.shapes().values()) * torch.finfo(dtype).bits // 8


def check_mode(requested: str, source: ModelSource) -> None:
    """``eval.mode: whole`` on a base model stored quantized (an FP8 release) is a RecipeError: transformers would
    load the release itself (FP8 kernels on a GPU, its own block arithmetic when dequantizing, wrong for blocks that
    do not divide a weight), not the dense weights quant quantized from; the streamed path reads exactly those."""
    if requested == "whole" and source.stored_quantized:
        raise RecipeError(f"eval.mode: whole cannot load {source.display_name} (stored in FP8 blocks) as the dense "
                          "weights quant quantized; use eval.mode: streamed or auto")


def proxy_mode(requested: str, source: ModelSource, plan: BitPlan, dtype: torch.dtype, device,
               dense_copy_needed: bool | None = None) -> tuple[str, str]:
    """(``whole`` or ``streamed``, why): ``requested`` unless ``auto``, then the documented size rule; a base model
    stored quantized (``check_mode``) is streamed. ``dense_copy_needed``: whole would load a dense copy of the
    checkpoint (``needs_dense_copy``; None: when transformers cannot serve the plan), which must fit the temporary
    folder."""
    check_mode(requested, source)
    if requested != "auto":
        return requested, f"eval.mode: {requested} (recipe)"
    if source.stored_quantized:
        return "streamed", "auto: the base model is stored in FP8 blocks (streamed reads it dequantized, as quantize did)"
    dense = dense_bytes(source, dtype)
    memory = device_memory_bytes(torch.device(device))
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    if dense > WHOLE_MAX_MEMORY_FRACTION * memory:
        return "streamed", f"auto: dense model {gb(dense)} > {WHOLE_MAX_MEMORY_FRACTION:g} x {device} memory {gb(memory)}"
    if dense_copy_needed is None:
        from quant.plan.runtimes import problems_for

        dense_copy_needed = bool(problems_for(plan, source, "transformers"))
    if dense_copy_needed:
        free = shutil.disk_usage(tempfile.gettempdir()).free
        if dense > free:
            return "streamed", f"auto: a dense copy ({gb(dense)}) does not fit the free disk of the temporary folder"
    return "whole", f"auto: dense model {gb(dense)} <= {WHOLE_MAX_MEMORY_FRACTION:g} x {device} memory {gb(memory)}"


def _task_cache_key(source: ModelSource, recipe: Recipe) -> str:
    e = recipe.eval
    blob = json.dumps([source.fingerprint, e.tasks, e.limit, e.num_fewshot, e.batch_size, e.backend,
                       e.max_gen_toks, recipe.model.dtype, e.humaneval_sandbox], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def task_gpus(e: EvalSpec, model_bytes: int) -> int:
    """GPUs the hf lm-eval backend dispatches the model over: ``eval.gpus``, else every visible GPU when the dense
    model exceeds ~90% of GPU 0's memory, else 1."""
    visible = torch.cuda.device_count()
    if e.gpus is not None:
        if e.gpus > max(visible, 1):
            raise RecipeError(f"eval.gpus is {e.gpus} but {visible} CUDA GPU(s) are visible")
        return e.gpus
    if visible <= 1:
        return 1
    return visible if model_bytes > 0.9 * device_memory_bytes(torch.device("cuda", 0)) else 1


def base_scores_path(source: ModelSource, recipe: Recipe) -> Path:
    """Where the base model's task scores for these eval settings are cached."""
    return cache_root() / "eval" / f"base-{_task_cache_key(source, recipe)}.json"


def read_cached_scores(path: Path, tasks) -> dict | None:
    """The base model's cached task scores at ``path`` (``{task: {"value": ...}}`` covering ``tasks``), or None when
    there are none; a damaged entry is a miss (a warning, and the base model is scored again), never an error."""
    if not path.is_file():
        return None
    try:
        scores = json.loads(path.read_bytes())
        if all(isinstance(scores[t]["value"], int | float) and not isinstance(scores[t]["value"], bool) for t in tasks):
            return scores
        problem = "a score that is not a number"
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
    log.warning("cached base-model scores %s are damaged (%s); scoring the base model again", path, problem)
    return None


def write_cached_scores(path: Path, scores: dict) -> None:
    """Cache the base model's task scores (atomically: a killed run never leaves half a file)."""
    from quant.io.rundir import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(scores))


LM_EVAL_RESULTS = {"base": "lm_eval_base.json", "quantized": "lm_eval_quantized.json"}  # in the run directory


def _run_tasks(recipe: Recipe, source: ModelSource, quant_dir: Path, device, gpus: int = 1,
               run_dir: Path | None = None) -> dict:
    """lm-eval on the base model (scores cached per model and settings) and on ``quant_dir``; lm-eval's own results
    of both go to ``run_dir`` (``LM_EVAL_RESULTS``)."""
    from quant.eval.lmeval import run_lm_eval

    e = recipe.eval
    kw = dict(limit=e.limit, num_fewshot=e.num_fewshot, batch_size=e.batch_size, seed=1234, device=str(device),
              backend=e.backend, max_gen_toks=e.max_gen_toks, trust_remote_code=source.trust_remote_code,
              humaneval_sandbox=e.humaneval_sandbox)
    if e.backend == "vllm":
        kw["model_args"] = {"tensor_parallel_size": e.tensor_parallel_size, "data_parallel_size": e.data_parallel_size}
    else:
        max_mem = None if e.max_memory_per_gpu_gb is None else int(e.max_memory_per_gpu_gb * 1e9)
        kw.update(gpus=gpus, max_memory_per_gpu=max_mem)
    cache = base_scores_path(source, recipe)
    raw = cache.with_suffix(".lm_eval.json")  # lm-eval's own results of the cached base run
    base = read_cached_scores(cache, e.tasks) if raw.is_file() else None
    if base is None:
        base = {k: asdict(v) for k, v in run_lm_eval(source.path, list(e.tasks), results_path=raw, **kw).items()}
        write_cached_scores(cache, base)
    out = run_dir / LM_EVAL_RESULTS["quantized"] if run_dir is not None else None
    quant = {k: asdict(v) for k, v in run_lm_eval(quant_dir, list(e.tasks), results_path=out, **kw).items()}
    if run_dir is not None:
        shutil.copyfile(raw, run_dir / LM_EVAL_RESULTS["base"])
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


def _sandbox_record(e) -> dict | None:
    """For eval.json, when a task ran generated code: the sandbox policy and the layers that were in force."""
    from quant.eval.lmeval import SANDBOXED_TASKS
    from quant.eval.sandbox import probe

    if not any(name in SANDBOXED_TASKS for name in e.tasks):
        return None
    found = probe()
    return {"policy": e.humaneval_sandbox, "layers": list(found.layers), "missing": list(found.missing)}


def _quantized_tasks(recipe: Recipe, source: ModelSource, plan: BitPlan, checkpoint: Path, device, gpus: int,
                     dense: Path | None, run_dir: Path | None = None) -> dict:
    """lm-eval on base and quantized model: vllm reads the checkpoint itself; hf loads ``dense`` (the folder the
    whole-model proxies loaded) or, when none was made, the folder ``servable_checkpoint`` makes now."""
    if recipe.eval.backend == "vllm":
        return _run_tasks(recipe, source, checkpoint, device, run_dir=run_dir)
    if dense is not None:
        return _run_tasks(recipe, source, dense, device, gpus, run_dir)
    with servable_checkpoint(checkpoint, plan, source, DTYPES[recipe.model.dtype]) as (path, _):
        return _run_tasks(recipe, source, path, device, gpus, run_dir)


def evaluate_run(recipe: Recipe, source: ModelSource, run_dir: Path, world: World) -> dict:
    """Proxies on every rank (each scores its share of the samples; sums all-reduced, identical everywhere);
    lm-eval tasks on the writer rank alone, the other ranks waiting for its result without the collective
    timeout (``World.on_writer``), so every rank returns the same result."""
    plan = BitPlan.load(run_dir / "plan.json")
    e = recipe.eval
    device = pick_device(e.device)
    dtype = DTYPES[recipe.model.dtype]
    tokens = build_calibration(e.perplexity.dataset, source.tokenizer(), e.perplexity.n_samples,
                               e.perplexity.seq_len, seed=0).tokens
    source.check_token_ids(tokens, f"the held-out set {e.perplexity.dataset}")
    checkpoint = run_dir / "checkpoint"
    gpus = task_gpus(e, dense_bytes(source, dtype)) if e.tasks and e.backend == "hf" else 1

    def tasks_on_writer(dense: Path | None = None) -> dict:
        if not e.tasks:
            return {}
        return world.on_writer(lambda: _quantized_tasks(recipe, source, plan, checkpoint, device, gpus, dense,
                                                        run_dir))

    mode, reason = proxy_mode(e.mode, source, plan, dtype, device, needs_dense_copy(checkpoint, plan, source))
    log.info("eval proxies: %s (%s)", mode, reason)
    if mode == "streamed":
        shipped = shipped_checkpoint(checkpoint, source, dtype, device, world.local_size)
        proxy = streamed_proxies(source, shipped, tokens, recipe.model.dtype, device, e.batch_size, world)
        loader = f"{checkpoint_format(checkpoint)}-per-layer"
        tasks = tasks_on_writer()
    else:
        with servable_checkpoint(checkpoint, plan, source, dtype) as (path, loader):
            proxy = whole_proxies(source.path, path, tokens, dtype, device, e.batch_size, source.trust_remote_code,
                                  world)
            tasks = tasks_on_writer(path)
    gates = gate_results(recipe, proxy, tasks)
    sandbox = _sandbox_record(e) if tasks else None
    log.info("eval: ppl %.3f -> %.3f, KL %.4f, top-1 %.3f, gates %s", proxy["perplexity"]["base"],
             proxy["perplexity"]["quantized"], proxy["kl"]["quantized"], proxy["top1_agreement"]["quantized"],
             "passed" if all(g["passed"] for g in gates) else "FAILED")
    return {"loader": loader, "proxy_mode": mode, "proxy_mode_reason": reason, "world_size": world.size,
            "task_gpus": gpus if tasks and e.backend == "hf" else None,
            "proxies": proxy, "tasks": tasks, **({"sandbox": sandbox} if sandbox else {}), "gates": gates,
            "passed": all(g["passed"] for g in gates)}
