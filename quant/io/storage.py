"""Files on disk: content digests cached by stat, temporaries left by dead processes, free space.

Digests: ``file_sha256`` is the full SHA-256 of a file's bytes, computed once and cached under
``$QUANT_CACHE/sha256/`` keyed by the file's identity and stat (device, inode, size, mtime and ctime in
nanoseconds). Any write through the file system changes mtime and ctime (ctime cannot be set back by a user), so
a damaged, truncated or replaced file is hashed again and its new digest differs; a file that did not change is
never read twice. The trade-off against hashing size + mtime + sampled blocks: the first use of a model or an
artifact reads it whole once (a 600 GB model: minutes, shards hashed in parallel), in exchange a digest is exact
(damage anywhere is seen) and content-addressed (a copied model folder keeps its fingerprint). What it cannot see
is a change that bypasses the file system's timestamps (writing the block device, setting the clock back).

Temporaries carry the writing process's id (``.name.<pid>.tmp``, ``.name.tmp-<pid>``, ``quant-dense-<pid>-*``,
``quant-damage-<pid>-*``);
``remove_stale`` deletes those whose process is gone, so a kill -9 leaks nothing past the next run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
# pid of a temporary's writer: .manifest.json.123.tmp, .checkpoint.tmp-123, .checkpoint.old-123, quant-dense-123-x,
# quant-damage-123-x (the layer-damage pass's clean inputs)
_TEMP_PID = re.compile(r"^\..+\.(\d+)\.tmp$|^\..+\.(?:tmp|old)-(\d+)$|^quant-(?:dense|damage)-(\d+)-")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def cache_root() -> Path:
    """``$QUANT_CACHE``, else ``$XDG_CACHE_HOME/quant``, else ``~/.cache/quant`` (a variable set but empty counts as
    unset, not as the current directory; a relative ``XDG_CACHE_HOME`` is ignored, as the XDG base directory
    specification says): builtin models, base-model eval scores, file digests."""
    if quant := os.environ.get("QUANT_CACHE", "").strip():
        return Path(quant)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "quant"


def assets_root() -> Path | None:
    """``$QUANT_ASSETS``: a folder holding shipped model files (``<name>/``) where this copy of quant has no git
    history to read them from (a GPU host the files were carried to, an installed wheel); None when unset."""
    folder = os.environ.get("QUANT_ASSETS", "").strip()
    return Path(folder) if folder else None


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_uncached(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """Full SHA-256 of ``path`` (hex), read once per content: cached by device, inode, size, mtime, ctime."""
    key = _stat_key(path)
    entry = cache_root() / "sha256" / f"{key[0]}-{key[1]}.json"
    try:
        cached = json.loads(entry.read_text())
        if cached["stat"] == key:
            return cached["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_uncached(path)
    if _stat_key(path) == key:  # unchanged while it was read: worth remembering
        _remember(path, key, digest)
    return digest


def _remember(path: Path, key: list[int], digest: str) -> None:
    entry = cache_root() / "sha256" / f"{key[0]}-{key[1]}.json"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stat": key, "sha256": digest, "path": str(path)}))
        os.replace(tmp, entry)
    except OSError:  # a read-only cache only costs a re-read next time
        pass


def file_stamp(path: Path) -> tuple[int, int]:
    """(size, mtime in ns) of ``path``: what another process (another node of a shared file system) sees of it too."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def remember_sha256(path: Path, digest: str, stamp: tuple[int, int]) -> None:
    """Cache ``digest``, computed by another process that saw ``path`` with ``stamp`` (``file_stamp``), if the
    file still has that stamp here; else nothing (``file_sha256`` will read it)."""
    if file_stamp(path) == tuple(stamp):
        _remember(path, _stat_key(path), digest)


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def temp_pid(name: str) -> int | None:
    """The writer's pid encoded in a temporary's name, or None if ``name`` is not one of ours."""
    m = _TEMP_PID.match(name)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def remove_stale(directory: Path, prefix: str = "") -> list[str]:
    """Delete temporaries in ``directory`` (names starting with ``prefix``) whose writing process is gone."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for p in entries:
        pid = temp_pid(p.name) if p.name.startswith(prefix) else None
        if pid is None or pid_alive(pid):
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            removed.append(p.name)
        except OSError as e:
            log.warning("could not remove stale temporary %s: %s", p, e)
    if removed:
        log.info("removed %d temporaries left by killed runs in %s: %s", len(removed), directory,
                 ", ".join(sorted(removed)[:5]))
    return removed


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def is_disk_full(error: BaseException) -> bool:
    """An OSError for a full disk or quota, or a writer library's wrapped one (safetensors: 'No space left')."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return True
    text = str(error)
    return "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text
