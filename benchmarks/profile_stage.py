"""Profiling-stage throughput (GPU): ``profile_routing`` on the engine benchmark's random-weight model.

Builds (or reuses) the 2-layer Qwen3-30B-A3B-shaped model ``benchmarks/engine.py`` builds (``quant.models.synthetic``)
under ``--workdir``, runs the
profile stage (routing counts, routing mass, top-1, per-domain counts, down-projection maxima, the per-expert W4
sensitivity probe) twice on ``--samples × --seqlen`` random tokens, bf16 on the GPU, and prints seconds per layer and
tokens/s for each run (the first includes warm-up), then a CUDA kernel profile of a short run.
Usage (GPU): python benchmarks/profile_stage.py --samples 512 --seqlen 2048 [--shape deepseek-v3 --layers 1]

First prints the same layers' load and forward without the profile's hooks, the floor the profile is held to.
``--layer-damage N`` then runs the bounded layer-damage pass (the headline's schemes) on N of the samples and
prints where its time goes (clean walk, gradients walked back, branches, their parts):

    python benchmarks/profile_stage.py --runs 0 --no-forward-alone --no-kernel-table --layer-damage 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from quant.calibration import random_calibration as calibration
from quant.diag.calltime import CallTimes
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.models.synthetic import SHAPES, TiledSource, build_model
from quant.parallel.world import World
from quant.profile.profile import profile_routing

TIMERS = CallTimes()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/qb")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--virtual-layers", type=int, default=0,
                    help="profile N layers tiled from the --layers saved ones (engine.py's TiledSource): a deep "
                         "model's steady state, each layer read ahead during the previous one's compute")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the script on a tiny shape")
    ap.add_argument("--cold-trace", action="store_true", help="run the first profile under cProfile")
    ap.add_argument("--build-only", action="store_true",
                    help="build the model files (if missing) and stop: e.g. beside other work on the machine")
    ap.add_argument("--fingerprint", action=argparse.BooleanOptionalAction, default=True,
                    help="time the model fingerprint before the runs (a once-per-model cost, not the profile's: "
                         "SHA-256 of every shard, cached by stat); --no-fingerprint sets a placeholder instead")
    ap.add_argument("--layer-damage", type=int, default=0, metavar="N",
                    help="time the bounded layer-damage pass on N samples, phase by phase")
    ap.add_argument("--runs", type=int, default=2, help="profile runs (each a fresh Layerwise, as a stage is)")
    ap.add_argument("--forward-alone", action=argparse.BooleanOptionalAction, default=True,
                    help="first the layers' load and forward without the profile's hooks")
    ap.add_argument("--kernel-table", action=argparse.BooleanOptionalAction, default=True,
                    help="a third, short profile (64 samples) under torch.profiler, its top CUDA kernels printed")
    a = ap.parse_args()
    model_dir = Path(a.workdir) / f"model-{a.shape}-{a.layers}"
    if not (model_dir / "config.json").is_file():
        build_model(a.shape, a.layers, model_dir, seed=0)
    src = TiledSource(model_dir, a.virtual_layers) if a.virtual_layers else ModelSource(model_dir)
    if a.fingerprint:
        t0 = time.perf_counter()
        fingerprint = src.fingerprint  # once per model files (digests cached by stat): not the profile's cost
        print(f"model fingerprint {fingerprint}: {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        src.__dict__["fingerprint"] = "not-computed"  # the cached_property's slot
    if a.build_only:
        return
    import quant.io.staging
    import quant.layerwise

    TIMERS.wrap(quant.layerwise, "load_layer", "load_s")
    TIMERS.wrap(quant.layerwise.LayerReader, "take", "take_s", device_sync=False)  # read-ahead waits, layer 0's
    TIMERS.wrap(quant.io.staging, "page_locked", "pin_s", device_sync=False)  # on the read-ahead thread too
    calib = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
    lw = Layerwise(src, "bfloat16", a.device, a.batch, world=World())
    sync()
    t0 = time.perf_counter()
    hidden = lw.embed(calib.tokens)
    load = fwd = 0.0
    for idx in range(src.n_layers if a.forward_alone else 0):  # the layers without the profile's hooks
        sync()
        t1 = time.perf_counter()
        with lw.layer(idx) as layer:
            sync()
            t2 = time.perf_counter()
            hidden = lw.forward(layer, hidden, out=hidden)
            sync()
            t3 = time.perf_counter()
        load, fwd = load + t2 - t1, fwd + t3 - t2
    if a.forward_alone:
        print(f"forward alone: {time.perf_counter() - t0:.2f} s (loads {load:.2f} s, forward {fwd:.2f} s = "
              f"{calib.tokens.numel() * src.n_layers / fwd:.0f} tokens/s per layer)", flush=True)
    del hidden
    from torch.profiler import ProfilerActivity, profile

    for rep in range(a.runs):
        sync()
        TIMERS.clear()
        t0 = time.perf_counter()
        if rep == 0 and a.cold_trace:  # where the first profile's extra seconds go (Python level: I/O and waits too)
            import cProfile
            import pstats

            cold = cProfile.Profile()
            cold.enable()
            profile_routing(src, calib, Layerwise(src, "bfloat16", a.device, a.batch, world=World()))
            sync()
            cold.disable()
            pstats.Stats(cold).sort_stats("cumulative").print_stats(35)
            pstats.Stats(cold).sort_stats("tottime").print_stats(15)
        else:
            profile_routing(src, calib, Layerwise(src, "bfloat16", a.device, a.batch, world=World()))
        sync()
        s = time.perf_counter() - t0
        n_tok, load_s = calib.tokens.numel() * src.n_layers, TIMERS.get("load_s")
        print(f"profile run {rep}: {src.n_layers} layers x {a.samples}x{a.seqlen} tokens: {s:.2f} s = "
              f"{s / src.n_layers:.2f} s/layer, {n_tok / s:.0f} tokens/s per layer ({n_tok / max(s - load_s, 1e-9):.0f} "
              f"without the {load_s:.2f} s of layer loads); waits for reads {TIMERS.get('take_s'):.2f} s, "
              f"page-locking staging buffers {TIMERS.get('pin_s'):.2f} s", flush=True)
    if a.layer_damage:
        layer_damage_phases(src, calib.tokens[: a.layer_damage], a)
    if not a.kernel_table:
        return
    short = calibration(min(64, a.samples), a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        profile_routing(src, short, Layerwise(src, "bfloat16", a.device, a.batch, world=World()))
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


def layer_damage_phases(src: ModelSource, tokens: torch.Tensor, a: argparse.Namespace) -> None:
    """The bounded layer-damage pass, each phase and the calls inside it timed (device syncs around each)."""
    import quant.models.expert_compute as ec
    import quant.profile.layer_damage as ld

    phases = ("_clean_pass", "_walk_back", "_head_cotangents", "_value", "_branch_kl")
    for name in phases:
        TIMERS.wrap(ld, name, name)
    TIMERS.wrap(ec, "_fused_forward", "experts forward")  # install() binds it: wrapped before the pass starts
    TIMERS.wrap(ec.ExpertsCompute, "widen", "ExpertsCompute.widen")  # widening, and round-to-nearest at a scheme
    TIMERS.wrap(ld._BlockShortcut, "run", "_BlockShortcut.run")
    TIMERS.wrap(Layerwise, "vjp", "Layerwise.vjp")
    TIMERS.wrap(Layerwise, "forward", "Layerwise.forward")
    schemes = ("w4g128", "w4g64", "w4g32", "w8g128")
    for rep in range(2):  # the first includes warm-up
        TIMERS.clear()
        sync()
        t0 = time.perf_counter()
        lw = Layerwise(src, "float32", a.device, a.batch, world=World(), narrow_experts=True)  # as the pipeline's
        out = ld.measure_layer_damage(src, tokens, lw, schemes)  # the headline recipe's pass dtype
        sync()
        s = time.perf_counter() - t0
        parts = ", ".join(f"{k} {TIMERS.get(k):.2f}" for k in (*phases, "experts forward", "ExpertsCompute.widen",
                                                                "_BlockShortcut.run",
                                                                "Layerwise.vjp", "Layerwise.forward", "load_s"))
        print(f"layer damage run {rep}: {src.n_layers} layers x {tokens.shape[0]}x{tokens.shape[1]} tokens, "
              f"{out.layer_forwards} layer forwards: {s:.2f} s = {s / src.n_layers:.2f} s/layer; seconds: {parts}",
              flush=True)


if __name__ == "__main__":
    main()
