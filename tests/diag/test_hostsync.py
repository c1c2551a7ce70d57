"""quant.diag.hostsync: the calls that make a host wait for a GPU, counted on a CPU run by source line."""

import pytest
import torch

from quant.diag.hostsync import HostSyncs

HERE = __file__.rsplit("/", 1)[0]


def _reads(t: torch.Tensor) -> None:
    t.sum().item()  # line +1
    bool(t.any())
    t.tolist()
    t.nonzero()
    t[t > 0]  # a boolean mask: nonzero inside the kernel
    torch.bincount(t.long().abs())
    t.cpu()


def _no_reads(t: torch.Tensor, counts: torch.Tensor) -> None:
    t[torch.tensor([0, 1])]  # an integer index
    torch.repeat_interleave(torch.arange(3), counts, output_size=6)
    t * 2 + 1
    t.to(torch.float64)


def test_each_kind_of_host_read_is_counted_at_its_line():
    t = torch.randn(16)
    with HostSyncs(package=HERE) as s:
        _reads(t)
    first = _reads.__code__.co_firstlineno + 1
    what = {k.split(" ")[0].split(":")[1]: k.split("(")[-1].rstrip(")") for k in s.sites}
    assert what == {str(first): "_local_scalar_dense", str(first + 1): "_local_scalar_dense", str(first + 2): "tolist",
                    str(first + 3): "nonzero", str(first + 4): "index", str(first + 5): "bincount",
                    str(first + 6): "cpu"}, s.sites
    assert s.total == 7 and all(k.split(" ")[1] == "_reads" for k in s.sites)


def test_sized_and_integer_index_ops_are_not_reads_and_methods_come_back():
    t, counts = torch.randn(16), torch.tensor([1, 2, 3])
    with HostSyncs(package=HERE) as s:
        _no_reads(t, counts)
        torch.repeat_interleave(torch.arange(3), counts)  # no output size: the host must read the total
    assert list(s.sites.values()) == [1] and "repeat_interleave" in next(iter(s.sites)), s.sites
    assert "counted" not in repr(torch.Tensor.tolist) and torch.tensor([1]).tolist() == [1]
    assert s.total == 1


def test_other_threads_are_not_counted():
    import threading

    with HostSyncs(package=HERE) as s:
        th = threading.Thread(target=lambda: torch.tensor([1.0]).item())
        th.start()
        th.join()
    assert s.total == 0


def test_on_device_values_and_tensors():
    from quant.diag.hostsync import on_device

    t = on_device([3, 1, 2], "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
    assert on_device(2.5, torch.device("cpu"), torch.float32).item() == 2.5
    src = torch.arange(4, dtype=torch.int32)
    assert torch.equal(on_device(src, "cpu"), src) and on_device(src, "cpu").dtype == torch.int32


def test_no_index_list_goes_to_a_device_from_pageable_memory():
    """``torch.tensor(values, device=...)`` on a GPU synchronizes the stream before its copy (pageable memory): a
    layer built hundreds of such index lists. Every one in quant goes through ``hostsync.on_device`` instead."""
    import ast
    from pathlib import Path

    import quant

    found = []
    for path in Path(quant.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tensor"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and any(k.arg == "device" for k in node.keywords)):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def _queue_work(dev) -> torch.Tensor:
    """About a second of queued matrix products (fp32; ~0.15 s with TF32): a stream sync would wait for it. The
    entries stay finite (tanh): a plain power of a random matrix overflows to inf within a few products."""
    busy = torch.randn(8192, 8192, device=dev)
    for _ in range(40):
        busy = torch.tanh(busy @ busy / 90.5)
    return busy


@pytest.mark.gpu
def test_on_device_copies_from_page_locked_memory_without_a_sync():
    from quant.diag.hostsync import on_device

    dev = torch.device("cuda")
    on_device(list(range(1000)), dev)  # the page-locked allocator's first block: not part of what is timed
    torch.cuda.synchronize()
    _queue_work(dev)  # runs on after its result is dropped
    t = on_device(list(range(1000)), dev)
    assert not torch.cuda.current_stream().query()  # the host did not wait for the queued work
    assert t.device.type == "cuda" and t.tolist() == list(range(1000))


def test_host_copy_of_a_cpu_tensor_is_the_tensor():
    from quant.diag.hostsync import HostCopy

    t = torch.tensor([3, 1, 2])
    c = HostCopy(t)
    assert c.values is t and c.tolist() == [3, 1, 2]


@pytest.mark.gpu
def test_host_copy_starts_without_waiting_and_reads_the_values():
    from quant.diag.hostsync import HostCopy

    dev = torch.device("cuda")
    HostCopy(torch.arange(7, device=dev)).tolist()  # the page-locked allocator's first block
    busy = _queue_work(dev)
    counts = torch.arange(7, device=dev) * busy[0, 0].isfinite().long()  # computed after the queued work
    c = HostCopy(counts)
    assert not torch.cuda.current_stream().query()  # queued, not waited for
    assert c.tolist() == list(range(7))
