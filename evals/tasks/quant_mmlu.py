"""lm-eval hooks for `quant_mmlu.yaml`: bundled MMLU test data with a per-subject held-out few-shot pool.

The first `FEWSHOT_POOL_SIZE` questions of each subject form the few-shot pool and are excluded from
scoring (with the 5 verbatim repeats of pool questions elsewhere in their subject); the rest, 13,752
questions, are interleaved round-robin across subjects so any `limit` is subject-balanced.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections import defaultdict
from pathlib import Path

from lm_eval.api.samplers import ContextSampler

DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "mmlu.jsonl.gz"
FEWSHOT_POOL_SIZE = 5


@functools.lru_cache(maxsize=1)
def _questions_by_subject() -> dict[str, list[dict]]:
    by_subject: dict[str, list[dict]] = defaultdict(list)
    with gzip.open(DATA_PATH, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            by_subject[row["subject"]].append(row)
    return dict(sorted(by_subject.items()))


def fewshot_pool(subject: str) -> list[dict]:
    """The held-out few-shot questions of `subject`, in file order."""
    return _questions_by_subject()[subject][:FEWSHOT_POOL_SIZE]


def _key(row: dict) -> tuple[str, tuple[str, ...]]:
    return row["question"], tuple(row["choices"])


def scored_questions() -> list[dict]:
    """All questions outside the few-shot pool, round-robin over subjects in alphabetical order.

    MMLU's test set repeats a few questions verbatim; a repeat of a same-subject few-shot question is not
    scored either, since its answer would be in the prompt.
    """
    remaining = []
    for subject, rows in _questions_by_subject().items():
        held_out = {_key(row) for row in fewshot_pool(subject)}
        remaining.append([row for row in rows[FEWSHOT_POOL_SIZE:] if _key(row) not in held_out])
    ordered = []
    for index in range(max(len(rows) for rows in remaining)):
        ordered.extend(rows[index] for rows in remaining if index < len(rows))
    return ordered


def load_dataset(**_metadata):
    """lm-eval `custom_dataset`: a DatasetDict whose `test` split is `scored_questions()`."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(scored_questions())})


class HeldOutSubjectSampler(ContextSampler):
    """Few-shot sampler: the first `n` held-out questions of the evaluated question's own subject."""

    def sample(self, n: int, eval_doc: dict | None = None, df=None, **kwargs) -> list[dict]:
        if eval_doc is None:
            raise ValueError("quant_mmlu few-shot needs the evaluated question (fewshot_split must be test)")
        pool = fewshot_pool(eval_doc["subject"])
        if n > len(pool):
            raise ValueError(
                f"quant_mmlu holds out {len(pool)} few-shot questions per subject, asked for {n}"
            )
        return pool[:n]
