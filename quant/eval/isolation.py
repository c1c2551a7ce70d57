"""Kernel isolation for the sandbox's child processes: namespaces, a minimal read-only root, dropped privileges.

Runs in the sandbox's child processes (``quant.eval.sandbox`` ships this module's source to them: standard
library only, no imports from ``quant``), except ``python_binds`` and ``stdlib_readable_by_others``, which the
grader calls to configure them. Through ctypes rather than ``os.unshare`` because Python 3.11 has
none, and because ``pivot_root``, ``capset`` and ``mount_setattr`` have no Python binding at all.

Two namespace modes, chosen by the probe (``probe_layers``, then an end-to-end run in ``quant.eval.sandbox``):

- ``root``: we are real root with CAP_SYS_ADMIN. Plain ``unshare`` of the mount, network, pid, ipc and uts
  namespaces; the worker later drops to uid/gid 65534, which clears every capability. Preferred as root,
  because real root mapped into a user namespace keeps kernel uid 0, which RLIMIT_NPROC exempts.
- ``userns``: anyone else. The same namespaces plus a user namespace that maps our uid and gid to 0; the worker
  later drops the namespace-local capabilities for good (bounding set, ambient set, locked securebits, capset).

The minimal root (``build_root``) is a tmpfs holding read-only, nosuid binds of ``/usr``, ``/lib*``, the
``/bin`` and ``/sbin`` links and the Python prefixes, a few ``/etc`` files, ``/dev/{null,zero,full,random,
urandom}`` and a fresh read-only ``/proc`` of the new pid namespace (when the kernel allows one); the working
directory is its own size-limited tmpfs at the host path of the (empty) host work dir. ``pivot_root`` then
detaches the host's root, so ``/etc/shadow``, ``/root``, ``/home``, the host's ``/tmp`` and every other path
simply do not exist inside.
"""

from __future__ import annotations

import functools
import os

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, ST_RELATIME = 1024, 2048, 1 << 21, 4096
MNT_DETACH = 2
SYS_PIVOT_ROOT, SYS_CAPSET, SYS_MOUNT_SETATTR = 155, 126, 442
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT = 1, 24, 28, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECBITS_LOCKED_NOROOT = 0xEF  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS off, NO_CAP_AMBIENT_RAISE, each locked
LINUX_CAPABILITY_VERSION_3 = 0x20080522
NOBODY = 65534
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
PASSWD = "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


def libc_handle():
    """``ctypes.CDLL(None, use_errno=True)`` with ``syscall`` returning a long."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def checked(ret: int, what: str) -> int:
    """``ret`` unless it is -1, then OSError with errno and ``what``."""
    import ctypes

    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def prctl(libc, option: int, *args: int) -> int:
    import ctypes

    return libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(a) for a in (list(args) + [0, 0, 0, 0])[:4]))


def mount(libc, source, target, fstype, flags: int, data=None) -> None:
    import ctypes

    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    checked(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]),
            f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x})")  # fmt: skip


def _write_proc_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces(libc, mode: str) -> None:
    """Move this single-threaded process into new mount, network, pid, ipc and uts namespaces (``mode`` "root"),
    plus a user namespace mapping our uid/gid to 0 (``mode`` "userns"). The new pid namespace applies to children
    only: the caller forks next, and that child is pid 1."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    if mode == "userns":
        flags |= CLONE_NEWUSER
    checked(libc.unshare(flags), "unshare")
    if mode == "userns":
        _write_proc_file("/proc/self/setgroups", "deny")
        _write_proc_file("/proc/self/uid_map", f"0 {uid} 1\n")
        _write_proc_file("/proc/self/gid_map", f"0 {gid} 1\n")


@functools.cache
def python_binds() -> tuple[str, ...]:
    """(In the grader.) Host paths the minimal root binds read-only: system directories and every Python prefix
    (real and symlinked, so a venv's bin/python link resolves inside), less those below another non-link entry."""
    import sys

    candidates = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"]
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable)):  # fmt: skip
        candidates += [os.path.realpath(p), os.path.abspath(p)]
    unique = list(dict.fromkeys(os.path.normpath(c) for c in candidates if os.path.normpath(c) != "/"))
    return tuple(c for c in unique
            if not any(o != c and c.startswith(o + "/") and not os.path.islink(o) for o in unique))  # fmt: skip


@functools.cache
def stdlib_readable_by_others() -> bool:
    """(In the grader.) Whether uid 65534 could import the standard library without namespaces: every directory
    down to it searchable by others (a pyenv under a 0700 /root is not)."""
    import stat
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents]) and bool(
        path.stat().st_mode & stat.S_IROTH)


def _make_mount_point(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
        return
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if not os.path.exists(dst):
        os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))


def bind_read_only(libc, src: str, dst: str, device: bool = False) -> None:
    """Bind ``src`` (a directory or file, submounts included) at ``dst``: read-only, nosuid, and nodev unless
    ``device`` (then noexec instead).

    Recursive (MS_REC) because in a user namespace the submounts of ``src`` are locked to it and a plain bind
    fails with EINVAL (a squashfs under ``/usr`` does this). Read-only for the whole subtree through
    ``mount_setattr(AT_RECURSIVE)`` (Linux >= 5.12), else by remounting every mount point below ``dst``.
    """
    import ctypes

    _make_mount_point(src, dst)
    mount(libc, src, dst, None, MS_BIND | MS_REC)
    attrs = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (MOUNT_ATTR_NOEXEC if device else MOUNT_ATTR_NODEV)

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip

    attr = MountAttr(attrs, 0, 0, 0)
    ret = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, os.fsencode(dst), AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr))  # fmt: skip
    if ret == 0:
        return
    if ctypes.get_errno() != 38:  # ENOSYS: an older kernel, remount one by one below
        checked(ret, f"mount_setattr({dst!r})")
    _remount_read_only(libc, dst, device)


