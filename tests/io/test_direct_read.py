"""quant.io.direct_read: safetensors tensors read by parallel preads into one caller buffer."""

import pytest
import torch
from safetensors.torch import save_file

from quant.errors import ModelError
from quant.io import direct_read
from quant.io.direct_read import _entries, _runs, read_into
from quant.io.staging import ALIGN_BYTES
from quant.models import resolve_model
from quant.models.layers import read_layer_tensors
from quant.models.source import read_safetensors


def _shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {
        "w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(3, 11, generator=g),
        "w.f16.odd": torch.randn(3, generator=g).to(torch.float16),  # 6 bytes: the next tensor is realigned
        "w.i64": torch.arange(-5, 8, dtype=torch.int64),
        "w.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    b = {
        "v.bool": torch.tensor([True, False, True]),
        "v.f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "v.u8": torch.arange(200, 213, dtype=torch.uint8),
        "v.i32": torch.tensor([[1, -2], [3, 2**30]], dtype=torch.int32),
    }
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    weight_map = {**dict.fromkeys(a, "a.safetensors"), **dict.fromkeys(b, "b.safetensors")}
    return weight_map, {**a, **b}


@pytest.mark.parametrize("chunk", [1 << 26, 24])
def test_every_dtype_reads_exactly_as_safe_open_into_one_aligned_buffer(tmp_path, monkeypatch, chunk):
    """Mixed dtypes (fp8, bool, a zero-size and a 6-byte tensor), two shards, keys in any order; with 24-byte
    chunks every tensor spans several preads from 4 threads. Each tensor is a 64-byte aligned view of the buffer."""
    monkeypatch.setattr(direct_read, "READ_CHUNK_BYTES", chunk)
    weight_map, saved = _shards(tmp_path)
    keys = ["v.i32", "w.f16.odd", "w.empty", "v.f8", "w.bf16", "v.bool", "w.f32", "w.i64", "v.u8"]
    bufs = []
    got = read_into(tmp_path, weight_map, keys, lambda n: bufs.append(torch.full((n,), 0xAB, dtype=torch.uint8))
                    or bufs[-1], threads=4)
    want = read_safetensors(tmp_path, weight_map, keys)
    assert sorted(got) == sorted(keys) and len(bufs) == 1
    base = bufs[0].data_ptr()
    for k in keys:
        assert got[k].dtype == want[k].dtype == saved[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
        if got[k].numel():  # a zero-size tensor has no address
            assert (got[k].data_ptr() - base) % ALIGN_BYTES == 0 and base <= got[k].data_ptr() < base + bufs[0].numel()


def test_neighbours_in_file_and_buffer_are_one_read_cut_into_chunks(monkeypatch):
    """(file, begin, n_bytes, ...) entries: adjacent in the file and in the buffer -> one read; a buffer gap (the
    64-byte realignment) or another file -> a new read; a read longer than a chunk -> several."""
    e = [("a", 100, 6, "x"), ("a", 106, 10, "y"), ("a", 116, 64, "z"), ("b", 180, 8, "u"), ("a", 500, 0, "empty")]
    assert _runs(e, [0, 6, 16, 80, 88]) == [("a", 100, 0, 80), ("b", 180, 80, 8)]
    assert _runs(e, [0, 64, 128, 192, 256]) == [("a", 100, 0, 6), ("a", 106, 64, 10), ("a", 116, 128, 64),
                                                 ("b", 180, 192, 8)]
    monkeypatch.setattr(direct_read, "READ_CHUNK_BYTES", 32)
    assert _runs(e[:3], [0, 6, 16]) == [("a", 100, 0, 32), ("a", 132, 32, 32), ("a", 164, 64, 16)]


def test_a_declined_buffer_reads_nothing_and_the_source_falls_back(tmp_path):
    weight_map, _ = _shards(tmp_path)
    assert read_into(tmp_path, weight_map, ["w.f32"], lambda n: None, threads=2) is None
    src = resolve_model("builtin:qwen3-moe-tiny")
    plain = read_layer_tensors(src, 1)
    keys = sorted(plain)
    declined = src.read_tensors(keys, into=lambda n: None)
    bufs = []
    direct = src.read_tensors(keys, into=lambda n: bufs.append(torch.empty(n, dtype=torch.uint8)) or bufs[-1])
    lo, hi = bufs[0].data_ptr(), bufs[0].data_ptr() + bufs[0].numel()
    for k in keys:
        assert torch.equal(declined[k], plain[k]) and torch.equal(direct[k], plain[k]), k
        assert lo <= direct[k].data_ptr() < hi or direct[k].numel() == 0, k


def test_a_truncated_shard_or_a_lying_header_is_one_model_error_naming_file_and_tensor(tmp_path):
    weight_map, _ = _shards(tmp_path)
    path = tmp_path / "a.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # the last tensor's data is cut short
    last = max(_entries(tmp_path, weight_map, [k for k, f in weight_map.items() if f == "a.safetensors"]),
               key=lambda e: e[1])[3]
    with pytest.raises(ModelError, match=rf"a\.safetensors ends before {last}'s data; it is truncated"):
        read_into(tmp_path, weight_map, [last], lambda n: torch.empty(n, dtype=torch.uint8), threads=2)
    path.write_bytes(data.replace(b'"data_offsets":[0,', b'"data_offsets":[2,', 1))
    with pytest.raises(ModelError, match=r"a\.safetensors: .* data offsets span .* the file is damaged"):
        read_into(tmp_path, weight_map, [k for k in weight_map if k.startswith("w.")],
                  lambda n: torch.empty(n, dtype=torch.uint8), threads=2)
    with pytest.raises(ModelError, match=r"lacks c\.safetensors"):
        read_into(tmp_path, {"x": "c.safetensors"}, ["x"], lambda n: torch.empty(n, dtype=torch.uint8), threads=1)


def test_a_dtype_outside_the_table_declines_before_any_buffer_is_asked_for(tmp_path, monkeypatch):
    """A shard holding a dtype the table lacks (here: BF16 taken out of it) is left to safe_open: read_into returns
    None without calling ``into``, and ModelSource.read_tensors still returns the tensors."""
    weight_map, saved = _shards(tmp_path)
    monkeypatch.delitem(direct_read.TORCH_DTYPES, "BF16")
    asked = []
    assert read_into(tmp_path, weight_map, ["w.f32", "w.bf16"], lambda n: asked.append(n), threads=2) is None
    assert asked == []
    got = read_into(tmp_path, weight_map, ["w.f32"], lambda n: torch.empty(n, dtype=torch.uint8), threads=2)
    assert torch.equal(got["w.f32"], saved["w.f32"])


def test_symlinked_shards_as_in_the_hub_cache_read_through_their_links(tmp_path):
    """huggingface_hub's cache keeps shards as symlinks into blobs/: the reads follow them."""
    (tmp_path / "blobs").mkdir()
    weight_map, saved = _shards(tmp_path / "blobs")
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for f in set(weight_map.values()):
        (snap / f).symlink_to(tmp_path / "blobs" / f)
    got = read_into(snap, weight_map, list(saved), lambda n: torch.empty(n, dtype=torch.uint8), threads=3)
    assert all(torch.equal(got[k].view(torch.uint8), saved[k].view(torch.uint8)) for k in saved)
