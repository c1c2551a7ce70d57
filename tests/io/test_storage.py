"""Content digests cached by stat, and temporaries of dead processes removed (only theirs)."""

import hashlib
import os
import subprocess
import sys

import pytest

from quant.io import storage
from quant.io.storage import cache_root, file_sha256, remove_stale, temp_pid


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_digest_is_exact_cached_and_sees_in_place_damage(tmp_path, monkeypatch):
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(3 << 20))
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    reads = []
    real = storage.sha256_uncached
    monkeypatch.setattr(storage, "sha256_uncached", lambda p: reads.append(p) or real(p))
    file_sha256(f)
    assert reads == []  # unchanged: from the cache
    st = f.stat()
    with open(f, "r+b") as h:  # damage one byte in the middle, same size, mtime put back
        h.seek(st.st_size // 2)
        b = h.read(1)[0]
        h.seek(st.st_size // 2)
        h.write(bytes([b ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() and reads == [f]


def test_temp_names():
    assert temp_pid(".manifest.json.123.tmp") == 123
    assert temp_pid(".checkpoint.tmp-45") == 45 and temp_pid(".checkpoint-gptq.old-7") == 7
    assert temp_pid(".layer_00003.safetensors.99.tmp") == 99 and temp_pid("quant-dense-12-abc") == 12
    assert temp_pid("manifest.json") is None and temp_pid(".lock") is None and temp_pid("checkpoint") is None


def test_remove_stale_only_touches_dead_writers(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    (tmp_path / f".manifest.json.{dead}.tmp").write_text("x")
    (tmp_path / f".checkpoint.tmp-{dead}").mkdir()
    (tmp_path / f".checkpoint.tmp-{dead}" / "model.safetensors").write_text("x")
    (tmp_path / f".plan.json.{alive}.tmp").write_text("a live writer's")
    (tmp_path / "plan.json").write_text("mine")
    (tmp_path / ".lock").write_text("")
    removed = remove_stale(tmp_path)
    assert sorted(removed) == sorted([f".manifest.json.{dead}.tmp", f".checkpoint.tmp-{dead}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".plan.json.{alive}.tmp", "plan.json", ".lock"])


def test_next_run_cleans_temporaries_of_a_killed_run(tmp_path, quant_cache):
    from quant.recipe import load_recipe
    from quant.run.pipeline import run
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",
                         overrides=("calibration.n_samples=4", "calibration.seq_len=32"))
    out = tmp_path / "r"
    run(recipe, out, until="calibrate")
    dead = _dead_pid()
    leaks = [out / f".manifest.json.{dead}.tmp", out / f".checkpoint.tmp-{dead}", out / f".plan.json.{dead}.tmp",
             out / "quantize.partial" / f".layer_00001.safetensors.{dead}.tmp"]
    for p in leaks:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir() if "checkpoint" in p.name else p.write_text("half")
    run(recipe, out, until="plan")
    assert not [p for p in leaks if p.exists()]


def test_a_digest_from_another_process_is_kept_only_for_the_file_it_saw(tmp_path, monkeypatch):
    """The writer rank keeps the SHA-256 another rank computed for a shard file it wrote (no re-read), unless the
    file's size or mtime differ from what that rank saw."""
    from quant.io.storage import file_stamp, remember_sha256

    f, g = tmp_path / "shard", tmp_path / "other"
    f.write_bytes(b"written by rank 1")
    g.write_bytes(b"also by rank 1")
    reads = []
    real = storage.sha256_uncached
    monkeypatch.setattr(storage, "sha256_uncached", lambda p: reads.append(p) or real(p))
    remember_sha256(f, "a" * 64, file_stamp(f))
    assert file_sha256(f) == "a" * 64 and reads == []  # taken as given: that rank hashed the bytes it wrote
    stamp = file_stamp(g)
    g.write_bytes(b"changed since")
    remember_sha256(g, "b" * 64, stamp)
    assert file_sha256(g) == hashlib.sha256(b"changed since").hexdigest() and reads == [g]


@pytest.mark.parametrize("value", ["", "  "])
def test_quant_cache_set_but_empty_is_the_default_not_the_current_directory(monkeypatch, tmp_path, value):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("QUANT_CACHE", value)
    assert cache_root() == tmp_path / "home" / ".cache" / "quant"
    monkeypatch.setenv("QUANT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_the_cache_follows_xdg_when_quant_cache_is_unset(monkeypatch, tmp_path):
    """QUANT_CACHE, else $XDG_CACHE_HOME/quant, else ~/.cache/quant; XDG_CACHE_HOME was ignored before."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QUANT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "quant"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the specification says
    assert cache_root() == tmp_path / "home" / ".cache" / "quant"
    monkeypatch.setenv("QUANT_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
