"""The engine's budget decisions: expert passes by Hessian budget, sub-batches by solve budget, partial sums over
ranks."""

import pytest

from quant.quantize.budgets import (
    expert_chunks,
    expert_hessian_bytes,
    reduce_asked,
    solve_bytes,
    sub_batch_cap,
    sub_batches,
)


@pytest.mark.parametrize("experts,budget_experts", [(range(16), 6), (range(5, 13), 3), (range(4), 100), (range(7), 0)])
def test_expert_chunks_cover_the_range_and_fit_the_budget(experts, budget_experts):
    per = expert_hessian_bytes(64, 32)
    chunks = expert_chunks(experts, 16, per, budget_experts * per / 1e9)
    assert [e for first, count in chunks for e in range(first, first + count)] == list(experts)
    assert all(count <= max(1, budget_experts) for _, count in chunks)  # at least one expert a pass


def test_sub_batches_are_equal_runs_within_the_cap():
    per = solve_bytes(64, 32)
    for n in (1, 7, 9, 24):
        for cap in (1, 4, 5, 100):
            parts = sub_batches(list(range(n)), 64, 32, cap * per / 1e9)
            assert sub_batch_cap(64, 32, cap * per / 1e9) == cap
            assert [e for p in parts for e in p] == list(range(n))
            assert max(map(len, parts)) <= cap and all(len(p) == len(parts[0]) for p in parts[:-1])


def test_partial_sums_are_asked_for_on_several_ranks_only():
    assert not any(reduce_asked(mode, 1, "nccl") for mode in ("auto", "reduce", "ordered"))
    assert reduce_asked("reduce", 2, "gloo") and reduce_asked("auto", 2, "nccl")
    assert not reduce_asked("auto", 2, "gloo") and not reduce_asked("ordered", 8, "nccl")
