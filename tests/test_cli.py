"""The command line's own options and the checks it makes before any work (in process: ``cli_exit_code``)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from quant import version
from quant.cli import cli_exit_code

REPO = Path(__file__).resolve().parents[1]
HEADLINE = str(REPO / "recipes" / "mixed_int8_int4.yaml")


def _one_error_line(capsys, code: int, expected: int = 1) -> str:
    err = capsys.readouterr().err.strip()
    assert code == expected and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
    return err


def test_version(capsys):
    assert cli_exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"quant {version()}"


@pytest.mark.parametrize("argv", [["-h"], ["run", "-h"], ["validate", "-h"]])
def test_h_is_help(capsys, argv):
    assert cli_exit_code(argv) == 0
    out = capsys.readouterr().out
    assert "Usage: quant" in out and "--help" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
@pytest.mark.parametrize("key", ["quantize.device", "eval.device"])
def test_validate_refuses_a_device_this_machine_lacks_as_run_does(capsys, key):
    err = _one_error_line(capsys, cli_exit_code(["validate", HEADLINE, "--set", f"{key}=cuda"]))
    assert "device 'cuda' is not present on this machine" in err


@pytest.mark.parametrize("command", ["validate", "run"])
def test_eval_tasks_without_lm_eval_name_the_pip_command_before_any_stage(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where the eval extra is not installed
    out = tmp_path / "r"
    argv = [command, HEADLINE, "--set", "eval.tasks=[quant_mmlu]"] + (["-o", str(out)] if command == "run" else [])
    err = _one_error_line(capsys, cli_exit_code(argv))
    assert "need lm-eval" in err and "pip install 'moe-quant[eval]'" in err
    assert not out.exists()  # nothing ran, not even calibrate


def test_eval_backend_vllm_without_vllm_names_the_pip_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    err = _one_error_line(capsys, cli_exit_code(["validate", HEADLINE, "--set", "eval.tasks=[quant_mmlu]",
                                                 "--set", "eval.backend=vllm"]))
    assert "pip install vllm" in err


@pytest.mark.parametrize("args", [
    ["run", "recipes/mixed_int8_int4.yaml", "-o", b"RUN\xffdir"],
    ["profile", "recipes/mixed_int8_int4.yaml", "--output", b"RUN\xfe"],
    ["run", b"RUN\xff.yaml"],
    ["inspect", b"RUN\xffckpt"],
    ["publish", b"RUN\xffrun", "--repo-id", "org/name"],
])
def test_a_path_that_is_not_utf8_is_one_error_line(args, tmp_path):
    """A run directory whose name is not UTF-8 ended in three tracebacks, no error line and 0-byte crash logs (a
    non-UTF-8 model.path was already refused): every path argument is checked before anything is written."""
    import subprocess
    import sys

    from tests.conftest import REPO, repo_pythonpath

    argv = [a.replace(b"RUN", os.fsencode(tmp_path) + b"/") if isinstance(a, bytes) else a for a in args]
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "quant.cli", *argv], cwd=REPO, capture_output=True, env=env, timeout=300)
    err = p.stderr.decode("utf-8", "replace")
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "is not valid UTF-8" in lines[0], err
    assert "Traceback" not in err and not list(tmp_path.glob("crash-*")) and list(tmp_path.iterdir()) == []
