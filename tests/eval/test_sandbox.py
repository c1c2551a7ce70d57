"""quant.eval.sandbox: generated code runs in a contained child process, never in ours."""

from __future__ import annotations

import builtins
import os
import re
import socket
import time
from pathlib import Path

import pytest

from quant.eval.sandbox import (
    STDERR_TAIL_CHARS,
    ExecResult,
    network_isolation_available,
    run_program,
    run_programs,
)


def test_passing_program_passes() -> None:
    result = run_program("assert sum(range(10)) == 45\nprint('hello')")
    assert isinstance(result, ExecResult)
    assert (result.status, result.returncode, result.passed) == ("passed", 0, True)
    assert 0 < result.seconds < 10


@pytest.mark.parametrize(
    ("source", "expected_in_stderr"),
    [
        ("assert 1 + 1 == 3", "AssertionError"),
        ("def broken(:\n    pass", "SyntaxError"),
        ("raise KeyError('missing')", "KeyError"),
    ],
)
def test_exceptions_fail_with_their_traceback(source: str, expected_in_stderr: str) -> None:
    result = run_program(source)
    assert result.status == "failed"
    assert result.returncode == 1
    assert expected_in_stderr in result.stderr_tail


@pytest.mark.parametrize("source", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()"])
def test_exiting_early_with_status_zero_is_not_a_pass(source: str) -> None:
    # A completion that exits before the tests run must not count as passing them.
    assert run_program(source + "\nraise AssertionError('tests would fail')").status == "failed"


def test_program_does_not_run_in_the_callers_process() -> None:
    result = run_program("import builtins\nbuiltins.QUANT_SANDBOX_MARK = 1")
    assert result.passed
    assert not hasattr(builtins, "QUANT_SANDBOX_MARK")


@pytest.mark.parametrize("source", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_timeout_kills_busy_and_sleeping_programs(source: str) -> None:
    start = time.monotonic()
    result = run_program(source, timeout_s=1.0)
    assert result.status == "timeout"
    assert result.returncode is not None and result.returncode < 0  # killed by a signal
    assert time.monotonic() - start < 5.0


def test_unbounded_allocation_hits_the_memory_limit() -> None:
    source = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    result = run_program(source, memory_bytes=256 << 20, timeout_s=20.0)
    assert result.status == "memory"
    assert "MemoryError" in result.stderr_tail


def test_large_files_hit_the_file_size_limit() -> None:
    result = run_program("open('big.bin', 'wb').write(b'x' * (64 << 20))")
    assert result.status == "failed"
    assert "File too large" in result.stderr_tail


@pytest.mark.parametrize(
    "connect",
    [
        "socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))",
    ],
)
def test_network_connections_never_reach_a_listener(connect: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        result = run_program("import socket\n" + connect.format(port=port))
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.status == "failed"
    assert "sandbox" in result.stderr_tail


def test_network_namespace_is_empty_when_available() -> None:
    if not network_isolation_available():
        pytest.skip(
            "this kernel/container refuses unshare(CLONE_NEWNET); the audit hook still blocks sockets"
        )
    # /proc/self/net shows the reader's namespace: only an unconfigured loopback device.
    source = (
        "lines = open('/proc/self/net/dev').read().splitlines()[2:]\n"
        "names = sorted(line.split(':')[0].strip() for line in lines)\n"
        "assert names == ['lo'], names"
    )
    result = run_program(source)
    assert result.passed, result.stderr_tail
    assert result.network_isolated


def test_environment_is_minimal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANT_TEST_SECRET", "do-not-leak")
    source = (
        "import os\n"
        "assert 'QUANT_TEST_SECRET' not in os.environ\n"
        "assert set(os.environ) <= {'PATH', 'LC_CTYPE'}, sorted(os.environ)\n"
        "assert os.environ['PATH'] == '/usr/bin:/bin'"
    )
    result = run_program(source)
    assert result.passed, result.stderr_tail


def test_fresh_working_directory_is_deleted_afterwards() -> None:
    source = "import os\nassert os.listdir('.') == []\nopen('scratch.txt', 'w').write('x')\nraise SystemExit(os.getcwd())"
    result = run_program(source)
    match = re.search(r"SystemExit: (\S+)", result.stderr_tail)
    assert match, result.stderr_tail
    work_dir = Path(match.group(1))
    assert work_dir != Path.cwd()
    assert not work_dir.exists()


def test_writes_outside_the_working_directory_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    result = run_program(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "failed"
    assert "PermissionError" in result.stderr_tail
    assert not target.exists()


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.system('touch {marker}')",
        "import subprocess\nsubprocess.run(['touch', '{marker}'])",
        "import os\nos.kill(os.getppid(), 9)",
        "import ctypes\nctypes.CDLL(None).system(b'touch {marker}')",
    ],
)
def test_processes_signals_and_ctypes_are_refused(source: str, tmp_path: Path) -> None:
    marker = tmp_path / "spawned"
    result = run_program(source.format(marker=marker))
    assert result.status == "failed"
    assert "sandbox:" in result.stderr_tail
    assert not marker.exists()


def test_stderr_tail_is_bounded() -> None:
    result = run_program("import sys\nsys.stderr.write('e' * 100_000)\nraise ValueError('last words')")
    assert result.status == "failed"
    assert len(result.stderr_tail) == STDERR_TAIL_CHARS
    assert result.stderr_tail.rstrip().endswith("ValueError: last words")


def test_run_programs_keeps_order_and_runs_in_parallel() -> None:
    """Order is kept, and the two sleeping programs overlap in time (each reports its own start and end on stderr,
    so a loaded machine that starts processes slowly cannot make this pass or fail by the clock alone)."""
    sleeper = "import sys, time\nt0 = time.time()\ntime.sleep(1)\nsys.stderr.write(f'SPAN {t0!r} {time.time()!r}')"
    results = run_programs([sleeper, "assert False"] * 2, max_workers=2)
    assert [r.status for r in results] == ["passed", "failed", "passed", "failed"]
    spans = [tuple(map(float, r.stderr_tail.split("SPAN ")[1].split())) for r in results[::2]]
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 < a1, spans  # the second started before the first ended: they ran at the same time
    assert run_programs([]) == []


@pytest.mark.parametrize("limits", [{"timeout_s": 0}, {"memory_bytes": -1}, {"file_bytes": 0}])
def test_non_positive_limits_are_rejected(limits: dict) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        run_program("pass", **limits)


def test_unicode_source_round_trips() -> None:
    assert run_program("s = 'héllo ✓'\nassert len(s) == 7 and s.encode('utf-8').decode() == s").passed


def test_caller_environment_is_untouched() -> None:
    before = dict(os.environ), os.getcwd()
    run_program("import os\nos.environ['X'] = '1'\nos.chdir('/')")
    assert (dict(os.environ), os.getcwd()) == before
