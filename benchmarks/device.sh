#!/usr/bin/env bash
# The GPU measurements BENCHMARKS.md records, as one script for a GPU host (no network needed there).
#
#   bash benchmarks/device.sh TASK [TASK ...]      # from the repository root, on the GPU machine
#
# Each task logs to $OUT/TASK.log (OUT defaults to ./device-out) and prints its JSON lines / tables; tasks run in
# the order given, so a time limit cuts the last ones, not the first. Carry the wheels the image lacks in .whl/
# (docs/gpu-testing.md); they are installed into /tmp/site first. Tasks:
#   suite      the whole test suite, 16 workers, failures appended to $OUT/faillog.txt as they happen (~400 s)
#   gpu        the GPU tier alone (-m gpu)
#   qwen3      Qwen3-30B-A3B shape, 2 layers, 256 x 2048: GPTQ and AWQ with llm-compressor GPTQ in the same run
#   qwen3-q    the same without llm-compressor (quant alone, ~1 min)
#   profile    the profile stage: Qwen3 2 layers x 512 samples, DeepSeek-V3 2 layers tiled to 8 x 256 samples
#              (profile-qwen3, profile-dsv3: one of them; the DeepSeek-V3 one builds 45 GB of model files, ~150 s,
#              unless WORK holds them: `profile_stage.py --build-only` builds them beside other work; the 45 GB
#              fingerprint, a once-per-model cost measured on 2026-11-30, is left out)
#   read-dsv3  one DeepSeek-V3 layer's host read (safe_open + pinned copy vs parallel preads into a staging buffer)
#              and upload (benchmarks/layer_read.py); keeps the model files for a profile-dsv3 after it
#   dsv3       DeepSeek-V3 layer, 32 x 2048: GPTQ and AWQ, each with the allocator's history at its peak
#   e2e48      48 virtual Qwen3-30B-A3B layers, 512 x 2048, profile + quantize + export end to end
#   headline48 the headline recipe (GPTQ, its layer-sensitivity pass included) through quant.run.pipeline.Run on
#              48 Qwen3-30B-A3B layers (2 saved, tiled) at 512 x 2048: calibrate, profile, plan, quantize (node.py depth)
#   dsv3-damage  the headline recipe with its layer-sensitivity pass on DeepSeek-V3-shaped layers (1 saved, tiled to
#              $DSV3_LAYERS, default 12) at 32 x 2048 (the pass's 16 samples are the same at any calibration size; quantize
#              is cheapest here): the pass's phases against quantize, both per layer (node.py depth). $DAMAGE_SET:
#              space-separated recipe overrides for it (KEY=VALUE, node.py --set)
#   expert-compute  quant's experts forward as the layer-damage pass runs it (bf16 experts, fp32 activations:
#              widened, split bf16 products, at a scheme), DeepSeek-V3 and Qwen3-30B-A3B shapes (~1 min)
#   x2         (2 GPUs) 1 vs 2 ranks on both shapes (Qwen3: ordered and reduce statistics), llm-compressor's
#              distributed oneshot on 2 GPUs
#   x2-awq     (2 GPUs) AWQ at 1 vs 2 ranks on both shapes (its searches divided over ranks)
#   fp8        DeepSeek-V3 layer, 32 x 2048, GPTQ on the bf16 model and on its FP8 block-scaled release (read
#              dequantized on the GPU): load and layer times side by side, GPU vs CPU dequantization bit for bit
#   node1      the whole pipeline (`quant run`, benchmarks/node.py) on one GPU: a DeepSeek-V3 layer tiled to 3 for
#              profile + quantize, the real layer through every stage with streamed eval, 32 x 2048 (~6 min)
#   x8-build, x8-depth, x8-breadth   (8 GPUs; one part a command, under 10 minutes each) 2 DeepSeek-V3
#              layers (47 GB, kept in $WORK-node between parts), tiled to $X8_LAYERS (default 24) at 512 x 2048 on
#              8 ranks, then every stage on the 2 saved layers; projected to 61 layers
#   vllm-part  copy each carried .vllm-part-N/part (benchmarks/vllm_wheels.sh makes them) to /tmp/parts/N, checked
#              against its SHA256SUMS, and list what /tmp/parts holds: one call per part, carry [".vllm-part-N"]
#   vllm-install  join /tmp/parts in order, check the archive's SHA256SUMS, unpack it into /tmp/vsite and import
#              vllm from there (skipped when /tmp/vsite already imports the parts' version). Kept apart from
#              /tmp/site: vLLM pins compressed-tensors 0.17, quant needs 0.19. Use it as PYTHONPATH=/tmp/vsite
#              VLLM_USE_FLASHINFER_SAMPLER=0 python3 ...
#   sglang-part, sglang-install  the same for SGLang (benchmarks/sglang_wheels.sh makes .sglang-part-N): parts in
#              /tmp/sgparts, unpacked into /tmp/sgsite, where sgl_kernel and SGLang's engine must import
#   sglang-tests  tests/serve/test_sglang.py: per-layer checkpoints served by SGLang from /tmp/sgsite against their
#              dequantized references; the agreement rows land in $OUT/sglang-report.json
#   serve-tests  the serving tests (tests/serve: every checkpoint form served by vLLM from /tmp/vsite against its
#              dequantized reference, the plugin, the refusals); the agreement table lands in $OUT/serve-report.json
#   serve-recipes, serve-recipes-dsv3  benchmarks/serve.py on the shipped recipes' checkpoints (headline with vllm-quant,
#              joint, per-layer, uniform W4/W8, bf16) of $SERVE_LAYERS Qwen3-30B-A3B layers (default 8) or DeepSeek-V3
#              MoE layers (default 2: 45 GB in bf16, so one checkpoint beside it fits the 64 GB disk: SERVE_MODELS one
#              at a time), each model served by $SERVE_PROCESSES processes (default 2) at 1/16/64/256 requests;
#              SERVE_MODELS / SERVE_SHAPES cut one call's share (not yet run on a GPU)
#   cold-load  benchmarks/cold_load.py: each of serve.py's layers / experts / bf16 checkpoints ($SERVE_LAYERS, default 4,
#              Qwen3-30B-A3B-shaped layers) loaded by a vLLM engine with empty caches, then warm, with vLLM's phase times
#   moe-layer  benchmarks/moe_layer.py: one MoE layer's forward (CUDA graphs, vLLM's Marlin MoE ops, random codes) at
#              Qwen3-30B-A3B and DeepSeek-V3 widths: W4, W8 and the plugin's per-expert mix, its groups as separate
#              calls or one shared routing, sequential or overlapped, and quant's mixed kernel (~2 min; needs
#              /tmp/vsite; $MOE_TOKENS: the token counts)
#   moe-sweep  benchmarks/moe_layer.py --sweep: the mixed kernel's tile shapes at both widths ($MOE_TOKENS tokens); the
#              first shape's fastest table goes to /tmp/moe-tiles.json (and $OUT): QUANT_MOE_TILES=/tmp/moe-tiles.json
#              serves with it
#   serve-bench  benchmarks/serve.py: vLLM throughput of bf16, W8, W4, the per-layer mix and the per-expert mix on a
#              5-layer Qwen3-30B-A3B-shaped model (results after each model in $OUT/serve.json); SERVE_MODELS and
#              SERVE_SHAPES pick models and prompt/generated shapes (one call runs ~4 models at one shape)
set -uo pipefail
cd "$(dirname "$0")/.."
for task in "$@"; do
  case $task in suite|gpu|qwen3|qwen3-q|profile|profile-qwen3|profile-dsv3|read-dsv3|dsv3|fp8|e2e48|headline48|dsv3-damage|expert-compute|x2|x2-awq|node1|x8-build|x8-depth|x8-breadth|vllm-part|vllm-install|sglang-part|sglang-install|sglang-tests|serve-tests|serve-bench|moe-layer|moe-sweep|cold-load|serve-recipes|serve-recipes-dsv3) ;; *) echo "unknown task: $task" >&2; exit 2 ;; esac
