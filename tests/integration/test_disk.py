"""Free disk is checked before the quantize stage: a run directory on a file system too small for the quantized store
and the checkpoints is refused with the bytes it needs, before any hour is spent; the estimate bounds what a
run really writes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

HEADLINE = str(REPO / "recipes" / "mixed_int8_int4.yaml")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (the run needs about 4 MB after planning)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN): {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_run_refuses_before_quantize_when_the_disk_is_too_small(small_fs):
    out = small_fs / "run"
    p = run_cli("run", HEADLINE, "-o", str(out), "--set", "export.formats=[compressed-tensors,gptq]")
    assert p.returncode == 1, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    m = re.search(r"error: not enough free disk for .*: the quantize and export stages need ([\d.]+) MB \(quantized "
                  r"store [\d.]+ MB, compressed-tensors checkpoint [\d.]+ MB, gptq checkpoint [\d.]+ MB\) and "
                  r"([\d.]+) MB is free", errors[0])
    assert m, errors[0]
    from quant.forecast.footprint import estimate
    from quant.models import resolve_model
    from quant.plan.bitplan import BitPlan

    need = estimate(resolve_model("builtin:qwen3-moe-tiny"), BitPlan.load(out / "plan.json"),
                    ("compressed-tensors", "gptq")).total(with_store=True)
    assert float(m.group(1)) == round(need / 1e6, 1) and float(m.group(2)) < 1.1
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    assert [s for s in stages if stages[s]["status"] == "done"] == ["calibrate", "profile", "plan"]
    assert "quantize" not in stages and not (out / "quantize.partial").exists()


def test_the_estimate_bounds_what_a_run_writes(tmp_path):
    out = tmp_path / "r"
    p = run_cli("export", HEADLINE, "-o", str(out), "--model", "builtin:deepseek-v3-tiny",
                "--set", "export.formats=[compressed-tensors,gptq]", "--set", "plan.symmetric=false")
    assert p.returncode == 0, p.stderr[-2000:]
    from quant.forecast.footprint import MARGIN_BYTES, estimate
    from quant.models import resolve_model
    from quant.plan.bitplan import BitPlan

    f = estimate(resolve_model("builtin:deepseek-v3-tiny"), BitPlan.load(out / "plan.json"), ("compressed-tensors",
                                                                                              "gptq"))
    written = {"store": _size(out / "quantized"), "compressed-tensors": _size(out / "checkpoint"),
               "gptq": _size(out / "checkpoint-gptq")}
    estimated = {"store": f.store_bytes, **f.checkpoint_bytes}
    for key in written:
        assert written[key] <= estimated[key] <= 1.6 * written[key] + MARGIN_BYTES, (key, written, estimated)
