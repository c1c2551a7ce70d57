"""Shared fixtures: an isolated builtin-model cache per test session, offline hub settings, CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


@pytest.fixture(scope="session", autouse=True)
def quant_cache(tmp_path_factory) -> Path:
    """Builtin models are built once per session into a private cache (never the user's ~/.cache)."""
    path = Path(os.environ.get("QUANT_TEST_CACHE") or tmp_path_factory.mktemp("quant-cache"))
    os.environ["QUANT_CACHE"] = str(path)
    return path


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``quant ARGS`` in a subprocess (the real console entry point), capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quant.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli
