"""quant.layerwise's layer reader (the read-ahead copy in page-locked memory on a GPU) and its copies between
host and GPU."""

import mmap
import threading

import pytest
import torch

from quant.io.staging import copy_into
from quant.layerwise import LayerReader, Layerwise, transfer
from quant.models import resolve_model
from quant.models.layers import read_layer_tensors
from quant.parallel.world import World


def test_copy_into_lays_tensors_out_aligned_in_one_buffer_or_leaves_them_when_declined():
    """Computed tensors (a dequantizing source) go into one staging buffer as 64-byte aligned views, values, dtypes
    and shapes kept; a declined buffer (over budget) leaves them as they are."""
    src = resolve_model("builtin:qwen3-moe-tiny")
    full = read_layer_tensors(src, 1)
    kept = copy_into(full, lambda n: None)
    assert all(kept[k] is full[k] for k in full) and copy_into({}, lambda n: 1 / 0) == {}
    bufs = []
    got = copy_into(full, lambda n: bufs.append(torch.empty(n, dtype=torch.uint8)) or bufs[-1])
    lo = bufs[0].data_ptr()
    for k, t in full.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t) and got[k] is not t, k
        assert (got[k].data_ptr() - lo) % 64 == 0 and lo <= got[k].data_ptr() < lo + bufs[0].numel(), k


@pytest.mark.gpu
def test_read_ahead_is_page_locked_exact_and_alternates_two_staging_buffers():
    """On a GPU layer ``idx + 1`` is read ahead into staging buffer ``(idx + 1) % 2`` (page-locked, page-aligned: no
    page shared with another registered buffer) while layer ``idx`` uploads from the other: every layer's tensors
    equal a direct read on the host and after the upload, dtypes and shapes kept, each 64-byte aligned inside its
    buffer, the buffers reused (not reallocated) from layer 2 on. Over the budget the read-ahead stays as read."""
    src = resolve_model("builtin:qwen3-moe-tiny")
    reader = LayerReader(src, World(), torch.device("cuda"))
    seen = []
    for idx in range(src.n_layers):  # layer 0 is read by take itself, each later one ahead
        got = reader.take(idx)
        on_gpu = {k: t.to("cuda", non_blocking=True) for k, t in got.items()}
        reader.uploaded(idx)
        buf = reader.staging.bufs[idx % 2]
        seen.append(buf.data_ptr())
        full = read_layer_tensors(src, idx)
        assert sorted(got) == sorted(full)
        assert _registered(buf)
        for k, t in full.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
            assert torch.equal(on_gpu[k].cpu(), t), k
            assert (got[k].data_ptr() - buf.data_ptr()) % 64 == 0, k
            assert buf.data_ptr() <= got[k].data_ptr() < buf.data_ptr() + buf.numel(), k
    assert src.n_layers >= 4 and seen[2:] == seen[:-2] and seen[0] != seen[1]
    assert all(p % mmap.PAGESIZE == 0 for p in seen)
    reader.pin_budget = 0
    reader.__dict__.pop("staging")
    reader.take(src.n_layers - 2)
    last = reader.take(src.n_layers - 1)
    assert reader.staging.bufs == [None, None] and all(torch.equal(last[k], t) for k, t in full.items())


def _registered(buf: torch.Tensor) -> bool:
    """Whether ``buf``'s pages are registered with CUDA: registering them again is refused. (torch's ``is_pinned``
    knows only its own allocator's blocks.) On a thread of its own: CUDA's last error is per thread."""
    out = []

    def probe():
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        if err == cudart.cudaError.success:
            cudart.cudaHostUnregister(buf.data_ptr())
        out.append(err != cudart.cudaError.success)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return out[0]


def test_staging_declines_every_later_read_once_cuda_refuses_a_registration(monkeypatch):
    """A refused page-locking (a host over its locked-memory limit) is tried once, not again for every layer (each
    try allocates and fills the layer's size): later reads decline at once and go to pageable memory."""
    from quant.io import staging

    calls = []
    monkeypatch.setattr(staging, "page_locked", lambda n: calls.append(n) and None)
    s = staging.Staging(1 << 30)
    assert s.into(0)(4096) is None and s.into(1)(4096) is None and s.into(0)(8192) is None
    assert calls == [4096] and s.used == [False, False]


def test_transfer_on_one_device_converts_and_copies():
    src = torch.randn(3, 5).bfloat16()
    dst = torch.empty(3, 5)
    transfer(dst, src)
    assert torch.equal(dst, src.float())
    back = torch.empty(3, 5, dtype=torch.bfloat16)
    transfer(back, dst)
    assert torch.equal(back, src)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [True, False])
def test_transfer_between_host_and_gpu_lands_every_value_converting_on_the_gpu(pinned, monkeypatch):
    """From the GPU into host memory (page-locked or not) and back, widening and narrowing: every value lands before
    anything reads it (``x.to("cpu", non_blocking=True)`` hands back page-locked memory the transfer has not yet
    filled), and no dtype change runs on the host (torch converts a copy between host and GPU there, through a
    temporary of the whole tensor)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    on_gpu = torch.randn(64, 1024, 1024, generator=gen, device="cuda")  # 256 MB: the transfer outlasts a host copy
    host = torch.empty(on_gpu.shape, dtype=torch.bfloat16, pin_memory=pinned)
    host_conversions = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "cuda" and out.dtype != self.dtype:
            host_conversions.append((self.dtype, out.dtype))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    transfer(host, on_gpu)
    want = on_gpu.bfloat16().cpu()
    assert torch.equal(host, want)
    back = torch.empty(on_gpu.shape, device="cuda")
    transfer(back, host)
    assert torch.equal(back, want.cuda().float()) and not host_conversions


@pytest.mark.gpu
def test_a_layer_forward_into_page_locked_host_memory_holds_the_gpu_s_outputs():
    """Layerwise.forward's batches written into a page-locked host tensor (activations kept off the GPU) are the
    outputs of the same forward kept on the GPU, bit for bit."""
    src = resolve_model("builtin:qwen3-moe-tiny")
    lw = Layerwise(src, "float32", "cuda", 2, World())
    hidden = torch.randn(8, 64, src.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with lw.layer(0) as layer:
        on_gpu = lw.forward(layer, hidden.cuda())
        host = lw.forward(layer, hidden, out=torch.empty(hidden.shape, pin_memory=True))
        torch.cuda.synchronize()
    assert torch.equal(host, on_gpu.cpu())
