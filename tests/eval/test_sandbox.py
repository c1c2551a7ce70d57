"""quant.eval.sandbox: generated code runs in a contained child process, never in ours."""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quant.eval.sandbox import (
    STDERR_TAIL_CHARS,
    ExecResult,
    network_isolation_available,
    probe,
    run_program,
    run_programs,
)
from tests.conftest import run_without_namespaces

REPO = Path(__file__).resolve().parents[2]


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
    if "fs" in probe().layers and "proc" not in probe().layers:
        pytest.skip("this kernel refuses a fresh /proc inside the sandbox's namespaces")
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


# ---------------------------------------------------------------------------------------------------------
# Below Python: escapes that got past the audit hook, and what the kernel layers guarantee on their own.
# ---------------------------------------------------------------------------------------------------------

# The "package path" trick: the extension module loaded under another name, so an import hook keyed on
# "_posixsubprocess" never sees it; then its fork_exec (the signature of Python 3.11 to 3.13) runs a shell.
FORK_EXEC_ALIAS = """
import glob, importlib.machinery, importlib.util, os, sys
paths = [p for d in sys.path if os.path.isdir(d) for p in glob.glob(d + '/_posixsubprocess*.so')]
if paths:
    loader = importlib.machinery.ExtensionFileLoader('x._posixsubprocess', paths[0])
    spec = importlib.util.spec_from_file_location('x._posixsubprocess', paths[0], loader=loader)
else:
    spec = importlib.machinery.BuiltinImporter.find_spec('_posixsubprocess')
m = importlib.util.module_from_spec(spec)
r, w = os.pipe()
pid = m.fork_exec([b'/bin/sh', b'-c', {command!r}], [b'/bin/sh'], True, (w,), None, None, -1, -1, -1, -1,
                  -1, -1, r, w, True, {setsid}, -1, None, None, None, -1, None, False)
os.close(w)
os.read(r, 100)
{wait}
"""


def _fork_exec_alias(command: str, setsid: bool = False, wait: bool = True) -> str:
    return FORK_EXEC_ALIAS.format(command=command.encode(), setsid=setsid, wait="os.waitpid(pid, 0)" if wait else "")


