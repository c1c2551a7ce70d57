"""quant.eval.humaneval: the bundled problems, completion truncation, and sandboxed grading."""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import pytest

from quant.eval.humaneval import (
    N_PROBLEMS,
    STOP_SEQUENCES,
    Problem,
    build_program,
    grade,
    load_problems,
    pass_at_1,
    truncate_completion,
)


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return load_problems()


def test_bundled_data_has_164_distinct_problems(problems: list[Problem]) -> None:
    assert len(problems) == N_PROBLEMS == 164
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    for p in problems:
        assert f"def {p.entry_point}(" in p.prompt
        assert "def check(candidate)" in p.test


def test_all_canonical_solutions_pass(problems: list[Problem]) -> None:
    # The acceptance bar for the harness: every reference solution passes (about 5 s on 2 cores).
    completions = [p.canonical_solution for p in problems]
    results = grade(problems, completions, max_workers=2)
    failures = {
        p.task_id: r.stderr_tail[-300:] for p, r in zip(problems, results, strict=True) if not r.passed
    }
    assert failures == {}
    assert pass_at_1(problems[:10], completions[:10], max_workers=2) == 1.0


@pytest.mark.parametrize("kind", ["empty", "return_none", "another_problems_solution"])
def test_empty_and_wrong_completions_score_zero(problems: list[Problem], kind: str) -> None:
    subset = problems[::4]  # 41 problems spread over the set
    completions = {
        "empty": ["" for _ in subset],
        "return_none": ["    return None\n" for _ in subset],
        "another_problems_solution": [
            subset[(i + 1) % len(subset)].canonical_solution for i in range(len(subset))
        ],
    }[kind]
    assert pass_at_1(subset, completions, max_workers=2) == 0.0


def test_runaway_completions_are_contained(problems: list[Problem]) -> None:
    problem = problems[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        completions = [
            "    while True:\n        pass\n",
            "    hog = []\n    while True:\n        hog.append(bytearray(1 << 24))\n",
            f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return True\n",
        ]
        results = grade([problem] * 3, completions, timeout_s=2.0, memory_bytes=256 << 20, max_workers=3)
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert [r.status for r in results] == ["timeout", "memory", "failed"]
    assert "sandbox" in results[2].stderr_tail


@pytest.mark.parametrize("stop", STOP_SEQUENCES)
def test_truncation_cuts_at_each_stop_sequence(stop: str) -> None:
    body = "    return x + 1"
    assert truncate_completion(body + stop + " junk()\n") == body


def test_truncation_uses_the_earliest_stop_and_is_idempotent() -> None:
    text = "    y = x * 2\n    return y\nprint(f(1))\ndef g():\n    pass\n"
    once = truncate_completion(text)
    assert once == "    y = x * 2\n    return y"
    assert truncate_completion(once) == once
    # Indented lines are part of the function, not stop sequences.
    nested = "    def helper():\n        return 1\n    if x:\n        return helper()\n"
    assert truncate_completion(nested) == nested


def test_build_program_matches_the_reference_layout(problems: list[Problem]) -> None:
    p = problems[0]
    program = build_program(p, "    return False\n")
    assert program == p.prompt + "    return False\n" + "\n" + p.test + "\n" + f"check({p.entry_point})\n"
    compile(program, "<program>", "exec")


def test_pass_at_1_rejects_bad_inputs(problems: list[Problem]) -> None:
    with pytest.raises(ValueError, match="at least one"):
        pass_at_1([], [])
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        pass_at_1(problems[:2], [""])


def test_load_problems_reads_plain_jsonl_and_reports_problems(
    problems: list[Problem], tmp_path: Path
) -> None:
    plain = tmp_path / "two.jsonl"
    plain.write_text("".join(json.dumps(vars(p)) + "\n" for p in problems[:2]), encoding="utf-8")
    assert load_problems(plain) == problems[:2]

    with pytest.raises(FileNotFoundError, match="missing.jsonl.gz"):
        load_problems(tmp_path / "missing.jsonl.gz")

    broken = tmp_path / "broken.jsonl.gz"
    with gzip.open(broken, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="lacks field"):
        load_problems(broken)

    duplicated = tmp_path / "dup.jsonl"
    duplicated.write_text((json.dumps(vars(problems[0])) + "\n") * 2, encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate task ids"):
        load_problems(duplicated)
