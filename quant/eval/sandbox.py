"""Run untrusted Python programs (model-generated code) in isolated subprocesses, enforced by the kernel.

Contract: `run_program(source)` never executes `source` in the caller's process. Each program runs in a fresh
`python -I -B` child in its own session, with a wall-clock timeout, rlimits (memory, CPU, file size, open files,
no core dumps), an environment holding only a minimal PATH and a fresh working directory deleted afterwards; and,
below Python, every kernel layer the machine allows (`quant.eval.isolation`, `quant.eval.seccomp`,
`quant.eval.sandbox_child`):

- namespaces: new mount, network (empty: a down loopback only), pid, ipc and uts namespaces, plus a user
  namespace when not root. The program is pid 2 of its own pid namespace: the grading process is invisible to
  it, and when the namespace's init exits (timeout included) the kernel kills everything the program started;
- fs: a minimal read-only root (`/usr`, `/lib*`, the Python prefixes, `/dev/null` and friends, a fresh `/proc`)
  entered with pivot_root; the working directory is a size-limited tmpfs. Nothing else of the host exists inside
  (`/etc/shadow`, `/root`, `/home`, the host's `/tmp`);
- drop: uid/gid 65534 (as root) or no capabilities left in the user namespace, no_new_privs;
- seccomp: a syscall filter refusing process creation, signals to others, pidfds, ptrace, mounts and
  namespaces, mknod, extended attributes, identity changes, non-Unix sockets and more (EPERM);
- audit: a Python audit hook, last, that turns naive attempts into one clear "sandbox:" message.

`probe()` finds, once per process, which layers work here (each tried in a forked child, then one end-to-end
run). The namespace layers (with fs) and seccomp are required: where one is missing `run_program` raises
`SandboxUnavailable` (one line naming what is missing and the opt-out), unless the caller opts out with
`policy="allow_weak"` (the recipe's `eval.humaneval_sandbox: allow_weak`), which runs with the layers present.
`ExecResult.layers` says which were in force. "passed" requires the child to reach the end of the program and
echo a per-run nonce, so a program that exits early with status 0 does not pass (code that digs the nonce out
of its own memory could forge it).

Linux only; Python 3.10+; the seccomp filter is x86-64 only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import marshal
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quant.errors import SandboxUnavailable
from quant.eval import isolation, sandbox_child, seccomp

logger = logging.getLogger(__name__)

Status = Literal["passed", "failed", "timeout", "memory", "error"]
Policy = Literal["require", "allow_weak"]
POLICIES = ("require", "allow_weak")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_FILE_BYTES = 16 << 20
WORK_DIR_BYTES = 64 << 20  # tmpfs of the working directory (page cache, not counted by RLIMIT_AS)
STDERR_TAIL_CHARS = 2000
PROBE_TIMEOUT_S = 30.0
_MINIMAL_PATH = "/usr/bin:/bin"
_CHILD_MODULES = (seccomp, isolation, sandbox_child)  # shipped to the child in this order (imports first)
_STUB = """\
import marshal, sys, types
stdin = sys.stdin.buffer
for package in ("quant", "quant.eval"):
    sys.modules[package] = types.ModuleType(package)
    sys.modules[package].__path__ = []
for name, code in marshal.loads(stdin.read(int.from_bytes(stdin.read(8), "little"))):
    module = sys.modules[name] = types.ModuleType(name)
    exec(code, module.__dict__)
    setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