done
[ $# -gt 0 ] || { sed -n "2,/^set -uo/{/^#/p}" "$0"; exit 2; }
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
W=${WORK:-/tmp/quant-device}

run() {  # run TASK COMMAND...: log, time, and free the scratch disk after
  local task=$1; shift
  local t0; t0=$(date +%s)
  echo "== $task: $*" | tee -a "$OUT/$task.log"
  # every line as it comes (a run cut off at the call's limit still shows where it was): the log whole, the screen
  # the result lines and quant's progress lines (benchmarks/node.py prints them as "progress ...")
  "$@" 2>&1 | grep --line-buffered -v -E "Warning|warn\(" | tee -a "$OUT/$task.log" | grep --line-buffered -E '^\{|^ *[0-9]|GPU|engine|passed|failed|^(stage|calibrate|profile|plan|quantize|export|eval|report) |projection|per rank|^progress' 
  echo "== $task: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$task.log"
}

# a carried runtime (benchmarks/runtime_wheels.sh): its parts' folder on the host, its site, its import check
parts_dir() { case $1 in vllm) echo /tmp/parts ;; sglang) echo /tmp/sgparts ;; esac; }
site_dir() { case $1 in vllm) echo /tmp/vsite ;; sglang) echo /tmp/sgsite ;; esac; }

