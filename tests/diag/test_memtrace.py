"""quant.diag.memtrace.LiveBytes: live tensor bytes allocated inside a block, checked against storage sizes by hand."""

import threading

import pytest
import torch

from quant.diag.memtrace import LiveBytes

MB = 1 << 20


def _alloc(n_mb: int) -> torch.Tensor:  # a site inside this file is "(outside)" the quant package
    return torch.empty(n_mb * MB, dtype=torch.uint8)


def test_views_and_in_place_results_are_not_new_bytes_and_storage_lives_while_a_view_does():
    outside = torch.zeros(MB, dtype=torch.uint8)
    with LiveBytes(step=1) as m:
        a = _alloc(4)
        v = a[: MB]  # a view keeps a's storage alive
        a.add_(1)
        outside.add_(1)  # made before the block: never counted
        t = outside.view(-1)[:10]
        assert m.current == 4 * MB
        b = a * 2
        assert m.current == 8 * MB
        del a
        assert m.current == 8 * MB  # v still holds the storage
        del v
        assert m.current == 4 * MB
        c = _alloc(6)
        del b, c
        assert m.current == 0
    assert m.peak.bytes == 10 * MB
    assert t.numel() == 10


def test_peak_sites_are_the_quant_frames_that_allocated():
    from quant.algos.grid import quantize_weight
    from quant.scheme import Scheme

    w = torch.randn(2, 256, 512)
    with LiveBytes(step=1) as m:
        q = quantize_weight(w, Scheme(4, 128, True), torch.float32)
    sites = dict(m.peak.sites)
    assert sites and all(s.startswith("grid.py:") for s in sites), sites
    assert m.peak.bytes >= q.q.nbytes + q.scale.nbytes
    assert m.current == q.q.untyped_storage().nbytes() + q.scale.untyped_storage().nbytes() + (
        0 if q.zero is None else q.zero.untyped_storage().nbytes())


def test_phase_peaks_and_other_threads_pass_through():
    with LiveBytes(step=1) as m:
        with m.phase("big"):
            x = _alloc(8)
            del x
        with m.phase("small"):
            y = _alloc(2)
        other = threading.Thread(target=lambda: _alloc(16))
        other.start()
        other.join()
        del y
    assert m.phase_peaks == {"big": 8 * MB, "small": 2 * MB}
    assert m.peak.bytes == 8 * MB and m.current == 0


def _event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_peak_from_a_snapshot_replays_the_trace_over_what_was_there_before():
    from pathlib import Path

    from quant.diag.memtrace import peak_from_snapshot

    here = str(Path(__import__("quant").__file__).parent / "engine" / "quantize.py")
    frames = [{"filename": "/site-packages/torch/x.py", "line": 1, "name": "f"},
              {"filename": here, "line": 7, "name": "solve"}]
    trace = [_event("alloc", 1, 100, frames), _event("alloc", 2, 50), _event("free_completed", 1, 100),
             _event("alloc", 3, 30, frames), _event("segment_alloc", 9, 4096)]
    # at snapshot time 40 bytes from before the trace plus blocks 2 and 3 are allocated
    snapshot = {"device_traces": [[], trace], "segments": [
        {"device": 1, "blocks": [{"size": 40, "state": "active_allocated"}, {"size": 50, "state": "active_allocated"},
                                 {"size": 30, "state": "active_allocated"}, {"size": 900, "state": "inactive"}]}]}
    peak = peak_from_snapshot(snapshot, 1, step=1)
    assert peak.bytes == 190
    assert dict(peak.sites) == {"quantize.py:7 solve": 100, "(outside)": 50, "(before the trace)": 40}


@pytest.mark.gpu
def test_peak_from_a_real_cuda_snapshot_matches_the_allocator():
    from quant.diag.memtrace import peak_from_snapshot

    dev = torch.cuda.current_device()
    keep = torch.empty(3 * MB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        a = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")
        b = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(2 * MB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = peak_from_snapshot(snapshot, dev, step=1)
    assert peak.bytes == torch.cuda.max_memory_allocated(dev)
    assert dict(peak.sites)["(before the trace)"] == torch.cuda.max_memory_allocated(dev) - 12 * MB
    del b, c, keep


def test_a_storage_counts_until_it_is_freed_also_when_rewrapped_outside_an_op():
    """``load_state_dict(assign=True)`` and ``.data =`` rewrap an op's output in another tensor object: the storage is
    alive as long as any object holds it (tracking tensor objects instead missed the layer's 23 GB of weights)."""
    with LiveBytes(step=1) as m:
        t = _alloc(4)
        p = torch.nn.Parameter(t, requires_grad=False)
        del t
        assert m.current == 4 * MB
        q = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        q.data = _alloc(2)
        assert m.current == 6 * MB
        del p, q
        assert m.current == 0


def test_meta_tensors_hold_no_bytes():
    with LiveBytes(step=1) as m:
        a = torch.empty(MB, device="meta")
        b = torch.nn.Linear(512, 512, device="meta").to("meta")
        c = _alloc(1)
    assert m.peak.bytes == MB == m.current
    assert a.is_meta and b.weight.is_meta and c.numel() == MB
