#!/usr/bin/env bash
# SGLang for GPU hosts without network access, in parts: benchmarks/runtime_wheels.sh (its header says how).
#   bash benchmarks/sglang_wheels.sh [VERSION] [PART_SIZE]  # VERSION: 0.5.17 (default, the newest that pins torch
#                                                            # 2.11.0; benchmarks/sglang-pins-0.5.17.txt)
exec bash "$(dirname "$0")/runtime_wheels.sh" sglang "$@"
