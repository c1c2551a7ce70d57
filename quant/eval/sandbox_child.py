"""The sandbox's child processes: the process tree around the untrusted program, and its last steps before it.

``quant.eval.sandbox`` starts ``python -I -B -c STUB`` in its own session and ships this module, ``isolation`` and
``seccomp`` as compiled code (standard library only; ``quant`` is not importable there), then a JSON config.
``main`` runs one of two entries: ``probe`` (print which layers this machine allows) or a program.

With namespaces (``config["mode"]`` "root" or "userns") a program runs in three processes:

    outer   enter_namespaces; fork                      (its pid is the session and process group)
      init    pid 1 of the new pid namespace: PR_SET_PDEATHSIG, build_root (pivot_root); fork
        worker  pid 2: chdir, rlimits, drop privileges, seccomp, audit hook, then the program

The new pid namespace applies to children only, hence the fork after ``unshare``; pid 1 ignores signals it has
no handler for (SIGXCPU from RLIMIT_CPU among them), hence the program is pid 2; and when init exits the kernel
kills everything left in the namespace, so nothing the program started outlives it. init relays the worker's
wait status through a pipe and outer exits the same way, so the grader sees the program's own status. On the
grader's timeout SIGTERM, outer kills and reaps init, so no zombie is left to a host pid 1 that may never reap.

Without namespaces (``mode`` None, the explicit weak opt-out) outer is the worker: a best-effort empty network
namespace, uid 65534 when root, seccomp when available, rlimits and the audit hook.

The worker reports on ``config["report_fd"]``: "ready <layer>,<layer>,..." once set up, then the run's nonce
when the program reached its end, so an early ``sys.exit(0)`` is not a pass.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from quant.eval import isolation, seccomp

EXIT_MEMORY = 97  # MemoryError under RLIMIT_AS
EXIT_SETUP = 98  # the sandbox itself could not be set up; the program did not run
NPROC = 512  # threads of uid 65534, all sandboxes together (fork and clone of processes are refused anyway)
# Audit events refused outright (prefix match): network, process creation, signals, FFI, heap introspection
# (could reach the hook's state), rlimit and identity changes. Friendly messages and defence in depth: the
# kernel layers enforce the same below Python.
REFUSED_EVENT_PREFIXES = (
    "socket.", "ftplib.", "http.client.", "imaplib.", "nntplib.", "poplib.", "smtplib.", "telnetlib.",
    "urllib.", "webbrowser.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system", "os.kill",
    "signal.pthread_kill", "subprocess.", "pty.", "ctypes.", "gc.get_", "resource.setrlimit",
    "resource.prlimit", "os.setuid", "os.setgid", "os.setre", "os.chroot",
)  # fmt: skip
# Audit events that change the file system, allowed only on paths inside the working directory.
WORK_DIR_PATH_EVENTS = frozenset((
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.lchown", "os.chflags",
    "os.link", "os.symlink", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree",
    "shutil.chown",
))  # fmt: skip
REFUSED_MODULES = ("_posixsubprocess", "_ctypes")


def main() -> None:
    """Entry point in the child: read the JSON config from the rest of stdin, then probe or run the program."""
    config = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the program reads an empty stdin
    os.close(null)
    if config["entry"] == "probe":
        _probe()
    else:
        _outer(config)


def _probe() -> None:
    """Print (JSON) which layers this machine allows: each tried in a forked child of this fresh interpreter."""
    libc = isolation.libc_handle()
    verdicts = {"euid": os.geteuid(), "kernel": os.uname().release, "python": sys.version.split()[0],
                "seccomp": isolation.in_forked_child(lambda: seccomp.check_enforced(libc))}  # fmt: skip
    verdicts.update(isolation.probe_namespaces(libc))
    sys.stdout.write(json.dumps(verdicts))


def _setup_failed() -> None:
    import traceback

    traceback.print_exc()
    os._exit(EXIT_SETUP)


def _outer(config: dict) -> None:
    """The session leader: with namespaces, enter them and fork init; without, become the worker."""
    import resource

    libc = isolation.libc_handle()
    if config["mode"] is None:
        _worker(libc, config, _weak_network())
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        isolation.enter_namespaces(libc, config["mode"])
    except BaseException:
        _setup_failed()
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        _init(libc, config, status_w)
    os.close(status_w)

    def on_timeout(signum, frame) -> None:  # the grader's timeout: kill and reap init, then die the same way
        os.kill(init, signal.SIGKILL)
        os.waitpid(init, 0)
        os.kill(os.getpid(), signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_timeout)
    _, status = os.waitpid(init, 0)
    relayed = os.read(status_r, 64).decode()
    _exit_like(int(relayed.split()[1]) if relayed.startswith("status ") else status)


def _weak_network() -> list:
    """Without the namespace layer: an empty network namespace if the kernel still allows one on its own."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # root takes a network namespace alone: a user namespace without uid map would make the drop to uid 65534
    # fail (and leave kernel uid 0 behind a uid that reads 65534)
    net, user = isolation.CLONE_NEWNET, isolation.CLONE_NEWUSER
    for flags in (net,) if os.geteuid() == 0 else (user | net, net):
        if libc.unshare(flags) == 0:
            return ["net"]
    return []