sys.modules["quant.eval.sandbox_child"].main()
"""
# The policy `run_program` applies when its caller passes none. lm-eval calls our HumanEval metric itself
# (evals/tasks/quant_humaneval.py), so the recipe's opt-out cannot travel as an argument; `lmeval.run_lm_eval`
# sets it around the evaluation with `isolation_policy`.
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("quant_sandbox_policy", default="require")


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
    layers: the layers in force, as the child reported them before the program ran (e.g. "ns:root", "net",
    "pid", "fs", "proc", "drop:uid65534", "seccomp", "audit"); empty when set-up failed.
    """

    status: Status
    returncode: int | None
    stderr_tail: str
    seconds: float
    network_isolated: bool = False
    layers: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class Isolation:
    """What `probe` found. mode: "root" or "userns" (the namespace mode in use), None without namespaces.
    seccomp: whether the filter can be installed. layers: what a program run here gets (from the end-to-end run).
    missing: the required layers that are absent, each with the reason. verdicts: every check's raw verdict."""

    mode: str | None
    seccomp: bool
    layers: tuple[str, ...]
    missing: tuple[str, ...]
    verdicts: dict

    def refusal(self) -> str:
        """The one-line message `require_isolation` raises with."""
        present = ", ".join(["rlimits", *self.layers])
        return (f"the sandbox for generated code (HumanEval) lacks {'; '.join(self.missing)} on this machine; "
                f"run where unshare and seccomp are allowed, or set eval.humaneval_sandbox: allow_weak "
                f"(policy='allow_weak' from Python) to run it with only the layers present ({present})")


@functools.cache
def probe() -> Isolation:
    """Which layers work on this machine: each tried in a forked child of a fresh interpreter, then one empty
    program run end to end in each namespace mode that passed (the per-layer checks can pass while the real
    set-up fails: a locked submount under /usr once did), keeping the first that works. Cached per process."""
    verdicts = _probe_verdicts()
    has_seccomp = verdicts["seccomp"].startswith("ok")
    modes = [m for m, key in (("root", "rootns"), ("userns", "userns")) if verdicts[key].startswith("ok")]
    mode, layers = None, ()
    for candidate in modes:
        result = _trial(candidate, has_seccomp)
        verdicts[f"end_to_end_{candidate}"] = "ok" if result.passed else f"no: {_last_line(result.stderr_tail)}"
        if result.passed:
            mode, layers = candidate, result.layers
            break
    if mode is None:
        layers = _trial(None, has_seccomp).layers
    missing = []
    if mode is None:
        why = [verdicts[k] for k in ("rootns", "userns", "end_to_end_root", "end_to_end_userns") if k in verdicts]
        reasons = dict.fromkeys(v.removeprefix("no: ") for v in why if v != "no: not root")
        missing.append(f"namespaces ({'; '.join(reasons)})")
    if not has_seccomp:
        missing.append(f"seccomp ({verdicts['seccomp'].removeprefix('no: ')})")
    isolation_found = Isolation(mode, has_seccomp, tuple(layers), tuple(missing), verdicts)
    logger.debug("sandbox probe: %s", isolation_found)
    return isolation_found


def _probe_verdicts() -> dict:
    """The child's per-layer verdicts; a probe that cannot run at all (no ctypes, a timeout) finds nothing."""
    try:
        proc = subprocess.run([sys.executable, "-I", "-B", "-c", _STUB], input=_payload({"entry": "probe"}),
                              capture_output=True, timeout=PROBE_TIMEOUT_S, env={"PATH": _MINIMAL_PATH})  # fmt: skip
        if proc.returncode == 0:
            return json.loads(proc.stdout)
        why = f"no: the probe failed: {_last_line(proc.stderr.decode(errors='replace'))}"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        why = f"no: the probe failed: {exc}"
    return {"seccomp": why, "userns": why, "rootns": why}


