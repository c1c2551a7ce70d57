"""One fused MoE layer's forward as quant's vLLM plugin runs it, against the per-layer layers it competes with (GPU,
vLLM's Marlin MoE kernels; a benchmark-only path: random codes and scales, no checkpoint, no engine).

For each ``--shape`` (Qwen3-30B-A3B: hidden 2048, 128 experts, intermediate 768; DeepSeek-V3: 7168, 256, 2048; top 8)
and token count, CUDA-graph replays of:

- ``w4`` / ``w8``: every expert W4 g128 / W8 g128, one ``fused_marlin_moe`` call (what stock vLLM runs for a
  per-layer layer); ``per-layer`` = 0.8 w4 + 0.2 w8, a per-layer mix at the per-expert mix's stored bits;
- the per-expert mix (the most routed 20 % of experts W8 g128, the rest W4 g128; routing skewed so that they get
  about half of the pairs) through ``MixedExpertsMethod.apply``: ``separate`` (a call per group) and ``shared`` (one
  routing, ``quant.serve.moe_routing``), each one group after the other (``-seq``) and overlapped (``-ovl``), and
  ``mixed``: quant's mixed-scheme kernel (``quant.serve.mixed_moe``, one Triton launch per projection for both
  groups; the plugin runs it with ``QUANT_MOE_KERNEL=mixed``), and ``nibbles``: every expert in one asymmetric 4-bit
  stack, each W8 expert as two rows (``quant.serve.nibbles``), one Marlin MoE GEMM per projection
  (``QUANT_MOE_KERNEL=nibbles``); ``w4a``: every expert W4 g128 with zero points (the stack's own kernel).

``--sweep`` times the mixed kernel at every tile shape of a small grid instead, per shape and token count, prints
the fastest beside the one ``mixed_moe.CONFIGS`` picks (the table is set from it) and, with ``--tiles FILE``, writes
the first shape's fastest tiles as a table the plugin reads (``QUANT_MOE_TILES=FILE``).

Prints a JSON line per point (microseconds, median of 5 x 50 replays, with the spread) and each mixed variant's
largest difference from ``separate-seq``, then a table. The shared routing runs only where vLLM's Marlin MoE GEMM
skips blocks of expert -1 (``vllm_mixed.SHARED_ROUTING``; 0.26's does not). Run in vLLM's environment::

    PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/moe_layer.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from types import SimpleNamespace

import torch

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}


def method(schemes, H: int, N: int, E: int, routing: str, overlap: bool, dev, seed: int, kernel: str = "marlin"):
    """A ``MixedExpertsMethod`` over random codes, without a vLLM layer (its constructor needs an engine)."""
    from quant.serve.layout import expert_groups, stacked_shapes
    from quant.serve.mixed_moe import CONFIGS
    from quant.serve.vllm_mixed import (
        MarlinGroup,
        MixedExpertsMethod,
        mixed_layer,
        nibble_layer,
        to_kernel_layout,
    )

    g = torch.Generator(device=dev).manual_seed(seed)
    m = object.__new__(MixedExpertsMethod)
    m.groups = [MarlinGroup(grp, {}) for grp in expert_groups(schemes)]
    for grp in m.groups:
        for key, shape in stacked_shapes(grp.group.scheme, len(grp.group.experts), H, N).items():
            if key[1] == "weight_scale":
                grp.tensors[key] = (torch.rand(shape, generator=g, device=dev) * 2e-3 + 1e-3).to(torch.bfloat16)
            else:
                grp.tensors[key] = torch.randint(-2**31, 2**31 - 1, shape, generator=g, device=dev, dtype=torch.int32)
    m.mixed, m.nibbles, m.tiles, m.kernel = None, None, CONFIGS, kernel
    m.sizes = SimpleNamespace(hidden=H, intermediate=N)
    if kernel == "mixed":
        m.mixed = mixed_layer([grp.group for grp in m.groups], [grp.tensors for grp in m.groups], E)
    elif kernel == "nibbles":
        m.nibbles = nibble_layer(m.groups, m.sizes, E)
    else:
        for grp in m.groups:
            to_kernel_layout(grp, H, N, E)
    m.routing, m.overlap_max_tokens = routing, (None if overlap else 0)
    m.side = m.side_workspace = None
    m.finish(E)
    return m


def routing(T: int, E: int, k: int, dev, seed: int):
    """Top-k of skewed logits: expert e's weight falls as (e + 1) ** -0.8, so experts 0 .. E/5 get about half."""
    g = torch.Generator(device=dev).manual_seed(seed)
    logp = -0.8 * torch.log(torch.arange(1, E + 1, device=dev, dtype=torch.float32))
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, device=dev)))
    w, ids = (logp + gumbel).topk(k, dim=1)
    return w.softmax(dim=1).float(), ids.to(torch.int32)


