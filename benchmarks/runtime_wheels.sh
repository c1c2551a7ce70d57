#!/usr/bin/env bash
# Build, here (where PyPI is reachable), a serving runtime for GPU hosts without network access (x86-64, Python 3.12,
# torch 2.11.0+cu130 in the image, no network there) as an installed site-packages folder, packed and split into parts
# small enough that one `run` call carries one of them beside the working tree (64 MiB a call in all).
#
#   bash benchmarks/runtime_wheels.sh RUNTIME [VERSION] [PART_SIZE]   # RUNTIME: vllm (default 0.26.0) or sglang
#                                                  # (default 0.5.17); PART_SIZE (bytes, 16M or 16Mi) overrides the
#                                                  # computed one, as does RUNTIME_PART_SIZE
#   bash benchmarks/vllm_wheels.sh [VERSION] ...   # the same for vLLM; benchmarks/sglang_wheels.sh for SGLang
#   XZ_LEVEL=6 bash benchmarks/runtime_wheels.sh vllm  # the xz preset (default 9e: vLLM 0.26.0 229.3 MiB, 17 min on
#                                                  # 2 cores; 6: 241.4 MiB, 5 min); rm .vllm-build/*.tar.xz to repack
#
# Steps, each skipped when its output is already there (delete .RUNTIME-build/ to start over):
#   0. without benchmarks/RUNTIME-pins-VERSION.txt: resolve RUNTIME==VERSION with pip's --dry-run --report for
#      cp312 manylinux x86-64 (.RUNTIME-build/report-VERSION.json) and write the pins: what the image lacks
#      (benchmarks/runtime_pins.py against benchmarks/gpu-image.txt), less the optional heavy wheels (SKIP below);
#      it prints every wheel's size and the total, and stops there when the wheels come to more than
#      RUNTIME_MAX_PARTS (default 12) parts: rerun with RUNTIME_MAX_PARTS=N to download and build anyway;
#   1. pip download --no-deps of the pins (the image's own numpy/numba/protobuf/setuptools/cuda-bindings and the
#      optional heavy wheels are filtered out here) into .RUNTIME-build/wheels;
#   2. pip install --no-deps --no-index --no-compile --target .RUNTIME-build/site of exactly those wheels (with
#      --python-version 3.12 --implementation cp --platform ..., so this machine's Python need not be 3.12);
#      console scripts in site/bin get `#!/usr/bin/env python3`;
#   3. tar.xz (xz -T0 -$XZ_LEVEL) of the site into .RUNTIME-build/RUNTIME-VERSION-site.tar.xz;
#   4. (always redone, it is cheap) split into .RUNTIME-part-1/part ... .RUNTIME-part-K/part, each folder with the
#      same SHA256SUMS (the whole archive's hash and each part's). The part size is 64 MiB minus what travels in
#      every call (the sizes of `git ls-files --cached --others --exclude-standard`) minus a 1 MiB margin: rerun
#      this script when the working tree has grown.
# All of .RUNTIME-build/ and .RUNTIME-part-*/ are ignored by git (.gitignore). On the GPU machine (benchmarks/device.sh):
# one call per part, carry [".RUNTIME-part-N"], `bash benchmarks/device.sh RUNTIME-part` (copies it to
# /tmp/parts-RUNTIME), the last one `... RUNTIME-part RUNTIME-install` (joins, checks, unpacks into /tmp/vsite for
# vLLM or /tmp/sgsite for SGLang, imports it); then e.g. PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3
# ... The calls must follow each other while the machine stays warm (/tmp is lost when it is given back). The site
# stays apart from /tmp/site (.whl/): vLLM and SGLang pin their own compressed-tensors, quant needs 0.19.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-}
case $R in
  vllm) DEFAULT=0.26.0 ;;
  sglang) DEFAULT=0.5.17 ;;
  *) echo "usage: bash benchmarks/runtime_wheels.sh vllm|sglang [VERSION] [PART_SIZE]" >&2; exit 2 ;;
esac
shift
VERSION=$DEFAULT
if [[ ${1:-} =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]]; then VERSION=$1; shift; fi
PINS=benchmarks/$R-pins-$VERSION.txt
B=.$R-build
WHEELS=$B/wheels
SITE=$B/site
ARCHIVE=$B/$R-$VERSION-site.tar.xz
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((1024 * 1024))
PART_SIZE=${1:-${RUNTIME_PART_SIZE:-${VLLM_PART_SIZE:-}}}
for p in "$B/x" ".$R-part-1/part"; do
  git check-ignore -q "$p" || { echo "$p is not ignored by git: add /.$R-build/ and /.$R-part-*/ to .gitignore" >&2; exit 1; }
