"""Engine benchmark (GPU): quant's layer-wise engine vs llm-compressor on MoE layers with real shapes.

Builds a random-weight model with Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top-8, expert
intermediate 768), DeepSeek-V3 layer shapes (hidden 7168, 256 routed experts + 1 shared, expert
intermediate 2048, top-8, MLA) or Mixtral-8x7B layer shapes (hidden 4096, 8 experts, top-2, intermediate 14336),
saves it as a real safetensors checkpoint, and on the same random calibration
tokens runs, in one process:
  - quant: profile (tokens/s), then quantize (rtn / gptq / awq) layer by layer; seconds per layer split into
    statistics passes, solve and propagation; peak GPU memory; export to compressed-tensors;
  - llm-compressor (oneshot, sequential pipeline; GPTQModifier W4A16 or AWQModifier + W4A16_ASYM), same tokens;
  - the mean relative layer-output error of both checkpoints: every decoder layer of the dequantized checkpoint
    and of the base model get the same (base) input hidden states; error = ||Y_q - Y|| / ||Y - X|| (the
    residual branch's output), averaged over layers.
Prints JSON lines and, last, a table. Usage (GPU):
  python benchmarks/engine.py --shape qwen3-30b-a3b --layers 2 --samples 256 --seqlen 2048 --algos rtn,gptq \\
      --llmcompressor gptq --out results.json
``--virtual-layers N`` tiles the saved layers to an N-layer model (layer i reads the tensors of saved layer
i mod K through the normal safetensors path) to time a full-depth run without N layers on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from quant.calibration import CalibrationSet
from quant.calibration import random_calibration as calibration
from quant.diag.calltime import CallTimes
from quant.diag.memtrace import CudaTrace
from quant.eval.layer_error import checkpoint_layer_errors
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.synthetic import SHAPES, TiledSource, build_model
from quant.parallel.world import World
from quant.plan.bitplan import plan_bits
from quant.profile.profile import profile_routing
from quant.quantize.driver import quantize_model
from quant.recipe import PlanSpec, QuantizeSpec

TIMERS = CallTimes()  # seconds spent in the wrapped functions (layer loads, layer writes)


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_quant(src: ModelSource, calib: CalibrationSet, algo: str, work: Path, batch: int, quant_all: bool,
              solve_budget_gb: float | None = None, export: bool = True, memory_trace: bool = False,
              tag: str = "") -> dict:
    """Profile + quantize with quant's engine; export compressed-tensors; timings per layer and end to end
    (``tag``: names this run's store and checkpoint folders and its row)."""
    from quant.export.compressed_tensors import write_compressed_tensors

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    reset_peak()
    TIMERS.clear()
    sync()
    t0 = time.perf_counter()
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", dev, batch, world=World()))
    sync()
    prof_s = time.perf_counter() - t0
    prof_load_s, prof_peak = TIMERS.get("load_s"), peak_gb()
    sym = algo != "awq"
    spec = PlanSpec(policy="uniform", low_bits=4, high_bits=4, group_size=128, symmetric=sym,
                    protect={"attention": 4 if quant_all else "keep", "shared_experts": 4, "dense_mlp": 4})
    plan = plan_bits(prof, src.modules, spec, src.n_layers)
    budget = {} if solve_budget_gb is None else {"solve_budget_gb": solve_budget_gb}
    qspec = QuantizeSpec(algorithm=algo, device=dev, batch_size=batch, **budget)
    qdir = work / f"q-{algo}{tag}"
    shutil.rmtree(qdir, ignore_errors=True)
    reset_peak()
    TIMERS.clear()
    sync()
    t0 = time.perf_counter()
    with CudaTrace() if memory_trace else contextlib.nullcontext() as trace:
        reports = quantize_model(src, calib, plan.quantized_schemes(), algo, qspec,
                                 Layerwise(src, "bfloat16", dev, batch, world=World()), qdir)
    sync()
    total = time.perf_counter() - t0
    if trace is not None and trace.peak is not None:
        print(f"{algo}: live at the quantize peak (GB, by the quant line that allocated it):\n{trace.peak.table(15)}")
    peak = peak_gb()
    n_tok = calib.tokens.numel() * len(reports)  # profile throughput per layer: tokens x layers / s
    out = {"algo": algo + tag, "store": str(qdir), "profile_s": prof_s, "profile_tokens_per_s": n_tok / prof_s, "profile_load_s": prof_load_s,
           "profile_tokens_per_s_excl_load": n_tok / max(prof_s - prof_load_s, 1e-9), "profile_peak_gpu_gb": prof_peak,
           "load_s_per_layer": TIMERS.get("load_s") / len(reports),
           "write_s_per_layer": TIMERS.get("write_s") / len(reports), "quantize_s": total, "layers": len(reports),
           "s_per_layer": total / len(reports),
           "stats_s_per_layer": sum(r.stats_seconds for r in reports) / len(reports),
           "solve_s_per_layer": sum(r.solve_seconds for r in reports) / len(reports),
           "forward_s_per_layer": sum(r.forward_seconds for r in reports) / len(reports),
           "peak_gpu_gb": peak, "repairs": sum(len(r.repairs) for r in reports),
           # per layer: the first includes one-time costs of the process (Triton's JIT on a cold cache, CUDA graphs)
           "layer_seconds": [round(r.seconds, 3) for r in reports],
           "layer_solve_seconds": [round(r.solve_seconds, 3) for r in reports],
           # the layers after the first: what each further layer of a deep model costs
           "warm_s_per_layer": (sum(r.seconds for r in reports[1:]) / (len(reports) - 1) if len(reports) > 1
                                else float("nan"))}
    if not export:
        return out
    t0 = time.perf_counter()
    ckpt = write_compressed_tensors(src, plan, qdir, work / f"ckpt-{algo}{tag}", 20 << 30, World())
    out["export_s"] = time.perf_counter() - t0
    out["end_to_end_s"] = prof_s + total + out["export_s"]
    if not isinstance(src, TiledSource):  # the layer-error check reads the base model's real layers
        out["checkpoint"] = str(ckpt)
    return out


def fp8_release(model_dir: Path) -> ModelSource:
    """The model's FP8 release with 128 x 128 block scales (written once beside it, blocks scaled on the GPU), opened
    as quant opens one: read dequantized."""
    from quant.io.staging import Staging, pin_budget
    from quant.models import resolve_model
    from quant.models.fp8 import Fp8BlockSource, write_fp8_release

    out = model_dir.with_name(model_dir.name + "-fp8")
    if not (out / "config.json").is_file():
        t0 = time.perf_counter()
        write_fp8_release(ModelSource(model_dir), out, device="cuda" if torch.cuda.is_available() else "cpu")
        say(step="fp8 release", s=round(time.perf_counter() - t0, 1))
    src = resolve_model(str(out))
    assert isinstance(src, Fp8BlockSource) and src.parts
    keys = sorted(src.layer_keys(0))
    times, staging = {}, Staging(pin_budget(1)) if torch.cuda.is_available() else None
    for name, source in (("bf16", ModelSource(model_dir)), ("fp8", src), ("fp8 again", src)):
        t0 = time.perf_counter()  # as the read-ahead reads, into one staging buffer (FP8: dequantized on the GPU)
        here = source.read_tensors(keys, "cpu", into=staging.into(0) if staging else None)
        sync()
        times[name] = round(time.perf_counter() - t0, 2)
    few = [k for k in keys if ".experts.0." in k or ".self_attn." in k]  # a CPU dequantization of the whole layer
    on_cpu = Fp8BlockSource(out, device="cpu").read_tensors(few)  # would hold 23 GB more of host memory
    say(layer0_read_s=times, fp8_dequantized_on=str(src.work_device()),
        fp8_equal_to_cpu_dequantization=all(torch.equal(here[k], on_cpu[k]) for k in few))
    del here, staging
    return src


def run_llmcompressor(model_dir: Path, calib: CalibrationSet, algo: str, work: Path) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ids = calib.tokens
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    ignore = ["lm_head", "re:.*mlp.gate$"]
    if algo == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=ignore)]
    else:
        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)
    out_dir = work / f"llmc-{algo}"
    shutil.rmtree(out_dir, ignore_errors=True)
    reset_peak()
    t0 = time.perf_counter()
    oneshot(model=str(model_dir), dataset=ds, recipe=recipe, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0], pipeline="sequential", output_dir=str(out_dir))
    sync()
    total = time.perf_counter() - t0
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return {"algo": f"llmcompressor-{algo}", "quantize_s": total, "layers": n_layers, "s_per_layer": total / n_layers,
            "peak_gpu_gb": peak_gb(), "checkpoint": str(out_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--virtual-layers", type=int, default=0)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--algos", default="rtn,gptq")
    ap.add_argument("--llmcompressor", default="", help="comma list: gptq,awq")
    ap.add_argument("--error-samples", type=int, default=16)
    ap.add_argument("--keep-attention", action="store_true", help="quantize experts only")
    ap.add_argument("--solve-budget-gb", type=float, default=None, help="default: quantize.solve_budget_gb's")
    ap.add_argument("--no-export", action="store_true", help="time profile + quantize only")
    ap.add_argument("--memory-trace", action="store_true", help="what quantize held at its peak (CUDA)")
    ap.add_argument("--fp8", action="store_true", help="also quantize the model's FP8 block-scaled release (read "
                    "dequantized, quant.models.fp8): its load and layer times beside the bf16 model's")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import quant.layerwise
    import quant.quantize.qstore

    TIMERS.wrap(quant.layerwise, "load_layer", "load_s")
    # layer files are written by qstore.LayerWriter on a background thread (codes already on the host): write_s is
    # that thread's time, overlapped with the next layer's compute
    TIMERS.wrap(quant.quantize.qstore, "write_layer", "write_s", device_sync=False)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="quant-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    say(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        args=vars(a))
    model_dir = work / f"model-{a.shape}-{a.layers}"
    t0 = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        build_model(a.shape, a.layers, model_dir, seed=0)
    say(step="build", s=round(time.perf_counter() - t0, 1))
    src = TiledSource(model_dir, a.virtual_layers) if a.virtual_layers else ModelSource(model_dir)
    calib = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
    rows = []
    sources = [("", src)]
    if a.fp8:
        if a.virtual_layers:
            ap.error("--fp8 reads the saved layers (no --virtual-layers)")
        sources.append((" fp8", fp8_release(model_dir)))
    for algo in [x for x in a.algos.split(",") if x]:
        for tag, source in sources:
            r = run_quant(source, calib, algo, work, a.batch, quant_all=not a.keep_attention,
                          solve_budget_gb=a.solve_budget_gb, export=not a.no_export, memory_trace=a.memory_trace,
                          tag=tag)
            say(**r)
            rows.append(r)
    for algo in [x for x in a.llmcompressor.split(",") if x]:
        r = run_llmcompressor(model_dir, calib, algo, work)
        say(**r)
        rows.append(r)
    err_tokens = calib.tokens[: a.error_samples]
    for r in rows if a.error_samples else []:
        if "checkpoint" in r:
            r["rel_layer_error"] = checkpoint_layer_errors(src, Path(r["checkpoint"]), work, err_tokens, a.batch,
                                                           "cuda" if torch.cuda.is_available() else "cpu")
            r["mean_rel_layer_error"] = sum(r["rel_layer_error"]) / len(r["rel_layer_error"])
            say(algo=r["algo"], rel_layer_error=r["rel_layer_error"])
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    nan = float("nan")
    print(f"\n{'engine':24} {'s/layer':>8} {'warm':>7} {'stats':>7} {'solve':>7} {'fwd':>7} {'load':>7} {'write':>7} {'peak GB':>8} "
          f"{'rel err':>8}")
    for r in rows:
        print(f"{r['algo']:24} {r['s_per_layer']:8.2f} {r.get('warm_s_per_layer', nan):7.2f} "
              f"{r.get('stats_s_per_layer', nan):7.2f} "
              f"{r.get('solve_s_per_layer', nan):7.2f} {r.get('forward_s_per_layer', nan):7.2f} "
              f"{r.get('load_s_per_layer', nan):7.2f} {r.get('write_s_per_layer', nan):7.2f} "
              f"{r['peak_gpu_gb']:8.1f} {r.get('mean_rel_layer_error', nan):8.4f}")
    if "profile_tokens_per_s" in (rows[0] if rows else {}):
        r = rows[0]
        print(f"profile throughput (first run, warm-up included): {r['profile_tokens_per_s']:.0f} tokens/s per layer "
              f"({a.samples}x{a.seqlen} tokens; {r['profile_tokens_per_s_excl_load']:.0f} without the {r['profile_load_s']:.1f} s of layer "
              f"loads), peak GPU {r['profile_peak_gpu_gb']:.1f} GB")
    for r in rows:
        if "end_to_end_s" in r:
            print(f"{r['algo']} end to end, {r['layers']} layers: profile {r['profile_s']:.1f} s + quantize "
                  f"{r['quantize_s']:.1f} s + export {r['export_s']:.1f} s = {r['end_to_end_s']:.1f} s")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
