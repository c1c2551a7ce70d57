"""Throughputs of one H200 that ``quant estimate`` turns work into time with, each taken from a measurement.

Each number is a measured time divided by the work quant/forecast/estimate.py counts for that measurement; the comment
above it names the record in the repository's ``benchmarks/records/`` that holds the measurement and, under ``rates``,
this number (``tests/forecast/test_throughputs.py`` checks that they agree), so a new measurement updates its record
and one line here. The package never reads those files: they stay with the repository. The solves' time models
(GPTQ's column loop, AWQ's search) live here too, next to the rates they use.

What a record measured and what the current engine does can differ: the engine records of 2026-11-30 at defaults
ran GPTQ's column loop as CUDA graphs (launch bound, time follows columns); the engine now runs it as one fused Triton
kernel per column block (bound by fp32 arithmetic). Forecasts use the current kernel (``"fused"``); tests
reproduce the older records with the kernel they measured (``"cuda-graph"``).
"""

THROUGHPUTS = {
    # 2026-11-30-qwen3-30b-a3b-engine-at-defaults.json: 3.47 s/layer minus statistics, solve and propagation leaves
    # 0.63 s to load a 1.25 GB layer; the DeepSeek-V3-shaped layer at defaults the same day: 13.5 s left for 23 GB
    "load_bytes_per_s": 2.0e9,
    # 2026-11-30-qwen3-30b-a3b-engine-at-defaults.json: propagate 0.36 s for 524 k tokens x 56.6 M active parameters
    # (0.71 s at 1 M tokens, full depth)
    "forward_param_tokens_per_s": 8.2e13,
    # 2026-11-30-qwen3-30b-a3b-engine-at-defaults.json: statistics 0.85 s/layer (Qwen3, 524 k tokens) and 1.98 s
    # (the DeepSeek-V3 layer at defaults, 65 k tokens, 4 expert chunks): routed Hessian products + linear Hessians + one
    # forward per pass; geometric mean of the two ratios
    "stats_macs_per_s": 8.5e13,
    # 2026-11-30-gptq-solve-sub-batches.json (fused column loop and GEMM-based inverse factor): the fused solves of its
    # four sub-batches (0.085, 0.058, 0.042, 0.038 s) against their fp32 work, per element 4/3·I³ (inverse factor) +
    # O·I² (lazy updates); least squares for a rate and a fixed cost per sub-batch (cuSOLVER leaf blocks, grids,
    # launches), every row within 20 %. The rate is the ~45 TFLOP/s that record's kernel profile saw the fp32 products
    # reach.
    "gptq_solve_flop_per_s": 4.0e13,
    "gptq_seconds_per_sub_batch": 0.032,
    # 2026-11-30-deepseek-v3-layer-gptq-at-defaults.json: the CUDA-graph column loop of the 2026-11-30 records at
    # defaults (solve 60.9 s for DeepSeek-V3's 695 k columns over all sub-batches, 1.63 s for Qwen3's 15 k): launch
    # bound, so time follows columns, not flops
    "gptq_graph_seconds_per_column": 0.97e-4,
    # 2026-12-01-qwen3-30b-a3b-awq-fused-deltas.json (cf32a38): Qwen3-30B-A3B's warm layer searched in 1.07 s (fused
    # trial deltas, split bf16 products) for 4.3e13 flop of trial errors and Cholesky rows (awq_search_flops: experts'
    # gate/up and down, q/k/v). One rate over-estimates large experts: DeepSeek-V3's layer took 30.8 s before the
    # fused deltas (2.7e15 flop: 67 s at this rate), where its products, not its elementwise passes, dominate
    "awq_search_flop_per_s": 4.0e13,
    # 2026-11-30-qwen3-30b-a3b-profile-stage.json: profile 1.76 s/layer at 1.05 M tokens, of which 0.63 s loading
    "profile_param_tokens_per_s": 5.3e13,
    # 2026-12-03-deepseek-v3-headline-12-layers.json: walks over the layers that read each one while the one before it
    # computes (the profile stage and the layer-damage pass), from the page cache: a layer takes the longer of its
    # read and its compute, plus a fixed cost. On 12 tiled DeepSeek-V3 layers the profile's walk took 1.2 s a layer
    # (0.72 s of forwards at the profile's rate) and the pass's clean walk 1.5 s (1.23 s of fp32 forwards): reads of
    # 23 GB in about 1.1 s; Qwen3-30B-A3B's clean walk (48 layers, the same day), 0.27 s a layer for 0.12 s of
    # forwards, leaves the fixed 0.15 s
    "layer_read_bytes_per_s": 20.0e9,
    "walk_seconds_per_layer": 0.15,
    # 2026-12-03-deepseek-v3-headline-12-layers.json: the layer-damage pass in fp32, bf16 experts widened as they run:
    # its walk back on 12 tiled DeepSeek-V3 layers (11.9 s a layer, 1.71e13 param-tokens/s) and on 48 tiled
    # Qwen3-30B-A3B layers the same day (1.46 s a layer, 1.38e13): their geometric mean
    "damage_param_tokens_per_s": 1.55e13,
    # 2026-11-30-qwen3-30b-a3b-48-layers-full-depth.json: export wrote 17 GB in 50.3 s
    "export_bytes_per_s": 0.34e9,
    # 2026-11-30-qwen3-30b-a3b-first-engine.json (be973b3): RTN solve 0.06 s/layer for a 1.25 GB layer
    "rtn_bytes_per_s": 2.1e10,
}

SOLVE_KERNELS = ("fused", "cuda-graph")  # GPTQ column loops: the engine's, and the one older records measured


def gptq_solve_seconds(problems: list[tuple[int, int, int]], kernel: str = "fused") -> float:
    """GPTQ solves of sub-batches ``(elements, out_features, in_features)``. The fused loop: fp32 work
    ``4/3·I³ + O·I²`` per element at ``gptq_solve_flop_per_s`` plus a fixed cost per sub-batch; the CUDA-graph
    loop: one launch-bound step per input column per sub-batch."""
    assert kernel in SOLVE_KERNELS, kernel
    t = THROUGHPUTS
    if kernel == "cuda-graph":
        return sum(in_f for _, _, in_f in problems) * t["gptq_graph_seconds_per_column"]
    flops = sum(n * (4 / 3 * in_f**3 + out_f * in_f**2) for n, out_f, in_f in problems)
    return flops / t["gptq_solve_flop_per_s"] + len(problems) * t["gptq_seconds_per_sub_batch"]


def awq_search_flops(problems: list[tuple[int, int, int]], n_grid: int) -> float:
    """AWQ's search of elements ``(elements, out_features, in_features)``: Cholesky rows ``Lᵀ [I, I]`` (2/3·I³),
    the reference ``x Wᵀ`` and one trial product per grid point (2·O·I² each)."""
    return sum(n * (2 / 3 * in_f**3 + (n_grid + 1) * 2 * out_f * in_f**2) for n, out_f, in_f in problems)


def awq_search_seconds(problems: list[tuple[int, int, int]], n_grid: int) -> float:
    return awq_search_flops(problems, n_grid) / THROUGHPUTS["awq_search_flop_per_s"]
