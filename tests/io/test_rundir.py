"""The run directory's claim: what a directory without a manifest may hold and still be taken as one's own; a
finished run refuses another model, and says why without guessing at damage."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quant.errors import RunDirError
from quant.io.rundir import MANIFEST, RunDir


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_directory_holding_only_a_claims_leftovers_is_claimed(tmp_path):
    """The lock and a dead writer's temporary manifest are what a claim stopped by a full disk leaves behind."""
    d = tmp_path / "run"
    d.mkdir()
    (d / ".lock").write_text("")
    (d / f".{MANIFEST}.{_dead_pid()}.tmp").write_text("{")
    m = RunDir(d).claim({"recipe": "r", "model": "m", "fingerprint": "f"}, force=False)
    assert m["identity"]["recipe"] == "r" and (d / MANIFEST).is_file()
    assert sorted(p.name for p in d.iterdir()) == [".lock", MANIFEST]


def test_a_directory_with_anything_else_is_not_taken(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / ".lock").write_text("")
    (d / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="exists and is not a quant run directory"):
        RunDir(d).claim({"recipe": "r"}, force=False)
    assert (d / "notes.txt").read_text() == "mine"


def _finished(path, identity):
    d = RunDir(path)
    m = d.claim(identity, force=False)
    d.mark(m, "calibrate", status="done", input_hash="x")
    d._lock_file.close()


@pytest.mark.parametrize("model, why", [("builtin:qwen3-moe-tiny", "a builtin model is rebuilt"),
                                        ("/models/m", "another copy, or files edited or downloaded again")])
def test_a_changed_model_is_refused_naming_both_fingerprints_not_damage(tmp_path, model, why):
    _finished(tmp_path / "r", {"recipe": "r", "model": model, "fingerprint": "aaaa"})
    with pytest.raises(RunDirError) as e:
        RunDir(tmp_path / "r").claim({"recipe": "r", "model": model, "fingerprint": "bbbb"}, force=False)
    msg = str(e.value)
    assert "damaged" not in msg and why in msg and "(aaaa, now bbbb" in msg and "--force all" in msg