def timed(fn, reps: int = 50, rounds: int = 5) -> tuple[float, float, float]:
    """Median, min and max microseconds of one call, from CUDA-graph replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from quant.scheme import Scheme

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 4096])
    ap.add_argument("--sweep", action="store_true", help="time the mixed kernel's tile shapes instead")
    ap.add_argument("--tiles", help="with --sweep: write the first shape's fastest tiles here (QUANT_MOE_TILES)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.sweep:
        return sweep(a.shapes, a.tokens, dev, a.tiles)
    rows = []
    for shape in a.shapes:
        H, N, E, k = SHAPES[shape]
        layer = SimpleNamespace(activation=MoEActivation.SILU, apply_router_weight_on_input=False,
                                global_num_experts=E)
        hot = E // 5
        mixed = [Scheme(8, 128) if e < hot else Scheme(4, 128) for e in range(E)]
        variants = {"w4": ([Scheme(4, 128)] * E, "separate", False), "w8": ([Scheme(8, 128)] * E, "separate", False),
                    "w4a": ([Scheme(4, 128, False)] * E, "separate", False),
                    "mixed": (mixed, "separate", False), "nibbles": (mixed, "separate", False)}
        from quant.serve.vllm_mixed import SHARED_ROUTING

        for r in ("separate", "shared") if SHARED_ROUTING else ("separate",):
            variants |= {f"{r}-seq": (mixed, r, False), f"{r}-ovl": (mixed, r, True)}
        methods = {name: method(s, H, N, E, r, ovl, dev, 0, name if name in ("mixed", "nibbles") else "marlin")
                   for name, (s, r, ovl) in variants.items()}
        for T in a.tokens:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            w, ids = routing(T, E, k, dev, T)
            row = {"shape": shape, "tokens": T}
            outs = {}
            for name, m in methods.items():
                outs[name] = m.apply(layer, x, w, ids, None, None)
                med, lo, hi = timed(partial(m.apply, layer, x, w, ids, None, None))
                row[name] = round(med, 1)
                row[f"{name}_spread"] = [round(lo, 1), round(hi, 1)]
            row["per-layer"] = round(0.8 * row["w4"] + 0.2 * row["w8"], 1)
            ref = outs["separate-seq"].float()
            row["max_rel_diff"] = max(float((outs[n].float() - ref).abs().max() / ref.abs().max())
                                      for n in outs if n.startswith(("shared", "separate-ovl", "mixed", "nibbles")))
            row["nibbles_rel_diff"] = float((outs["nibbles"].float() - ref).abs().max() / ref.abs().max())
            print(json.dumps(row), flush=True)
            rows.append(row)
        del methods
        torch.cuda.empty_cache()
    cols = [c for c in ("w4", "w8", "per-layer", "w4a", "separate-seq", "separate-ovl", "shared-seq", "shared-ovl",
                        "mixed", "nibbles") if c in rows[0]]
    print("\nus per layer forward (CUDA graphs, median of 5 x 50 replays); last column: best mixed / per-layer")
    print(f"{'shape':14} {'T':>5} " + " ".join(f"{c:>12}" for c in cols) + "   ratio")
    for r in rows:
        best = min(r[c] for c in cols[4:])
        print(f"{r['shape']:14} {r['tokens']:>5} " + " ".join(f"{r[c]:>12}" for c in cols)
              + f"   {r['per-layer'] / best:.2f}")


def sweep(shapes, tokens, dev, tiles: str | None = None) -> None:
    """The mixed kernel's forward at every tile shape of a grid: JSON lines, then the fastest per point."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from quant.scheme import Scheme
    from quant.serve.mixed_moe import TileConfig, mixed_moe, tile_config
    from quant.serve.vllm_mixed import align, apply_moe_activation

    act = partial(apply_moe_activation, MoEActivation.SILU)
    best = []
    for shape in shapes:
        H, N, E, k = SHAPES[shape]
        mixed = [Scheme(8, 128) if e < E // 5 else Scheme(4, 128) for e in range(E)]
        layer = method(mixed, H, N, E, "separate", False, dev, 0, "mixed").mixed
        for T in tokens:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            w, ids = routing(T, E, k, dev, T)
            ref = mixed_moe(x, w, ids, layer, align=align, act=act).float()
            picked = tile_config(T, k, E)
            results = []
            for bm in (16, 32, 64):
                if bm > 16 and T * k < E * bm / 4:
                    continue  # blocks mostly padding
                for bn, bk, warps, stages in [(n, kk, wp, st) for n in (64, 128) for kk in (64, 128)
                                              for wp in ((4,) if bm == 16 else (4, 8)) for st in (3, 4)]:
                    cfg = TileConfig(bm, bn, bk, warps, stages)
                    try:
                        out = mixed_moe(x, w, ids, layer, align=align, act=act, config=cfg)
                        err = float((out.float() - ref).abs().max() / ref.abs().max())
                        med, lo, hi = timed(partial(mixed_moe, x, w, ids, layer, align=align, act=act, config=cfg),
                                            reps=20, rounds=3)
                    except Exception as e:  # a tile the GPU cannot hold (shared memory): not a candidate
                        print(json.dumps({"shape": shape, "tokens": T, "config": cfg.__dict__, "error": str(e)[:80]}))
                        continue
                    results.append((med, cfg, err))
                    print(json.dumps({"shape": shape, "tokens": T, "config": cfg.__dict__, "us": round(med, 1),
                                      "spread": [round(lo, 1), round(hi, 1)], "max_rel_diff": err}), flush=True)
            fastest = min(results, key=lambda r: r[0])
            at_pick = next((r[0] for r in results if r[1] == picked), None)
            best.append((shape, T, fastest, picked, at_pick))
        torch.cuda.empty_cache()
        if tiles and shape == shapes[0]:
            write_tiles(tiles, [(T * k / E, cfg) for _, T, (_, cfg, _), _, _ in best])
    print("\nfastest tile per point (us) beside the table's pick")
    for shape, T, (med, cfg, err), picked, at_pick in best:
        print(f"{shape:14} {T:>5}  {med:8.1f}  {cfg} (max rel diff {err:.1e})  pick {picked} {at_pick}")


def write_tiles(path: str, points) -> None:
    """A tile table (``mixed_moe.read_configs``) from (pairs per expert, fastest tile) points: each tile up to the
    geometric middle between its point and the next."""
    table = [[(p * q) ** 0.5 if q else 1e9, [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages]]
             for (p, c), (q, _) in zip(points, [*points[1:], (0, None)], strict=True)]
    with open(path, "w") as f:
        json.dump(table, f)
    print(json.dumps({"tiles": path, "table": table}), flush=True)


if __name__ == "__main__":
    main()
