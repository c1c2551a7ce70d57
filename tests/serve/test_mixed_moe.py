"""quant.serve.mixed_moe: the mixed-scheme fused MoE kernel (Triton; its interpreter on CPU) against the grouped
forward on dequantized weights and against a dense per-token MoE."""

import pytest
import torch

from quant.scheme import Scheme
from quant.serve.layout import expert_groups, grouped_moe_reference, stacked_shapes
from quant.serve.mixed_moe import (
    MixedLayer,
    Projection,
    TileConfig,
    dequantize,
    layer_tables,
    mixed_gemm,
    mixed_moe,
    servable,
    tile_config,
)
from tests.serve.test_moe_routing import _act, _align

pytest.importorskip("triton")

# the kernel runs on a GPU where there is one, else in Triton's interpreter (conftest sets TRITON_INTERPRET there)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_dev(layer):
    def proj(p):
        return Projection(p.schemes, tuple(c.to(DEV) for c in p.codes), tuple(c.to(DEV) for c in p.scales))

    return MixedLayer(proj(layer.w13), proj(layer.w2), layer.expert_group.to(DEV), layer.expert_row.to(DEV))


def _run(x, wts, ids, layer, **kw):
    """``mixed_moe`` on ``DEV`` (the routing aligned by the plain-torch alignment), the result back on the CPU."""
    def align(topk_ids, block_m, n_experts):
        return tuple(t.to(DEV) for t in _align(topk_ids.cpu(), block_m, n_experts))

    def act(out, inp):
        _act(out, inp.float())

    out = mixed_moe(x.to(DEV), wts.to(DEV), ids.to(DEV), _on_dev(layer), align=align, act=act, **kw)
    return out.cpu()


def _close(out, want, tol=1e-5):
    """Equal up to fp32 summation order: the largest difference against the output's scale."""
    assert out.shape == want.shape
    if DEV.type == "cuda":  # fp32 tiles go through the tensor cores as tf32 (10-bit mantissas)
        tol = max(tol, 5e-3)
    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < tol, err


def _projection(groups, side, H, N, gen, dtype):
    """Random codes and scales of every group's ``side`` stack, and the dense weights they stand for."""
    codes, scales = [], []
    for g in groups:
        shapes = stacked_shapes(g.scheme, len(g.experts), H, N)
        codes.append(torch.randint(-2**31, 2**31 - 1, shapes[(side, "weight_packed")], generator=gen,
                                   dtype=torch.int32))
        scales.append((torch.rand(shapes[(side, "weight_scale")], generator=gen) * 0.02 + 0.01).to(dtype))
    return Projection(tuple(g.scheme for g in groups), tuple(codes), tuple(scales))


def _dense(proj, groups, E):
    """``[E, Nout, K]`` fp32: each expert's dequantized weight at its own index."""
    out = torch.empty(E, proj.out_size, proj.in_size)
    for g, c, s in zip(groups, proj.codes, proj.scales, strict=True):
        out[list(g.experts)] = dequantize(c, s, g.scheme)
    return out