done
P=()
for g in $(seq 17 39); do P+=(--platform "manylinux_2_${g}_x86_64"); done  # torch 2.14's NCCL is manylinux_2_18 only
P+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${P[@]}")
mkdir -p "$WHEELS"
# the image's own (the runtime runs on its numpy etc.), then optional heavy wheels the runtime imports only on paths
# the serving tests do not take. SGLang keeps CUTLASS's DSL for CUDA 13 (its DeepSeek attention kernels import it at
# module level), QuACK and Humming (small, imported by its kernel and quantization modules)
SKIP="numpy numba protobuf setuptools cuda-bindings tokenspeed-triton nvidia-nvvm nvidia-cuda-nvcc tilelang z3-solver \
pynvvideocodec torchcodec fastsafetensors"
case $R in
  vllm) SKIP="$SKIP nvidia-cutlass-dsl* quack-kernels humming-kernels" ;;
  sglang) SKIP="$SKIP nvidia-cutlass-dsl-libs-cu12" ;;
esac
SKIP="$SKIP ${RUNTIME_SKIP:-}"

# the part size from what travels with every call now
TRAVEL=$(git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
print(sum(os.lstat(p).st_size for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.lexists(p)))')
SUMS_SIZE=4096  # the part folder's SHA256SUMS, generously
if [ -n "$PART_SIZE" ]; then
  PART_SIZE=$(numfmt --from=auto "${PART_SIZE%B}")
else
  PART_SIZE=$(( LIMIT - TRAVEL - MARGIN - SUMS_SIZE ))
fi
[ "$PART_SIZE" -gt 0 ] || { echo "no room for a part: $TRAVEL bytes travel with every call" >&2; exit 1; }
if [ $(( TRAVEL + PART_SIZE + SUMS_SIZE )) -gt "$LIMIT" ]; then
  echo "warning: $TRAVEL (tree) + $PART_SIZE (part) bytes is over the 64 MiB a call" >&2
fi

# 0. the pins: pip's resolution for the image's Python and platform, less what the image has; and, before anything
# is downloaded, what it comes to (also where the pins are committed: a fresh clone sizes them first)
CARRY=$B/carry-$VERSION.txt
if [ ! -f "$PINS" ] || [ ! -f "$CARRY" ]; then
  REPORT=$B/report-$VERSION.json
  if [ ! -f "$REPORT" ]; then
    echo "resolving $R==$VERSION for cp312 manylinux x86-64 (pip --dry-run --report, ~1 min)"
    python3 -m pip install -q --dry-run --ignore-installed --report "$REPORT.tmp" "${TARGET[@]}" \
      --target "$B/dry-run" "$R==$VERSION" 2> >(grep -v "^WARNING: Location 'file:" >&2)
    mv "$REPORT.tmp" "$REPORT"
  fi
  NEW_PINS=(); [ -f "$PINS" ] || NEW_PINS=(--pins "$PINS.tmp")
  # shellcheck disable=SC2086
  python3 benchmarks/runtime_pins.py "$REPORT" "${NEW_PINS[@]}" --skip $SKIP --part-size "$PART_SIZE" > "$CARRY.tmp"
  mv "$CARRY.tmp" "$CARRY"
  cat "$CARRY"
  if [ ! -f "$PINS" ]; then
    mv "$PINS.tmp" "$PINS"
    echo "wrote $PINS ($(wc -l < "$PINS") wheels; sizes above, also in $CARRY)"
  fi
fi
if [ -f "$CARRY" ]; then
  N_PARTS=$(sed -n 's/^carried: .* = \([0-9]*\) parts .*/\1/p' "$CARRY")
  if [ "${N_PARTS:-0}" -gt "${RUNTIME_MAX_PARTS:-12}" ]; then
    echo "$R $VERSION: $(grep '^carried:' "$CARRY")"
    echo "that is more than RUNTIME_MAX_PARTS=${RUNTIME_MAX_PARTS:-12} calls to carry: not downloaded (rerun with RUNTIME_MAX_PARTS=$N_PARTS to build it)"
    exit 0
  fi
fi

# the pins less what the image has and the optional heavy wheels
SKIP=$SKIP python3 - "$PINS" > "$B/pins.txt" <<'EOF'
import fnmatch, os, re, sys
skip = os.environ["SKIP"]
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name = re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]
    norm = re.sub(r"[-_.]+", "-", name).lower()
    if any(fnmatch.fnmatch(norm, s) for s in skip.split()):
        print(f"left out (the image has it, or optional): {line}", file=sys.stderr)
        continue
    print(line)
EOF
N_PINS=$(wc -l < "$B/pins.txt")
STAMP=$(sha256sum "$B/pins.txt" | cut -d' ' -f1)

# 1. download
if [ "$(cat "$WHEELS/.done" 2>/dev/null)" = "$STAMP" ]; then
  echo "wheels: already downloaded ($N_PINS in $WHEELS)"
else
  # (this machine's pip.conf may name local file:// indexes that hold none of these: pip warns for each)
  python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$WHEELS" -r "$B/pins.txt" \
    2> >(grep -v "^WARNING: Location 'file:" >&2)
  echo "$STAMP" > "$WHEELS/.done"
