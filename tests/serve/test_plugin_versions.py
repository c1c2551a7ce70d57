"""The plugin names the vLLM releases it serves and refuses others in one line (it reaches into vLLM's fused-MoE
internals, which change from release to release)."""

import pytest

from quant.serve.names import CHECKED_VLLM, TESTED_VLLM, vllm_version_problem


@pytest.mark.parametrize("version", [*TESTED_VLLM, *CHECKED_VLLM, "0.26.1", "0.26.0+cu130", "0.26.1.dev4+g1234abc",
                                     "0.33.1"])
def test_the_releases_it_was_served_on_are_supported(version):
    assert vllm_version_problem(version) is None


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "0.27.0", "0.25.2", "1.26.0", "0.3.0", "dev", ""])
def test_other_releases_are_refused_by_name(version):
    problem = vllm_version_problem(version)
    assert problem is not None and "\n" not in problem
    assert f"not vLLM {version}:" in problem
    assert "serves vLLM 0.26.x, 0.33.x (served on 0.26.0; 0.33.0 checked from its source)" in problem
    assert "pip install vllm==0.26.0" in problem
