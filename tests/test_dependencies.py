"""The README's two install commands resolve the same libraries: the base dependencies admit no transformers that
an extra of the test command (eval, reference) refuses, so what `pip install -e .` picks is what CI tests."""

from __future__ import annotations

import importlib.metadata as md

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# every transformers release a resolver could pick in the 5.x series (the newest admitted one is what it picks)
CANDIDATES = [Version(f"5.{minor}.{patch}") for minor in range(60) for patch in range(6)]


def _transformers(requirements) -> list[Requirement]:
    reqs = [Requirement(r) for r in requirements or ()]
    return [r for r in reqs if r.name == "transformers" and (r.marker is None or r.marker.evaluate({"extra": ""}))]


def _base() -> Requirement:
    (req,) = _transformers(PYPROJECT["dependencies"])
    return req


def test_the_installed_transformers_is_in_the_base_range():
    assert _base().specifier.contains(md.version("transformers"), prereleases=True)


@pytest.mark.parametrize("extra", ["eval", "reference"])
def test_the_newest_transformers_the_base_admits_is_admitted_by_every_package_of_the_test_extras(extra):
    newest = max(v for v in CANDIDATES if _base().specifier.contains(v))
    for line in PYPROJECT["optional-dependencies"][extra]:
        name = Requirement(line).name
        try:
            requires = md.requires(name)
        except md.PackageNotFoundError:
            pytest.skip(f"{name} (extra {extra}) is not installed here")
        for req in _transformers(requires):
            assert req.specifier.contains(newest), (f"pip install -e . picks transformers {newest}; {name} of the "
                                                    f"{extra} extra needs {req.specifier}")
