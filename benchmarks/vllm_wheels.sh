#!/usr/bin/env bash
# vLLM for GPU hosts without network access, in parts: benchmarks/runtime_wheels.sh (its header says how).
#   bash benchmarks/vllm_wheels.sh [VERSION] [PART_SIZE]   # VERSION: 0.26.0 (default; benchmarks/vllm-pins-0.26.0.txt)
#                                                           # or another, resolved into benchmarks/vllm-pins-VERSION.txt
exec bash "$(dirname "$0")/runtime_wheels.sh" vllm "$@"
