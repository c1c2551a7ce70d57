"""Distributed runs on CPU (gloo) through the real launcher: the same plan and checkpoint at any world size, stop
requests and dead ranks ending every rank with one error line, and resume at another world size."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, repo_pythonpath, run_cli

HEADLINE = str(REPO / "recipes" / "mixed_int8_int4.yaml")
GPTQ = ("--set", "quantize.algorithm=gptq")
SLOW = str(REPO / "tests" / "fixtures" / "slow_cli.py")
FAMILIES = ("qwen3-moe-tiny", "deepseek-v3-tiny")  # the second: MLA, a shared expert, a dense first layer


def torchrun(n: int, *args: str, entry: tuple[str, ...] = ("-m", "quant.cli")) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *entry, *args]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": "", **extra}


def checkpoint_hashes(run_dir: Path) -> dict:
    """SHA-256 of every checkpoint file (export's manifest) and every stored layer's content: each tensor's bytes,
    its module index and its report without the measured times (a layer file carries its report, whose seconds
    differ from run to run)."""
    from safetensors import safe_open

    files = json.loads((run_dir / "checkpoint" / "quant_manifest.json").read_text())["files"]
    layers = {}
    for p in sorted((run_dir / "quantized").glob("layer_*.safetensors")):
        with safe_open(str(p), "pt") as f:
            meta = json.loads(f.metadata()["quant"])
            report = {k: v for k, v in meta["report"].items() if "seconds" not in k}
            tensors = {k: (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                       for k in f.keys() for t in [f.get_tensor(k)]}
            layers[p.name] = (meta["modules"], report, tensors)
    return {"checkpoint": files, "layers": layers}


# as torchrun gives each rank: CPU kernels' sums depend on the thread count. No GPU, also on GPU machines: these tests
# check the gloo path's same-answer claim (byte-identical codes on CPUs); NCCL runs are benchmarks/distributed.py's
ONE_THREAD = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """One process, no launcher: the headline recipe with GPTQ on each family (and AWQ on the first), up to the
    checkpoint."""
    out = {}
    for fam, algo in [(f, "gptq") for f in FAMILIES] + [(FAMILIES[0], "awq")]:
        d = tmp_path_factory.mktemp("ref") / f"{fam}-{algo}"
        p = run_cli("export", HEADLINE, "-o", str(d), "--model", f"builtin:{fam}", "--set",
                    f"quantize.algorithm={algo}", env=ONE_THREAD)
        assert p.returncode == 0, p.stderr[-3000:]
        out[fam if algo == "gptq" else f"{fam}-{algo}"] = d
    return out


@pytest.mark.parametrize("family,algorithm", [(f, "gptq") for f in FAMILIES] + [(FAMILIES[0], "awq")])
def test_two_ranks_give_the_one_process_plan_and_checkpoint(reference, tmp_path, family, algorithm):
    """Experts and modules shared out over ranks (AWQ: each rank searches its own experts, the statistics are
    every rank's)."""
    d = tmp_path / "r2"
    p = subprocess.run(torchrun(2, "export", HEADLINE, "-o", str(d), "--model", f"builtin:{family}", "--set",
                                f"quantize.algorithm={algorithm}"),
                       capture_output=True, text=True, env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = reference[family if algorithm == "gptq" else f"{family}-{algorithm}"]
    assert (d / "plan.json").read_bytes() == (ref / "plan.json").read_bytes()
    assert (d / "profile.json").read_bytes() == (ref / "profile.json").read_bytes()
    assert checkpoint_hashes(d) == checkpoint_hashes(ref)
    m = json.loads((d / "manifest.json").read_text())
    assert m["stages"]["quantize"]["ranks"] == 2 and m["stages"]["profile"]["ranks"] == 2
    assert p.stdout.count("export: ran") == 1  # one writer prints


def test_two_ranks_give_the_one_process_checkpoint_with_awq_in_expert_chunks(tmp_path):
    """AWQ whose expert statistics come in 3 passes per MoE layer (``hessian_budget_gb`` holds 6 of the 16
    experts' Hessians): every pass's relay hands both ranks every batch, each rank searches every expert, and the
    checkpoint is the one process's byte for byte (deepseek-v3-tiny: its dense first layer takes the unrouted
    path, its shared expert reuses the routed experts' s)."""
    from quant.models import resolve_model
    from quant.quantize.budgets import expert_hessian_bytes

    budget = 1.3e-4
    cfg = resolve_model("builtin:deepseek-v3-tiny").config_dict
    per_expert = expert_hessian_bytes(cfg["hidden_size"], cfg["moe_intermediate_size"])
    assert int(budget * 1e9) // per_expert == 6 and cfg["n_routed_experts"] == 16  # chunks of 6, 6, 4
    _same_checkpoint_as_one_process(tmp_path, 2, "--model", "builtin:deepseek-v3-tiny", "--set",
                                    "quantize.algorithm=awq", "--set", f"quantize.hessian_budget_gb={budget}")


def _code_changes(a: Path, b: Path) -> float:
    from quant.quantize.qstore import read_layer

    total = changed = 0
    for f in sorted((a / "quantized").glob("layer_*.safetensors")):
        x, y = read_layer(f), read_layer(b / "quantized" / f.name)
        assert x.keys() == y.keys()
        for k in x:
            total += x[k].q.numel()
            changed += int((x[k].q != y[k].q).sum())
    return changed / total


@pytest.mark.parametrize("family,algorithm", [(f, "gptq") for f in FAMILIES] + [(FAMILIES[0], "awq")])
def test_reduced_statistics_give_the_one_process_plan_and_errors(reference, tmp_path, family, algorithm):
    """``quantize.statistics: reduce``: each rank sums its own batches' statistics, summed over ranks once a pass
    (no activations move between ranks; the default on GPUs); GPTQ and AWQ. Same plan; the sums differ from one
    process's only in rounding order, so every layer's worst error is within 0.5 % and at most 1 % of the codes
    change."""
    d = tmp_path / "r2"
    p = subprocess.run(torchrun(2, "export", HEADLINE, "-o", str(d), "--model", f"builtin:{family}", "--set",
                                f"quantize.algorithm={algorithm}", "--set", "quantize.statistics=reduce"),
                       capture_output=True, text=True, env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = reference[family if algorithm == "gptq" else f"{family}-{algorithm}"]
    _close_to_one_process(ref, d, p)


def _close_to_one_process(ref: Path, d: Path, p: subprocess.CompletedProcess) -> None:
    """The run in ``d`` reduced its statistics and is the one process's ``ref`` up to rounding order: same plan,
    each layer's worst error within 1 %, at most 2 % of the codes changed."""
    assert (d / "plan.json").read_bytes() == (ref / "plan.json").read_bytes()
    assert (p.stdout + p.stderr).count("statistics of each rank's own batches, summed over 2 ranks") >= 1
    mine = json.loads((d / "quantized" / "layers.json").read_text())
    one = json.loads((ref / "quantized" / "layers.json").read_text())
    for x, y in zip(mine, one, strict=True):
        # summed in another order, the Hessians differ at rounding level, and GPTQ's codes with them (at most 1 %)
        assert abs(x["worst_rel_error"] - y["worst_rel_error"]) <= 1e-2 * y["worst_rel_error"], (x, y)
    assert _code_changes(ref, d) <= 0.02  # a flip moves the later columns of its row: 1.03 % on deepseek-v3-tiny


def test_reduced_awq_statistics_in_expert_chunks(tmp_path):
    """AWQ whose expert statistics take 3 passes (6 of 16 experts' Hessians fit): with ``reduce`` every pass's
    sums are added over ranks (AWQ holds every chunk on every rank, so chunks do not prevent it)."""
    args = ("--model", "builtin:deepseek-v3-tiny", "--set", "quantize.algorithm=awq", "--set",
            "quantize.hessian_budget_gb=1.3e-4")
    one = run_cli("export", HEADLINE, "-o", str(tmp_path / "one"), *args, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr[-3000:]
    p = subprocess.run(torchrun(2, "export", HEADLINE, "-o", str(tmp_path / "many"), *args, "--set",
                                "quantize.statistics=reduce"), capture_output=True, text=True, env=_env(),
                       timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    _close_to_one_process(tmp_path / "one", tmp_path / "many", p)


def test_reduced_statistics_fall_back_to_the_ordered_relay_when_experts_take_several_passes(tmp_path):
    """A layer whose expert Hessians need several passes (``hessian_budget_gb``) keeps the ordered relay even when
    ``reduce`` is asked for (a reduced pass per chunk would hold every rank's chunk on every rank): the one
    process's checkpoint byte for byte."""
    p = _same_checkpoint_as_one_process(tmp_path, 2, "--model", "builtin:deepseek-v3-tiny", *GPTQ, "--set",
                                        "quantize.hessian_budget_gb=1.3e-4", "--set", "quantize.statistics=reduce")
    reduced = re.findall(r"layer (\d+): statistics of each rank's own batches, summed", p.stdout + p.stderr)
    assert reduced == ["0"], reduced  # only the dense first layer (its linears fit one pass)


def _same_checkpoint_as_one_process(tmp_path: Path, ranks: int, *args: str) -> subprocess.CompletedProcess:
    """``export`` in one process (one thread) and at ``ranks`` ranks under torchrun: the same checkpoint."""
    one = run_cli("export", HEADLINE, "-o", str(tmp_path / "one"), *args, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr[-3000:]
    p = subprocess.run(torchrun(ranks, "export", HEADLINE, "-o", str(tmp_path / "many"), *args), capture_output=True,
                       text=True, env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert checkpoint_hashes(tmp_path / "many") == checkpoint_hashes(tmp_path / "one")
    return p


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {path.name} appeared: {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.2)


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def test_stop_file_stops_every_rank_after_the_layer_and_one_process_resumes(reference, tmp_path):
    d = tmp_path / "stop"
    proc = subprocess.Popen(torchrun(2, "quantize", HEADLINE, "-o", str(d), *GPTQ, entry=(SLOW,)), cwd=REPO,
                            env=_env(QUANT_TEST_LAYER_SLEEP="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(d / "quantize.partial" / "layer_00000.safetensors.written", proc)
    (d / "STOP").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: stopped on request (stop file "), err[-3000:]
    assert "exitcode  : 75" in err and not (d / "STOP").exists()
    m = json.loads((d / "manifest.json").read_text())
    assert m["stages"]["quantize"]["status"] == "stopped"
    assert len(list((d / "quantize.partial").glob("layer_*.safetensors"))) < 4
    p = run_cli("export", HEADLINE, "-o", str(d), *GPTQ, env=ONE_THREAD)  # one process takes over two ranks' run
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ran quantize, export; up to date: calibrate, profile, plan" in p.stdout
    assert json.loads((d / "manifest.json").read_text())["stages"]["quantize"]["resumed_layers"] >= 1
    assert checkpoint_hashes(d)["checkpoint"] == checkpoint_hashes(reference["qwen3-moe-tiny"])["checkpoint"]


def test_sigusr1_stops_one_process_with_exit_75_and_three_ranks_resume(reference, tmp_path):
    d = tmp_path / "usr1"
    proc = subprocess.Popen([sys.executable, SLOW, "quantize", HEADLINE, "-o", str(d), *GPTQ], cwd=REPO,
                            env=_env(QUANT_TEST_LAYER_SLEEP="3", **ONE_THREAD), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(d / "quantize.partial" / "layer_00000.safetensors.written", proc)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert len(_error_lines(err)) == 1 and "(SIGUSR1) after layer" in err and "Traceback" not in err
    p = subprocess.run(torchrun(3, "export", HEADLINE, "-o", str(d), *GPTQ), capture_output=True, text=True,
                       env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert checkpoint_hashes(d)["checkpoint"] == checkpoint_hashes(reference["qwen3-moe-tiny"])["checkpoint"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_rank_ends_the_other_with_one_error_line_and_the_run_resumes(reference, tmp_path):
    """Ranks started as a scheduler would (env only, no torchrun agent to clean up): SIGKILL rank 1 mid-quantize;
    rank 0 must notice at its next collective and exit non-zero with one error line, well within the timeout."""
    d = tmp_path / "kill"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, SLOW, "quantize", HEADLINE, "-o", str(d), *GPTQ], cwd=REPO,
                              env=_env(QUANT_TEST_LAYER_SLEEP="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), QUANT_DIST_TIMEOUT_S="600",
                                       **ONE_THREAD),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    _wait_for(d / "quantize.partial" / "layer_00000.safetensors.written", procs[0])
    procs[1].kill()
    t0 = time.time()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 1 and time.time() - t0 < 60, err[-3000:]
    assert len(_error_lines(err)) == 1 and "Traceback" not in err, err[-3000:]
    assert "error: rank 0 of 2:" in err and "another rank stopped, crashed or did not answer" in err
    procs[1].communicate()
    p = run_cli("export", HEADLINE, "-o", str(d), *GPTQ, env=ONE_THREAD)
    assert p.returncode == 0, p.stderr[-3000:]
    assert checkpoint_hashes(d)["checkpoint"] == checkpoint_hashes(reference["qwen3-moe-tiny"])["checkpoint"]


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def test_torchrun_job_ends_when_the_writer_rank_dies(tmp_path):
    d = tmp_path / "agent"
    proc = subprocess.Popen(torchrun(2, "quantize", HEADLINE, "-o", str(d), *GPTQ, entry=(SLOW,)), cwd=REPO,
                            env=_env(QUANT_TEST_LAYER_SLEEP="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(d / "quantize.partial" / "layer_00000.safetensors.written", proc)
    writer = [p for p in _descendants(proc.pid) if _rank_of(p) == 0]
    assert writer, "rank 0's process not found"
    os.kill(writer[0], signal.SIGKILL)
    t0 = time.time()
    proc.communicate(timeout=180)
    assert proc.returncode != 0 and time.time() - t0 < 120


def test_more_ranks_than_calibration_batches_give_the_one_process_checkpoint(tmp_path):
    """8 samples = one batch of 8: ranks 1 and 2 run no batch at all, so they see no forward pass and must learn
    from rank 0 which linears share an input (q/k/v are one solve group); a third family (Mixtral)."""
    _same_checkpoint_as_one_process(tmp_path, 3, "--model", "builtin:mixtral-tiny", *GPTQ, "--set",
                                    "calibration.n_samples=8")


def test_two_rank_eval_scores_half_the_samples_each_and_matches_one_process(reference, tmp_path):
    """``eval`` runs on every rank: each scores its share of the held-out samples (sums all-reduced), lm-eval runs
    on the writer alone while the other rank waits for its result; the one writer records what one process does."""
    import shutil

    tasks = ("--set", "eval.tasks=[quant_mmlu]", "--set", "eval.limit=2", "--set", "eval.num_fewshot=0")
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        shutil.copytree(reference["qwen3-moe-tiny"], d)
    p = run_cli("eval", HEADLINE, "-o", str(one), "--model", "builtin:qwen3-moe-tiny", *GPTQ, *tasks, env=ONE_THREAD)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(torchrun(2, "eval", HEADLINE, "-o", str(two), "--model", "builtin:qwen3-moe-tiny", *GPTQ,
                                *tasks), capture_output=True, text=True, env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (json.loads((d / "eval.json").read_text()) for d in (one, two))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    for metric, key in (("perplexity", "base"), ("perplexity", "quantized"), ("kl", "quantized"),
                        ("top1_agreement", "quantized")):
        assert b["proxies"][metric][key] == pytest.approx(a["proxies"][metric][key], rel=1e-6, abs=1e-9)
    assert b["proxies"]["n_tokens"] == a["proxies"]["n_tokens"]
    assert b["tasks"] == a["tasks"] and set(b["tasks"]) == {"quant_mmlu"}
    assert json.loads((two / "manifest.json").read_text())["stages"]["eval"]["ranks"] == 2


BOTH_FORMATS = ("--model", "builtin:qwen3-moe-tiny", *GPTQ, "--set", "export.formats=[compressed-tensors,gptq]",
                "--set", "export.max_shard_gb=0.0002")  # ~0.7 MB checkpoints: 4 shard files each
FAILING_EXPORT = str(REPO / "tests" / "fixtures" / "failing_export_cli.py")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _temporaries(run_dir: Path) -> list[str]:
    return [p.name for p in run_dir.iterdir() if p.name.startswith(".checkpoint")]


def test_two_ranks_export_the_one_process_files_of_both_formats(reference, tmp_path):
    """Each rank writes its share of every checkpoint's shard files; the writer finishes the checkpoints: every file
    (shards, index, configs, manifest) is byte-identical to one process's."""
    import shutil

    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        shutil.copytree(reference["qwen3-moe-tiny"], d)
    p = run_cli("export", HEADLINE, "-o", str(one), *BOTH_FORMATS, env=ONE_THREAD)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(torchrun(2, "export", HEADLINE, "-o", str(two), *BOTH_FORMATS), capture_output=True,
                       text=True, env=_env(), timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    for folder in ("checkpoint", "checkpoint-gptq"):
        files = _files(two / folder)
        assert len([f for f in files if f.endswith(".safetensors")]) >= 3, sorted(files)
        assert "model.safetensors.index.json" in files and files == _files(one / folder), folder
    assert re.search(r"checkpoint: \d+ shard files written by 2 ranks \(rank 0: [1-9]\d*, rank 1: [1-9]", p.stderr)
    m1, m2 = (json.loads((d / "manifest.json").read_text())["stages"]["export"] for d in (one, two))
    assert (m1["ranks"], m2["ranks"]) == (1, 2) and m1["outputs"] == m2["outputs"]
    assert not _temporaries(two)


def test_a_rank_that_cannot_write_its_shards_ends_every_rank_with_one_error_line(reference, tmp_path):
    """Rank 1's shard writes fail (read-only file system): both ranks exit 1, the job prints one error line naming
    rank 1 and the path, the manifest records export failed, no checkpoint or temporary is left (not even the
    finished one the run had before); one process then finishes the export."""
    import shutil

    d = tmp_path / "ro"
    shutil.copytree(reference["qwen3-moe-tiny"], d)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, FAILING_EXPORT, "export", HEADLINE, "-o", str(d), *BOTH_FORMATS],
                              cwd=REPO, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                                                 RANK=str(r), LOCAL_RANK=str(r), QUANT_TEST_FAIL_EXPORT_RANK="1",
                                                 **ONE_THREAD),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [proc.communicate(timeout=600)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [1, 1], errs
    lines = _error_lines(errs[0]) + _error_lines(errs[1])
    assert len(lines) == 1 and not _error_lines(errs[0]), errs
    assert lines[0].startswith("error: rank 1 of 2: cannot write ") and "Read-only file system" in lines[0]
    assert "Traceback" not in errs[0] + errs[1]
    entry = json.loads((d / "manifest.json").read_text())["stages"]["export"]
    assert entry["status"] == "failed" and "rank 1 of 2: cannot write" in entry["error"] and "outputs" not in entry
    assert not (d / "checkpoint").exists() and not (d / "checkpoint-gptq").exists() and not _temporaries(d)
    p = run_cli("export", HEADLINE, "-o", str(d), *BOTH_FORMATS, env=ONE_THREAD)
    assert p.returncode == 0 and "ran export;" in p.stdout, p.stderr[-3000:]


@pytest.mark.parametrize("timeout", ["nan", "0", "-5"])
def test_a_bad_collective_timeout_is_named_by_every_rank_before_joining(tmp_path, timeout):
    """Under torchrun a timeout of nan, 0 or -5 s made every rank blame "another rank" (or crash), and then every rank
    printed the same line: the variable is named once for the job (by rank 0), before the process group is joined,
    the job exits 1, and nothing is written."""
    t0 = time.time()
    p = subprocess.run(torchrun(2, "plan", HEADLINE, "-o", str(tmp_path / "r")), capture_output=True, text=True,
                       env=_env(QUANT_DIST_TIMEOUT_S=timeout), timeout=300, cwd=REPO)
    lines = _error_lines(p.stderr)
    assert p.returncode == 1 and len(lines) == 1 and time.time() - t0 < 120, p.stderr[-3000:]
    assert all(ln.startswith(f"error: QUANT_DIST_TIMEOUT_S='{timeout}'") for ln in lines), lines
    assert "another rank" not in p.stderr and not (tmp_path / "r").exists()
