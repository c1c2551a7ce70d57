"""The sandbox's system-call filter: a seccomp BPF program assembled by hand (no libseccomp dependency).

Runs in the sandbox's worker process, installed last, just before the untrusted program (``quant.eval.sandbox``
ships this module's source to the child: standard library only, no imports from ``quant``). The filter is a
deny-list over an allow-by-default base, reviewed against the x86-64 syscall table up to number 469:

- a syscall of another architecture (i386 ``int 0x80``) kills the process; x32 numbers get EPERM; numbers newer
  than the reviewed table get ENOSYS, which libc treats as "not implemented" and falls back from;
- EPERM (``PermissionError`` in Python, so the program is graded "failed") for process creation (execve,
  fork, vfork, clone without CLONE_THREAD or with any namespace flag), signals to anything but the program
  itself, pidfds, ptrace and cross-process memory access, the mount family and namespace changes, device nodes
  and FIFOs (mknod), extended attributes, identity changes, and kernel facilities a HumanEval program never
  needs (bpf, perf, io_uring: its operations bypass seccomp, keyrings, modules, clocks, reboot, ...);
- sockets only of family AF_UNIX; no terminal input injection (TIOCSTI, TIOCLINUX).

x86-64 only: ``filter_program`` raises on other machines, and the probe then reports seccomp missing.
"""

from __future__ import annotations

import os

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
FIRST_UNREVIEWED_NR = 470  # one past file_setattr (469), the newest syscall this table was reviewed against
EPERM, ENOSYS = 1, 38
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_THREAD = 0x00010000
CLONE_NEW_ANY = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

# x86-64 syscall numbers refused with EPERM
DENIED = {
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "process_madvise": 440,
    "process_mrelease": 448,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "open_tree_attr": 467,
    "mknod": 133, "mknodat": 259,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
    "fremovexattr": 199, "setxattrat": 463, "removexattrat": 466,
    "setuid": 105, "setgid": 106, "setreuid": 113, "setregid": 114, "setresuid": 117,
    "setresgid": 119, "setfsuid": 122, "setfsgid": 123, "setgroups": 116, "capset": 126,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248,
    "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
    "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171, "iopl": 172,
    "ioperm": 173, "modify_ldt": 154, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "fanotify_init": 300, "lookup_dcookie": 212, "uselib": 134, "vhangup": 153, "nfsservctl": 180,
    "_sysctl": 156, "personality": 135, "lsm_set_self_attr": 460,
}  # fmt: skip
# signal senders: allowed only when the first argument (pid / tgid) is the program's own pid
SELF_ONLY = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297}
SYS_CLONE, SYS_CLONE3, SYS_SOCKET, SYS_SOCKETPAIR, SYS_IOCTL = 56, 435, 41, 53, 16

# BPF opcodes: load a 32-bit word of struct seccomp_data, jumps on a constant, return a constant
BPF_LD_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
DATA_NR, DATA_ARCH = 0, 4  # offsets in struct seccomp_data


def _arg_low_word(index: int) -> int:
    """Offset of the low 32 bits of syscall argument ``index`` (little endian); the kernel truncates int-typed
    arguments (pids, flags, families) to those bits, so comparing them is exact."""
    return 16 + 8 * index


def _deny_rules() -> list[tuple[int, int, int, int]]:
    """Architecture check, x32 and unreviewed numbers, then EPERM for every entry of ``DENIED``."""
    p = [(BPF_LD_ABS, 0, 0, DATA_ARCH), (BPF_JEQ, 1, 0, AUDIT_ARCH_X86_64), (BPF_RET, 0, 0, RET_KILL_PROCESS),
         (BPF_LD_ABS, 0, 0, DATA_NR),
         (BPF_JGE, 0, 1, X32_SYSCALL_BIT), (BPF_RET, 0, 0, RET_ERRNO | EPERM),
         (BPF_JGE, 0, 1, FIRST_UNREVIEWED_NR), (BPF_RET, 0, 0, RET_ERRNO | ENOSYS)]  # fmt: skip
    for nr in sorted(set(DENIED.values())):
        p += [(BPF_JEQ, 0, 1, nr), (BPF_RET, 0, 0, RET_ERRNO | EPERM)]
    return p