def _remount_read_only(libc, dst: str, device: bool) -> None:
    """Remount every mount point at or below ``dst`` read-only (the flags a bind remount must repeat are kept)."""
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == dst or point.startswith(dst.rstrip("/") + "/"):
                points.append(point)
    for point in points:
        flags = os.statvfs(point).f_flag
        keep = flags & (MS_NOEXEC | MS_NODEV | MS_NOATIME | MS_NODIRATIME)
        keep |= MS_RELATIME if flags & ST_RELATIME else 0
        mount(libc, None, point, None,
              MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep | (MS_NOEXEC if device else MS_NODEV))


def _populate_root(libc, new: str, binds: list) -> None:
    """Under the new root ``new``: the read-only binds (symlinks recreated as symlinks), ``/etc``, ``/dev``."""
    for src in list(binds) + list(ETC_FILES):
        if os.path.islink(src):
            os.makedirs(new + os.path.dirname(src), exist_ok=True)
            os.symlink(os.readlink(src), new + src)
        elif os.path.exists(src):
            bind_read_only(libc, src, new + src)
    os.makedirs(new + "/etc", exist_ok=True)
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        with open(f"{new}/etc/{name}", "w") as handle:
            handle.write(text)
    for dev in DEVICES:
        bind_read_only(libc, "/dev/" + dev, f"{new}/dev/{dev}", device=True)


def _mount_proc(libc, target: str) -> bool:
    """A fresh read-only /proc of the new pid namespace at ``target``; False when the kernel refuses one (a
    container with masked /proc entries refuses it in a user namespace). Python does not need /proc."""
    os.makedirs(target, exist_ok=True)
    try:
        mount(libc, "proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        return True
    except OSError:
        return False


def build_root(libc, config: dict) -> bool:
    """In pid 1 of the new namespaces: build the minimal root described above, ``pivot_root`` into it, detach
    the old root and make ``/`` read-only. ``config``: ``workdir`` (absolute, empty), ``binds`` (host paths),
    ``work_bytes`` (tmpfs size of the working directory), ``final_uid`` (its owner). True when /proc is mounted."""
    work = config["workdir"]
    mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    new = work  # the empty host work dir is only the mount point of the new root, and stays empty
    mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    _populate_root(libc, new, config["binds"])
    proc = _mount_proc(libc, new + "/proc")
    os.makedirs(new + work, exist_ok=True)
    uid = config["final_uid"]
    mount(libc, "tmpfs", new + work, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={config['work_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={uid}")  # fmt: skip
    os.chdir(new)
    checked(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    checked(libc.umount2(b".", MNT_DETACH), "umount of the old root")
    os.chdir("/")
    mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return proc


def capabilities_effective() -> int | None:
    """CapEff of this process (from /proc/self/status), None when /proc is not mounted."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        return None
    return None


def drop_privileges(libc, mode: str) -> None:
    """``mode`` "root": become uid/gid 65534 with no supplementary groups (from root without KEEP_CAPS this
    clears every capability). ``mode`` "userns": keep the namespace-local uid 0 but drop every capability from
    the bounding, ambient, permitted and effective sets, with securebits locked so none comes back. Raises when
    capabilities remain afterwards."""
    import ctypes

    if mode == "root":
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    else:
        for cap in range(64):  # past the kernel's last capability prctl fails with EINVAL, harmlessly
            prctl(libc, PR_CAPBSET_DROP, cap)
        prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        checked(prctl(libc, PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT), "PR_SET_SECUREBITS")

        class CapHeader(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        data = (ctypes.c_uint32 * 6)()
        checked(libc.syscall(SYS_CAPSET, ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")
    effective = capabilities_effective()
    if effective:
        raise RuntimeError(f"capabilities still held after the drop: {effective:#x}")


def in_forked_child(check) -> str:
    """Run ``check()`` in a forked child; its verdict: "ok", "ok (<note>)" or "no: <why>"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            note = check()
            verdict = "ok" if note is None else f"ok ({note})"
        except BaseException as exc:  # noqa: BLE001 - any failure means the layer is unusable here
            verdict = f"no: {exc}"
        os.write(w, verdict.encode()[:4000])
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode() or "no: the check's process died"


def _namespace_check(libc, mode: str):
    def check() -> str | None:
        enter_namespaces(libc, mode)
        pid = os.fork()
        if pid == 0:  # pid 1 of the new namespace: a private tmpfs, and /proc if the kernel allows it
            try:
                mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
                mount(libc, "tmpfs", "/mnt", "tmpfs", 0, "size=64k")
                os._exit(3 if os.getpid() != 1 else 0 if _mount_proc(libc, "/mnt/proc") else 4)
            except BaseException:
                os._exit(2)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code not in (0, 4):
            raise OSError(f"set-up inside the new namespaces failed (code {code})")
        return None if code == 0 else "no new /proc"

    return check


def probe_namespaces(libc) -> dict:
    """Whether each namespace mode works here, tried in a forked child of this (fresh, single-threaded)
    interpreter: {"userns": verdict, "rootns": verdict}, verdicts as ``in_forked_child`` returns them."""
    return {
        "userns": in_forked_child(_namespace_check(libc, "userns")),
        "rootns": in_forked_child(_namespace_check(libc, "root")) if os.geteuid() == 0 else "no: not root",
    }