runtime_part() {  # RUNTIME: the carried .RUNTIME-part-N/part -> its parts' folder /N, with its SHA256SUMS
  local r=$1 d n want have found=0 parts
  parts=$(parts_dir "$r")
  mkdir -p "$parts"
  for d in ."$r"-part-*/; do
    n=${d#."$r"-part-}; n=${n%/}
    [[ $n =~ ^[0-9]+$ && -f $d/part && -f $d/SHA256SUMS ]] || continue
    found=1
    want=$(awk -v n="$n" '$2 == n {print $1}' "$d/SHA256SUMS")
    have=$(sha256sum < "$d/part" | cut -d' ' -f1)
    [ -n "$want" ] && [ "$want" = "$have" ] || { echo "part $n: sha256 $have, SHA256SUMS says '$want'"; return 1; }
    if [ -f "$parts/$n" ] && [ "$(sha256sum < "$parts/$n" | cut -d' ' -f1)" = "$want" ]; then
      echo "part $n: already in $parts"
    else
      cp "$d/part" "$parts/$n.tmp" && mv "$parts/$n.tmp" "$parts/$n" || return 1
      echo "part $n: copied"
    fi
    cp "$d/SHA256SUMS" "$parts/SHA256SUMS.tmp" && mv "$parts/SHA256SUMS.tmp" "$parts/SHA256SUMS" || return 1
  done
  [ "$found" = 1 ] || echo "no .$r-part-N/part carried"
  echo "$parts now (name, bytes):"
  (cd "$parts" && find . -maxdepth 1 -type f -printf '%f %s\n' | sort -n)
  if [ -f "$parts/SHA256SUMS" ]; then
    local missing
    missing=$(awk 'NR > 1 {print $2}' "$parts/SHA256SUMS" | while read -r n; do [ -f "$parts/$n" ] || echo "$n"; done | xargs)
    echo "parts: $(($(wc -l < "$parts/SHA256SUMS") - 1)) in all, missing: ${missing:-none}"
  fi
  [ "$found" = 1 ]
}

runtime_version() {  # RUNTIME: the version its site imports (SGLang: its engine's whole import chain), or nothing
  local site; site=$(site_dir "$1")
  case $1 in
    vllm) env PYTHONPATH="$site" VLLM_USE_FLASHINFER_SAMPLER=0 python3 -c 'import vllm; print(vllm.__version__)' ;;
    sglang) env PYTHONPATH="$site" HF_HUB_OFFLINE=1 python3 -c \
              'import sgl_kernel, sglang, sglang.srt.entrypoints.engine; print(sglang.__version__)' ;;
  esac 2>"$OUT/$1-import.err" | tail -1
}

