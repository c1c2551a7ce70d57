"""A hub id when the hub cannot be reached: one line at once, or the copy in the local hub cache (whose snapshot
files are symlinks into its blobs/, which the shard check allows). The hub is an endpoint nothing listens on."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from quant.models.builtin import builtin_path
from tests.conftest import REPO

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connection refused at once


def _quant(*args: str, hub_cache: Path, code: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": UNREACHABLE, "HF_HUB_CACHE": str(hub_cache), "HF_HOME": str(hub_cache.parent)}
    argv = ["-c", code, *args] if code else ["-m", "quant.cli", *args]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    return proc, time.perf_counter() - t0


def _cache_holding(hub_cache: Path, repo_id: str, folder: Path) -> None:
    """``folder``'s files in huggingface_hub's cache layout: blobs, refs/main, a snapshot of symlinks."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in folder.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copy2(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)


def test_a_hub_id_without_network_is_one_line_without_retries(tmp_path, quant_cache):
    """Before: 25-30 s of retries, each retry's warning printed, then the error."""
    _, baseline = _quant("estimate", "recipes/mixed_int8_int4.yaml", hub_cache=tmp_path / "hub")
    for command in (["estimate"], ["plan", "-o", str(tmp_path / "r")]):
        proc, seconds = _quant(*command, "recipes/mixed_int8_int4.yaml", "--model", "acme/not-cached",
                               hub_cache=tmp_path / "hub")
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert "the hub cannot be reached (127.0.0.1:9" in lines[0] and "local hub cache does not hold it" in lines[0]
        assert "Retry" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert seconds < baseline + 15, (seconds, baseline)


def test_a_cached_hub_model_is_read_from_the_cache_without_network(tmp_path, quant_cache):
    hub_cache = tmp_path / "hub"
    _cache_holding(hub_cache, "acme/tiny-olmoe", builtin_path("olmoe-tiny"))
    proc, _ = _quant("estimate", "recipes/mixed_int8_int4.yaml", "--model", "acme/tiny-olmoe", hub_cache=hub_cache)
    assert proc.returncode == 0 and "acme/tiny-olmoe:" in proc.stdout, proc.stderr[-3000:]
    code = ("import sys; from quant.models import resolve_model; s = resolve_model(sys.argv[1]); "
            "print(len(s.modules), s.path.parent.name)")
    proc, _ = _quant("acme/tiny-olmoe", hub_cache=hub_cache, code=code)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "snapshots", proc.stderr[-3000:]
