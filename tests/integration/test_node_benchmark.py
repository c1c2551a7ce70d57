"""benchmarks/node.py (one node's full-depth run in one command) at CPU scale: 2 gloo ranks, a tiny model's one
saved layer tiled to 3 for the depth run, the CLI for the breadth run. What the GPU run relies on: the depth run quantizes
every virtual layer yet keeps only the saved layers' files, the breadth run passes every stage with streamed eval
over both ranks, the calibration text is random tokens through quant's own calibration path, and the projection
adds up what was measured."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.integration.test_distributed import _env


def test_node_benchmark_runs_the_whole_pipeline_to_depth_and_keeps_only_the_saved_layers(tmp_path):
    work = tmp_path / "node"
    p = subprocess.run([sys.executable, "benchmarks/node.py", "--shape", "tiny", "--layers", "1", "--virtual-layers",
                        "3", "--samples", "8", "--seqlen", "64", "--eval-samples", "4", "--ranks", "2", "--keep",
                        "--project-layers", "6",
                        "--workdir", str(work)], capture_output=True, text=True, env=_env(OMP_NUM_THREADS="1"),
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((work / "node.json").read_text())
    depth, breadth = out["depth"], out["breadth"]

    assert len(depth["layer_seconds"]) == 3  # every virtual layer quantized ...
    assert depth["stored_layer_files"] == ["layer_00000.safetensors"]  # ... only the saved one kept
    assert list(depth["stages"]) == ["calibrate", "profile", "plan", "quantize"]
    assert depth["stages"]["quantize"]["ranks"] == depth["stages"]["profile"]["ranks"] == 2
    plan = json.loads((work / "run-depth" / "plan.json").read_text())
    assert any(name.startswith("layers.2.") for name in json.dumps(plan).split('"'))

    assert list(breadth["stages"]) == ["calibrate", "profile", "plan", "quantize", "export", "eval", "card", "report"]
    assert breadth["eval"]["proxy_mode"] == "streamed" and breadth["eval"]["world_size"] == 2
    ppl = breadth["eval"]["proxies"]["perplexity"]
    assert math.isfinite(ppl["base"]) and math.isfinite(ppl["quantized"]) and ppl["base"] > 1
    assert (work / "run-breadth" / "checkpoint" / "config.json").is_file()

    tokens = load_file(str(work / "run-breadth" / "calibration.safetensors"))["tokens"]
    assert tokens.shape == (8, 64) and int(tokens.min()) >= 1  # random words, never [UNK]
    assert torch.unique(tokens).numel() > 256  # of a 512-word vocabulary: random, not one repeated token

    # 6 layers projected: the depth run's layer stages x 6 / 3, the breadth run's x 6 / 1, the rest as measured
    parts, total = out["projection"]["parts_s"], out["projection"]["total_s"]
    assert math.isclose(total, sum(parts.values()))
    assert math.isclose(parts["quantize"], depth["stages"]["quantize"]["wall_s"] * 2)
    assert math.isclose(parts["profile"], depth["stages"]["profile"]["wall_s"] * 2)
    assert math.isclose(parts["export"], breadth["stages"]["export"]["wall_s"] * 6)
    assert math.isclose(parts["fingerprint"], out["fingerprint_s"] * 6) and out["fingerprint_s"] > 0
    assert math.isclose(parts["report"], breadth["stages"]["report"]["wall_s"])
    assert math.isclose(parts["card"], breadth["stages"]["card"]["wall_s"])
    assert "projection, 6 layers on 2 rank(s)" in p.stdout
    # the depth run's progress as it goes (the writer's lines): every stage, and every virtual layer of profile and
    # quantize, with the seconds since the previous line
    progress = [ln for ln in p.stdout.splitlines() if ln.startswith("progress ")]
    for stage in ("calibrate", "profile", "plan", "quantize"):
        assert any(f"stage {stage}: done" in ln for ln in progress), stage
    for idx in range(3):
        assert any(f"profile.profile: profile layer {idx}:" in ln for ln in progress)
        assert any(re.search(rf"\(\+ *[\d.]+\) quantize.driver: layer {idx}: ", ln) for ln in progress)
