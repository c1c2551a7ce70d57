"""quant's version where it is not installed (a source checkout on PYTHONPATH, as on a GPU node without network)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_version_of_a_source_checkout_that_is_not_installed(tmp_path):
    # a copy of the checkout (quant/ and pyproject.toml, no egg-info) seen by a Python that cannot see the installed
    # distribution: isolated mode (-I, -S) reads neither PYTHONPATH nor site-packages
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "quant", checkout / "quant", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", checkout / "pyproject.toml")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata as md\n"
            "try:\n    md.version('moe-quant'); print('installed')\nexcept md.PackageNotFoundError:\n"
            "    import quant; print(quant.version())")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(checkout)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{out.stdout.strip().removesuffix("+source")}"' in pyproject
    assert out.stdout.strip().endswith("+source")


def test_installed_version_is_the_distribution_s():
    import importlib.metadata as md

    import quant

    try:
        installed = md.version("moe-quant")
    except md.PackageNotFoundError:  # run from a checkout (the GPU node): the other test covers it
        pytest.skip("moe-quant is not installed here")
    quant.version.cache_clear()
    assert quant.version() == installed
