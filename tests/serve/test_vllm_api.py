"""The vLLM API the plugin depends on, checked on CPU against each supported release's manifest
(``tests/serve/data/vllm-api-X.json``, built by ``benchmarks/vllm_api.py build`` from that release's wheel): every
vLLM symbol quant/serve imports, calls or overrides is in each manifest (so a new use needs the manifests rebuilt),
and each call and override is compatible with the signatures recorded there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quant.serve.names import SUPPORTED_VLLM_MINORS
from tests.conftest import REPO

DATA = Path(__file__).parent / "data"
MANIFESTS = sorted(DATA.glob("vllm-api-*.json"))
SCRIPT = REPO / "benchmarks" / "vllm_api.py"


def _check(*manifests: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "check", *map(str, manifests)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _uses() -> dict:
    p = subprocess.run([sys.executable, str(SCRIPT), "uses"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_every_supported_minor_has_a_manifest():
    minors = {tuple(int(x) for x in json.loads(m.read_text())["vllm"].split(".")[:2]) for m in MANIFESTS}
    assert set(SUPPORTED_VLLM_MINORS) <= minors, (SUPPORTED_VLLM_MINORS, MANIFESTS)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
def test_the_plugins_uses_of_vllm_agree_with_the_manifest(manifest):
    p = _check(manifest)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_uses_cover_imports_calls_overrides_and_the_layer():
    uses = _uses()
    kinds = {u["kind"] for u in uses["uses"]}
    assert {"module", "name", "call", "subclass", "override", "attribute"} <= kinds
    called = {u["symbol"].rsplit(".", 1)[-1] for u in uses["uses"] if u["kind"] == "call"}
    assert {"fused_marlin_moe", "convert_to_wna16_moe_kernel_format", "moe_wna16_marlin_gemm", "LLM"} <= called
    # the feature checks the plugin's version-gated calls hang on are evaluated per manifest
    assert {"MARLIN_G_IDX", "SHARED_ROUTING"} <= set(uses["gates"])


def _edited(tmp_path: Path, edit) -> Path:
    man = json.loads((DATA / "vllm-api-0.26.0.json").read_text())
    edit(man)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(man))
    return out


MARLIN = "vllm.model_executor.layers.fused_moe.experts.marlin_moe.fused_marlin_moe"


def test_a_use_missing_from_the_manifest_fails_until_it_is_rebuilt(tmp_path):
    p = _check(_edited(tmp_path, lambda m: m["symbols"].pop(MARLIN)))
    assert p.returncode == 1 and "the manifest lacks" in p.stdout and MARLIN in p.stdout


def test_a_renamed_keyword_and_a_removed_symbol_are_caught(tmp_path):
    def rename(m):
        for param in m["symbols"][MARLIN]["params"]:
            if param[0] == "expert_map":
                param[0] = "expert_mapping"

    p = _check(_edited(tmp_path, rename))
    assert p.returncode == 1 and "no parameter 'expert_map'" in p.stdout, p.stdout

    def remove(m):
        m["symbols"].pop(MARLIN)
        m["missing"].append(MARLIN)

    p = _check(_edited(tmp_path, remove))
    assert p.returncode == 1 and f"{MARLIN} is not in vLLM 0.26.0" in p.stdout, p.stdout


def test_an_abstract_method_the_plugin_does_not_define_is_caught(tmp_path):
    base = "vllm.model_executor.layers.fused_moe.FusedMoEMethodBase"
    p = _check(_edited(tmp_path, lambda m: m["symbols"][base]["abstract"].append("select_gemm_impl")))
    assert p.returncode == 1 and "does not define" in p.stdout and "select_gemm_impl" in p.stdout, p.stdout
