#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the pure-Python wheels a GPU host without network lacks, into .whl/
# (ignored by git; copy it to the host with the checkout), for Python 3.12 there. benchmarks/device.sh installs them into
# /tmp/site on the machine. The list: quant's own dependencies missing from the image, the reference oracles
# (llm-compressor, auto-round) and lm-eval with its pure-Python dependencies, gguf for the SmolLM2 tests.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
WHEELS=(
  compressed-tensors==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  loguru==0.7.3 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  llmcompressor==0.14.0.1 auto-round==0.15.1
  lm-eval==0.4.13 evaluate==0.4.6 pytablewriter==1.2.1 rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1
  more-itertools==11.2.1 nltk==3.10.4 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1
  tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 defusedxml==0.7.1
  gguf==0.19.0
)
PLATFORMS=()
for n in 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
# sdist-only packages (rouge-score, sqlitedict, word2number) are built into wheels here: they are pure Python
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl "${WHEELS[@]}" 2>/dev/null || {
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d .whl "$w" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .whl "$w"
  done
}
du -sh .whl
