"""quant.eval.seccomp: the hand-assembled BPF filter, against a reference interpreter and in the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant.eval import seccomp as s

REPO = Path(__file__).resolve().parents[2]
OWN_PID = 2
ALLOW, KILL = "allow", "kill"


def run_bpf(program: list[tuple[int, int, int, int]], nr: int, args: tuple[int, ...] = (),
            arch: int = s.AUDIT_ARCH_X86_64) -> str:  # fmt: skip
    """Reference interpreter for the instructions the filter uses (classic BPF, as the kernel runs it)."""
    data = {s.DATA_NR: nr, s.DATA_ARCH: arch}
    data.update({16 + 8 * i: a & 0xFFFFFFFF for i, a in enumerate(args)})
    acc, pc = 0, 0
    while True:
        assert 0 <= pc < len(program), f"jump out of the program at {pc}"
        code, jt, jf, k = program[pc]
        if code == s.BPF_LD_ABS:
            acc, pc = data.get(k, 0), pc + 1
        elif code in (s.BPF_JEQ, s.BPF_JGE, s.BPF_JSET):
            taken = {s.BPF_JEQ: acc == k, s.BPF_JGE: acc >= k, s.BPF_JSET: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        else:
            assert code == s.BPF_RET, f"unknown opcode {code:#x}"
            if k == s.RET_ALLOW:
                return ALLOW
            if k == s.RET_KILL_PROCESS:
                return KILL
            assert k & 0xFFFF0000 == s.RET_ERRNO
            return {s.EPERM: "EPERM", s.ENOSYS: "ENOSYS"}[k & 0xFFFF]


@pytest.fixture(scope="module")
def program() -> list[tuple[int, int, int, int]]:
    return s.filter_program(OWN_PID)


READ, WRITE, GETPID = 0, 1, 39
CLONE_VM_THREAD = 0x00010000 | 0x00000100 | 0x00000800 | 0x00000400  # THREAD | VM | SIGHAND | FILES


@pytest.mark.parametrize(("nr", "args", "verdict"), [
    (READ, (), ALLOW), (WRITE, (), ALLOW), (GETPID, (), ALLOW),
    (s.DENIED["execve"], (), "EPERM"), (s.DENIED["fork"], (), "EPERM"), (s.DENIED["mknodat"], (), "EPERM"),
    (s.DENIED["setxattr"], (), "EPERM"), (s.DENIED["pidfd_open"], (), "EPERM"), (s.DENIED["unshare"], (), "EPERM"),
    (s.SYS_CLONE, (CLONE_VM_THREAD,), ALLOW),  # a thread
    (s.SYS_CLONE, (17,), "EPERM"),  # fork through clone(SIGCHLD)
    (s.SYS_CLONE, (CLONE_VM_THREAD | 0x10000000,), "EPERM"),  # a thread in a new user namespace
    (s.SYS_CLONE3, (), "ENOSYS"),
    (s.SELF_ONLY["kill"], (OWN_PID, 9), ALLOW), (s.SELF_ONLY["kill"], (1, 9), "EPERM"),
    (s.SELF_ONLY["kill"], (-1, 9), "EPERM"), (s.SELF_ONLY["tgkill"], (OWN_PID, 7, 10), ALLOW),
    (s.SYS_SOCKET, (s.AF_UNIX, 1, 0), ALLOW), (s.SYS_SOCKET, (2, 1, 0), "EPERM"), (s.SYS_SOCKET, (16, 3, 0), "EPERM"),
    (s.SYS_IOCTL, (0, s.TIOCSTI), "EPERM"), (s.SYS_IOCTL, (0, 0x5401), ALLOW),  # TCGETS
    (s.FIRST_UNREVIEWED_NR, (), "ENOSYS"), (s.X32_SYSCALL_BIT | GETPID, (), "EPERM"),
])  # fmt: skip
def test_filter_decides_like_the_documented_policy(program, nr: int, args: tuple, verdict: str) -> None:
    assert run_bpf(program, nr, args) == verdict


def test_other_architectures_are_killed(program) -> None:
    audit_arch_i386 = 0x40000003
    assert run_bpf(program, 20, arch=audit_arch_i386) == KILL
    assert len(program) < 4096  # the kernel's BPF_MAXINSNS


KERNEL_CHECK = f"""
import json, os, socket, sys, threading
sys.path.insert(0, {str(REPO)!r})
from quant.eval import isolation, seccomp
parent = os.getppid()
open("target", "w").close()
seccomp.install_filter(isolation.libc_handle(), seccomp.filter_program(os.getpid()))

def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return type(exc).__name__

t = threading.Thread(target=lambda: None)
out = {{
    "fork": outcome(os.fork), "thread": outcome(lambda: (t.start(), t.join())),
    "signal_self": outcome(lambda: os.kill(os.getpid(), 0)), "signal_parent": outcome(lambda: os.kill(parent, 0)),
    "inet": outcome(lambda: socket.socket(socket.AF_INET).close()),
    "unix": outcome(lambda: [x.close() for x in socket.socketpair()]),
    "mkfifo": outcome(lambda: os.mkfifo("fifo-that-must-not-exist")),
    "setxattr": outcome(lambda: os.setxattr("target", "user.quant", b"1")),
    "exec": outcome(lambda: os.execv("/bin/true", ["true"])),
}}
print(json.dumps(out))
"""


def test_filter_is_enforced_by_the_kernel(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {
        "fork": "PermissionError", "thread": "ok", "signal_self": "ok", "signal_parent": "PermissionError",
        "inet": "PermissionError", "unix": "ok", "mkfifo": "PermissionError", "setxattr": "PermissionError",
        "exec": "PermissionError",
    }  # fmt: skip
    assert not (tmp_path / "fifo-that-must-not-exist").exists() and not os.listxattr(tmp_path / "target")
