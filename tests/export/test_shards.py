"""The shard plan: the same on every rank, shard files filled in order up to the limit, shards dealt to ranks
balanced by bytes, and exactly what each format's writer puts in each file."""

from __future__ import annotations

import json
import random

import pytest

from quant.export.shards import Planned, plan_shards, plan_tensors, shard_owners
from quant.models.headers import read_safetensors_header
from quant.parallel.world import World


def _tensors(sizes: list[int]) -> list[Planned]:
    return [Planned(f"t{i:03d}", (n,), "U8", f"t{i:03d}", None) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("seed", range(5))
def test_shards_hold_every_tensor_once_in_order_each_file_filled_up_to_the_limit(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 10, 100, 400, 1500]) for _ in range(rng.randint(1, 200))]
    tensors, limit = _tensors(sizes), 1000
    shards = plan_shards(tensors, limit)
    assert [t for s in shards for t in s.tensors] == tensors
    for i, s in enumerate(shards):
        assert s.tensors and (s.nbytes <= limit or len(s.tensors) == 1)  # a larger tensor has a file of its own
        if i + 1 < len(shards):  # the next file's first tensor did not fit
            assert s.nbytes + shards[i + 1].tensors[0].nbytes > limit
    n = len(shards)
    names = [s.file for s in shards]
    assert names == (["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors"
                                                           for i in range(1, n + 1)])


@pytest.mark.parametrize("limit", [1, 50, 120, 1000])
def test_a_modules_parts_share_one_file(limit):
    """Codes, scale and zero point of a quantized module are never split over files, whatever the limit (a loader
    finds a module's parts in the file of its codes); other tensors still fill files up to the limit."""
    tensors = []
    for m in range(6):
        tensors += [Planned(f"m{m}.{part}", (n,), "U8", f"m{m}.weight", 0, f"layers.0.m{m}", part)
                    for part, n in (("weight_packed", 40), ("weight_scale", 30), ("weight_zero_point", 10))]
        tensors.append(Planned(f"norm{m}", (25,), "U8", f"norm{m}", 0))
    shards = plan_shards(tensors, limit)
    assert [t for s in shards for t in s.tensors] == tensors
    home = {t.module: {s.file for s in shards for u in s.tensors if u.module == t.module} for t in tensors if t.module}
    assert all(len(files) == 1 for files in home.values()), home
    for s in shards:
        units = {t.module or t.name for t in s.tensors}
        assert s.nbytes <= limit or len(units) == 1


def test_no_tensors_is_one_empty_file_and_small_models_one_file():
    assert [(s.file, s.tensors) for s in plan_shards([], 10)] == [("model.safetensors", ())]
    assert [s.file for s in plan_shards(_tensors([3, 3, 3]), 10)] == ["model.safetensors"]


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 8])
def test_shards_go_to_ranks_once_each_balanced_by_bytes_and_alike_everywhere(n_ranks):
    rng = random.Random(n_ranks)
    shards = plan_shards(_tensors([rng.randint(1, 1000) for _ in range(300)]), 1000)
    owners = shard_owners(shards, n_ranks)
    assert owners == shard_owners(list(shards), n_ranks)  # what every rank computes
    assert len(owners) == len(shards) and set(owners) == set(range(n_ranks))
    loads = [sum(s.nbytes for s, r in zip(shards, owners, strict=True) if r == rank) for rank in range(n_ranks)]
    assert max(loads) - min(loads) <= max(s.nbytes for s in shards)
    assert shard_owners(shards[:3], 8).count(0) == 1  # fewer shards than ranks: some ranks write nothing


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """builtin:qwen3-moe-tiny quantized with AWQ (it changes kept norms, written from the store), experts at 8 and
    2 bits, asymmetric, group 32: every kind of tensor the writers make."""
    from transformers import AutoTokenizer

    from quant.calibration import build_calibration
    from quant.layerwise import Layerwise
    from quant.models import resolve_model
    from quant.plan.bitplan import plan_bits
    from quant.profile.profile import profile_routing
    from quant.quantize.driver import quantize_model
    from quant.recipe import PlanSpec, QuantizeSpec

    src = resolve_model("builtin:qwen3-moe-tiny")
    calib = build_calibration("calibration/bundled.yaml", AutoTokenizer.from_pretrained(src.path), 8, 32, 0)
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", 8, world=World()))
    plan = plan_bits(prof, src.modules, PlanSpec(group_size=32, low_bits=2, high_bits=8, symmetric=False), src.n_layers, ("compressed-tensors", "gptq"))
    qdir = tmp_path_factory.mktemp("store") / "quantized"
    quantize_model(src, calib, plan.quantized_schemes(), "awq", QuantizeSpec(algorithm="awq"),
                   Layerwise(src, "bfloat16", "cpu", 8, World()), qdir)
    return src, plan, qdir


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_every_file_holds_exactly_the_planned_tensors(store, tmp_path, fmt):
    from quant.export.compressed_tensors import compress_module, write_compressed_tensors
    from quant.export.gptq import gptq_tensors, write_gptq

    src, plan, qdir = store
    make, write = ((compress_module, write_compressed_tensors) if fmt == "compressed-tensors"
                   else (lambda qw: gptq_tensors(qw, True), write_gptq))
    limit = 150_000
    shards = plan_shards(plan_tensors(src, plan, qdir, make), limit)
    write(src, plan, qdir, tmp_path / "ckpt", limit, World())
    assert len(shards) >= 3
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == [s.file for s in shards]
    for s in shards:
        header = read_safetensors_header(tmp_path / "ckpt" / s.file)
        assert header == {t.name: (t.dtype, t.shape) for t in s.tensors}, s.file
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {t.name: s.file for s in sorted(shards, key=lambda s: s.file) for t in s.tensors}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in shards)
    parts = {t.part for s in shards for t in s.tensors}
    assert parts >= ({"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"}
                     if fmt == "compressed-tensors" else {"qweight", "qzeros", "scales", "g_idx"})
