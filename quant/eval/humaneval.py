"""HumanEval: load the 164 problems, post-process completions, grade them in the sandbox, pass@1.

A completion is the text a model generates after a problem's prompt (the function body). Grading builds
`prompt + completion + "\\n" + test + "\\n" + "check(entry_point)"` exactly as the reference harness does
and runs it with `quant.eval.sandbox` (never in this process, and only where its kernel layers work unless the
caller allows weak isolation); a problem passes when that program runs to the end without an exception within
the time and memory limits.

`truncate_completion` applies the stop sequences lm-eval's `humaneval` task generates with (`"\\nclass"`,
`"\\ndef"`, `"\\n#"`, `"\\nif"`, `"\\nprint"`): text after the first one is not part of the function.
The data file is `evals/data/HumanEval.jsonl.gz` in the repository (OpenAI, MIT; see its LICENSE).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quant.eval.sandbox import DEFAULT_MEMORY_BYTES, ExecResult, run_programs

logger = logging.getLogger(__name__)

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
DEFAULT_TIMEOUT_S = 10.0
N_PROBLEMS = 164


def default_data_path() -> Path:
    """`<repo>/evals/data/HumanEval.jsonl.gz`, located relative to this package (source checkouts)."""
    return Path(__file__).resolve().parents[2] / "evals" / "data" / "HumanEval.jsonl.gz"


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem; `prompt` ends where the model's completion starts."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def load_problems(path: Path | str | None = None) -> list[Problem]:
    """Read problems from a (gzipped) JSON-lines file, default `default_data_path()`, in file order.

    Raises FileNotFoundError naming the path when it is missing, ValueError on a row without the
    HumanEval fields or on duplicate task ids.
    """
    path = Path(path) if path is not None else default_data_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"HumanEval data not found at {path}; pass the path to HumanEval.jsonl.gz explicitly"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                problems.append(Problem(**{k: row[k] for k in Problem.__dataclass_fields__}))
            except KeyError as exc:
                raise ValueError(f"{path}:{line_no}: HumanEval row lacks field {exc}") from None
    duplicates = [k for k, n in Counter(p.task_id for p in problems).items() if n > 1]
    if duplicates:
        raise ValueError(f"{path}: duplicate task ids {duplicates[:5]}")
    return problems


def truncate_completion(completion: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut `completion` at the earliest stop sequence (the stop text itself is dropped). Idempotent."""
    cut = len(completion)
    for stop in stop_sequences:
        index = completion.find(stop)
        if index != -1:
            cut = min(cut, index)
    return completion[:cut]


def build_program(problem: Problem, completion: str) -> str:
    """The program the sandbox runs: prompt, completion, the problem's tests and the call to `check`."""
    return f"{problem.prompt}{completion}\n{problem.test}\ncheck({problem.entry_point})\n"


def grade(
    problems: Sequence[Problem],
    completions: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    max_workers: int | None = None,
    policy: str | None = None,
) -> list[ExecResult]:
    """Run each (problem, completion) pair in the sandbox, `max_workers` at a time; input order.

    Completions are graded as given (apply `truncate_completion` to raw generations first). `policy`: the
    sandbox's ("require", "allow_weak"; default the current `sandbox.isolation_policy`). Raises ValueError when
    the two sequences differ in length, SandboxUnavailable (before any program runs) as `run_programs` does.
    """
    if len(problems) != len(completions):
        raise ValueError(f"got {len(problems)} problems but {len(completions)} completions")
    programs = [build_program(p, c) for p, c in zip(problems, completions, strict=True)]
    results = run_programs(programs, timeout_s=timeout_s, memory_bytes=memory_bytes, max_workers=max_workers,
                           policy=policy)
    counts = Counter(r.status for r in results)
    logger.info("graded %d HumanEval completions: %s", len(results), dict(sorted(counts.items())))
    return results


def pass_at_1(
    problems: Sequence[Problem],
    completions: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    max_workers: int | None = None,
    policy: str | None = None,
) -> float:
    """Fraction of problems whose single completion passes its tests, in [0, 1].

    One completion per problem (greedy decoding), so pass@1 is the plain pass rate. Raises ValueError on
    an empty problem list or mismatched lengths.
    """
    if not problems:
        raise ValueError("pass_at_1 needs at least one problem")
    results = grade(
        problems, completions, timeout_s=timeout_s, memory_bytes=memory_bytes, max_workers=max_workers,
        policy=policy,
    )
    return sum(r.passed for r in results) / len(results)
