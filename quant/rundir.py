"""The run directory: manifest (stage status, input/output hashes, time, memory, versions), atomic writes, lock.

A stage is finished only when its manifest entry says ``done`` and its outputs still hash to what the entry
recorded; the entry is written after the outputs are in place, so a crash (SIGKILL included) between the two
leaves the stage unfinished, never half-finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from pathlib import Path

from quant.errors import RunDirError

MANIFEST = "manifest.json"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_path(path: Path) -> str:
    """Content hash of a file, or of a directory (names + file hashes; large files by size and edges)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    for p in files:
        h.update(str(p.relative_to(path.parent if path.is_file() else path)).encode())
        size = p.stat().st_size
        with open(p, "rb") as f:
            if size <= 64 << 20:
                h.update(f.read())
            else:  # big artifacts (codes, shards) are written atomically; size + edges identify them
                h.update(str(size).encode())
                h.update(f.read(1 << 20))
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("moe-quant", "torch", "transformers", "compressed-tensors", "safetensors", "lm_eval"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


class RunDir:
    """``runs/<name>/``: holds the manifest and every stage's artifacts."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_file = None

    def manifest(self) -> dict:
        p = self.path / MANIFEST
        if not p.is_file():
            return {}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            raise RunDirError(f"{p} is corrupt; remove the run directory or use another --output") from None

    def save_manifest(self, data: dict) -> None:
        atomic_write_text(self.path / MANIFEST, json.dumps(data, indent=1))

    def claim(self, identity: dict, force: bool) -> dict:
        """Create or reopen the run dir for ``identity`` (recipe hash, model); refuse a different run."""
        if self.path.exists() and not (self.path / MANIFEST).is_file() and any(self.path.iterdir()) and not force:
            raise RunDirError(f"{self.path} exists and is not a quant run directory; use another --output or --force")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        m = self.manifest()
        finished = any(s.get("status") == "done" for s in m.get("stages", {}).values())
        if m and finished and m.get("identity") != identity and not force:
            raise RunDirError(
                f"{self.path} holds a different run (recipe '{m.get('identity', {}).get('recipe')}', "
                f"model {m.get('identity', {}).get('model')}); use another --output, or --force STAGE to redo it"
            )
        m = {"identity": identity, "stages": m.get("stages", {}) if m.get("identity") == identity or force else {},
             "versions": versions()}
        self.save_manifest(m)
        return m

    def _lock(self) -> None:
        self._lock_file = open(self.path / ".lock", "w")  # noqa: SIM115 - held for the process lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"another quant process is using {self.path}") from None

    def is_fresh(self, m: dict, stage: str, input_hash: str, outputs: list[str]) -> bool:
        entry = m["stages"].get(stage, {})
        if entry.get("status") != "done" or entry.get("input_hash") != input_hash:
            return False
        paths = [self.path / o for o in outputs]
        return all(p.exists() for p in paths) and entry.get("outputs") == {o: hash_path(self.path / o) for o in outputs}

    def mark(self, m: dict, stage: str, **fields) -> None:
        m["stages"].setdefault(stage, {}).update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.save_manifest(m)