def _argument_rules(own_pid: int) -> list[tuple[int, int, int, int]]:
    """Rules that look at an argument: threads only from clone, signals only to ourselves, AF_UNIX sockets only,
    no TIOCSTI. Each rule leaves the syscall number in the accumulator when it does not match."""
    p = [(BPF_JEQ, 0, 1, SYS_CLONE3), (BPF_RET, 0, 0, RET_ERRNO | ENOSYS)]  # clone3's flags sit in a struct
    # seccomp cannot read; ENOSYS makes glibc create threads with clone, whose flags it can
    p += [(BPF_JEQ, 0, 5, SYS_CLONE), (BPF_LD_ABS, 0, 0, _arg_low_word(0)),
          (BPF_JSET, 2, 0, CLONE_NEW_ANY), (BPF_JSET, 0, 1, CLONE_THREAD),
          (BPF_RET, 0, 0, RET_ALLOW), (BPF_RET, 0, 0, RET_ERRNO | EPERM)]  # fmt: skip
    for nr, value in [(nr, own_pid) for nr in sorted(SELF_ONLY.values())] + [
        (SYS_SOCKET, AF_UNIX), (SYS_SOCKETPAIR, AF_UNIX)
    ]:
        p += [(BPF_JEQ, 0, 4, nr), (BPF_LD_ABS, 0, 0, _arg_low_word(0)), (BPF_JEQ, 0, 1, value),
              (BPF_RET, 0, 0, RET_ALLOW), (BPF_RET, 0, 0, RET_ERRNO | EPERM)]  # fmt: skip
    p += [(BPF_JEQ, 0, 5, SYS_IOCTL), (BPF_LD_ABS, 0, 0, _arg_low_word(1)),
          (BPF_JEQ, 1, 0, TIOCSTI), (BPF_JEQ, 0, 1, TIOCLINUX),
          (BPF_RET, 0, 0, RET_ERRNO | EPERM), (BPF_RET, 0, 0, RET_ALLOW)]  # fmt: skip
    return p


def filter_program(own_pid: int) -> list[tuple[int, int, int, int]]:
    """The whole filter as BPF instructions ``(code, jump if true, jump if false, constant)``; ``own_pid`` is the
    pid (in the program's own pid namespace) that signals may be sent to. Raises OSError off x86-64."""
    if os.uname().machine != "x86_64":
        raise OSError(f"the seccomp filter is written for x86-64, not {os.uname().machine}")
    return _deny_rules() + _argument_rules(own_pid) + [(BPF_RET, 0, 0, RET_ALLOW)]


def install_filter(libc, program: list[tuple[int, int, int, int]]) -> None:
    """Set no_new_privs (required to install a filter, and no setuid binary can regain privileges afterwards),
    then attach ``program`` to this thread with ``prctl(PR_SET_SECCOMP)``; it is inherited by every thread and
    child created later and cannot be removed. ``libc`` is ``ctypes.CDLL(None, use_errno=True)``."""
    import ctypes
    import struct

    raw = b"".join(struct.pack("<HBBI", code, jt, jf, k) for code, jt, jf, k in program)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program), ctypes.addressof(buf))
    for what, args in (("PR_SET_NO_NEW_PRIVS", (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)),
                       ("PR_SET_SECCOMP", (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0))):
        if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl({what}): {os.strerror(err)}")


def check_enforced(libc) -> None:
    """Install a one-rule filter (getppid -> EPERM) on this process and check that the kernel applies it; raises
    OSError otherwise. Destructive: run it in a throw-away child (the probe forks one)."""
    import ctypes

    sys_getppid = 110
    install_filter(libc, [(BPF_LD_ABS, 0, 0, DATA_NR), (BPF_JEQ, 0, 1, sys_getppid),
                          (BPF_RET, 0, 0, RET_ERRNO | EPERM), (BPF_RET, 0, 0, RET_ALLOW)])  # fmt: skip
    if libc.syscall(sys_getppid) != -1 or ctypes.get_errno() != EPERM:
        raise OSError("a seccomp filter was installed but the kernel does not apply it")
