#!/usr/bin/env bash
# Whether two revisions export the same checkpoints: each revision, checked out in a temporary git worktree, runs
# the shipped recipes on builtin:reference-moe up to the card stage (calibration kept small), and every file of
# every checkpoint folder is hashed (SHA-256); one table compares them.
#
#   bash benchmarks/byte_identity.sh OLD_REV NEW_REV      # from the repository root; a revision "." is the work tree
#
# Exits 0 when every file of every checkpoint is the same in both, 1 on any difference (changed, missing, extra),
# 2 on a usage error. PYTHON picks the interpreter (default: .venv/bin/python of the repository, else python3);
# KEEP=1 keeps the temporary directory (both revisions' run directories) for a look at a difference.
# The model card (README.md) is compared too: it names quant's version, which is the installed distribution's for
# both revisions (PYTHONPATH points at each checkout), so it differs only where the revisions write it differently.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 OLD_REV NEW_REV   (a revision '.' is the work tree as it is)" >&2
    exit 2
fi
root=$(git rev-parse --show-toplevel)
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
work=$(mktemp -d "${TMPDIR:-/tmp}/byte-identity.XXXXXX")
trees=()

cleanup() {
    for tree in "${trees[@]}"; do git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || true; done
    if [[ ${KEEP:-0} == 1 ]]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

# name | recipe | overrides beyond FAST (space-separated KEY=VALUE): every shipped recipe, and the headline one with
# each other algorithm and with the GPTQ format beside compressed-tensors
RUNS=(
    "mixed_int8_int4|recipes/mixed_int8_int4.yaml|"
    "mixed_int8_int4_rtn|recipes/mixed_int8_int4_rtn.yaml|"
    "mixed_int8_int4_awq|recipes/mixed_int8_int4.yaml|quantize.algorithm=awq"
    "mixed_int8_int4_gptq_format|recipes/mixed_int8_int4.yaml|export.formats=[compressed-tensors,gptq]"
    "mixed_vllm|recipes/mixed_vllm.yaml|"
    "joint_vllm_quant|recipes/joint_vllm_quant.yaml|"
)
FAST=(calibration.n_samples=8 calibration.seq_len=64 eval.perplexity.n_samples=2 eval.perplexity.seq_len=64
      profile.layer_sensitivity.n_samples=4 "eval.gates={}" eval.tasks=[])

checkout() {  # REV TAG -> the folder holding that revision's tree
    local rev=$1 tag=$2
    if [[ $rev == . ]]; then
        echo "$root"
        return
    fi
    git -C "$root" worktree add --detach --quiet "$work/$tag" "$rev" >&2
    trees+=("$work/$tag")
    echo "$work/$tag"
}

export_all() {  # TREE TAG: every run into $work/runs-TAG, then the digests into $work/TAG.sha256
    local tree=$1 tag=$2 entry name recipe extra args
    for entry in "${RUNS[@]}"; do
        IFS='|' read -r name recipe extra <<<"$entry"
        args=()
        for kv in "${FAST[@]}" $extra; do args+=(--set "$kv"); done
        echo "$tag: $name" >&2
        (cd "$tree" && PYTHONPATH="$tree" "$python" -c 'import sys; from quant.cli import main; sys.argv[0] = "quant"; main()' \
            card "$recipe" --model builtin:reference-moe -o "$work/runs-$tag/$name" "${args[@]}" >"$work/$tag-$name.log" 2>&1) \
            || { echo "$tag: $name failed (log: $work/$tag-$name.log)" >&2; KEEP=1; tail -20 "$work/$tag-$name.log" >&2; exit 1; }
    done
    (cd "$work/runs-$tag" && find . -path '*/checkpoint*/*' -type f -print0 | sort -z | xargs -0 sha256sum) \
        >"$work/$tag.sha256"
}

export_all "$(checkout "$1" old)" old
export_all "$(checkout "$2" new)" new

"$python" - "$work/old.sha256" "$work/new.sha256" "$1" "$2" <<'EOF'
import sys

def digests(path):
    return {f.removeprefix("./"): d for d, f in (line.split(None, 1) for line in open(path).read().splitlines())}

old, new = digests(sys.argv[1]), digests(sys.argv[2])
rows, bad = [], 0
for f in sorted(old.keys() | new.keys()):
    a, b = old.get(f), new.get(f)
    verdict = "same" if a == b else "MISSING" if b is None else "EXTRA" if a is None else "DIFFERENT"
    bad += verdict != "same"
    rows.append((f, (a or "-")[:16], (b or "-")[:16], verdict))
width = max(len(r[0]) for r in rows)
print(f"{'file':<{width}}  {sys.argv[3][:16]:<16}  {sys.argv[4][:16]:<16}  verdict")
for f, a, b, verdict in rows:
    print(f"{f:<{width}}  {a:<16}  {b:<16}  {verdict}")
print(f"{len(rows)} files, {bad} differing")
sys.exit(1 if bad else 0)
EOF