def _init(libc, config: dict, status_w: int) -> None:
    """pid 1 of the new pid namespace: build the root, fork the worker, reap, relay its status, exit."""
    try:
        isolation.prctl(libc, isolation.PR_SET_PDEATHSIG, signal.SIGKILL)  # outer gone: the whole namespace goes
        proc = isolation.build_root(libc, config)
    except BaseException:
        _setup_failed()
    layers = ["ns:" + config["mode"], "net", "pid", "fs"] + (["proc"] if proc else [])
    worker = os.fork()
    if worker == 0:
        os.close(status_w)
        _worker(libc, config, layers)
    while True:  # pid 1 reaps every orphan of the namespace; only the worker's status matters
        pid, status = os.waitpid(-1, 0)
        if pid == worker:
            break
    os.write(status_w, f"status {status}".encode())
    os._exit(0)  # pid 1 exits: the kernel kills whatever is left in the namespace


def _limit_resources(config: dict, as_nobody: bool) -> None:
    """Lower soft and hard rlimits so the program cannot raise them back. NPROC counts every process and thread
    of the real uid, so it is set only for uid 65534 (a user's own processes would count against it)."""
    import resource

    cpu_s = config["cpu_seconds"]
    limits = {
        resource.RLIMIT_AS: (config["memory_bytes"], config["memory_bytes"]),
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_FSIZE: (config["file_bytes"], config["file_bytes"]),
        resource.RLIMIT_NOFILE: (256, 256),
        resource.RLIMIT_CORE: (0, 0),
    }
    if as_nobody:
        limits[resource.RLIMIT_NPROC] = (NPROC, NPROC)
    for kind, value in limits.items():
        resource.setrlimit(kind, value)


def _lock_down(libc, config: dict, layers: list) -> None:
    """The worker's last steps before the program, in the only order that works: rlimits (setrlimit is refused
    by the audit hook later), privileges (set*id is refused by seccomp), seccomp (uses ctypes, which the audit
    hook refuses), the audit hook."""
    mode = config["mode"]
    as_nobody = mode == "root" or (mode is None and config["drop_weak"])
    os.chdir(config["workdir"])
    _limit_resources(config, as_nobody)
    if mode is not None or as_nobody:
        isolation.drop_privileges(libc, "root" if as_nobody else mode)
        layers.append("drop:uid65534" if as_nobody else "drop:caps")
    if config["seccomp"]:
        seccomp.install_filter(libc, seccomp.filter_program(os.getpid()))
        layers.append("seccomp")
    else:  # still: no setuid binary or file capability grants anything from here on
        isolation.checked(isolation.prctl(libc, seccomp.PR_SET_NO_NEW_PRIVS, 1), "PR_SET_NO_NEW_PRIVS")
    if config["audit_hook"]:
        _install_audit_hook(config["workdir"])
        layers.append("audit")


def _worker(libc, config: dict, layers: list) -> None:
    """Lock down, report ready with the layers in force, run the program, report the nonce if it ran to the end."""
    try:
        _lock_down(libc, config, layers)
    except BaseException:
        _setup_failed()
    report_fd = config["report_fd"]
    os.write(report_fd, ("ready " + ",".join(layers) + "\n").encode())
    try:
        exec(compile(config.pop("source"), "<program>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(EXIT_MEMORY)
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(report_fd, (config["nonce"] + "\n").encode())
    os._exit(0)


def _install_audit_hook(work_dir: str) -> None:
    """From here on refuse the audit events of ``REFUSED_EVENT_PREFIXES``, ``WORK_DIR_PATH_EVENTS`` on paths
    outside ``work_dir``, opening files for writing outside it, and importing ``REFUSED_MODULES`` under any
    package name. CPython audit hooks can be worked around by code that reads its own memory: this is not the
    boundary (the kernel layers are), it turns naive attempts into one clear "sandbox:" message."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    root = os.path.realpath(work_dir)

    def inside_work_dir(path) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor: the open itself was checked
        resolved = os.path.realpath(os.fsdecode(path))
        return resolved == os.devnull or resolved == root or resolved.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(REFUSED_EVENT_PREFIXES) or (
            event == "import" and args and str(args[0]).rpartition(".")[2] in REFUSED_MODULES
        ):
            what = f"importing {args[0]}" if event == "import" else event
            raise PermissionError(f"sandbox: {what} is not allowed")
        # os.open (mode None) may be relative to a dir_fd the event does not show, so only the builtin open()
        # may write, and only inside the working directory.
        if event == "open" and len(args) >= 3 and (args[2] or 0) & write_flags:
            if args[1] is None or not inside_work_dir(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} is not allowed")
        elif event in WORK_DIR_PATH_EVENTS and args and not all(
            inside_work_dir(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))
        ):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


def _exit_like(status: int) -> None:
    """Exit the way a child with wait status ``status`` did: by the same signal, or with the same code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))