def _case(seed, T, E, k, H, N, schemes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    groups = expert_groups(schemes)
    w13 = _projection(groups, "w13", H, N, gen, dtype)
    w2 = _projection(groups, "w2", H, N, gen, dtype)
    layer = MixedLayer(w13, w2, *layer_tables(groups, E))
    x = (torch.randn(T, H, generator=gen) * 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, k, generator=gen).softmax(dim=1)
    return x, ids, wts, layer, groups, _dense(w13, groups, E), _dense(w2, groups, E)


def test_the_dequantized_reference_reads_codes_as_compressed_tensors_packs_them():
    """Code j of an int32 word sits at bits 4j (8j), stored as value + 8 (128)."""
    for bits in (4, 8):
        s = Scheme(bits, 32)
        vals = torch.arange(64, dtype=torch.int64).reshape(64, 1) % (1 << bits) - (1 << (bits - 1))  # [K, 1]
        pf = s.pack_factor
        words = torch.zeros(64 // pf, 1, dtype=torch.int64)
        for j in range(pf):
            words |= (vals[j::pf] + (1 << (bits - 1))) << (bits * j)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        w = dequantize(words[None], torch.full((1, 2, 1), 0.5), s)
        assert torch.equal(w[0, 0], vals[:, 0].float() * 0.5)


W8, W4 = Scheme(8, 128), Scheme(4, 128)


@pytest.mark.parametrize("T,E,k,H,N", [(1, 8, 2, 256, 128), (5, 16, 4, 128, 256), (70, 8, 2, 256, 128)])
@pytest.mark.parametrize("on_input", [False, True])
def test_two_groups_in_one_launch_are_the_grouped_forward(T, E, k, H, N, on_input):
    schemes = [W8 if e % 5 == 0 else W4 for e in range(E)]
    x, ids, wts, layer, groups, w13, w2 = _case(T * E + k, T, E, k, H, N, schemes)
    cfg = TileConfig(16, 64, 64, 4, 1)
    out = _run(x, wts, ids, layer, weight_on_input=on_input, config=cfg)
    if on_input:  # the router weight scales the first GEMM's output, as vLLM's kernels do
        want = torch.zeros_like(x)
        for t in range(T):
            for s in range(k):
                e = int(ids[t, s])
                h = (w13[e] @ x[t]) * wts[t, s]
                want[t] += w2[e] @ (torch.nn.functional.silu(h[:N]) * h[N:])
    else:
        want = grouped_moe_reference(x, w13, w2, groups, wts, ids.long())
    _close(out, want)


@pytest.mark.parametrize("schemes", [
    [Scheme(4, 32), Scheme(8, 128), Scheme(4, 32), Scheme(4, 32)],  # group sizes below the tile's K step
    [Scheme(8, 64)] * 4,  # one group
    [Scheme(4, 64), Scheme(4, 128)] * 2,  # two W4 groups
])
def test_group_sizes_and_one_group(schemes):
    E = len(schemes)
    x, ids, wts, layer, groups, w13, w2 = _case(7, 9, E, 2, 128, 128, schemes)
    out = _run(x, wts, ids, layer, config=TileConfig(16, 32, 128, 4, 1))
    _close(out, grouped_moe_reference(x, w13, w2, groups, wts, ids.long()))


def test_half_precision_output_and_unrouted_experts():
    """fp16 activations and scales (what a GPU runs), experts no token picks, rows past the padding untouched."""
    schemes = [W8] * 2 + [W4] * 6
    x, _, wts, layer, groups, w13, w2 = _case(3, 6, 8, 2, 128, 128, schemes, dtype=torch.float16)
    ids = torch.tensor([[2, 3], [3, 4], [2, 7]] * 2, dtype=torch.int32)  # experts 0, 1 (W8), 5, 6 unrouted
    out = _run(x, wts, ids, layer, config=TileConfig(16, 64, 64, 4, 1))
    want = grouped_moe_reference(x.float(), w13, w2, groups, wts, ids.long())
    _close(out, want, tol=5e-3)


def test_one_gemm_writes_only_valid_pairs_and_weights_them():
    schemes = [W8, W4, W4, W8]
    x, ids, wts, layer, groups, w13, _ = _case(5, 3, 4, 2, 128, 128, schemes)
    cfg = TileConfig(16, 32, 64, 4, 1)
    sorted_ids, experts, n_padded = (t.to(DEV) for t in _align(ids, 16, 4))
    out = torch.full((6, 256), 7.0, device=DEV)
    lay = _on_dev(layer)
    mixed_gemm(x.to(DEV), out, lay.w13, lay, sorted_ids, experts, n_padded, wts.to(DEV), top_k=2, mul_weights=True,
               config=cfg)
    out = out.cpu()
    want = torch.stack([(w13[int(ids.flatten()[p])] @ x[p // 2]) * wts.flatten()[p] for p in range(6)])
    _close(out, want)


def test_tables_and_refusals():
    groups = expert_groups([W8, W4, W4, W8])
    group, row = layer_tables(groups, 4)
    assert group.tolist() == [0, 1, 1, 0] and row.tolist() == [0, 0, 1, 1]
    assert servable([W8, W4]) is None
    assert "3 scheme groups" in servable([W8, W4, Scheme(4, 64)])
    assert "symmetric" in servable([Scheme(4, 128, False), W8])
    assert tile_config(1, 8, 128).block_m <= tile_config(4096, 8, 128).block_m


def test_a_tile_table_from_json_and_its_refusals():
    from quant.serve.mixed_moe import read_configs

    table = read_configs("[[2.0, [16, 64, 128, 4, 3]], [1e9, [64, 128, 64, 8, 3]]]")
    assert tile_config(1, 8, 128, table) == TileConfig(16, 64, 128, 4, 3)
    assert tile_config(4096, 8, 128, table) == TileConfig(64, 128, 64, 8, 3)
    assert tile_config(10**7, 8, 128, table[:1]) == TileConfig(16, 64, 128, 4, 3)  # past the last bound: the last
    for bad in ("[]", "[[2, [16, 64, 100, 4, 3]]]", "[[9, [16, 64, 64, 4, 3]], [2, [16, 64, 64, 4, 3]]]"):
        with pytest.raises(ValueError):
            read_configs(bad)


def test_the_kernel_choice_and_its_refusals():
    from quant.serve.mixed_moe import choose_kernel

    assert choose_kernel("", [W8, W4]) == "marlin"
    assert choose_kernel("marlin", [W8, W4, Scheme(4, 64)]) == "marlin"
    assert choose_kernel("mixed", [W8, W4]) == "mixed"
    with pytest.raises(ValueError, match="QUANT_MOE_KERNEL='triton': use marlin"):
        choose_kernel("triton", [W8, W4])
    with pytest.raises(ValueError, match="mixed cannot run 3 scheme groups"):
        choose_kernel("mixed", [W8, W4, Scheme(4, 64)])
    with pytest.raises(ValueError, match="mixed cannot run scheme w4g128a"):
        choose_kernel("mixed", [W8, Scheme(4, 128, False)])
    assert choose_kernel("nibbles", [W8, Scheme(4, 128, False), Scheme(4, 32)]) == "nibbles"
    with pytest.raises(ValueError, match="nibbles cannot run w8g128a experts"):
        choose_kernel("nibbles", [Scheme(8, 128, False), W4])