def _run_in_throwaway_grader(source: str, subreaper: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    """run_program in a separate grading process (an escape may kill its grader; it must not kill pytest). With
    `subreaper`, the grader adopts every orphan of the run (PR_SET_CHILD_SUBREAPER) and reports what was left
    0.5 s after run_program returned, then kills it."""
    script = f"""
import ctypes, json, os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
if {subreaper}:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
from quant.eval.sandbox import run_program
result = run_program(sys.stdin.read(), timeout_s=2.0)
time.sleep(0.5)
left = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        stat = open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()
    except OSError:
        continue
    if int(stat[1]) == os.getpid():
        left.append({{"pid": int(pid), "state": stat[0]}})
        os.kill(int(pid), signal.SIGKILL)
print(json.dumps({{"status": result.status, "stderr": result.stderr_tail, "left": left}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], input=source, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    return proc, (json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {})


def test_a_program_cannot_kill_its_grader_through_a_pidfd() -> None:
    proc, result = _run_in_throwaway_grader(
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)")
    assert proc.returncode == 0, f"the grading process died (rc {proc.returncode}): {proc.stderr[-500:]}"
    assert result["status"] == "failed", result


def test_posixsubprocess_under_another_name_cannot_run_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    result = run_program(_fork_exec_alias(f"id > {marker}"))
    assert not marker.exists(), marker.read_text()
    assert result.status == "failed"


@pytest.mark.parametrize("make", ["os.mkfifo({path!r})", "os.mknod({path!r}, 0o600 | stat.S_IFREG)"])
def test_fifos_and_nodes_cannot_be_made_outside_the_working_directory(make: str, tmp_path: Path) -> None:
    target = tmp_path / "node"
    result = run_program("import os, stat\n" + make.format(path=str(target)))
    assert not os.path.lexists(target)
    assert result.status == "failed"


def test_extended_attributes_cannot_be_set_outside_the_working_directory(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("t")
    result = run_program(f"import os\nos.setxattr({str(target)!r}, 'user.quant', b'1')")
    assert os.listxattr(target) == []
    assert result.status == "failed"


def test_host_secrets_are_not_readable() -> None:
    result = run_program("open('/etc/shadow').read()")
    assert result.status == "failed"
    assert "Error" in result.stderr_tail  # FileNotFoundError inside the minimal root


@pytest.mark.parametrize(
    "source",
    [
        "import os\nassert os.system('touch {marker}') == 0",
        "import subprocess\nsubprocess.run(['touch', '{marker}'], check=True)",
        "import ctypes\nctypes.CDLL(None).execv(b'/bin/sh', (ctypes.c_char_p * 4)(b'sh', b'-c', b'touch {marker}', None))"
        "\nraise SystemExit('execv returned')",
        "open('{marker}', 'w').write('x')",
        "import os\nos.kill(os.getppid(), 9)\nos.kill(-1, 9)",
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "import os\nos.fork()",
        "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0",
        _fork_exec_alias("touch {marker}"),
    ],
    ids=["system", "subprocess", "ctypes-execv", "write-outside", "kill", "tcp", "fork", "unshare", "fork-exec"],
)
def test_kernel_layers_hold_without_the_audit_hook(source: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        program = source.replace("{marker}", str(marker)).replace("{port}", str(listener.getsockname()[1]))
        result = run_program(program, audit_hook=False)
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.status == "failed", result.stderr_tail
    assert "sandbox:" not in result.stderr_tail  # refused below Python, not by the hook
    assert not marker.exists()


NORMAL_PROGRAMS = {
    "humaneval": "import math, itertools, re, collections, heapq, functools, string, typing, bisect, random\n"
                 "from typing import List\n"
                 "def close(numbers: List[float], t: float) -> bool:\n"
                 "    return any(abs(a - b) < t for a, b in itertools.combinations(numbers, 2))\n"
                 "assert close([1.0, 2.8, 3.0], 0.3) and not close([1.0, 2.0], 0.5)\n"
                 "assert re.sub('a+', 'b', 'caaat') == 'cbt' and math.gcd(12, 18) == 6\n"
                 "h = [5, 1, 3]; heapq.heapify(h); assert heapq.heappop(h) == 1\n"
                 "assert collections.Counter('abca')['a'] == 2 and random.Random(0).random() < 1",
    "stdlib": "import fractions, decimal, statistics, hashlib, json, datetime, copy, array, struct, dataclasses\n"
              "assert hashlib.sha256(b'x').hexdigest()[:4] == '2d71' and statistics.mean([1, 2, 3]) == 2\n"
              "assert json.loads(json.dumps({'a': [1]})) == {'a': [1]} and datetime.date(2024, 1, 1).year == 2024",
    "recursion": "import sys\nsys.setrecursionlimit(20000)\n"
                 "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nassert f(8000) == 8000",
    "files": "import os\nopen('s.txt', 'w').write('x' * 1000)\nos.mkdir('d')\nos.rename('s.txt', 'd/s')\n"
             "assert os.listdir('d') == ['s'] and open('d/s').read() == 'x' * 1000",
    "threads": "from concurrent.futures import ThreadPoolExecutor\n"
               "with ThreadPoolExecutor(4) as ex:\n    assert list(ex.map(lambda x: x * x, range(10)))[-1] == 81",
}


@pytest.mark.parametrize("audit_hook", [True, False], ids=["with-hook", "kernel-only"])
@pytest.mark.parametrize("name", sorted(NORMAL_PROGRAMS))
def test_normal_programs_pass_with_every_layer_in_force(name: str, audit_hook: bool) -> None:
    result = run_program(NORMAL_PROGRAMS[name], audit_hook=audit_hook)
    assert result.passed, result.stderr_tail
    assert set(result.layers) == set(probe().layers) - ({"audit"} if not audit_hook else set())


def test_timeout_kills_everything_the_program_started() -> None:
    # threads, plus (where fork is possible at all) a shell in a session of its own, outside the process group
    source = ("import threading, time\n"
              "[threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]\n"
              "try:\n" + "".join(f"    {line}\n" for line in _fork_exec_alias("sleep 60", setsid=True, wait=False)
                                  .strip().splitlines()) +
              "except OSError:\n    pass\n"
              "time.sleep(60)\n")  # fmt: skip
    proc, result = _run_in_throwaway_grader(source, subreaper=True)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert result["status"] == "timeout", result
    assert result["left"] == [], "processes (or zombies) outlived the run"


def test_probe_reports_the_layers_a_run_gets() -> None:
    found = probe()
    assert not found.missing, f"this machine lacks sandbox layers: {found.missing}"
    assert found.mode in ("root", "userns") and found.seccomp
    assert {f"ns:{found.mode}", "net", "pid", "fs", "seccomp", "audit"} <= set(found.layers)
    assert any(layer.startswith("drop:") for layer in found.layers)
    assert run_program("pass").layers == found.layers
    assert found.verdicts[f"end_to_end_{found.mode}"] == "ok"


def test_child_modules_use_only_the_standard_library() -> None:
    """The child's modules travel as compiled source to an interpreter where quant is not importable."""
    shipped = {"quant.eval.seccomp", "quant.eval.isolation"}
    for name in ("seccomp", "isolation", "sandbox_child"):
        tree = ast.parse((REPO / "quant" / "eval" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quant"):
                assert {f"{node.module}.{a.name}" for a in node.names} <= shipped, (name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top = {a.name for a in node.names} if isinstance(node, ast.Import) else {node.module or ""}
                assert {t.split(".")[0] for t in top} <= sys.stdlib_module_names | {"__future__"}, (name, top)


def test_missing_namespaces_refuse_unless_weak_isolation_is_allowed() -> None:
    script = """
import json
from quant.errors import SandboxUnavailable
from quant.eval.sandbox import isolation_policy, probe, run_program, run_programs
out = {"missing": probe().missing}
try:
    run_program("pass")
except SandboxUnavailable as exc:
    out["refused"] = str(exc)
weak = run_program("import math", policy="allow_weak")
out["weak"] = [weak.status, weak.layers]
with isolation_policy("allow_weak"):
    out["weak_context"] = [r.status for r in run_programs(["pass", "assert False"])]
print(json.dumps(out))
"""
    proc = run_without_namespaces("-c", script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert len(out["missing"]) == 1 and out["missing"][0].startswith("namespaces (")
    message = out["refused"]
    assert "\n" not in message and "lacks namespaces" in message and "eval.humaneval_sandbox: allow_weak" in message
    status, layers = out["weak"]
    assert status == "passed" and "seccomp" in layers and not {"pid", "fs"} & set(layers)
    assert out["weak_context"] == ["passed", "failed"]
