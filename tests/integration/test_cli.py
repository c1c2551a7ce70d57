"""The command line: bad input gives one clear line and a non-zero exit, nothing is overwritten; resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

HEADLINE = "recipes/mixed_int8_int4.yaml"
FAST = ["--set", "calibration.n_samples=8", "--set", "calibration.seq_len=64", "--set", "eval.perplexity.n_samples=2",
        "--set", "eval.perplexity.seq_len=64"]


def _one_line_error(proc, code: int, pattern: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and pattern in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.fixture
def dense_model(tmp_path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    path = tmp_path / "dense"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_missing_model_path(tmp_path):
    p = run_cli("run", HEADLINE, "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "r"))
    _one_line_error(p, 1, "model path does not exist")
    assert not (tmp_path / "r" / "manifest.json").exists()


def test_dense_model_is_refused(tmp_path, dense_model):
    p = run_cli("run", HEADLINE, "--model", str(dense_model), "-o", str(tmp_path / "r"))
    _one_line_error(p, 1, "is a dense model")


def test_pickle_checkpoint_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 1}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    p = run_cli("plan", HEADLINE, "--model", str(d), "-o", str(tmp_path / "r"))
    _one_line_error(p, 1, "pickle weights")


def test_unknown_builtin(tmp_path):
    p = run_cli("run", HEADLINE, "--model", "builtin:gpt-17", "-o", str(tmp_path / "r"))
    _one_line_error(p, 1, "unknown builtin model 'gpt-17'; builtins: qwen3-moe-tiny")


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nplan: [unclosed\n")
    _one_line_error(run_cli("run", str(bad)), 1, "malformed YAML")


def test_misspelled_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("name: x\nquantize:\n  algoritm: gptq\n")
    _one_line_error(run_cli("validate", str(bad)), 1, "did you mean 'quantize.algorithm'")


def test_bits_5_via_set():
    _one_line_error(run_cli("validate", HEADLINE, "--set", "plan.low_bits=5"), 1, "plan.low_bits must be one of")


def test_validate_prints_resolved_recipe():
    p = run_cli("validate", HEADLINE, "--set", "plan.top_fraction=0.25")
    assert p.returncode == 0 and "top_fraction: 0.25" in p.stdout and "schema_version: 1" in p.stdout


def test_different_finished_run_is_not_overwritten(tmp_path):
    out = tmp_path / "r"
    p = run_cli("plan", HEADLINE, "-o", str(out), *FAST)
    assert p.returncode == 0 and "\nplan: expert bits 4.75, bits over all weights " in p.stdout  # the plan's typed headline
    before = (out / "plan.json").read_bytes()
    p = run_cli("plan", HEADLINE, "-o", str(out), "--model", "builtin:olmoe-tiny", *FAST)
    _one_line_error(p, 1, "holds a different run")
    assert (out / "plan.json").read_bytes() == before
    p = run_cli("plan", HEADLINE, "-o", str(out), "--model", "builtin:olmoe-tiny", "--force", "all", *FAST)
    assert p.returncode == 0 and (out / "plan.json").read_bytes() != before


def test_vllm_rejects_per_expert_mixed_plan_but_accepts_per_layer(tmp_path):
    p = run_cli("plan", HEADLINE, "-o", str(tmp_path / "a"), "--set", "plan.target_runtime=vllm",
                "--set", "plan.group_size=32", *FAST)
    _one_line_error(p, 1, "vllm applies one quantization scheme to all experts of a fused MoE layer")
    assert "plan.granularity: per_layer" in p.stderr
    p = run_cli("plan", HEADLINE, "-o", str(tmp_path / "b"), "--set", "plan.target_runtime=vllm",
                "--set", "plan.group_size=32", "--set", "plan.granularity=per_layer", *FAST)
    assert p.returncode == 0, p.stderr[-1500:]
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())["modules"]
    by_layer = {}
    for name, mp in plan.items():
        if ".experts." in name:
            by_layer.setdefault(name.split(".")[1], set()).add(mp["bits"])
    assert all(len(b) == 1 for b in by_layer.values()) and {8} in by_layer.values()


def test_failing_gate_exits_3_and_is_recorded(tmp_path):
    out = tmp_path / "g"
    p = run_cli("run", HEADLINE, "-o", str(out), "--set", "eval.gates.perplexity.max_rel_increase=-0.5", *FAST)
    _one_line_error(p, 3, "quality gates failed: perplexity")
    m = json.loads((out / "manifest.json").read_text())
    assert m["passed"] is False and m["stages"]["eval"]["passed"] is False
    assert "gates FAILED" in (out / "report.md").read_text()


def test_resume_after_sigkill_during_quantize(tmp_path):
    """Kill -9 inside quantize; the rerun resumes without redoing calibrate/profile/plan."""
    out = tmp_path / "k"
    slow = (
        "import time, quant.quantize.qstore as q\n"
        "orig = q.write_layer\n"
        "def slow(path, *args, **kwargs):\n"
        "    orig(path, *args, **kwargs)\n"
        "    open(str(path) + '.written', 'w').close()\n"
        "    time.sleep(60)\n"
        "q.write_layer = slow\n"
        "import sys; from quant.cli import main; sys.argv = ['quant'] + sys.argv[1:]; main()\n"
    )
    args = [sys.executable, "-c", slow, "run", HEADLINE, "-o", str(out), *FAST]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.time() + 240
    while not list((out / "quantize.partial").glob("*.written")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if proc.poll() is not None:
        pytest.fail(f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
    assert list((out / "quantize.partial").glob("*.written")), "quantize never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = json.loads((out / "manifest.json").read_text())
    assert m["stages"]["quantize"]["status"] == "running" and "export" not in m["stages"]
    before = {s: m["stages"][s]["updated"] for s in ("calibrate", "profile", "plan")}
    time.sleep(1.1)
    p = run_cli("run", HEADLINE, "-o", str(out), *FAST)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ran quantize, export, eval, card, report; up to date: calibrate, profile, plan" in p.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert {s: m["stages"][s]["updated"] for s in before} == before
    assert m["stages"]["quantize"]["status"] == "done" and m["stages"]["quantize"]["resumed_layers"] >= 1
    assert not (out / "quantize.partial").exists() and (out / "quantized" / "layers.json").is_file()


def test_rerun_skips_everything_and_force_redoes_from_stage(tmp_path):
    out = tmp_path / "s"
    assert run_cli("run", HEADLINE, "-o", str(out), *FAST).returncode == 0
    p = run_cli("run", HEADLINE, "-o", str(out), *FAST)
    assert "ran nothing" in p.stdout
    p = run_cli("run", HEADLINE, "-o", str(out), "--force", "export", *FAST)
    assert "ran export, eval, card, report; up to date: calibrate, profile, plan, quantize" in p.stdout
    # same recipe and model, one knob changed: the run is redone from the first stage that reads it
    p = run_cli("run", HEADLINE, "-o", str(out), "--set", "plan.top_fraction=0.3", *FAST)
    assert p.returncode == 0 and "ran plan, quantize, export, eval, card, report; up to date: calibrate, profile" in p.stdout


def test_inspect_matches_plan(tmp_path):
    out = tmp_path / "i"
    assert run_cli("export", HEADLINE, "-o", str(out), *FAST).returncode == 0
    p = run_cli("inspect", str(out / "checkpoint"))
    assert p.returncode == 0
    rows = {ln.split("\t")[0]: ln.split("\t")[1] for ln in p.stdout.splitlines() if not ln.startswith(("#", "module"))}
    plan = json.loads((out / "plan.json").read_text())["modules"]
    from quant.models import resolve_model

    src = resolve_model("builtin:qwen3-moe-tiny")
    for cname, mp in plan.items():
        if cname == "embed":
            continue
        assert rows[src.modules[cname].disk_prefix] == (str(mp["bits"]) if mp["bits"] else "keep"), cname
