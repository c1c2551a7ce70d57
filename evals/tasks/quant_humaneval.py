"""lm-eval hooks for `quant_humaneval.yaml`: bundled data, stop-sequence truncation, sandboxed pass@1.

lm-eval imports this file by path (`!function`), so it only adapts lm-eval's calling conventions to
`quant.eval.humaneval`; all code execution happens in `quant.eval.sandbox` subprocesses.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
_DATA_PATH = _REPO_ROOT / "evals" / "data" / "HumanEval.jsonl.gz"

try:
    from quant.eval import humaneval
except ModuleNotFoundError:  # a source checkout that is not installed: use the package beside evals/
    sys.path.insert(0, str(_REPO_ROOT))
    from quant.eval import humaneval


@functools.lru_cache(maxsize=1)
def _problems_by_id() -> dict[str, humaneval.Problem]:
    return {p.task_id: p for p in humaneval.load_problems(_DATA_PATH)}


def load_dataset(**_metadata):
    """lm-eval `custom_dataset`: the 164 problems as a DatasetDict with one `test` split, file order."""
    import datasets

    rows = [vars(p) for p in _problems_by_id().values()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def truncate_responses(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """lm-eval custom filter: cut every generation at the HumanEval stop sequences."""
    return [[humaneval.truncate_completion(r) for r in resp] for resp in resps]


def pass_at_1(references: list[str], predictions: list[str], **_kwargs) -> dict[str, float]:
    """lm-eval metric for one document: 1.0 if its completion passes the problem's tests in the sandbox.

    `references` holds the problem's task id (the task's doc_to_target), `predictions` its completion.
    """
    (task_id,), (completion,) = references, predictions
    problem = _problems_by_id()[task_id]
    (result,) = humaneval.grade([problem], [completion])
    return {"pass@1": float(result.passed)}