pth_links() {  # SITE: what its .pth files add to sys.path, linked into SITE (PYTHONPATH folders read no .pth file)
  python3 - "$1" <<'EOF'
import os, re, sys
site = sys.argv[1]
for pth in sorted(f for f in os.listdir(site) if f.endswith(".pth")):
    for line in open(os.path.join(site, pth)):
        # "import sys, os, PKG; sys.path.insert(0, os.path.join(PKG.__path__[0], 'SUB'))" or a plain folder
        m = re.search(r"os\.path\.join\((\w+)\.__path__\[0\],\s*['\"]([^'\"]+)['\"]\)", line)
        folder = os.path.join(m[1], m[2]) if m else ("" if line.startswith(("import", "#")) else line.strip())
        if not folder or not os.path.isdir(os.path.join(site, folder)):
            continue
        for entry in sorted(os.listdir(os.path.join(site, folder))):
            if not os.path.lexists(os.path.join(site, entry)):
                os.symlink(os.path.join(folder, entry), os.path.join(site, entry))
                print(f"{pth}: linked {entry} -> {folder}/{entry}")
EOF
}

runtime_install() {  # RUNTIME: its parts' folder -> its site
  local r=$1 parts site sums archive want v n missing
  parts=$(parts_dir "$r"); site=$(site_dir "$r"); sums=$parts/SHA256SUMS
  archive=$(head -1 "$sums" 2>/dev/null | awk '{print $2}')  # RUNTIME-VERSION-site.tar.xz
  want=${archive#"$r"-}; want=${want%-site.tar.xz}
  [ -n "$want" ] || case $r in vllm) want=${VLLM_VERSION:-0.26.0} ;; sglang) want=${SGLANG_VERSION:-0.5.17} ;; esac
  if [ -f "$site/$r/__init__.py" ] && v=$(runtime_version "$r") && [ "$v" = "$want" ]; then
    echo "$r $v: already in $site"; return 0
  fi
  [ -f "$sums" ] || { echo "no $sums: run $r-part first"; return 1; }
  missing=$(tail -n +2 "$sums" | awk '{print $2}' | while read -r n; do [ -f "$parts/$n" ] || echo "$n"; done | xargs)
  [ -z "$missing" ] || { echo "parts missing from $parts: $missing ($r-part with each)"; return 1; }
  (cd "$parts" && tail -n +2 SHA256SUMS | sha256sum --quiet -c -) || { echo "parts missing or damaged"; return 1; }
  for n in $(tail -n +2 "$sums" | awk '{print $2}' | sort -n); do cat "$parts/$n"; done > "/tmp/$archive" || return 1
  (cd /tmp && head -1 "$sums" | sha256sum -c -) || { rm -f "/tmp/$archive"; return 1; }
  rm -rf "$site.tmp" && mkdir -p "$site.tmp" && tar -C "$site.tmp" -xJf "/tmp/$archive" || return 1
  pth_links "$site.tmp" || return 1
  rm -rf "$site" "/tmp/$archive" && mv "$site.tmp" "$site" || return 1
  echo "unpacked into $site: $(du -sh "$site" | cut -f1)"
  v=$(runtime_version "$r")
  [ "$v" = "$want" ] || { echo "importing $r from $site gave '$v', want $want:"; tail -30 "$OUT/$r-import.err"; return 1; }
  rm -rf "$parts"  # the site holds it all now
  echo "$r $v (PYTHONPATH=$site)"
}

