"""The run directory: manifest (stage status, input/output hashes, time, memory, versions), atomic writes, lock.

A stage is finished only when its manifest entry says ``done`` and its outputs still hash to what the entry
recorded; the entry is written after the outputs are in place, so a crash (SIGKILL included) between the two
leaves the stage unfinished, never half-finished. A stage that raises is recorded as ``failed`` (``interrupted``
for Ctrl-C) with the error, and whatever outputs it had are removed. Temporaries of killed processes are removed
when the directory is next claimed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path

from quant.errors import RunDirError
from quant.io.storage import file_sha256, free_bytes, is_disk_full, pid_alive, remove_stale, temp_pid

MANIFEST = "manifest.json"
LOCK = ".lock"
# OSErrors that are the environment's, not a bug: reported as one line naming the file
ENVIRONMENT_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
                      errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT}


def temp_path(path: Path) -> Path:
    """Where to write ``path`` before renaming it into place (names the writer's pid: see storage.remove_stale)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary beside ``path``, then rename it over ``path``; on failure (a full disk) the
    temporary is removed and ``path`` is unchanged."""
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def hash_path(path: Path) -> str | None:
    """Content hash of a file, or of a directory (names + full SHA-256 of every file, cached by stat: see
    ``storage.file_sha256``); None when ``path`` does not exist."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    for p in files:
        h.update(os.fsencode(p.relative_to(path.parent if path.is_file() else path)))  # any name, UTF-8 or not
        h.update(file_sha256(p).encode())
    return h.hexdigest()[:16]


def data_digest(data) -> str:
    """Content hash of JSON-able data (dict keys sorted): what a stage reads of an artifact, not its file."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:,.1f} MB" if n_bytes < 10e6 else f"{n_bytes / 1e6:,.0f} MB"


def environment_error(error: BaseException, where: Path, needed_bytes=None) -> RunDirError | None:
    """A one-line RunDirError for a full disk, a read-only or forbidden path, ...; None for anything else.
    ``needed_bytes()`` estimates what the failed step needed (for the disk-full message)."""
    target = Path(getattr(error, "filename", None) or where)
    if is_disk_full(error):
        folder = target
        while not folder.is_dir() and folder != folder.parent:  # the nearest existing folder
            folder = folder.parent
        try:
            need = f", about {_mb(needed_bytes())} needed" if needed_bytes else ""
        except Exception:  # noqa: BLE001 - an estimate must not hide the disk-full error
            need = ""
        return RunDirError(f"no space left on {folder}: {_mb(free_bytes(folder))} free{need}; free some space or use "
                           "another --output (or TMPDIR for eval's temporary files)")
    if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
        return RunDirError(f"cannot write {target}: {error.strerror}")
    return None


def versions() -> dict[str, str]:
    import importlib.metadata as md

    from quant import version

    out = {"python": platform.python_version(), "moe-quant": version()}
    for pkg in ("torch", "transformers", "compressed-tensors", "safetensors", "lm_eval"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


STATUSES = ("running", "done", "failed", "interrupted", "stopped")
_NUMBER = (int, float)
# stage entry field -> the JSON types it may hold (a hand-edited manifest is refused, not half read)
_STAGE_FIELDS: dict[str, tuple] = {
    "status": (str,), "input_hash": (str,), "error": (str,), "updated": (str,), "device": (str,),
    "upstream": (dict,), "outputs": (dict,), "wall_s": _NUMBER, "peak_memory_bytes": _NUMBER, "ranks": (int,),
    "passed": (bool, type(None)), "failed_gates": (list,)}


def manifest_problem(data) -> str | None:
    """What makes ``data`` (a parsed manifest.json) not one quant wrote, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for key, kinds in (("identity", (dict,)), ("stages", (dict,)), ("versions", (dict,)), ("passed", (bool, type(None)))):
        if key in data and not isinstance(data[key], kinds):
            return f"'{key}' is a {type(data[key]).__name__}"
    for stage, entry in data.get("stages", {}).items():
        if not isinstance(entry, dict):
            return f"stage '{stage}' is a {type(entry).__name__}, not an object"
        for field, kinds in _STAGE_FIELDS.items():
            value = entry.get(field, kinds[0]())
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # true is no number
                return f"stages.{stage}.{field} is a {type(value).__name__}"
        if entry.get("status", "done") not in STATUSES:
            return f"stages.{stage}.status is {entry['status']!r}"
        if not all(isinstance(v, str | None) for v in entry.get("outputs", {}).values()):
            return f"stages.{stage}.outputs holds a value that is not a digest"
        if not all(isinstance(v, dict | None) for v in entry.get("upstream", {}).values()):
            return f"stages.{stage}.upstream holds a value that is not a stage's outputs"
        if not all(isinstance(g, str) for g in entry.get("failed_gates", [])):
            return f"stages.{stage}.failed_gates holds a value that is not a gate's text"
    return None


def read_run_manifest(path: Path) -> dict:
    """The manifest at ``path`` ({} when there is none), or a RunDirError saying it is damaged."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8 text
        problem = f"not JSON: {str(e).splitlines()[0][:100]}"
    else:
        problem = manifest_problem(data)
    if problem is not None:
        raise RunDirError(f"{path} is damaged or was edited ({problem}); remove the run directory or use another "
                          "--output")
    return data


def first_link(root: Path) -> Path | None:
    """The first symbolic link at any depth under ``root`` (``root`` itself may be one: the user chose where the run
    lives), in a sorted top-down walk that follows no link, so every command names the same one; None when there
    is none or ``root`` does not exist."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            if (here / name).is_symlink():
                return here / name
    return None


def refuse_links(root: Path) -> None:
    """The one link rule for a run directory, applied by every command that reads or writes one (run and its stage
    commands, ``--dry-run``, publish, inspect): no entry at any depth is a symbolic link. quant writes, replaces,
    hashes and uploads these files itself; through a link it would follow a file it does not own (an upload, a
    stage's output or its freshness check would read or write what the link points to)."""
    link = first_link(root)
    if link is not None:
        raise RunDirError(f"{link} is a symbolic link; quant follows no links in a run directory (at any depth): "
                          "replace it by the file or folder itself, or put the whole run directory where it points, "
                          "with --output")


def enclosing_run_dir(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint folder was exported into: its parent (named as given, links not resolved),
    when that holds a run manifest quant wrote; None for a checkpoint anywhere else (a hub download, a copy)."""
    parent = Path(os.path.abspath(checkpoint)).parent
    try:
        data = json.loads((parent / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return parent if manifest_problem(data) is None and isinstance(data.get("stages"), dict) else None


def _model_changed(path: Path, old: dict, new: dict) -> str:
    """Why a finished run directory refuses its model: the files differ from those it was made from. A builtin is
    rebuilt when a quant version defines it differently; a folder or hub model was copied, edited or re-fetched."""
    model = new.get("model")
    why = ("a builtin model is rebuilt when a quant version defines it differently" if str(model).startswith("builtin:")
           else "another copy, or files edited or downloaded again since")
    return (f"the model {model} changed since {path} was made: its files no longer match the recorded fingerprint "
            f"({old.get('fingerprint')}, now {new.get('fingerprint')}: {why}); use the model it was made with, or "
            "--force all to redo the run on this one")


class RunDir:
    """``runs/<name>/``: holds the manifest and every stage's artifacts."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_file = None

    def manifest(self) -> dict:
        return read_run_manifest(self.path / MANIFEST)

    def save_manifest(self, data: dict) -> None:
        atomic_write_text(self.path / MANIFEST, json.dumps(data, indent=1))

    def claim(self, identity: dict, force: bool) -> dict:
        """Create or reopen the run dir for ``identity`` (recipe hash, model); refuse a different run, and a symbolic
        link anywhere in it (``refuse_links``)."""
        try:
            return self._claim(identity, force)
        except OSError as e:
            raise environment_error(e, self.path) or RunDirError(f"cannot create or use run directory {self.path}: "
                                                                 f"{e.strerror or e}") from None

    def check_entries(self) -> None:
        """What a run (or its dry run) refuses before reading anything: a file in place of the directory, and a
        symbolic link anywhere in it."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"{self.path} is a file, not a run directory; use another --output")
        refuse_links(self.path)

    def _claim(self, identity: dict, force: bool) -> dict:
        self.check_entries()
        if self.path.exists() and not (self.path / MANIFEST).is_file() and self._foreign() and not force:
            raise RunDirError(f"{self.path} exists and is not a quant run directory; use another --output or --force")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        for d in (self.path, self.path / "quantize.partial"):
            remove_stale(d)
        m = self.manifest()
        refusal = self.refusal(m, identity, force)
        if refusal is not None:
            raise RunDirError(refusal)
        m = {"identity": identity, "stages": m.get("stages", {}) if m.get("identity") == identity or force else {},
             "versions": versions()}
        self.save_manifest(m)
        return m

    def _foreign(self) -> list[str]:
        """Entries of a directory without a manifest that are not a claim's own leftovers: the lock, and temporaries
        of processes that are gone (a claim stopped by a full disk leaves just those)."""
        return [p.name for p in self.path.iterdir()
                if p.name != LOCK and not ((pid := temp_pid(p.name)) is not None and not pid_alive(pid))]

    def refusal(self, m: dict, identity: dict, force: bool) -> str | None:
        """Why this run directory, whose manifest is ``m``, cannot take a run of ``identity`` (None: it can)."""
        finished = any(s.get("status") == "done" for s in m.get("stages", {}).values())
        old = m.get("identity", {})
        if not m or not finished or old == identity or force:
            return None
        if {**old, "fingerprint": None} == {**identity, "fingerprint": None}:
            return _model_changed(self.path, old, identity)
        return (f"{self.path} holds a different run (recipe '{old.get('recipe')}', model {old.get('model')}); use "
                "another --output, or --force STAGE to redo it")

    def _lock(self) -> None:
        self._lock_file = open(self.path / LOCK, "w")  # noqa: SIM115 - held for the process lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"another quant process is using {self.path}") from None

    def is_fresh(self, m: dict, stage: str, input_hash: str, output_hashes) -> bool:
        """Done with these inputs, and ``output_hashes()`` (None for a missing or damaged output) as recorded."""
        entry = m["stages"].get(stage, {})
        if entry.get("status") != "done" or entry.get("input_hash") != input_hash:
            return False
        now = output_hashes()
        return None not in now.values() and entry.get("outputs") == now

    def mark(self, m: dict, stage: str, **fields) -> None:
        m["stages"].setdefault(stage, {}).update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.save_manifest(m)

    def fail(self, m: dict, stage: str, error: BaseException, outputs: list[str]) -> None:
        """Record ``stage`` as failed (or interrupted) with the error and remove its outputs, so nothing it left
        looks finished. Best effort: a full disk must not hide the original error."""
        for o in outputs:
            p = self.path / o
            try:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            except OSError:
                pass
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        message = (str(error).strip().splitlines() or [""])[0]
        try:
            m["stages"].setdefault(stage, {}).pop("outputs", None)
            self.mark(m, stage, status=status, error=f"{type(error).__name__}: {message}"[:500])
        except OSError:
            pass
