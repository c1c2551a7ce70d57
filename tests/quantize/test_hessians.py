"""Statistics the solvers see: per-expert Hessians against an fp64 reference, load buckets, shared inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quant.models.experts import ExpertsView, fused_view
from quant.parallel.relay import Relay
from quant.parallel.world import World
from quant.quantize.hessians import ExpertStats, linear_stats
from quant.quantize.routing import load_buckets

E, D, I, K, T = 8, 32, 16, 2, 300


def _alone() -> Relay:
    """The relay of a process alone (a world of one): every payload is consumed as it is put."""
    return Relay(World())


def _skewed_routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing where expert 0 is far busier than the rest and expert 7 gets no token."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor([40.0, 8, 4, 3, 2, 1, 0.5, 0.0])
    idx = torch.multinomial(probs.expand(T, E), K, generator=g)
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return idx, w


@pytest.fixture(scope="module")
def experts() -> ExpertsView:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.3)
        mod.down_proj.normal_(0, 0.3)
    return fused_view(mod)


def _reference(view: ExpertsView, x, idx, w, gate_weighted: bool, all_experts: bool):
    x64 = x.double()
    gu = view.gate_up.detach().double()
    H_gu, H_down = [], []
    for e in range(view.n_experts):
        if all_experts:
            rows, wt = torch.arange(x.shape[0]), torch.ones(x.shape[0], dtype=torch.float64)
        else:
            tok, slot = (idx == e).nonzero(as_tuple=True)
            rows = tok
            wt = w[tok, slot].double() if gate_weighted else torch.ones(len(tok), dtype=torch.float64)
        xe = x64[rows]
        h = xe @ gu[e].T
        a = view.act(h[:, :I]) * h[:, I:]
        denom = wt.sum().clamp_min(1e-12)
        H_gu.append((xe * wt[:, None]).T @ xe / denom)
        H_down.append((a * wt[:, None]).T @ a / denom)
    return torch.stack(H_gu), torch.stack(H_down)


@pytest.mark.parametrize("gate_weighted,all_experts", [(False, False), (True, False), (False, True)])
def test_expert_hessians_equal_fp64_reference_under_skewed_routing(experts, gate_weighted, all_experts):
    idx, w = _skewed_routing()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    stats = ExpertStats(experts, gate_weighted, all_experts, relay=_alone())
    with torch.no_grad():
        for s in range(0, T, 100):  # several calibration batches
            experts.module(x[s : s + 100], idx[s : s + 100], w[s : s + 100])
    stats.remove()
    H_gu, H_down = stats.hessians()
    ref_gu, ref_down = _reference(experts, x, idx, w, gate_weighted, all_experts)
    assert stats.counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    torch.testing.assert_close(H_gu.double(), ref_gu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(H_down.double(), ref_down, rtol=1e-5, atol=1e-6)
    if not all_experts:
        assert H_gu[7].abs().sum() == 0  # the expert no token reached


def test_expert_hessians_of_a_chunk_equal_the_full_pass(experts):
    idx, w = _skewed_routing(3)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    full = ExpertStats(experts, False, False, relay=_alone())
    part = ExpertStats(experts, False, False, first=2, count=3, relay=_alone())
    with torch.no_grad():
        experts.module(x, idx, w)
    full.remove(), part.remove()
    for a, b in zip(full.hessians(), part.hessians(), strict=True):
        torch.testing.assert_close(a[2:5], b)


def test_hessians_are_the_sums_normalized_in_place_without_a_copy(experts):
    """The chunk's normalized Hessians reuse the sums' storage (a copy was the largest term at the GPTQ peak on the
    DeepSeek-V3 shape: benchmarks/memtrace.py), equal sum / weight exactly, and a second call changes nothing."""
    from quant.diag.memtrace import LiveBytes

    idx, w = _skewed_routing(8)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(9))
    stats = ExpertStats(experts, True, False, relay=_alone())
    with torch.no_grad():
        experts.module(x, idx, w)
    stats.remove()
    denom = stats.weight_sum.clamp_min(1e-12).float().view(-1, 1, 1)
    want = (stats.sum_gu / denom, stats.sum_down / denom)
    ptrs = (stats.sum_gu.data_ptr(), stats.sum_down.data_ptr())
    with LiveBytes(step=1) as m:
        got = stats.hessians()
    assert m.peak.bytes < (want[0].nbytes + want[1].nbytes) / 10, m.peak.table(unit=1)
    assert (got[0].data_ptr(), got[1].data_ptr()) == ptrs
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(stats.hessians(), want, strict=True))


def test_totals_without_hessians_equal_the_full_statistics(experts):
    """AWQ's first pass over every expert (counts, routing-weight sums, gate/up Σ|x|) holds no Hessian and takes
    the same sums as a pass that also accumulates them."""
    idx, w = _skewed_routing(6)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    full = ExpertStats(experts, False, False, relay=_alone())
    totals = ExpertStats(experts, False, False, hessians=False, relay=_alone())
    with torch.no_grad():
        experts.module(x, idx, w)
    full.remove(), totals.remove()
    assert totals.sum_gu is None and totals.sum_down is None
    for name in ("counts", "weight_sum", "abs_gu"):
        assert torch.equal(getattr(full, name), getattr(totals, name)), name


def test_load_buckets_cover_every_assignment_once_and_bound_padding():
    idx, w = _skewed_routing(5)
    counts, buckets = load_buckets(idx, w, E, width=D, max_waste=1.5)
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    seen = []
    for b in buckets:
        rows = int(b.mask.sum())
        assert b.mask.numel() <= 1.5 * rows or len(b.experts) == 1
        if b.span is not None:
            assert b.experts.tolist() == list(range(b.span.start, b.span.stop))
        for j, e in enumerate(b.experts.tolist()):
            toks = b.token[j][b.mask[j]].tolist()
            assert (b.token[j][~b.mask[j]] == T).all() and (b.weight[j][~b.mask[j]] == 0).all()
            assert toks == sorted(toks)
            seen += [(t, e, float(b.weight[j][m])) for m, t in zip(b.mask[j].nonzero().flatten().tolist(), toks,
                                                                     strict=True)]
    expect = [(t, int(idx[t, s]), float(w[t, s])) for t in range(T) for s in range(K)]
    assert sorted(seen) == sorted(expect)
    assert 7 not in [e for b in buckets for e in b.experts.tolist()]
    # a subset of experts and a tight block budget: still every assignment of the subset, one per slot
    _, small = load_buckets(idx, w, 3, first_expert=1, width=D, max_elems=40 * D)
    assert sum(int(b.mask.sum()) for b in small) == int(((idx >= 1) & (idx < 4)).sum())
    assert all(b.mask.shape[0] * b.mask.shape[1] <= 40 or b.mask.shape[0] == 1 for b in small)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


def test_linear_stats_share_one_sum_for_one_input_and_match_separate_sums():
    torch.manual_seed(0)
    attn = _Attn()
    mods = {"q": attn.q, "k": attn.k, "v": attn.v, "o": attn.o}
    stats = linear_stats(mods, _alone())
    xs = [torch.randn(5, 7, D) for _ in range(3)]
    inputs: dict[str, list] = {n: [] for n in mods}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: inputs[n].append(a[0].reshape(-1, D))) for n, m in mods.items()]
    with torch.no_grad():
        for x in xs:
            attn(x)
    for h in hooks:
        h.remove()
    for st in stats.values():
        st.remove()
    assert stats["k"].leader is stats["q"] and stats["v"].leader is stats["q"]
    assert stats["q"].leader is None and stats["o"].leader is None
    for n in mods:
        X = torch.cat(inputs[n]).double()
        torch.testing.assert_close(stats[n].hessian().double(), X.T @ X / X.shape[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats[n].mean_abs().double(), X.abs().mean(0), rtol=1e-5, atol=1e-6)


def test_linear_stats_refuse_inputs_shared_on_some_calls_only():
    a, b = nn.Linear(D, D), nn.Linear(D, D)
    stats = linear_stats({"a": a, "b": b}, _alone())
    x = torch.randn(4, D)
    with torch.no_grad():
        a(x), b(x)  # b follows a
        a(x)
        with pytest.raises(RuntimeError, match="b: stopped sharing its input with a"):
            b(torch.randn(4, D))
    for st in stats.values():
        st.remove()


def test_near_uniform_routing_is_bucketed_in_contiguous_ranges():
    n = 296
    idx = torch.stack([torch.arange(n) % E, (torch.arange(n) + 3) % E], dim=1)  # every expert 2n/E = 74 tokens
    w = torch.full((n, K), 0.5)
    _, buckets = load_buckets(idx, w, E, width=D)
    assert [b.span for b in buckets] == [slice(0, E)]
    _, split = load_buckets(idx, w, E, width=D, max_elems=3 * 74 * D)  # 3 experts per block
    assert [b.span for b in split] == [slice(0, 3), slice(3, 6), slice(6, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("gate_weighted", [False, True])
def test_gpu_bf16_expert_hessians_equal_fp64_under_skewed_routing(experts, gate_weighted):
    """On the GPU, bf16 activations are multiplied as they are with fp32 output (no fp32 copies) in load
    buckets, also for a chunk of the experts; the sums equal fp64 ones of the same bf16 values. (Gate-weighted
    rows go through fp32.) The down input is a bf16 intermediate (cuBLAS rounds it per block shape), so its sum is
    checked against fp64 to bf16 accuracy."""
    import copy

    from quant.models.experts import fused_view

    mod = copy.deepcopy(experts.module).to("cuda", torch.bfloat16)
    view = fused_view(mod)
    idx, w = (t.cuda() for t in _skewed_routing(7))
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    full = ExpertStats(view, gate_weighted, False, relay=_alone())
    part = ExpertStats(view, gate_weighted, False, first=2, count=3, relay=_alone())
    with torch.no_grad():
        for s in range(0, T, 100):
            mod(x[s : s + 100], idx[s : s + 100], w[s : s + 100].to(torch.bfloat16))
    full.remove(), part.remove()
    H_gu, H_down = full.hessians()
    wb = w.to(torch.bfloat16)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        wt = wb[tok, slot].double() if gate_weighted else torch.ones(len(tok), dtype=torch.float64, device="cuda")
        xe = x[tok].double()
        h = xe @ view.gate_up[e].double().T
        a = view.act(h[:, :I]) * h[:, I:]
        denom = wt.sum().clamp_min(1e-12)
        for ours, rows, tol in ((H_gu[e], xe, 1e-5), (H_down[e], a, 2e-2)):
            ref = (rows * wt[:, None]).T @ rows / denom
            torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    for a, b in zip(full.hessians(), part.hessians(), strict=True):
        torch.testing.assert_close(a[2:5], b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_linear_stats_of_bf16_inputs_equal_fp64():
    lin = nn.Linear(D, D, bias=False).to("cuda", torch.bfloat16)
    stats = linear_stats({"a": lin}, _alone())
    xs = [torch.randn(5, 7, D, device="cuda").to(torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        for x in xs:
            lin(x)
    stats["a"].remove()
    X = torch.cat([x.reshape(-1, D) for x in xs]).double()
    torch.testing.assert_close(stats["a"].hessian().double(), X.T @ X / X.shape[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skew", [False, True])
def test_bucket_add_to_equals_index_add_for_whole_and_restricted_buckets(skew):
    """``Bucket.add_to`` (a slice add over a contiguous id range) adds exactly what ``index_add_`` adds, also for
    a bucket restricted to an expert chunk (renumbered ids and span) and for load-sorted (non-contiguous) ones."""
    from quant.quantize.routing import load_buckets

    g = torch.Generator().manual_seed(3)
    E, T, k = 16, 200, 2
    hot = torch.linspace(0, 6, E)[torch.randperm(E, generator=g)]  # skewed loads in scattered ids
    logits = torch.randn(T, E, generator=g) + (hot if skew else 0)
    idx = logits.topk(k, dim=1).indices
    w = torch.rand(T, k, generator=g)
    _, buckets = load_buckets(idx, w, E, width=8, max_elems=8 * 400)
    assert any(b.span is not None for b in buckets) and (not skew or any(b.span is None for b in buckets))
    for first, count in ((0, E), (5, 7)):
        want, got = torch.zeros(count, 3, dtype=torch.float64), torch.zeros(count, 3, dtype=torch.float64)
        for b in buckets:
            r = b.restrict(first, count)
            if r is None:
                continue
            vals = torch.randn(len(r.members), 3, generator=g, dtype=torch.float64)
            want.index_add_(0, r.experts, vals)
            r.add_to(got, vals)
        assert torch.equal(got, want)