for task in "$@"; do
  case $task in
    vllm-part|vllm-install|sglang-part|sglang-install)
      t0=$(date +%s)
      echo "== $task" | tee -a "$OUT/$task.log"
      "runtime_${task#*-}" "${task%%-*}" 2>&1 | tee -a "$OUT/$task.log"
      echo "== $task: $([ "${PIPESTATUS[0]}" = 0 ] && echo ok || echo FAILED), $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$task.log"
      continue ;;  # nothing in $W
    serve-tests) run serve-tests env QUANT_VLLM_PYTHONPATH=/tmp/vsite QUANT_SERVE_REPORT="$OUT/serve-report.json" \
                   python3 -m pytest -p no:cacheprovider tests/serve -v -rfEs --tb=short ;;
    sglang-tests) run sglang-tests env QUANT_SGLANG_PYTHONPATH=/tmp/sgsite \
                    QUANT_SERVE_REPORT="$OUT/sglang-report.json" \
                    python3 -m pytest -p no:cacheprovider tests/serve/test_sglang.py -v -rfEs --tb=short ;;
    moe-layer) run moe-layer env PYTHONPATH="/tmp/vsite:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 \
                 python3 benchmarks/moe_layer.py ${MOE_TOKENS:+--tokens $MOE_TOKENS} ;;
    moe-sweep) run moe-sweep env PYTHONPATH="/tmp/vsite:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 \
                 python3 benchmarks/moe_layer.py --sweep --tiles /tmp/moe-tiles.json \
                 --tokens ${MOE_TOKENS:-1 16 64 256 1024 4096}
               cp /tmp/moe-tiles.json "$OUT/" 2>/dev/null
               continue ;;
    serve-bench) run serve-bench python3 benchmarks/serve.py --vllm-path /tmp/vsite --layers "${SERVE_LAYERS:-5}" \
                   --models ${SERVE_MODELS:-experts layers w4 bf16 w8} --shapes ${SERVE_SHAPES:-128/128 1024/128} \
                   --workdir "$W" --results "$OUT/serve.json" ;;
    serve-recipes|serve-recipes-dsv3)  # what users ship: the shipped recipes' checkpoints, 2 processes a model
      if [ "$task" = serve-recipes ]; then shape=qwen3-30b-a3b layers=${SERVE_LAYERS:-8}; else shape=deepseek-v3 layers=${SERVE_LAYERS:-2}; fi
      run "$task" python3 benchmarks/serve.py --vllm-path /tmp/vsite --shape $shape --layers "$layers" \
        --models ${SERVE_MODELS:-headline joint per-layer uniform-w4 uniform-w8 bf16} --shapes ${SERVE_SHAPES:-128/128 1024/128} \
        --processes "${SERVE_PROCESSES:-2}" --workdir "$W-$task" --results "$OUT/$task.json" ;;
    cold-load) run cold-load python3 benchmarks/serve.py --vllm-path /tmp/vsite --layers "${SERVE_LAYERS:-4}" \
                 --models layers experts bf16 --workdir "$W" --part build
               run cold-load python3 benchmarks/cold_load.py --vllm-path /tmp/vsite --workdir "$W" \
                 --models ${COLD_MODELS:-layers experts bf16} ;;
    suite) run suite env QUANT_TEST_FAILLOG="$OUT/faillog.txt" QUANT_TEST_PROGRESS="$OUT/progress.txt" python3 -m pytest -p no:cacheprovider -n 16 -q -rfE \
             --tb=short --durations=30 --junitxml="$OUT/junit.xml" ;;
    gpu) run gpu python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --tb=short ;;
    qwen3) run qwen3 python3 benchmarks/engine.py --shape qwen3-30b-a3b --layers 2 --samples 256 --seqlen 2048 \
             --algos gptq,awq --llmcompressor gptq --error-samples 16 --workdir "$W" ;;
    qwen3-q) run qwen3-q python3 benchmarks/engine.py --shape qwen3-30b-a3b --layers 2 --samples 256 --seqlen 2048 \
               --algos gptq,awq --error-samples 16 --workdir "$W" ;;
    profile|profile-qwen3|profile-dsv3)
      [ "$task" = profile-dsv3 ] || { run "$task" python3 benchmarks/profile_stage.py --shape qwen3-30b-a3b \
        --layers 2 --samples 512 --workdir "$W"; rm -rf "$W"; }
      [ "$task" = profile-qwen3 ] || run "$task" python3 benchmarks/profile_stage.py --shape deepseek-v3 --layers 2 \
        --virtual-layers 8 --samples 256 --no-kernel-table --no-fingerprint --workdir "$W" ;;
    read-dsv3)
      run read-dsv3 python3 benchmarks/profile_stage.py --shape deepseek-v3 --layers 2 --no-fingerprint --build-only \
        --workdir "$W"
      run read-dsv3 python3 benchmarks/layer_read.py --shape deepseek-v3 --layers 2 --threads 8 --workdir "$W"
      continue ;;  # the model files stay for profile-dsv3
    dsv3)
      run dsv3 python3 benchmarks/engine.py --shape deepseek-v3 --layers 1 --samples 32 --seqlen 2048 --algos gptq,awq \
        --error-samples 0 --no-export --memory-trace --workdir "$W" ;;
    fp8) run fp8 python3 benchmarks/engine.py --shape deepseek-v3 --layers 1 --samples 32 --seqlen 2048 --algos gptq \
           --error-samples 0 --no-export --fp8 --workdir "$W" ;;
    e2e48) run e2e48 python3 benchmarks/engine.py --shape qwen3-30b-a3b --layers 2 --virtual-layers 48 --samples 512 \
             --seqlen 2048 --algos gptq --error-samples 0 --workdir "$W" ;;
    headline48) run headline48 python3 benchmarks/node.py --shape qwen3-30b-a3b --layers 2 --virtual-layers 48 \
                  --samples 512 --seqlen 2048 --ranks 1 --layer-damage --part depth --workdir "$W" ;;
    dsv3-damage)
      sets=(); for kv in ${DAMAGE_SET:-}; do sets+=(--set "$kv"); done
      run dsv3-damage python3 benchmarks/node.py --shape deepseek-v3 --layers 1 --virtual-layers "${DSV3_LAYERS:-12}" \
        --samples 32 --seqlen 2048 --ranks 1 --layer-damage --part depth "${sets[@]}" --workdir "$W" ;;
    expert-compute)
      run expert-compute python3 benchmarks/expert_compute.py --shape deepseek-v3 --tokens 16384
      run expert-compute python3 benchmarks/expert_compute.py --shape qwen3-30b-a3b --tokens 16384 ;;
    x2)
      run x2 python3 benchmarks/distributed.py --shape qwen3-30b-a3b --layers 2 --samples 256 --seqlen 2048 \
        --ranks 1,2 --statistics ordered,reduce --error-samples 16 --llmcompressor 2 --workdir "$W"
      rm -rf "$W"
      run x2 python3 benchmarks/distributed.py --shape deepseek-v3 --layers 1 --samples 32 --seqlen 2048 \
        --ranks 1,2 --error-samples 0 --memory-trace --workdir "$W" ;;
    x2-awq)
      run x2-awq python3 benchmarks/distributed.py --algo awq --shape qwen3-30b-a3b --layers 2 --samples 256 \
        --seqlen 2048 --ranks 1,2 --error-samples 16 --workdir "$W"
      rm -rf "$W"
      run x2-awq python3 benchmarks/distributed.py --algo awq --shape deepseek-v3 --layers 1 --samples 32 \
        --seqlen 2048 --ranks 1,2 --error-samples 0 --memory-trace --workdir "$W" ;;
    node1) run node1 python3 benchmarks/node.py --shape deepseek-v3 --layers 1 --virtual-layers 3 --samples 32 \
             --seqlen 2048 --eval-samples 16 --ranks 1 --workdir "$W" ;;
    x8-build|x8-depth|x8-breadth)
      run "$task" python3 benchmarks/node.py --shape deepseek-v3 --layers 2 --virtual-layers "${X8_LAYERS:-24}" \
        --project-layers 61 --samples 512 --seqlen 2048 --eval-samples 64 --ranks 8 --part "${task#x8-}" \
        --workdir "$W-node"
      continue ;;  # the model and the parts' results stay for the next part
    *) echo "unknown task: $task" >&2; exit 2 ;;
  esac
  rm -rf "$W"  # the machine's disk is 64 GB: one model at a time
done
