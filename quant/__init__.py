"""quant: mixed-precision quantization of Mixture-of-Experts LLMs."""

from __future__ import annotations

import functools
import re
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path

DIST_NAME = "moe-quant"


@functools.cache
def version() -> str:
    """The installed distribution's version; run from a source checkout on ``PYTHONPATH`` (not installed, e.g. on a
    GPU node without network), pyproject.toml's version marked ``+source``, or ``0+unknown`` without either."""
    try:
        return _dist_version(DIST_NAME)
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        except OSError:
            m = None
        return f"{m.group(1)}+source" if m else "0+unknown"
