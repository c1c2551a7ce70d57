"""Profiling-stage throughput (GPU): ``profile_routing`` on the engine benchmark's random-weight model.

Builds (or reuses) the 2-layer Qwen3-30B-A3B-shaped model of ``benchmarks/engine.py`` under ``--workdir``, runs the
profile stage (routing counts, routing mass, top-1, per-domain counts, down-projection maxima, the per-expert W4
sensitivity probe) twice on ``--samples × --seqlen`` random tokens, bf16 on the GPU, and prints seconds per layer and
tokens/s for each run (the first includes warm-up), then a CUDA kernel profile of a short run.
Usage (GPU): python benchmarks/profile_stage.py --samples 512 --seqlen 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import build_model, calibration  # noqa: E402

from quant.layerwise import Layerwise  # noqa: E402
from quant.models import ModelSource  # noqa: E402
from quant.profile import profile_routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/qb")
    a = ap.parse_args()
    model_dir = Path(a.workdir) / "model-qwen3-30b-a3b-2"
    if not (model_dir / "config.json").is_file():
        build_model("qwen3-30b-a3b", 2, model_dir, seed=0)
    src = ModelSource(model_dir)
    calib = calibration(a.samples, a.seqlen, 32000, seed=0)
    for rep in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        profile_routing(src, calib, Layerwise(src, "bfloat16", "cuda", a.batch))
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        print(f"profile run {rep}: {src.n_layers} layers x {a.samples}x{a.seqlen} tokens: {s:.2f} s = "
              f"{s / src.n_layers:.2f} s/layer, {calib.tokens.numel() / s:.0f} tokens/s", flush=True)
    from torch.profiler import ProfilerActivity, profile

    short = calibration(64, a.seqlen, 32000, seed=0)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        profile_routing(src, short, Layerwise(src, "bfloat16", "cuda", a.batch))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()
