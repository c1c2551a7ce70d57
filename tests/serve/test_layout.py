"""quant.serve.layout: the per-expert mixed layer's stacked tensors and grouped forward, against slow references."""

import pytest
import torch

from quant.scheme import Scheme
from quant.serve.layout import (
    ExpertGroup,
    check_servable,
    expert_groups,
    grouped_moe_reference,
    place,
    rank_part,
    stacked_shapes,
)


def test_groups_split_experts_by_scheme_and_map_only_their_own():
    w8, w4 = Scheme(8, 128), Scheme(4, 64)
    groups = expert_groups([w4, w8, w4, w4, w8])
    assert [(g.scheme, g.experts) for g in groups] == [(w8, (1, 4)), (w4, (0, 2, 3))]
    assert groups[0].expert_map(5) == [-1, 0, -1, -1, 1]
    assert groups[1].expert_map(5) == [0, -1, 1, 2, -1]


def _dense_moe(x, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert: the MoE layer as written."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    N = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:N]) * h[N:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ act)
    return out


def test_the_grouped_forward_sums_to_the_whole_layer():
    g = torch.Generator().manual_seed(0)
    T, H, N, E, k = 37, 16, 8, 6, 2
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * N, H, generator=g), torch.randn(E, H, N, generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    topk_weights = torch.rand(T, k, generator=g)
    schemes = [Scheme(8, 128) if e in (2, 5) else Scheme(4, 128) for e in range(E)]
    got = grouped_moe_reference(x, w13, w2, expert_groups(schemes), topk_weights, topk_ids)
    want = _dense_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # one group holding every expert is the plain layer; a group missing experts is not
    alone = grouped_moe_reference(x, w13, w2, [ExpertGroup(Scheme(4, 128), tuple(range(E)))], topk_weights, topk_ids)
    torch.testing.assert_close(alone.double(), want, rtol=1e-4, atol=1e-4)
    part = grouped_moe_reference(x, w13, w2, expert_groups(schemes)[:1], topk_weights, topk_ids)
    assert not torch.allclose(part.double(), want, rtol=1e-2, atol=1e-2)


def _expert(bits: int, group: int, H: int, N: int, sym: bool, g: torch.Generator) -> dict[str, dict]:
    """One expert's three projections as compressed-tensors writes them (its own packing)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1  # codes as compressed-tensors holds them (signed)
    out = {}
    for shard, (rows, cols) in {"w1": (N, H), "w3": (N, H), "w2": (H, N)}.items():
        q = torch.randint(lo, hi + 1, (rows, cols), generator=g, dtype=torch.int8)
        t = {"weight_packed": pack_to_int32(q, bits), "weight_scale": torch.rand(rows, cols // group, generator=g),
             "codes": q}
        if not sym:
            z = torch.randint(lo, hi + 1, (rows, cols // group), generator=g, dtype=torch.int8)
            t["weight_zero_point"] = pack_to_int32(z, bits, packed_dim=0)
            t["zero"] = z
        out[shard] = t
    return out


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (8, 64, True), (4, 64, False)])
def test_each_ranks_part_lands_where_the_kernel_reads_it(tp_size, bits, group, sym):
    """Every rank's stacked tensors, read back in the kernel's layout (``[in, out]`` per expert, gate then up),
    hold exactly that rank's rows of gate/up and columns of down, codes and scales and zero points."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    g = torch.Generator().manual_seed(1)
    H, N, n_experts = 256, 128, 3
    scheme = Scheme(bits, group, sym)
    experts = [_expert(bits, group, H, N, sym, g) for _ in range(n_experts)]
    n = N // tp_size
    for rank in range(tp_size):
        stacks = {k: torch.zeros(s, dtype=torch.float32 if k[1] == "weight_scale" else torch.int32)
                  for k, s in stacked_shapes(scheme, n_experts, H, n).items()}
        for row, ex in enumerate(experts):
            for shard, tensors in ex.items():
                side = "w2" if shard == "w2" else "w13"
                for kind in ("weight_packed", "weight_scale", "weight_zero_point"):
                    if kind in tensors:
                        place(stacks[(side, kind)], rank_part(tensors[kind], kind, shard, rank, tp_size), kind, shard, row)
        for row, ex in enumerate(experts):
            rows = slice(rank * n, (rank + 1) * n)
            w13 = unpack_from_int32(stacks[("w13", "weight_packed")][row].t().contiguous(), bits, torch.Size([2 * n, H]))
            assert torch.equal(w13[:n], ex["w1"]["codes"][rows]) and torch.equal(w13[n:], ex["w3"]["codes"][rows])
            w2 = unpack_from_int32(stacks[("w2", "weight_packed")][row].t().contiguous(), bits, torch.Size([H, n]))
            assert torch.equal(w2, ex["w2"]["codes"][:, rows])
            s13 = stacks[("w13", "weight_scale")][row].t()
            assert torch.equal(s13, torch.cat([ex["w1"]["weight_scale"][rows], ex["w3"]["weight_scale"][rows]]))
            cols = slice(rank * n // group, (rank + 1) * n // group)
            assert torch.equal(stacks[("w2", "weight_scale")][row].t(), ex["w2"]["weight_scale"][:, cols])
            if not sym:
                z13 = unpack_from_int32(stacks[("w13", "weight_zero_point")][row].t().contiguous(), bits,
                                        torch.Size([2 * n, H // group]), packed_dim=0)
                assert torch.equal(z13, torch.cat([ex["w1"]["zero"][rows], ex["w3"]["zero"][rows]]))


def test_a_part_of_another_scheme_does_not_fit_its_slot():
    g = torch.Generator().manual_seed(2)
    w8 = _expert(8, 64, 256, 128, True, g)
    stacks = stacked_shapes(Scheme(4, 64), 1, 256, 128)
    packed = torch.zeros(stacks[("w13", "weight_packed")], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit its slot"):
        place(packed, w8["w1"]["weight_packed"], "weight_packed", "w1", 0)


@pytest.mark.parametrize("scheme,hidden,inter,why", [
    (Scheme(4, 128), 256, 128, None),
    (Scheme(8, 32), 2048, 768, None),
    (Scheme(3, 128), 256, 128, "3-bit experts"),
    (Scheme(8, 128, False), 256, 128, "8-bit experts with zero points"),
    (Scheme(4, 256), 256, 256, "group size 256"),
    (Scheme(4, 32), 64, 128, "hidden size 64"),
    (Scheme(4, 128), 256, 64, "intermediate size 64"),
])
def test_what_the_marlin_moe_kernel_takes(scheme, hidden, inter, why):
    got = check_servable(scheme, hidden, inter)
    assert (got is None) if why is None else (why in got)


def test_pyproject_declares_the_entry_point_vllm_loads(tmp_path):
    from importlib.metadata import entry_points

    import tomllib

    from quant.serve.names import PLUGIN_NAME, PLUGIN_TARGET
    from quant.serve.vllm_plugin import checkout_entry_point
    from tests.conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {PLUGIN_NAME: PLUGIN_TARGET}
    import sys

    sys.path.insert(0, str(checkout_entry_point(tmp_path)))
    try:
        found = [e for e in entry_points(group="vllm.general_plugins") if e.name == PLUGIN_NAME]
        assert found and found[0].value == PLUGIN_TARGET
        assert callable(found[0].load())  # the target imports without vLLM (vLLM is imported when it is called)
    finally:
        sys.path.remove(str(tmp_path))
