"""Run untrusted Python programs (model-generated code) in isolated subprocesses.

Contract: `run_program(source)` never executes `source` in the caller's process. Each program runs in a
fresh `python -I -B` child (own session / process group, so a timeout kills everything it started) with:

- a wall-clock timeout (the parent kills the process group) and an RLIMIT_CPU backstop;
- RLIMIT_AS (memory), RLIMIT_FSIZE (largest file it may write), RLIMIT_NOFILE, no core dumps;
- a fresh temporary working directory, deleted afterwards, and an environment holding only a minimal PATH;
- no network: the child first tries `unshare(CLONE_NEWUSER | CLONE_NEWNET)` (then `CLONE_NEWNET` alone) so it
  sits in an empty network namespace with only a down loopback device; whether or not that works it then
  installs a `sys.addaudithook` hook, before any untrusted byte runs, refusing sockets, process creation
  and signals, ctypes, rlimit changes, gc introspection, and file writes outside its working directory.

The namespace and rlimits are kernel-enforced; the audit hook is defence in depth against accidents and
naive escapes by generated code, not a boundary against a determined attacker (CPython audit hooks can be
worked around by code that reads its own memory). `ExecResult.network_isolated` says which layer was in
force. "passed" requires the child to reach the end of the program and echo a per-run nonce, so a program
that calls `sys.exit(0)` or `os._exit(0)` before its tests run is not counted as passing (this catches
accidental early exits; code that deliberately digs the nonce out of the interpreter could forge it).

POSIX (Linux) only; Python 3.10+.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Status = Literal["passed", "failed", "timeout", "memory", "error"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_FILE_BYTES = 16 << 20
STDERR_TAIL_CHARS = 2000
_MINIMAL_PATH = "/usr/bin:/bin"
# Audit events the child refuses outright (prefix match): network, process creation, signals, FFI,
# heap introspection (could reach the hook's state), rlimit and identity changes.
_REFUSED_EVENT_PREFIXES = (
    "socket.", "ftplib.", "http.client.", "imaplib.", "nntplib.", "poplib.", "smtplib.", "telnetlib.",
    "urllib.", "webbrowser.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system", "os.kill",
    "signal.pthread_kill", "subprocess.", "pty.", "ctypes.", "gc.get_", "resource.setrlimit",
    "resource.prlimit", "os.setuid", "os.setgid", "os.setre", "os.chroot",
)  # fmt: skip
# Audit events that change the file system; allowed only on paths inside the child's working directory.
_WORK_DIR_PATH_EVENTS = (
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.lchown", "os.chflags",
    "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.chown",
)  # fmt: skip
# Exit codes the trusted child bootstrap uses to report outcomes the parent must tell apart.
_EXIT_MEMORY = 97
_EXIT_SETUP = 98


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program.

    status: "passed" (ran to the end, exit 0), "failed" (exception, assertion, non-zero exit, killed by a
    signal, or exited before the end), "timeout" (wall clock or CPU limit), "memory" (MemoryError under
    RLIMIT_AS), "error" (the sandbox itself could not be set up; the program did not run).
    returncode: the child's exit status (negative: killed by that signal), None if it never started.
    stderr_tail: the last `STDERR_TAIL_CHARS` characters of the child's stderr.
    seconds: wall-clock seconds from spawn to reaping.
    network_isolated: True when the child ran inside its own empty network namespace.
    """

    status: Status
    returncode: int | None
    stderr_tail: str
    seconds: float
    network_isolated: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# ---------------------------------------------------------------------------------------------------------
# Child side. These functions are shipped to the child as source text (inspect.getsource) and run there
# before the untrusted program, so they may use only the standard library and each other.
# ---------------------------------------------------------------------------------------------------------


