"""The quantized store's files: the background writer writes exactly what write_layer writes, and a failed write
surfaces at the next wait instead of being lost."""

from __future__ import annotations

import pytest
import torch

from quant.algos.grid import quantize_weight
from quant.quantize.qstore import LayerWriter, read_layer, read_params, write_layer
from quant.scheme import Scheme


def _results():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 64, generator=g)
    qw = quantize_weight(w, Scheme(4, 32, False), torch.bfloat16)
    return {f"layers.0.experts.{e}.up": type(qw)(qw.q[e], qw.scale[e], qw.zero[e], qw.spec) for e in range(3)}


def test_background_writer_writes_the_same_bytes_as_write_layer(tmp_path):
    results, params = _results(), {"post_attention_layernorm.weight": torch.ones(64, dtype=torch.bfloat16)}
    write_layer(tmp_path / "a.safetensors", results, params)
    writer = LayerWriter(background=True)
    writer.submit(tmp_path / "b.safetensors", results, params)
    writer.wait()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    back = read_layer(tmp_path / "b.safetensors")
    assert all(torch.equal(back[n].q, results[n].q) and torch.equal(back[n].zero, results[n].zero) for n in results)
    assert torch.equal(read_params(tmp_path / "b.safetensors")["post_attention_layernorm.weight"], params[
        "post_attention_layernorm.weight"])


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    writer = LayerWriter(background=True)
    writer.submit(tmp_path / "missing-dir" / "layer.safetensors", _results(), {})
    with pytest.raises(Exception, match="No such file|not found|missing-dir"):
        writer.wait()
    writer.wait()  # the error is reported once


@pytest.mark.parametrize("bits,symmetric,n_in", [(4, True, 64), (4, False, 64), (3, False, 32), (2, True, 32),
                                                 (8, True, 64), (4, True, 33)])
def test_codes_of_up_to_4_bits_are_stored_two_a_byte_and_read_back_unchanged(tmp_path, bits, symmetric, n_in):
    from safetensors import safe_open

    from quant.quantize.qstore import read_layout

    g = torch.Generator().manual_seed(bits)
    group = n_in if n_in % 32 else 32
    qw = quantize_weight(torch.randn(2, 8, n_in, generator=g) * 3, Scheme(bits, group, symmetric), torch.bfloat16)
    assert int(qw.q.min()) == qw.spec.qmin and int(qw.q.max()) == qw.spec.qmax  # both ends of the range occur
    results = {f"m{e}": type(qw)(qw.q[e], qw.scale[e], None if qw.zero is None else qw.zero[e], qw.spec)
               for e in range(2)}
    path = tmp_path / "layer.safetensors"
    write_layer(path, results)
    packed = bits <= 4 and n_in % 2 == 0
    with safe_open(str(path), "pt") as f:
        stored = f.get_slice("m0.q")
        assert stored.get_dtype() == ("U8" if packed else "I8")
        assert stored.get_shape() == [8, n_in // 2 if packed else n_in]
    back = read_layer(path)
    for n, r in results.items():
        assert back[n].q.dtype == torch.int8 and torch.equal(back[n].q, r.q), n
        assert torch.equal(back[n].scale, r.scale)
    spec, (q_layout, _, _) = read_layout(path)["m0"]
    assert q_layout == ((8, n_in), "I8") and spec == qw.spec


def test_a_store_file_of_the_unpacked_layout_still_reads(tmp_path):
    """Files written before codes were packed hold int8 codes for 4-bit modules: a resumed run reads them."""
    from safetensors.torch import save_file

    qw = _results()["layers.0.experts.0.up"]
    path = tmp_path / "old.safetensors"
    save_file({"m.q": qw.q, "m.scale": qw.scale, "m.zero": qw.zero}, str(path),
              metadata={"quant": '{"modules": {"m": [4, 32, false]}, "report": {}}'})
    back = read_layer(path)["m"]
    assert torch.equal(back.q, qw.q) and torch.equal(back.zero, qw.zero)


@pytest.mark.gpu
def test_gpu_background_writer_packs_on_the_gpu_and_writes_the_same_bytes(tmp_path):
    results = _results()
    on_gpu = {n: type(q)(q.q.cuda(), q.scale.cuda(), q.zero.cuda(), q.spec) for n, q in results.items()}
    write_layer(tmp_path / "cpu.safetensors", results)
    writer = LayerWriter(background=True)
    writer.submit(tmp_path / "gpu.safetensors", on_gpu, {})
    writer.wait()
    assert (tmp_path / "cpu.safetensors").read_bytes() == (tmp_path / "gpu.safetensors").read_bytes()


@pytest.mark.parametrize("bits,symmetric,n_in", [(4, True, 64), (4, False, 64), (4, True, 36), (3, False, 32),
                                                 (2, True, 32), (8, True, 64), (4, True, 33)])
def test_the_checkpoint_writers_take_the_stores_packed_codes_as_they_are(tmp_path, bits, symmetric, n_in):
    """compressed-tensors' and GPTQ's tensors of a module are the same whether its codes come unpacked (int8) or as
    the store keeps them (read with ``packed=True``); at 4 bits the store's bytes are pack_to_int32's words and
    GPTQ's qweight transposed."""
    from quant.export.compressed_tensors import compress_module
    from quant.export.gptq import gptq_tensors

    g = torch.Generator().manual_seed(bits + n_in)
    group = n_in if n_in % 32 else 32
    qw = quantize_weight(torch.randn(1, 16, n_in, generator=g) * 3, Scheme(bits, group, symmetric), torch.bfloat16)
    one = type(qw)(qw.q[0], qw.scale[0], None if qw.zero is None else qw.zero[0], qw.spec)
    write_layer(tmp_path / "l.safetensors", {"m": one})
    as_stored = read_layer(tmp_path / "l.safetensors", packed=True)["m"]
    assert as_stored.q.dtype == (torch.uint8 if bits <= 4 and n_in % 2 == 0 else torch.int8)
    for writer in (compress_module, lambda qw: gptq_tensors(qw, not symmetric)):
        if writer is not compress_module and (bits == 3 or n_in * bits % 32):  # GPTQ: 2/4/8 bits, whole words
            continue
        a, b = writer(one), writer(as_stored)
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a}


