"""Serve model folders with SGLang and record what it predicts: ``python -m quant.serve.sglang_check SPEC.json
OUT.json``, the same spec and results as ``quant.serve.vllm_check`` (``top1``, ``greedy``, ``quantization``,
``seconds`` or ``error``), from SGLang's offline engine (``sglang.Engine``).

Runs in SGLang's own environment (it pins its own compressed-tensors and transformers): it imports SGLang, torch and
the standard library only. Each model is served by a process of its own, one at a time by default (SGLang sizes its
memory pool as a fraction of the GPU, ``spec["mem_fraction_static"]``), with the tokenizer skipped (token ids in
and out), CUDA graphs off, Triton attention and the PyTorch sampler: nothing that compiles C++ at run time, so a host
without a compiler or network serves as well. The engine's own log lines (its scheduler's errors among them) go to
the serving process's output, whose last lines a failed model's result keeps as ``log``.
"""

from __future__ import annotations

import sys
import time

from quant.serve.vllm_check import failure, main

# what every serving process runs with: no network (the model folder has all it needs)
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _top1(input_top_logprobs: list) -> list[int]:
    """The most likely token at every prompt position after the first (``(logprob, id, text)`` lists; None at
    position 0, which has no prediction)."""
    return [int(max(pos, key=lambda t: t[0])[1]) for pos in input_top_logprobs[1:]]


def serve_one(model: dict, spec: dict) -> dict:
    t0 = time.perf_counter()
    engine = None
    try:
        import sglang

        engine = sglang.Engine(
            model_path=model["path"], skip_tokenizer_init=True, dtype="bfloat16", random_seed=0,
            context_length=spec.get("max_model_len", 512), mem_fraction_static=spec.get("mem_fraction_static", 0.3),
            tp_size=model.get("tensor_parallel_size", 1), disable_cuda_graph=True, disable_radix_cache=True,
            attention_backend="triton", sampling_backend="pytorch", log_level="warning",
            **model.get("engine_args", {}))
        prompts = spec["prompts"]
        scored = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1},
                                 return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        greedy = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": spec.get("greedy_tokens", 32), "ignore_eos": True})
        # the method SGLang resolved from the checkpoint's config (the tokenizer manager's model config)
        quant = getattr(getattr(engine.tokenizer_manager, "model_config", None), "quantization", None)
        return {"top1": [_top1(r["meta_info"]["input_top_logprobs"]) for r in scored],
                "greedy": [list(r["output_ids"]) for r in greedy],
                "quantization": quant, "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as e:  # a refusal is a result: the caller checks it was the expected one
        return failure(e, t0)
    finally:
        if engine is not None:
            try:
                engine.shutdown()  # the scheduler's process and its GPU memory go before this one ends
            except Exception:  # noqa: BLE001 (a failed shutdown of a finished model changes no result)
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], serve=serve_one, module="quant.serve.sglang_check", engine_env=ENGINE_ENV))
