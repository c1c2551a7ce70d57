"""Eval benchmark (GPU): streamed vs whole-model proxies on one checkpoint, and lm-eval's hf backend over GPUs.

Builds a random-weight model with Qwen3-30B-A3B layer shapes (``quant.models.synthetic``), plans the headline mix
(top 20% experts per layer 8-bit, the rest 4-bit, per expert: transformers cannot load it directly), quantizes it
with RTN and exports compressed-tensors. Then, each in a fresh subprocess on its own GPU, on the same random tokens:
  - whole: compressed-tensors' dequantizer writes a dense copy, each model is loaded whole in turn
    (``quant.eval.evaluate.whole_proxies``, the small-model path);
  - streamed: both models layer by layer, the checkpoint dequantized per layer (``quant.eval.stream``);
wall time, peak GPU memory (``max_memory_allocated``) and peak host RSS of each, and the relative difference of
the proxies. ``--lm-eval-gpus 2`` then scores ``quant_mmlu`` (``--lm-eval-limit`` questions) on
``builtin:reference-moe`` with lm-eval's hf backend on one GPU and dispatched over two (accelerate device map).
Prints JSON lines and, last, a table. Usage (GPU):
  python benchmarks/eval_stream.py --layers 4 --samples 16 --seqlen 1024 --lm-eval-gpus 2 --out eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from quant.calibration import random_calibration as calibration
from quant.layerwise import Layerwise
from quant.models import ModelSource, synthetic
from quant.models.synthetic import build_model
from quant.parallel.world import World

DTYPE = "bfloat16"
MODES = ("whole", "streamed")
# the package's shapes and a 12-layer-class MoE small enough for a CPU run (1.4 GB at 12 layers): peak RSS against
# the number of layers
SHAPES = {**synthetic.SHAPES, "moe-mid": dict(
    model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
    num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4,
    norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)}


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def prepare(work: Path, shape: str, n_layers: int, samples: int, seqlen: int, batch: int) -> dict:
    """Model, headline plan, RTN quantization, compressed-tensors checkpoint and eval tokens under ``work``."""
    from safetensors.torch import save_file

    from quant.export.compressed_tensors import write_compressed_tensors
    from quant.plan.bitplan import plan_bits
    from quant.profile.profile import profile_routing
    from quant.quantize.driver import quantize_model
    from quant.recipe import PlanSpec, QuantizeSpec

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    build_model(SHAPES[shape], n_layers, work / "model", seed=0)
    src = ModelSource(work / "model")
    calib = calibration(16, 256, SHAPES[shape]["vocab_size"], seed=0)
    t1 = time.perf_counter()
    plan = plan_bits(profile_routing(src, calib, Layerwise(src, DTYPE, dev, batch, World())), src.modules, PlanSpec(),
                     src.n_layers)
    plan.save(work / "plan.json")
    quantize_model(src, calib, plan.quantized_schemes(), "rtn", QuantizeSpec(device=dev, batch_size=batch),
                   Layerwise(src, DTYPE, dev, batch, World()),
                   work / "quantized")
    t2 = time.perf_counter()
    write_compressed_tensors(src, plan, work / "quantized", work / "checkpoint", 5 << 30, World())
    tokens = calibration(samples, seqlen, SHAPES[shape]["vocab_size"], seed=1).tokens
    save_file({"tokens": tokens}, str(work / "tokens.safetensors"))
    return {"build_s": t1 - t0, "quantize_s": t2 - t1, "export_s": time.perf_counter() - t2,
            "model_gb": sum(p.stat().st_size for p in (work / "model").glob("*.safetensors")) / 1e9,
            "checkpoint_gb": sum(p.stat().st_size for p in (work / "checkpoint").glob("*.safetensors")) / 1e9}


class PeakAnon(threading.Thread):
    """Samples this process's anonymous resident memory (``RssAnon``: heap, not the page cache that mmapped
    safetensors files add to RSS) every 10 ms; ``peak_bytes`` is the largest seen."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_bytes, self.stop = 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            try:
                with open("/proc/self/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
            except (OSError, StopIteration):
                return
            self.peak_bytes = max(self.peak_bytes, kb * 1024)


def measure(work: Path, mode: str, batch: int) -> dict:
    """One eval path, in this (fresh) process: proxies, wall time, peak GPU memory, peak RSS."""
    from safetensors.torch import load_file

    from quant.eval.evaluate import servable_checkpoint, whole_proxies
    from quant.eval.stream import ShippedCheckpoint, streamed_proxies
    from quant.models.layers import DTYPES
    from quant.plan.bitplan import BitPlan

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src, plan = ModelSource(work / "model"), BitPlan.load(work / "plan.json")
    tokens = load_file(str(work / "tokens.safetensors"))["tokens"]
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampler = PeakAnon()
    sampler.start()
    t0 = time.perf_counter()
    if mode == "streamed":
        shipped = ShippedCheckpoint(work / "checkpoint", src, DTYPES[DTYPE])
        proxies, loader = streamed_proxies(src, shipped, tokens, DTYPE, dev, batch, World()), \
            "compressed-tensors-per-layer"
    else:
        with servable_checkpoint(work / "checkpoint", plan, src) as (path, loader):
            proxies = whole_proxies(src.path, path, tokens, DTYPES[DTYPE], dev, batch, False, World())
    if dev == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    return {"mode": mode, "loader": loader, "wall_s": wall, "proxies": proxies,
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else float("nan"),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "peak_anon_gb": sampler.peak_bytes / 1e9}


def lm_eval_dispatch(gpus: int, limit: int, batch: int) -> dict:
    """quant_mmlu on builtin:reference-moe with the hf backend on ``gpus`` GPUs."""
    from quant.eval.lmeval import dispatch_map, run_lm_eval
    from quant.models.builtin import builtin_path

    path = builtin_path("reference-moe")
    device_map = {} if gpus == 1 else dict(dispatch_map(path, gpus, dtype=DTYPE))
    if torch.cuda.is_available():
        torch.cuda.init()  # resetting peak statistics needs an initialized context
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    score = run_lm_eval(path, ["quant_mmlu"], limit=limit, batch_size=batch, device=dev, dtype=DTYPE,
                        gpus=gpus, seed=1234)["quant_mmlu"]
    return {"gpus": gpus, "acc": score.value, "n": score.n, "wall_s": time.perf_counter() - t0,
            "peak_gpu_gb": [torch.cuda.max_memory_allocated(i) / 1e9 for i in range(torch.cuda.device_count())],
            "device_map": device_map}


def _subprocess(args: list[str], gpus: str | None) -> subprocess.Popen:
    """This script in a fresh process (``gpus``: its CUDA_VISIBLE_DEVICES), output captured."""
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _last_json(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {out[-3000:]}"}
    return json.loads(out.strip().splitlines()[-1])


def _rel(a: dict, b: dict) -> float:
    pairs = [(a["perplexity"][k], b["perplexity"][k]) for k in ("base", "quantized")]
    pairs += [(a["kl"]["quantized"], b["kl"]["quantized"]), (a["top1_agreement"]["quantized"], b["top1_agreement"]["quantized"])]
    return max(abs(x - y) / abs(x) for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lm-eval-gpus", type=int, default=0)
    ap.add_argument("--lm-eval-limit", type=int, default=40)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--measure", choices=("whole", "streamed"), help=argparse.SUPPRESS)
    ap.add_argument("--lm-eval-only", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="quant-evalbench-"))
    if a.measure:
        return say(**measure(work, a.measure, a.batch))
    if a.lm_eval_only:
        return say(**lm_eval_dispatch(a.lm_eval_only, a.lm_eval_limit, a.batch))
    say(torch=torch.__version__, gpus=torch.cuda.device_count(), args=vars(a))
    say(step="prepare", **prepare(work, a.shape, a.layers, a.samples, a.seqlen, a.batch))
    cmd = lambda m: ["--workdir", str(work), "--measure", m, "--batch", str(a.batch)]  # noqa: E731
    two = torch.cuda.device_count() >= 2
    # side by side: each eval path on its own GPU, the lm-eval runs (a 0.2 GB model) beside them
    if two:
        procs = {m: _subprocess(cmd(m), str(gpu)) for gpu, m in enumerate(MODES)}
    else:  # one at a time
        procs = {m: _last_json(_subprocess(cmd(m), None)) for m in MODES}
    lm_procs = [_subprocess(["--lm-eval-only", str(g), "--lm-eval-limit", str(a.lm_eval_limit)],
                            "0" if g == 1 else None) for g in sorted({1, a.lm_eval_gpus}) if a.lm_eval_gpus]
    rows = {m: p if isinstance(p, dict) else _last_json(p) for m, p in procs.items()}
    lm = [_last_json(p) for p in lm_procs]
    for r in [*rows.values(), *lm]:
        say(**r)
    if any("error" in r for r in [*rows.values(), *lm]):
        raise SystemExit("a measurement failed (see its error above)")
    rel = _rel(rows["whole"]["proxies"], rows["streamed"]["proxies"])
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "eval": rows, "max_rel_diff": rel, "lm_eval": lm}, indent=1))
    print(f"\n{'path':10} {'wall s':>7} {'peak GPU GB':>12} {'peak RSS GB':>12} {'anon GB':>8} {'ppl base':>9} "
          f"{'ppl quant':>10} {'KL':>10} {'top-1':>7}")
    for r in rows.values():
        p = r["proxies"]
        print(f"{r['mode']:10} {r['wall_s']:7.1f} {r['peak_gpu_gb']:12.2f} {r['peak_rss_gb']:12.2f} {r['peak_anon_gb']:8.2f} "
              f"{p['perplexity']['base']:9.3f} {p['perplexity']['quantized']:10.3f} {p['kl']['quantized']:10.3e} "
              f"{p['top1_agreement']['quantized']:7.4f}")
    print(f"max relative difference of the proxies, streamed vs whole: {rel:.2e}")
    for r in lm:
        print(f"lm-eval hf quant_mmlu on {r['gpus']} GPU(s): acc {r['acc']:.4f} (n={r['n']}), {r['wall_s']:.1f} s, "
              f"peak GB per GPU {[round(x, 2) for x in r['peak_gpu_gb']]}")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
