"""quant.layerwise's layer reader: the read-ahead copy in page-locked memory on a GPU."""

import pytest
import torch

from quant.dist import SINGLE
from quant.layerwise import _LayerReader, pinned_copy
from quant.models import resolve_model
from quant.models.layers import read_layer_tensors


def test_over_budget_or_without_a_gpu_the_tensors_stay_as_read():
    src = resolve_model("builtin:qwen3-moe-tiny")
    full = read_layer_tensors(src, 1)
    kept = pinned_copy(full, budget=0)
    assert all(kept[k] is full[k] for k in full)
    if not torch.cuda.is_available():
        assert all(pinned_copy(full, budget=1 << 40)[k] is full[k] for k in full)


@pytest.mark.gpu
def test_read_ahead_is_page_locked_and_exact():
    """On a GPU the next layer is read ahead into one page-locked buffer (its uploads then queue without a
    stream sync); every tensor equal to a direct read, dtypes and shapes kept, each 64-byte aligned."""
    src = resolve_model("builtin:qwen3-moe-tiny")
    reader = _LayerReader(src, SINGLE, torch.device("cuda"))
    reader.take(0)  # starts reading layer 1 ahead
    got = reader.take(1)
    full = read_layer_tensors(src, 1)
    assert sorted(got) == sorted(full)
    for k, t in full.items():
        assert got[k].is_pinned() and got[k].dtype == t.dtype and torch.equal(got[k], t), k
        assert got[k].data_ptr() % 64 == 0, k
    reader.pin_budget = 0
    reader.take(1)
    assert not any(t.is_pinned() for t in reader.take(2).values())
