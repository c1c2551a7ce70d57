"""The test harness itself: xdist workers spread over the visible GPUs."""

from __future__ import annotations

import pytest

from tests.conftest import _spread_xdist_workers_over_gpus


@pytest.mark.parametrize(("worker", "visible", "expect"), [
    ("gw3", "4,5", "5"), ("gw2", "4,5", "4"), ("gw7", "0,1,2", "1"),  # worker N takes GPU N mod count
    ("gw3", "6", "6"),  # one visible GPU: shared by every worker
    ("", "0,1", "0,1"),  # not an xdist worker: left alone
])
def test_xdist_workers_each_see_one_of_the_visible_gpus(monkeypatch, worker, visible, expect):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("QUANT_TEST_GPU_SPREAD", raising=False)
    _spread_xdist_workers_over_gpus()
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == expect


def test_spreading_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("QUANT_TEST_GPU_SPREAD", "0")
    _spread_xdist_workers_over_gpus()
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
