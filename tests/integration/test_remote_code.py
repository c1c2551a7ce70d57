"""The command line on a remote-code model with per-expert Linear experts (``model.trust_remote_code: true``).

``per_expert_model`` is builtin:qwen3-moe-tiny's checkpoint under its own transformers-4.x-style modeling file
(tests/conftest.py); runs are fp32 so that the native fused run is the exact reference.
"""

import json
import re

import pytest
import torch

from tests.conftest import REPO, make_per_expert_model, run_cli

HEADLINE = "recipes/mixed_int8_int4.yaml"
FAST = ["--set", "calibration.n_samples=8", "--set", "calibration.seq_len=64", "--set", "eval.perplexity.n_samples=2",
        "--set", "eval.perplexity.seq_len=64", "--set", "model.dtype=float32", "--set", "plan.group_size=32"]
TRUST = ["--set", "model.trust_remote_code=true", "--set", "model.family=qwen3_moe"]


def _one_line_error(proc, pattern: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and pattern in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def runs(per_expert_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-runs")
    pe = run_cli("run", HEADLINE, "--model", str(per_expert_model), "-o", str(root / "pe"), *TRUST, *FAST)
    assert pe.returncode == 0, pe.stderr[-3000:]
    nat = run_cli("export", HEADLINE, "-o", str(root / "nat"), *FAST)
    assert nat.returncode == 0, nat.stderr[-3000:]
    return root / "pe", root / "nat"


def test_whole_run_on_remote_code_passes_and_profile_equals_native(runs):
    pe, nat = runs
    assert json.loads((pe / "manifest.json").read_text())["passed"] is True
    a, b = (json.loads((d / "profile.json").read_text()) for d in (pe, nat))
    assert a["counts"] == b["counts"] and a["top1"] == b["top1"]
    assert torch.allclose(torch.tensor(a["weight_mass"]), torch.tensor(b["weight_mass"]), rtol=1e-5)
    pa, pb = (json.loads((d / "plan.json").read_text()) for d in (pe, nat))
    assert pa["modules"] == pb["modules"]


def test_export_and_inspect_equal_native(runs):
    from safetensors.torch import load_file

    pe, nat = runs
    assert (pe / "checkpoint" / "modeling_qwen3_moe_perexpert.py").is_file()  # the checkpoint loads on its own
    config = json.loads((pe / "checkpoint" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe_perexpert" and "auto_map" in config and "quantization_config" in config
    ta, tb = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (pe, nat))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    ia, ib = (run_cli("inspect", str(d / "checkpoint")) for d in (pe, nat))
    assert ia.returncode == 0 and ia.stdout == ib.stdout and re.search(r"W4=\d+, W8=\d+", ia.stdout)


def test_remote_model_type_without_the_flag_is_one_clear_error(per_expert_model, tmp_path):
    p = run_cli("profile", HEADLINE, "--model", str(per_expert_model), "-o", str(tmp_path / "r"), *FAST)
    _one_line_error(p, "set model.trust_remote_code: true")


def test_remote_model_type_without_a_family_is_one_clear_error(per_expert_model, tmp_path):
    p = run_cli("profile", HEADLINE, "--model", str(per_expert_model), "-o", str(tmp_path / "r"), *FAST,
                "--set", "model.trust_remote_code=true")
    _one_line_error(p, "set model.family to it")


def test_a_family_that_contradicts_the_model_type_is_one_clear_error(tmp_path):
    p = run_cli("profile", HEADLINE, "-o", str(tmp_path / "r"), *FAST, "--set", "model.family=mixtral")
    _one_line_error(p, "is model_type 'qwen3_moe' (family qwen3_moe); model.family 'mixtral' contradicts it")
    p = run_cli("profile", HEADLINE, "-o", str(tmp_path / "r2"), *FAST, "--set", "model.family=qwen9")
    _one_line_error(p, "model.family 'qwen9' is not one of qwen3_moe")


def test_unrecognised_module_list_is_one_clear_error(tmp_path):
    model = make_per_expert_model(tmp_path / "odd-experts")
    code = model / "modeling_qwen3_moe_perexpert.py"
    code.write_text(code.read_text().replace("self.up_proj", "self.fc_up"))  # experts no longer named like the checkpoint
    p = run_cli("profile", HEADLINE, "--model", str(model), "-o", str(tmp_path / "r"), *TRUST, *FAST, cwd=REPO)
    # the model folder check, before any stage: the code's modules against the checkpoint's tensors
    _one_line_error(p, "odd-experts does not match its config.json: model.layers.0.mlp.experts.0.fc_up.weight is missing")
    assert not (tmp_path / "r" / "profile.json").exists()