fi
# exactly one wheel per pin (a folder used with older pins may hold others: they are not installed)
mapfile -t FILES < <(python3 - "$B/pins.txt" "$WHEELS" <<'EOF'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {}
for f in os.listdir(sys.argv[2]):
    if f.endswith(".whl"):
        name, version = f.split("-")[:2]
        have.setdefault((norm(name), version), []).append(f)
missing = []
for line in open(sys.argv[1]):
    name, version = line.strip().split("==")
    files = have.get((norm(name), version), [])
    if len(files) != 1:
        missing.append(f"{line.strip()}: {files or 'no wheel'}")
    else:
        print(os.path.join(sys.argv[2], files[0]))
if missing:
    sys.exit("wheels missing or ambiguous: " + "; ".join(missing))
EOF
)
[ "${#FILES[@]}" -eq "$N_PINS" ] || { echo "expected $N_PINS wheels, found ${#FILES[@]}" >&2; exit 1; }
echo "wheels: ${#FILES[@]}, $(du -cb "${FILES[@]}" | tail -1 | cut -f1 | numfmt --to=iec-i --suffix=B)"

# 2. install into a site-packages folder
if [ "$(cat "$SITE/.done" 2>/dev/null)" = "$STAMP" ]; then
  echo "site: already installed ($SITE)"
else
  rm -rf "$SITE" "$SITE.tmp" "$ARCHIVE"
  python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --disable-pip-version-check \
    --root-user-action=ignore "${TARGET[@]}" --target "$SITE.tmp" "${FILES[@]}"
  # console scripts: pip wrote this machine's interpreter into them
  if [ -d "$SITE.tmp/bin" ]; then
    for f in "$SITE.tmp"/bin/*; do
      if [ -f "$f" ] && head -c 2 "$f" | grep -q '#!' && head -1 "$f" | grep -q python; then
        sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$f"
      fi
    done
  fi
  [ -f "$SITE.tmp/$R/__init__.py" ] && [ -d "$SITE.tmp/$R-$VERSION.dist-info" ] || {
    echo "the site lacks $R/__init__.py or $R-$VERSION.dist-info" >&2; exit 1; }
  echo "$STAMP" > "$SITE.tmp/.done"
  mv "$SITE.tmp" "$SITE"
fi
echo "site: $(du -sb --exclude=.done "$SITE" | cut -f1 | numfmt --to=iec-i --suffix=B), \
$(ls -d "$SITE"/*.dist-info | wc -l) dist-infos"

# 3. pack
if [ -f "$ARCHIVE" ]; then
  echo "archive: already packed ($ARCHIVE)"
else
  tar -C "$SITE" --exclude=./.done --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -T0 "-${XZ_LEVEL:-9e}" > "$ARCHIVE.tmp"
  mv "$ARCHIVE.tmp" "$ARCHIVE"
fi
A_SIZE=$(stat -c %s "$ARCHIVE")

# 4. split
rm -rf "$B/split" ."$R"-part-[0-9]*/
mkdir -p "$B/split"
split -b "$PART_SIZE" -d -a 3 "$ARCHIVE" "$B/split/p."
K=0
for f in "$B"/split/p.*; do
  K=$((K + 1))
  mkdir -p ".$R-part-$K"
  mv "$f" ".$R-part-$K/part"
done
rmdir "$B/split"
{
  echo "$(sha256sum < "$ARCHIVE" | cut -d' ' -f1)  $(basename "$ARCHIVE")"
  for i in $(seq 1 "$K"); do echo "$(sha256sum < ".$R-part-$i/part" | cut -d' ' -f1)  $i"; done
} > "$B/SHA256SUMS"
for i in $(seq 1 "$K"); do cp "$B/SHA256SUMS" ".$R-part-$i/SHA256SUMS"; done

iec() { numfmt --to=iec-i --suffix=B --format=%.2f "$1"; }
echo
echo "archive: $ARCHIVE, $A_SIZE bytes ($(iec "$A_SIZE")), sha256 $(head -1 "$B/SHA256SUMS" | cut -d' ' -f1)"
echo "travels with every call: $TRAVEL bytes ($(iec "$TRAVEL")); part size $PART_SIZE bytes ($(iec "$PART_SIZE"))"
echo "$K parts:"
for i in $(seq 1 "$K"); do
  s=$(du -cb ".$R-part-$i" | tail -1 | cut -f1)
  echo "  .$R-part-$i: part $(stat -c %s ".$R-part-$i/part") bytes; a call carries $((TRAVEL + s)) of $LIMIT bytes"
done
echo
echo "On the GPU machine, one call per part, back to back (the machine must stay warm between them):"
for i in $(seq 1 "$K"); do
  t="$R-part"; [ "$i" -eq "$K" ] && t="$R-part $R-install"
  echo "  run  carry=[\".$R-part-$i\"]  command=\"bash benchmarks/device.sh $t\""
done
case $R in
  vllm) echo "then: bash benchmarks/device.sh serve-tests (PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 ...)" ;;
  sglang) echo "then: bash benchmarks/device.sh sglang-tests (PYTHONPATH=/tmp/sgsite python3 ...)" ;;
esac