def _trial(mode: str | None, has_seccomp: bool) -> ExecResult:
    return _run(_config("pass", mode, has_seccomp, timeout_s=10.0, memory_bytes=DEFAULT_MEMORY_BYTES,
                        file_bytes=DEFAULT_FILE_BYTES, audit_hook=True), 10.0)  # fmt: skip


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def require_isolation(policy: str | None = None) -> Isolation:
    """The probe's result, or SandboxUnavailable (one line: what is missing, the opt-out) when a required layer
    is missing and ``policy`` (default: the current `isolation_policy`) is "require"."""
    policy = _POLICY.get() if policy is None else policy
    if policy not in POLICIES:
        raise ValueError(f"sandbox policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    found = probe()
    if found.missing and policy == "require":
        raise SandboxUnavailable(found.refusal())
    return found


@contextlib.contextmanager
def isolation_policy(policy: str) -> Iterator[None]:
    """Within the block (this thread, this context), `run_program` calls without a policy use ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"sandbox policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def run_program(
    source: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    file_bytes: int = DEFAULT_FILE_BYTES,
    policy: str | None = None,
    audit_hook: bool = True,
) -> ExecResult:
    """Run `source` as `__main__` in a sandboxed child process and classify the outcome.

    Blocks for at most about `timeout_s` seconds (plus process start-up and clean-up); everything the program
    started is killed on timeout, and its working directory is always deleted. `policy`: see
    `require_isolation`. `audit_hook=False` leaves out the Python-level hook (the kernel layers alone; tests show
    they hold). Raises SandboxUnavailable as `require_isolation` does, ValueError on non-positive limits and
    RuntimeError on non-Linux platforms; program failures never raise.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError("quant.eval.sandbox needs Linux (namespaces, seccomp, rlimits)")
    if timeout_s <= 0 or memory_bytes <= 0 or file_bytes <= 0:
        raise ValueError(
            f"sandbox limits must be positive, got timeout_s={timeout_s}, "
            f"memory_bytes={memory_bytes}, file_bytes={file_bytes}"
        )
    found = require_isolation(policy)
    config = _config(source, found.mode, found.seccomp, timeout_s=timeout_s, memory_bytes=memory_bytes,
                     file_bytes=file_bytes, audit_hook=audit_hook)  # fmt: skip
    result = _run(config, timeout_s)
    logger.debug("sandboxed program: %s (rc=%s, %.2f s, layers=%s)", result.status, result.returncode,
                 result.seconds, ",".join(result.layers))  # fmt: skip
    return result


def _config(source: str, mode: str | None, has_seccomp: bool, *, timeout_s: float, memory_bytes: int,
            file_bytes: int, audit_hook: bool) -> dict:  # fmt: skip
    """The child's config (see `quant.eval.sandbox_child`), the working directory and report pipe still unset."""
    return {
        "entry": "program", "source": source, "nonce": secrets.token_hex(16), "mode": mode,
        "seccomp": has_seccomp, "audit_hook": audit_hook, "binds": isolation.python_binds(),
        # in root mode the worker drops to 65534 inside; without namespaces only when that uid can still
        # read the interpreter's standard library (a pyenv under a 0700 /root cannot be)
        "final_uid": isolation.NOBODY if mode == "root" else 0,
        "drop_weak": mode is None and os.geteuid() == 0 and isolation.stdlib_readable_by_others(),
        "memory_bytes": int(memory_bytes), "file_bytes": int(file_bytes), "work_bytes": WORK_DIR_BYTES,
        "cpu_seconds": math.ceil(timeout_s) + 1,
    }  # fmt: skip


def _run(config: dict, timeout_s: float) -> ExecResult:
    """Run one configured child in a fresh working directory (always deleted) and classify the outcome."""
    work_dir = os.path.realpath(tempfile.mkdtemp(prefix="quant-sandbox-"))
    config["workdir"] = work_dir
    if config["drop_weak"]:
        os.chown(work_dir, isolation.NOBODY, isolation.NOBODY)
    report_r, report_w = os.pipe()
    config["report_fd"] = report_w
    try:
        with tempfile.TemporaryFile() as err:
            start = time.monotonic()
            returncode, timed_out = _spawn_and_wait(_payload(config), work_dir, report_w, err, timeout_s)
            seconds = time.monotonic() - start
            report = _drain(report_r)
            err.seek(0)
            stderr_tail = err.read().decode("utf-8", errors="replace")[-STDERR_TAIL_CHARS:]
    finally:
        os.close(report_r)
        shutil.rmtree(work_dir, ignore_errors=True)
    first = report.split("\n", 1)[0]
    layers = tuple(first.removeprefix("ready ").split(",")) if first.startswith("ready ") else ()
    status = _classify(returncode, timed_out, report, config["nonce"])
    return ExecResult(status, returncode, stderr_tail, seconds, "net" in layers, tuple(x for x in layers if x))


@functools.cache
def _child_code() -> bytes:
    """The child's modules, compiled once here (the child is this same interpreter) and marshalled."""
    compiled = [(m.__name__, compile(Path(m.__file__).read_text(), m.__file__, "exec")) for m in _CHILD_MODULES]
    return marshal.dumps(compiled)


def _payload(config: dict) -> bytes:
    code = _child_code()
    return len(code).to_bytes(8, "little") + code + json.dumps(config).encode()


def _spawn_and_wait(payload: bytes, work_dir: str, report_w: int, err, timeout_s: float) -> tuple[int | None, bool]:
    """Start the child, feed it `payload`, wait up to `timeout_s`; returns (returncode, timed_out)."""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _STUB], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=err, cwd=work_dir, env={"PATH": _MINIMAL_PATH}, pass_fds=(report_w,),
            start_new_session=True,  # its own session and process group: killpg reaches everything left
        )  # fmt: skip
    except OSError as exc:
        err.write(f"sandbox: could not start the interpreter: {exc}\n".encode())
        return None, False
    finally:
        os.close(report_w)  # the child holds the only write end: the report reads to its end once it is gone
    try:
        with proc.stdin:
            proc.stdin.write(payload)
    except BrokenPipeError:
        pass  # the child died before reading its input; its exit status tells why
    timed_out = not _wait_unreaped(proc, timeout_s)
    if timed_out:  # outer kills and reaps its pid namespace (no zombie left behind), then the group backstop
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        _wait_unreaped(proc, 1.0)
    # The group leader is still an unreaped zombie here, so its pid (the group id) cannot be reused yet.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.returncode, timed_out