def _child_unshare_network() -> bool:
    """Move this (single-threaded) process into a new, empty network namespace; True on success."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    for flags in (clone_newuser | clone_newnet, clone_newnet):
        if libc.unshare(flags) == 0:
            return True
    return False


def _child_limit_resources(config: dict) -> None:
    """Lower soft and hard rlimits so the program cannot raise them back."""
    import resource

    cpu_s = config["cpu_seconds"]
    limits = {
        resource.RLIMIT_AS: (config["memory_bytes"], config["memory_bytes"]),
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_FSIZE: (config["file_bytes"], config["file_bytes"]),
        resource.RLIMIT_NOFILE: (256, 256),
        resource.RLIMIT_CORE: (0, 0),
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)


def _child_install_audit_hook(work_dir: str, refused_prefixes: list, path_events: list) -> None:
    """From here on, refuse audit events starting with `refused_prefixes`, `path_events` on paths outside
    `work_dir`, opening files for writing outside it, and importing the raw process/FFI modules."""
    import os
    import sys

    refused_prefixes, path_events = tuple(refused_prefixes), frozenset(path_events)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    root = os.path.realpath(work_dir)

    def inside_work_dir(path) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor: the open itself was checked
        resolved = os.path.realpath(os.fsdecode(path))
        return resolved == os.devnull or resolved == root or resolved.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(refused_prefixes) or (
            event == "import" and args and args[0] in ("_posixsubprocess", "_ctypes")
        ):
            what = f"importing {args[0]}" if event == "import" else event
            raise PermissionError(f"sandbox: {what} is not allowed")
        # os.open (mode None) may be relative to a dir_fd the event does not show, so only the
        # builtin open() may write, and only inside the working directory.
        if event == "open" and len(args) >= 3 and (args[2] or 0) & write_flags:
            if args[1] is None or not inside_work_dir(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} is not allowed")
        elif (
            event in path_events
            and args
            and not all(inside_work_dir(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))
        ):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


def _child_main() -> None:
    """Read the config and program from stdin, isolate, then run the program as __main__."""
    import json
    import os
    import sys
    import traceback

    config = json.loads(sys.stdin.read())
    sys.stdin.close()
    report_fd = os.dup(1)  # stdout pipe back to the parent; the program's own stdout goes to /dev/null
    try:
        isolated = _child_unshare_network()
        _child_limit_resources(config)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        _child_install_audit_hook(os.getcwd(), config["refused_prefixes"], config["path_events"])
    except BaseException:
        traceback.print_exc()
        os._exit(config["exit_setup"])
    os.write(report_fd, f"ready network_isolated={int(isolated)}\n".encode())
    try:
        exec(compile(config.pop("source"), "<program>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(config["exit_memory"])
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    sys.stderr.flush()
    os.write(report_fd, (config["nonce"] + "\n").encode())
    os._exit(0)


_CHILD_FUNCTIONS = (_child_unshare_network, _child_limit_resources, _child_install_audit_hook, _child_main)


def _child_bootstrap_source() -> str:
    """The `-c` script for the child: the child functions above plus a call to `_child_main`."""
    parts = [inspect.getsource(fn) for fn in _CHILD_FUNCTIONS]
    return "\n\n".join(parts) + "\n\n_child_main()\n"


# ---------------------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------------------


def run_program(
    source: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    file_bytes: int = DEFAULT_FILE_BYTES,
) -> ExecResult:
    """Run `source` as `__main__` in a sandboxed child process and classify the outcome.

    Blocks for at most about `timeout_s` seconds (plus process start-up and clean-up); the child's whole
    process group is killed on timeout, and its working directory is always deleted. Raises ValueError on
    non-positive limits and RuntimeError on non-POSIX platforms; program failures never raise.
    """
    if os.name != "posix":
        raise RuntimeError("quant.eval.sandbox needs a POSIX system (rlimits, sessions, namespaces)")
    if timeout_s <= 0 or memory_bytes <= 0 or file_bytes <= 0:
        raise ValueError(
            f"sandbox limits must be positive, got timeout_s={timeout_s}, "
            f"memory_bytes={memory_bytes}, file_bytes={file_bytes}"
        )
    nonce = secrets.token_hex(16)
    config = {
        "source": source,
        "nonce": nonce,
        "memory_bytes": int(memory_bytes),
        "file_bytes": int(file_bytes),
        "cpu_seconds": math.ceil(timeout_s) + 1,
        "exit_memory": _EXIT_MEMORY,
        "exit_setup": _EXIT_SETUP,
        "refused_prefixes": list(_REFUSED_EVENT_PREFIXES),
        "path_events": list(_WORK_DIR_PATH_EVENTS),
    }
    work_dir = tempfile.mkdtemp(prefix="quant-sandbox-")
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            returncode, timed_out = _spawn_and_wait(json.dumps(config), work_dir, out, err, timeout_s)
            seconds = time.monotonic() - start
            report = _read_all(out)
            stderr_tail = _read_all(err)[-STDERR_TAIL_CHARS:]
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    status = _classify(returncode, timed_out, report, nonce)
    isolated = "network_isolated=1" in report.split("\n", 1)[0]
    logger.debug("sandboxed program: %s (rc=%s, %.2f s, netns=%s)", status, returncode, seconds, isolated)
    return ExecResult(status, returncode, stderr_tail, seconds, isolated)


def _spawn_and_wait(payload: str, work_dir: str, out, err, timeout_s: float) -> tuple[int | None, bool]:
    """Start the child, feed it `payload`, wait up to `timeout_s`; returns (returncode, timed_out)."""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _child_bootstrap_source()],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=work_dir,
            env={"PATH": _MINIMAL_PATH},
            start_new_session=True,  # own process group, so killpg reaches everything it spawned
        )
    except OSError as exc:
        err.write(f"sandbox: could not start the interpreter: {exc}\n".encode())
        return None, False
    try:
        with proc.stdin:
            proc.stdin.write(payload.encode("utf-8"))
    except BrokenPipeError:
        pass  # the child died before reading its input; its exit status tells why
    timed_out = not _wait_unreaped(proc.pid, timeout_s)
    # The group leader is still an unreaped zombie here, so its pid (the group id) cannot be reused yet.
    _kill_group(proc.pid)
    proc.wait()
    return proc.returncode, timed_out


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until child `pid` exits without reaping it; False if `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return False
        time.sleep(min(delay_s, remaining_s))
        delay_s = min(delay_s * 2, 0.02)
    return True


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group, tolerating one that is already gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_all(handle) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")


def _classify(returncode: int | None, timed_out: bool, report: str, nonce: str) -> Status:
    if timed_out:
        return "timeout"
    if returncode is None or returncode == _EXIT_SETUP or not report.startswith("ready"):
        return "error"
    if returncode == 0 and nonce in report.splitlines():
        return "passed"
    if returncode == _EXIT_MEMORY:
        return "memory"
    if returncode == -signal.SIGXCPU:
        return "timeout"
    return "failed"


def run_programs(
    sources: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    max_workers: int | None = None,
) -> list[ExecResult]:
    """Run many programs with `run_program`, at most `max_workers` at a time; results keep input order.

    `max_workers` defaults to the CPU count. Threads only wait on child processes, so the GIL is not a
    bottleneck; memory use is bounded by `max_workers * memory_bytes`.
    """
    if not sources:
        return []
    workers = max(1, min(len(sources), max_workers or os.cpu_count() or 1))

    def run_one(source: str) -> ExecResult:
        return run_program(source, timeout_s=timeout_s, memory_bytes=memory_bytes)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quant-sandbox") as pool:
        results = list(pool.map(run_one, sources))
    if not all(r.network_isolated for r in results if r.status != "error"):
        logger.warning(
            "network namespaces unavailable: sandbox relied on its audit hook alone for no-network"
        )
    return results


def network_isolation_available() -> bool:
    """Whether sandboxed programs on this machine get their own network namespace (spawns one child)."""
    return run_program("pass", timeout_s=DEFAULT_TIMEOUT_S).network_isolated
