"""Shared fixtures: an isolated builtin-model cache per test session, offline hub settings, CLI runner, a
remote-code (per-expert Linear) copy of builtin:qwen3-moe-tiny."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# MKL's conditional numerical reproducibility: without it, fp32 products on the CPU may take another code path
# (another summation order) depending on buffer alignment, and the tests that require two code paths (per-expert
# vs fused experts) to give bit-identical checkpoints depend on the allocation pattern. Read when MKL starts.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def _spread_xdist_workers_over_gpus() -> None:
    """Under pytest-xdist on a machine with several GPUs, worker ``gwN`` sees one GPU, ``N mod count`` of those
    visible (before torch reads CUDA_VISIBLE_DEVICES): 16 workers time-slicing one GPU while the others idle made
    the suite several times slower on the 2-GPU node. ``QUANT_TEST_GPU_SPREAD=0`` leaves every GPU visible."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or os.environ.get("QUANT_TEST_GPU_SPREAD") == "0":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    else:  # the driver's GPUs, without initialising CUDA
        gpus = Path("/proc/driver/nvidia/gpus")
        ids = [str(i) for i in range(len(list(gpus.iterdir())))] if gpus.is_dir() else []
    if len(ids) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker[2:] or 0) % len(ids)]


def _split_cpu_threads_over_xdist_workers() -> None:
    """Under pytest-xdist each worker (and the CLI / torchrun children it starts) gets ``cores // workers`` CPU
    threads: 16 workers with 16 threads each on the 16-core GPU machine spent the suite's time oversubscribed (a
    calibrate stage that takes 1 s alone took 30 s). Set before torch reads it; an explicit setting wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, threads)


_spread_xdist_workers_over_gpus()
_split_cpu_threads_over_xdist_workers()
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU-only machines (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """The GPU tier (``@pytest.mark.gpu``) runs where CUDA is present and is skipped elsewhere (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the GPU tier; see README 'Tests on a GPU')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _controller() -> bool:
    """Under xdist every report reaches the hooks twice (worker, then controller): the logs below are written once."""
    return "PYTEST_XDIST_WORKER" not in os.environ


def pytest_runtest_logstart(nodeid, location) -> None:
    """With ``QUANT_TEST_PROGRESS=FILE``: a line when each test starts and one when it ends, so a run cut off by a
    time limit shows which tests were still running and how long the finished ones took."""
    path = os.environ.get("QUANT_TEST_PROGRESS")
    if path and _controller():
        with open(path, "a") as f:
            f.write(f"start {nodeid}\n")


def pytest_runtest_logreport(report) -> None:
    """With ``QUANT_TEST_FAILLOG=FILE``: each failure's traceback is appended to FILE as it happens (device runs
    under a time limit keep what failed even when the run is cut off before pytest's summary)."""
    if not _controller():
        return
    path = os.environ.get("QUANT_TEST_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
    path = os.environ.get("QUANT_TEST_PROGRESS")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.outcome} {report.when} {report.duration:.1f} {report.nodeid}\n")


@pytest.fixture(scope="session", autouse=True)
def quant_cache(tmp_path_factory) -> Path:
    """Builtin models are built once per session into a private cache (never the user's ~/.cache)."""
    path = Path(os.environ.get("QUANT_TEST_CACHE") or tmp_path_factory.mktemp("quant-cache"))
    os.environ["QUANT_CACHE"] = str(path)
    return path


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs the CLI in-process leaves its console handler on the root logger, writing to that test's
    captured stderr, which is closed after it: later tests' log records then print "--- Logging error ---" dumps.
    Handlers added to the root logger during a test are removed after it, and its level restored."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):  # pytest's own capture handlers come and go by phase: left to pytest
        if h not in handlers and not type(h).__module__.startswith("_pytest"):
            root.removeHandler(h)
    root.setLevel(level)


def expert_schemes_by_layer(plan) -> dict[int, set[tuple[int | None, int]]]:
    """Layer index -> the (bits, group size) its routed-expert projections got (one entry: one scheme per layer)."""
    out: dict[int, set] = {}
    for name, p in plan.modules.items():
        if ".experts." in name:
            out.setdefault(int(name.split(".")[1]), set()).add((p.bits, p.group_size))
    return out


def repo_pythonpath() -> str:
    """PYTHONPATH for child processes: the checkout first, then whatever the caller had (e.g. a --target folder of
    wheels installed beside it on a GPU node), never replacing it."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``quant ARGS`` in a subprocess (the real console entry point), capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quant.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli


# A child process whose seccomp filter refuses unshare: namespaces are unavailable to it and its children, as
# in a container whose runtime refuses them (Docker's default profile does).
WITHOUT_NAMESPACES = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from quant.eval import isolation, seccomp as s
s.install_filter(isolation.libc_handle(), [(s.BPF_LD_ABS, 0, 0, s.DATA_NR), (s.BPF_JEQ, 0, 1, s.DENIED["unshare"]),
                                           (s.BPF_RET, 0, 0, s.RET_ERRNO | s.EPERM), (s.BPF_RET, 0, 0, s.RET_ALLOW)])
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def run_without_namespaces(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """``python ARGV`` under a filter refusing unshare (see WITHOUT_NAMESPACES)."""
    return subprocess.run([sys.executable, "-c", WITHOUT_NAMESPACES, *argv], capture_output=True, text=True,
                          timeout=300, cwd=REPO, **kwargs)


PER_EXPERT_CODE = REPO / "tests" / "fixtures" / "modeling_qwen3_moe_perexpert.py"


def make_per_expert_model(dst: Path) -> Path:
    """builtin:qwen3-moe-tiny's weights, tokenizer and config under remote code (``auto_map`` to
    tests/fixtures/modeling_qwen3_moe_perexpert.py) whose MoE blocks keep a per-expert nn.ModuleList of Linear
    MLPs; ``model_type`` qwen3_moe_perexpert. The safetensors file is the builtin's, byte for byte."""
    from quant.models.builtin import builtin_path

    shutil.copytree(builtin_path("qwen3-moe-tiny"), dst)
    shutil.copy2(PER_EXPERT_CODE, dst / PER_EXPERT_CODE.name)
    module = PER_EXPERT_CODE.stem
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(model_type="qwen3_moe_perexpert", architectures=["Qwen3MoePerExpertForCausalLM"],
               auto_map={"AutoConfig": f"{module}.Qwen3MoePerExpertConfig",
                         "AutoModelForCausalLM": f"{module}.Qwen3MoePerExpertForCausalLM"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="session")
def per_expert_model(quant_cache, tmp_path_factory) -> Path:
    return make_per_expert_model(tmp_path_factory.mktemp("remote") / "qwen3-moe-tiny-perexpert")
