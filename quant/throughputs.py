"""Throughputs of one H200 that ``quant estimate`` turns work into time with (BENCHMARKS.md, 2026-11-30).

Each number is a measured time divided by the work quant/estimate.py counts for that record; the comment names
the BENCHMARKS.md section and row, so a new measurement updates one line here.
"""

THROUGHPUTS = {
    # "Engine vs llm-compressor, Qwen3-30B-A3B shapes" second session: 3.47 s/layer minus statistics, solve and
    # propagation leaves 0.63 s to load a 1.25 GB layer; "DeepSeek-V3-shaped layer": 13.5 s left for 23 GB
    "load_bytes_per_s": 2.0e9,
    # same Qwen3 row: propagate 0.36 s for 524 k tokens x 56.6 M active parameters (0.71 s at 1 M tokens, full depth)
    "forward_param_tokens_per_s": 8.2e13,
    # statistics 0.85 s/layer (Qwen3, 524 k tokens) and 1.98 s (DeepSeek-V3, 65 k tokens, 4 expert chunks): routed
    # Hessian products + linear Hessians + one forward per pass; geometric mean of the two ratios
    "stats_macs_per_s": 8.5e13,
    # solve 1.63 s (Qwen3: 15 k GPTQ columns over all sub-batches) and 60.9 s (DeepSeek-V3: 695 k columns); the
    # CUDA-graph column loop is launch bound, so time follows columns, not flops
    "gptq_seconds_per_column": 0.97e-4,
    # "Full depth, end to end" paragraph: profile 1.76 s/layer at 1.05 M tokens, of which 0.63 s loading
    "profile_param_tokens_per_s": 5.3e13,
    # "Full depth, end to end": export wrote 17 GB in 50.3 s
    "export_bytes_per_s": 0.34e9,
    # first-session Qwen3 table: RTN solve 0.06 s/layer for a 1.25 GB layer
    "rtn_bytes_per_s": 2.1e10,
}