def _wait_unreaped(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until `proc` exits without reaping it; False if `timeout_s` passed first. A pidfd wakes us the moment
    it exits; without one (old kernels) poll waitid with growing sleeps."""
    import select

    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        deadline = time.monotonic() + timeout_s
        delay_s = 0.001
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(delay_s, max(0.0, deadline - time.monotonic())))
            delay_s = min(delay_s * 2, 0.02)
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))
    finally:
        os.close(fd)


def _drain(fd: int) -> str:
    """What the child wrote to the report pipe; non-blocking, so a process that kept the write end cannot hang us."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _classify(returncode: int | None, timed_out: bool, report: str, nonce: str) -> Status:
    if timed_out:
        return "timeout"
    if returncode is None or returncode == sandbox_child.EXIT_SETUP or not report.startswith("ready"):
        return "error"
    if returncode == 0 and nonce in report.splitlines():
        return "passed"
    if returncode == sandbox_child.EXIT_MEMORY:
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
    policy: str | None = None,
) -> list[ExecResult]:
    """Run many programs with `run_program`, at most `max_workers` at a time; results keep input order.

    `max_workers` defaults to the CPU count. Threads only wait on child processes, so the GIL is not a
    bottleneck; memory use is bounded by `max_workers * memory_bytes`. `policy` is checked once, before any
    program runs (SandboxUnavailable as in `require_isolation`).
    """
    if not sources:
        return []
    policy = _POLICY.get() if policy is None else policy
    found = require_isolation(policy)
    if found.missing:
        logger.warning("sandbox without %s (policy allow_weak): generated code runs with %s only",
                       "; ".join(found.missing), ", ".join(found.layers) or "rlimits")  # fmt: skip
    workers = max(1, min(len(sources), max_workers or os.cpu_count() or 1))

    def run_one(source: str) -> ExecResult:
        return run_program(source, timeout_s=timeout_s, memory_bytes=memory_bytes, policy=policy)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quant-sandbox") as pool:
        return list(pool.map(run_one, sources))


def network_isolation_available() -> bool:
    """Whether sandboxed programs on this machine get their own empty network namespace."""
    return "net" in probe().layers
