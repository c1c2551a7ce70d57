"""What the serving tests share (``test_vllm``, ``test_sglang``): the runtimes' folders, the models' inputs, the
checkpoints exported by ``quant export`` and their dequantized references, the prompts, the agreement figures and
the report every runtime's rows go to.

A runtime lives in a folder of its own (it pins its own compressed-tensors, so not quant's): its serving check
(``quant.serve.vllm_check``, ``quant.serve.sglang_check``) runs with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from tests.conftest import REPO, repo_pythonpath

N_PROMPTS, PROMPT_LEN, GREEDY = 32, 128, 32
# top-1 over the 32 x 127 prompt positions; the greedy figure compares the free-running generations position by
# position, so after the first flip the two continuations differ: on these random-weight models every form, stock
# per-layer checkpoints included, measured 0.89-0.99 (1x H200, vLLM 0.26.0, 2026-12-01)
MIN_TOP1, MIN_GREEDY = 0.98, 0.85
REPORT: list[dict] = []  # every runtime's agreement rows, written to QUANT_SERVE_REPORT after each


def runtime_paths(variable: str) -> list[str]:
    """``variable`` (e.g. ``QUANT_VLLM_PYTHONPATH``): one folder per installation to serve with, ``os.pathsep``
    between them (a test module runs against each: the serving matrix)."""
    return [p for p in os.environ.get(variable, "").split(os.pathsep) if p]


def runtime_version(path: str, package: str, variable: str, how: str) -> tuple[str | None, str | None]:
    """(the version of ``package`` importable from ``path``, None) or (None, why the module is skipped there)."""
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU (the GPU tier; see README 'Tests on a GPU')"
    if not path:
        return None, f"set {variable} to folders holding {package} ({how})"
    probe = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__version__)"],
                           env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if probe.returncode:
        return None, f"{package} does not import from {path} ({(probe.stderr.strip().splitlines() or ['?'])[-1]})"
    return probe.stdout.strip().splitlines()[-1], None


def inputs(work: Path) -> tuple[Path, Path]:
    """Random-word calibration and held-out text over the synthetic models' word-level vocabulary (ids 1..511)."""
    from quant.models.synthetic import random_words

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    manifests = []
    for name, seed in (("calibration", 0), ("heldout", 1)):
        (data / f"{name}.txt").write_text(random_words(40 * 128, 512, seed))
        (data / f"{name}.yaml").write_text(yaml.safe_dump(
            {"name": f"random-{name}", "sources": [{"name": name, "kind": "text", "path": f"{name}.txt"}]}))
        manifests.append(data / f"{name}.yaml")
    return manifests[0], manifests[1]


def build_models(cases: dict, work: Path) -> dict[str, Path]:
    """Each case's random-weight model (``(shape, decoder layers, ...)``), one folder per shape and depth."""
    from quant.models.synthetic import build_model

    folders = {(c[0], c[1]): work / f"model-{c[0]}-{c[1]}" for c in cases.values()}
    for (shape, layers), folder in folders.items():
        build_model(shape, layers, folder, seed=0, logit_scale=4.0)
    return {n: folders[(c[0], c[1])] for n, c in cases.items()}


def exported(cases: dict, work: Path, jobs: int) -> tuple[dict[str, Path], dict[str, Path]]:
    """Every case's model built, exported (``jobs`` at a time) and dequantized into ``work/ref-NAME``: ({name: run
    folder}, {name: model folder})."""
    from concurrent.futures import ThreadPoolExecutor

    calib, _ = inputs(work)
    models = build_models(cases, work)

    def export_and_reference(name: str) -> Path:
        run = export(name, cases[name], work, models[name], calib)
        dequantized(run / "checkpoint", work / f"ref-{name}")
        return run

    with ThreadPoolExecutor(jobs) as pool:
        runs = dict(zip(cases, pool.map(export_and_reference, cases), strict=True))
    return runs, models


def export(name: str, case: tuple, work: Path, model: Path, calib: Path) -> Path:
    """``quant export`` of ``case`` = (shape, layers, plan keys, export formats) on ``model`` (RTN); the run folder."""
    _, _, plan, formats = case
    recipe = {"name": name, "model": {"path": str(model), "dtype": "bfloat16"},
              "calibration": {"dataset": str(calib), "n_samples": 16, "seq_len": 128, "seed": 0},
              "plan": plan, "quantize": {"algorithm": "rtn"}, "export": {"formats": formats}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_dir = work / f"run-{name}"
    p = subprocess.run([sys.executable, "-m", "quant.cli", "export", str(path), "-o", str(run_dir)], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo_pythonpath()},
                       timeout=900)
    assert p.returncode == 0, f"{name}: quant export failed\n{p.stderr[-3000:]}"
    return run_dir


def dequantized(checkpoint: Path, out: Path) -> Path:
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    convert_checkpoint(checkpoint, out, CompressedTensorsDequantizer(checkpoint), device="cpu")
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 512, (N_PROMPTS, PROMPT_LEN), generator=g).tolist()


def serve(check_module: str, spec: dict, work: Path, pythonpath: list[str], jobs: int, timeout_s: int) -> dict:
    """Every model of ``spec`` served by ``python -m check_module`` with ``pythonpath`` (the runtime's folder first,
    then the checkout); its results by model name."""
    (work / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, "-m", check_module, str(work / "spec.json"), str(work / "served.json"),
                        "--jobs", str(jobs)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO)])}, timeout=timeout_s)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((work / "served.json").read_text())


def record(rows: list[dict], work: Path) -> None:
    """Add a runtime's agreement rows to the report (``QUANT_SERVE_REPORT``, else beside the run)."""
    REPORT.extend(rows)
    Path(os.environ.get("QUANT_SERVE_REPORT", work / "report.json")).write_text(json.dumps(REPORT, indent=1))


def top1(a: dict, b: dict) -> float:
    pairs = [(x, y) for pa, pb in zip(a["top1"], b["top1"], strict=True) for x, y in zip(pa, pb, strict=True)]
    assert len(pairs) >= 4000
    return sum(x == y for x, y in pairs) / len(pairs)


def greedy(a: dict, b: dict) -> float:
    pairs = [(x, y) for ga, gb in zip(a["greedy"], b["greedy"], strict=True)
             for x, y in zip(ga[:GREEDY], gb[:GREEDY], strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)