def test_background_writer_lets_the_codes_go_before_the_disk_write(tmp_path, monkeypatch):
    """The codes the background writer was handed (on a GPU: the layer's codes on the device, 7 GB for a
    DeepSeek-V3 layer) are released once copied to the host, not held while the file is written: by the time the
    disk write starts no reference to them is left."""
    import weakref

    from quant.quantize import qstore

    results = _results()
    refs = [weakref.ref(qw.q) for qw in results.values()]
    alive_at_write = []
    real = qstore.write_layer
    monkeypatch.setattr(qstore, "write_layer", lambda *a, **k: alive_at_write.append(
        sum(r() is not None for r in refs)) or real(*a, **k))
    writer = LayerWriter(background=True)
    gate = __import__("threading").Event()
    writer.pool.submit(gate.wait)  # the write starts only after the caller has let go of its own references
    writer.submit(tmp_path / "l.safetensors", results, {})
    expected = {n: qw.q.clone() for n, qw in results.items()}
    del results
    gate.set()
    writer.wait()
    assert alive_at_write == [0]
    back = read_layer(tmp_path / "l.safetensors")
    assert all(torch.equal(back[n].q, q) for n, q in expected.items())


def test_a_stored_layer_is_reusable_only_while_its_bytes_are_the_recorded_ones(tmp_path):
    """write_layer records the file's SHA-256 beside it; a flipped byte, a truncated file or a missing record make
    the layer not reusable, each with its reason."""
    from quant.quantize.qstore import digest_file, remove_layer, stored_layer_problem

    path = tmp_path / "layer_00000.safetensors"
    write_layer(path, _results())
    assert digest_file(path).is_file() and stored_layer_problem(path) is None
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a code byte in the data section: the file still parses
    path.write_bytes(bytes(data))
    assert "damaged" in stored_layer_problem(path)
    write_layer(path, _results())
    assert stored_layer_problem(path) is None
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    assert "damaged" in stored_layer_problem(path)
    write_layer(path, _results())
    digest_file(path).unlink()
    assert "without a recorded digest" in stored_layer_problem(path)
    remove_layer(path)
    assert stored_layer_problem(path) == "missing" and not digest_file(path).exists()
