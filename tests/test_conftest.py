"""The test harness itself: xdist workers spread over the visible GPUs; the failure and progress logs."""

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


class _Report:
    def __init__(self, outcome: str, when: str = "call"):
        self.nodeid, self.when, self.duration, self.outcome = "tests/x.py::t", when, 1.25, outcome
        self.failed, self.longreprtext = outcome == "failed", "Traceback: boom"


@pytest.mark.parametrize("worker", ["gw0", None])
def test_failure_and_progress_logs_are_written_once_by_the_controller(tmp_path, monkeypatch, worker):
    """Under xdist each report reaches the hooks in the worker and again in the controller: only the controller
    writes, so a failure appears once; the progress log has each test's start, its end with the outcome, and a
    failed setup."""
    from tests.conftest import pytest_runtest_logreport, pytest_runtest_logstart

    faillog, progress = tmp_path / "fail.txt", tmp_path / "progress.txt"
    monkeypatch.setenv("QUANT_TEST_FAILLOG", str(faillog))
    monkeypatch.setenv("QUANT_TEST_PROGRESS", str(progress))
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytest_runtest_logstart("tests/x.py::t", ("tests/x.py", 1, "t"))
    for report in (_Report("passed", "setup"), _Report("failed"), _Report("passed", "teardown"),
                   _Report("failed", "setup")):
        pytest_runtest_logreport(report)
    if worker:
        assert not faillog.exists() and not progress.exists()
        return
    assert faillog.read_text().count("=====") == 2 and "Traceback: boom" in faillog.read_text()
    assert progress.read_text().splitlines() == ["start tests/x.py::t", "failed call 1.2 tests/x.py::t",
                                                 "failed setup 1.2 tests/x.py::t"]
