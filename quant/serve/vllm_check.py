"""Serve model folders with vLLM and record what it predicts: ``python -m quant.serve.vllm_check SPEC.json OUT.json``.

Runs in vLLM's own environment (vLLM pins its own compressed-tensors, so it may not be quant's): it imports vLLM,
torch and the standard library only. ``SPEC.json``::

    {"prompts": [[token ids], ...], "max_model_len": 512, "greedy_tokens": 32, "enforce_eager": true,
     "models": [{"name": "w4", "path": "/abs/folder", "tensor_parallel_size": 1, "env": {"VLLM_PLUGINS": ""}}]}

For each model ``OUT.json`` gets ``top1`` (per prompt, vLLM's most likely next token at every prompt position
after the first, from ``prompt_logprobs``), ``greedy`` (per prompt, ``greedy_tokens`` generated at temperature 0),
``quantization`` (the method vLLM chose) and ``seconds``; or ``error``: the last line of what vLLM raised, when it
refused the folder, with ``log``, the last lines the serving process printed. Each model is served by a process of
its own (``--jobs N``: N at a time), with the model's
``env`` added to its environment (``VLLM_PLUGINS=""`` loads no plugin: stock vLLM).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import traceback


def _top1(prompt_logprobs) -> list[int]:
    out = []
    for pos in prompt_logprobs[1:]:  # position 0 has no prediction
        best = min(pos.items(), key=lambda kv: kv[1].rank)
        out.append(int(best[0]))
    return out


def failure(e: BaseException, t0: float) -> dict:
    """A serving attempt that raised, as a result: the last line of what was raised, its traceback's end."""
    message = " ".join(" ".join(traceback.format_exception_only(type(e), e)).split())
    return {"error": message[:2000], "traceback": traceback.format_exc().splitlines()[-40:],
            "seconds": round(time.perf_counter() - t0, 2)}


def serve_one(model: dict, spec: dict) -> dict:
    t0 = time.perf_counter()
    llm = None
    try:
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=model["path"], skip_tokenizer_init=True, dtype="bfloat16",
                  enforce_eager=model.get("enforce_eager", spec.get("enforce_eager", True)), max_model_len=spec.get("max_model_len", 512),
                  tensor_parallel_size=model.get("tensor_parallel_size", 1),
                  gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.05), seed=0,
                  kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 1 << 30),
                  enable_prefix_caching=False, **model.get("engine_args", {}))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        greedy = SamplingParams(temperature=0, max_tokens=spec.get("greedy_tokens", 32), ignore_eos=True,
                                detokenize=False)
        scored = llm.generate(prompts, scoring, use_tqdm=False)
        generated = llm.generate(prompts, greedy, use_tqdm=False)
        quant = getattr(getattr(getattr(llm.llm_engine, "vllm_config", None), "model_config", None),
                        "quantization", None)
        return {"top1": [_top1(r.prompt_logprobs) for r in scored],
                "greedy": [list(r.outputs[0].token_ids) for r in generated],
                "quantization": quant, "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as e:  # a refusal is a result: the caller checks it was the expected one
        return failure(e, t0)
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            try:
                core.shutdown()  # the engine and its GPU memory go before the process ends
            except Exception:  # noqa: BLE001 (a failed shutdown of a finished model changes no result)
                pass
        del llm
        gc.collect()


log = logging.getLogger("quant.serve.vllm_check")
# the engine in the serving process itself: what vLLM raises while it builds the model reaches ``error`` (a separate
# engine process reports only "Engine core initialization failed")
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _serve_apart(spec_path: str, models: list[dict], jobs: int, work: str, module: str, engine_env: dict) -> dict:
    """Each model in a process of its own (``python -m module ... --only``) with ``engine_env`` and its ``env``,
    ``jobs`` at a time: engines start in parallel on one GPU (the spec's ``kv_cache_memory_bytes`` keeps each one's
    share small and fixed), and a model the runtime refuses cannot leave state behind for the next."""
    import subprocess

    pending, running, results = list(enumerate(models)), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            i, model = pending.pop(0)
            name = model["name"]
            out, err = os.path.join(work, f"{i}.json"), open(os.path.join(work, f"{i}.log"), "w")  # noqa: SIM115
            running[name] = (subprocess.Popen([sys.executable, "-m", module, spec_path, out, "--only", name],
                                              stdout=err, stderr=subprocess.STDOUT,
                                              env={**os.environ, **engine_env, **model.get("env", {})}), out, err)
        for name, (proc, out, err) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            err.close()
            with open(err.name) as f:
                tail = f.read().splitlines()[-60:]  # the engine's own last lines (its workers' errors among them)
            try:
                with open(out) as f:
                    results.update(json.load(f))
            except (OSError, ValueError):
                results[name] = {"error": f"the serving process exited {proc.returncode} without a result",
                                 "traceback": tail[-40:]}
            if "error" in results[name]:
                results[name]["log"] = tail
        time.sleep(0.2)
    return results


def main(argv: list[str], serve=serve_one, module: str = "quant.serve.vllm_check", engine_env: dict = ENGINE_ENV) -> int:
    """``SPEC.json OUT.json [--jobs N] [--only NAME]``: each model served by ``serve(model, spec)`` in a process of
    its own running ``module`` (this one for vLLM; ``sglang_check`` passes its own)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # this module is its own command line
    args = list(argv)
    opts = {}
    for flag in ("--jobs", "--only"):
        if flag in args:
            k = args.index(flag)
            opts[flag] = args[k + 1]
            del args[k:k + 2]
    spec_path, out_path = args
    with open(spec_path) as f:
        spec = json.load(f)
    if "--only" not in opts:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vllm-check-") as work:
            results = _serve_apart(spec_path, spec["models"], int(opts.get("--jobs", 1)), work, module, engine_env)
        models = spec["models"]
        for m in models:
            r = results[m["name"]]
            log.info("%s", json.dumps({"model": m["name"], **{k: r[k] for k in ("error", "quantization", "seconds")
                                                               if k in r}}))
        with open(out_path, "w") as f:
            json.dump(results, f)
        return 0
    (model,) = [m for m in spec["models"] if m["name"] == opts["--only"]]
    with open(out_path, "w") as f:
        json.dump({model["name"]: serve(model, spec)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
