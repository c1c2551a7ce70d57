"""quant.serve.moe_routing: one routing for every scheme group, against the grouped forward and a dense MoE, with
plain-torch kernels of the semantics vLLM's Marlin MoE ops have."""

import pytest
import torch

from quant.scheme import Scheme
from quant.serve.layout import expert_groups, grouped_moe_reference
from quant.serve.moe_routing import (
    MoeOps,
    _split_blocks_triton,
    block_size_m,
    group_rows,
    shared_routing_moe,
    split_blocks,
)


def _align(topk_ids, block_m, n_experts, garbage=7):
    """Pairs ``t * k + slot`` sorted by expert, each expert's padded to whole blocks with ``T * k``; the arrays are
    longer than ``n_padded`` says and hold ``garbage`` past it, as vLLM's buffers hold whatever was there."""
    flat = topk_ids.flatten().long()
    sentinel = flat.numel()
    ids, experts = [], []
    for e in range(n_experts):
        pairs = (flat == e).nonzero().flatten().tolist()
        n_blocks = -(-len(pairs) // block_m)
        ids += pairs + [sentinel] * (n_blocks * block_m - len(pairs))
        experts += [e] * n_blocks
    n_padded = len(ids)
    ids += [garbage] * (3 * block_m)
    experts += [garbage, -5, 10**6]
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32),
            torch.tensor([n_padded], dtype=torch.int32))


def _gemm(a, out, group, proj, sorted_ids, block_rows, n_padded, topk_weights, block_m, top_k, mul, size_m, size_n,
          size_k, workspace):
    """Each block whose row is not -1: its valid pairs' rows of ``out`` from ``a[pair // top_k] @ W[row]^T``."""
    assert a.shape == (size_m, size_k) and out.shape == (size_m * top_k, size_n)
    w = group.w13 if proj == "w13" else group.w2
    for b in range(int(n_padded) // block_m):
        row = int(block_rows[b])
        if row == -1:
            continue
        pairs = sorted_ids[b * block_m:(b + 1) * block_m].long()
        pairs = pairs[pairs < size_m * top_k]
        y = a[pairs // top_k].float() @ w[row].float().T
        if mul:
            y = y * topk_weights.flatten()[pairs, None]
        out[pairs] = y.to(out.dtype)
    return out


def _act(out, inp):
    gate, up = inp.float().chunk(2, dim=1)
    out.copy_(torch.nn.functional.silu(gate) * up)


REF = MoeOps(align=_align, gemm=_gemm, act=_act)


class _Stack:
    def __init__(self, group, w13, w2):
        self.experts = group.experts
        self.w13, self.w2 = w13[list(group.experts)], w2[list(group.experts)]


def _layer(seed, T, E, k, H=32, N=16, schemes=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * N, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, N, generator=g) / N**0.5
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    topk_weights = torch.rand(T, k, generator=g).softmax(dim=1)
    schemes = schemes or [Scheme(8, 128) if e % 5 == 0 else Scheme(4, 128) for e in range(E)]
    groups = expert_groups(schemes)
    return x, w13, w2, topk_ids, topk_weights, groups


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 16, 4), (64, 8, 2), (300, 16, 8)])
@pytest.mark.parametrize("on_input", [False, True])
def test_one_routing_for_every_group_is_the_grouped_forward(T, E, k, on_input):
    x, w13, w2, ids, wts, groups = _layer(T * E + k, T, E, k)
    stacks = [_Stack(g, w13, w2) for g in groups]
    out = shared_routing_moe(x, wts, ids, stacks, group_rows(groups, E), REF, intermediate=w2.shape[2],
                             weight_on_input=on_input, workspaces=(None, None))
    if on_input:  # the router weight scales the input of the first GEMM: only equal when the layer is linear in it
        want = torch.zeros_like(x)
        for t in range(T):
            for s in range(k):
                e = int(ids[t, s])
                h = w13[e] @ (x[t] * wts[t, s])
                want[t] += w2[e] @ (torch.nn.functional.silu(h[: w2.shape[2]]) * h[w2.shape[2]:])
    else:
        want = grouped_moe_reference(x, w13, w2, groups, wts, ids)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_three_groups_one_of_them_unrouted_and_int32_routing():
    E = 12
    schemes = [Scheme(8, 128)] * 3 + [Scheme(4, 64)] * 3 + [Scheme(4, 128)] * 6
    x, w13, w2, _, wts, groups = _layer(3, 9, E, 3, schemes=schemes)
    ids = torch.tensor([[3, 4, 6], [7, 8, 11], [5, 9, 10]] * 3, dtype=torch.int32)  # no token picks experts 0-2
    stacks = [_Stack(g, w13, w2) for g in groups]
    out = shared_routing_moe(x, wts, ids, stacks, group_rows(groups, E), REF, intermediate=w2.shape[2],
                             weight_on_input=False, workspaces=(None, None))
    torch.testing.assert_close(out, grouped_moe_reference(x, w13, w2, groups, wts, ids.long()), rtol=1e-4, atol=1e-5)


def test_split_marks_other_groups_and_entries_past_the_padding():
    groups = expert_groups([Scheme(8, 128), Scheme(4, 128), Scheme(4, 128), Scheme(8, 128)])  # w8: 0, 3; w4: 1, 2
    rows = group_rows(groups, 4)
    assert rows.tolist() == [[0, -1, -1, 1], [-1, 0, 1, -1]]
    experts = torch.tensor([0, 1, 2, 3, 3, 99, -3], dtype=torch.int32)
    split = split_blocks(experts, torch.tensor([5 * 16], dtype=torch.int32), rows, 16)
    assert split.tolist() == [[0, -1, -1, 1, 1, -1, -1], [-1, 0, 1, -1, -1, -1, -1]]


def test_the_triton_split_matches_the_torch_one():
    g = torch.Generator().manual_seed(0)
    E = 40
    groups = expert_groups([Scheme(8 if e % 3 else 4, 128) for e in range(E)])
    rows = group_rows(groups, E)
    experts = torch.randint(-5, E + 5, (600,), generator=g, dtype=torch.int32)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else Triton's interpreter
    for n_blocks in (0, 1, 333, 600):
        n_padded = torch.tensor([n_blocks * 8], dtype=torch.int32)
        got = _split_blocks_triton(experts.to(dev), n_padded.to(dev), rows.to(dev), 8).cpu()
        assert torch.equal(got, split_blocks(experts, n_padded, rows, 8))


def test_block_size_follows_the_mean_pairs_per_expert():
    assert block_size_m(1, 8, 128) == 8
    assert block_size_m(256, 8, 128) == 32  # 16 pairs a mean expert: 16 / 16 >= 0.9, 16 / 32 < 0.9
    assert block_size_m(8192, 8, 128) == 64
    assert [block_size_m(t, 8, 256) for t in (1, 300, 500)] == [8, 16, 32]
