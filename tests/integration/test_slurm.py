"""The Slurm job scripts for real: munged, slurmctld and slurmd started on localhost by the fixture (Debian's
packages, installed by .ci/run), ``sbatch examples/slurm/*.sbatch`` at 2 ranks on CPU (gloo) with a builtin model.

- an uninterrupted job of each script finishes the run;
- the scheduler's warning signal (``--signal=B:USR1@600`` delivers USR1 to the batch shell; here
  ``scancel --signal=USR1 --batch``) mid-quantize: quant stops after the layer in hand, the job requeues itself
  and the next start resumes;
- ``scontrol requeue`` mid-quantize: the job is ended (SIGTERM, then SIGKILL) and requeued, and resumes;
all ending with the same checkpoint SHA-256s as the uninterrupted job.

Local config (no cgroups needed): ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
``JobAcctGatherType=jobacct_gather/none``, ``SlurmdUser=root``, a private munge socket and key. A requeued job
is held until its begin time (now + 2 minutes, Slurm's rule); the test moves the begin time to now.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, repo_pythonpath

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "torchrun")
SCRIPTS = REPO / "examples" / "slurm"
GPTQ = "--set quantize.algorithm=gptq"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    root: Path
    env: dict

    def cmd(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=60)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {p.stderr or p.stdout}")
        return p.stdout

    def job(self, job_id: str) -> dict[str, str]:
        text = self.cmd("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S+)", text))

    def submit(self, script: str, run_dir: Path, *sbatch_args: str, **env: str) -> str:
        job_env = {**self.env, "RUN_DIR": str(run_dir), "NPROC": "2", "QUANT_ARGS": GPTQ, **env}
        p = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=30",
                            f"--output={run_dir}.out", *sbatch_args, str(SCRIPTS / script)],
                           capture_output=True, text=True, env=job_env, cwd=REPO, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().split(";")[0]

    def wait(self, job_id: str, pred, timeout: float = 600) -> dict[str, str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if pred(info):
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} timed out in state {info.get('JobState')}: {self.log_tail()}")

    def release_requeued(self, job_id: str) -> None:
        """Start a requeued job now instead of after Slurm's begin-time delay."""
        info = self.wait(job_id, lambda j: j["JobState"] == "PENDING" and int(j.get("Restarts", 0)) >= 1, 300)
        assert info["JobState"] == "PENDING"
        # a job that requeued itself (the warning signal's path) is PENDING while its first start may still be
        # completing on the node; on a cluster the requeue's begin-time delay covers that, here the node must be
        # done with it before the job is started again (else its relaunch can fail: seen once in CI, FAILED)
        # A second start in the same wall-clock second as the requeue is refused by slurmd ("Killing
        # non-startable batch job: Job credential revoked", seen in CI): it compares the new credential's
        # creation time with the revocation time in whole seconds. Real requeues wait 2 minutes; wait 2 s.
        deadline = time.time() + 120
        while "COMPLETING" in self.cmd("scontrol", "show", "node") and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(2.5)
        self.cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def job_log(self, job_id: str) -> str:
        """slurmctld's and slurmd's lines about one job."""
        return "\n".join(ln for n in ("slurmctld.log", "slurmd.log") if (self.root / n).exists()
                         for ln in (self.root / n).read_text().splitlines()
                         if f"JobId={job_id}" in ln or f"job {job_id}" in ln or f"{job_id}.batch" in ln)[-3000:]

    def log_tail(self) -> str:
        return "\n".join((self.root / n).read_text()[-1500:] for n in ("slurmctld.log", "slurmd.log")
                         if (self.root / n).exists())


def _start_daemons(root: Path) -> dict:
    key, sock = root / "munge.key", root / "munge" / "sock"
    (root / "munge").mkdir(mode=0o700)
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={root}/munged.pid",
                    f"--log-file={root}/munged.log", f"--seed-file={root}/munge/seed"], check=True, timeout=30)
    host = socket.gethostname()
    (root / "state").mkdir()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=quanttest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", "AuthType=auth/munge",
        f"AuthInfo=socket={sock}", "CredType=cred/munge", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "SwitchType=switch/none",
        "MpiDefault=none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "ReturnToService=2", "KillWait=15", "SlurmdTimeout=120",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONPATH": repo_pythonpath()}
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], check=True, env=env, timeout=60)
    return env


@pytest.fixture(scope="module")
def cluster():
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed here ({', '.join(missing)} missing); .ci/run installs Debian's "
                    "slurmctld, slurmd, slurm-client and munge")
    if os.geteuid() != 0:
        pytest.skip("a localhost slurmd runs jobs as their user and must itself run as root (SlurmdUser=root)")
    root = Path(tempfile.mkdtemp(prefix="qslurm-", dir="/tmp"))  # a short path: munge's socket name is bounded
    c = None
    try:
        c = Cluster(root, _start_daemons(root))
        deadline = time.time() + 90
        while c.cmd("sinfo", "-h", "-o", "%T", check=False).strip() not in ("idle", "mixed", "allocated"):
            if time.time() > deadline:
                pytest.skip(f"slurmd did not register with slurmctld on this machine: {c.log_tail()}")
            time.sleep(1)
        yield c
    finally:
        if c is not None:
            c.cmd("scancel", "--user=root", check=False)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):  # the daemons this fixture started, by id
            p = root / pid_file
            if p.is_file():
                try:
                    os.kill(int(p.read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(2)
        shutil.rmtree(root, ignore_errors=True)


def _checkpoint(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoint" / "quant_manifest.json").read_text())["files"]


def _finished(run_dir: Path) -> dict:
    m = json.loads((run_dir / "manifest.json").read_text())
    assert all(m["stages"][s]["status"] == "done" for s in ("calibrate", "profile", "plan", "quantize", "export",
                                                            "eval", "card", "report")), m["stages"]
    assert m["stages"]["quantize"]["ranks"] == 2
    return m


def _wait_file(path: Path, c: Cluster, job_id: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        state = c.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job ended ({state}) before {path.name}"
        assert time.time() < deadline, f"{path.name} did not appear"
        time.sleep(0.5)


def _done(j: dict) -> bool:
    return j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def test_job_scripts_finish_resume_after_the_warning_signal_and_after_requeue(cluster, tmp_path):
    slow = {"QUANT_ENTRY": "tests/fixtures/slow_cli.py", "QUANT_TEST_LAYER_SLEEP": "3"}
    jobs = {
        "plain": cluster.submit("quant-1node.sbatch", tmp_path / "plain"),
        "nodes": cluster.submit("quant-multinode.sbatch", tmp_path / "nodes", "--nodes=1",
                                RDZV_PORT=str(_free_port())),
        "warned": cluster.submit("quant-1node.sbatch", tmp_path / "warned", **slow),
        "requeued": cluster.submit("quant-1node.sbatch", tmp_path / "requeued", **slow),
    }
    first = "quantize.partial/layer_00000.safetensors.written"
    _wait_file(tmp_path / "warned" / first, cluster, jobs["warned"])
    cluster.cmd("scancel", "--signal=USR1", "--batch", jobs["warned"])  # what --signal=B:USR1@600 sends
    _wait_file(tmp_path / "requeued" / first, cluster, jobs["requeued"])
    cluster.cmd("scontrol", "requeue", jobs["requeued"])
    for name in ("warned", "requeued"):
        cluster.release_requeued(jobs[name])
    final = {name: cluster.wait(job, _done, 900) for name, job in jobs.items()}
    for name, info in final.items():
        out = (tmp_path / f"{name}.out").read_text()[-2000:] if (tmp_path / f"{name}.out").exists() else ""
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
            f"{name}: {info.get('JobState')} {info.get('ExitCode')} {info.get('Reason')}\n"
            f"{cluster.job_log(jobs[name])}\n--- job output:\n{out}")
        _finished(tmp_path / name)
    reference = _checkpoint(tmp_path / "plain")
    assert all(_checkpoint(tmp_path / name) == reference for name in jobs)
    for name in ("warned", "requeued"):
        assert final[name]["Restarts"] == "1", (name, final[name])
        assert _finished(tmp_path / name)["stages"]["quantize"]["resumed_layers"] >= 1
    warned_log = (tmp_path / "warned.out").read_text()
    assert "stopped on request (stop file" in warned_log and "requeueing job" in warned_log
    assert [ln for ln in warned_log.splitlines() if ln.startswith("error:")] == [  # quant's one line, no other
        ln for ln in warned_log.splitlines() if ln.startswith("error: stopped on request (stop file")]
    assert "(start 2)" in (tmp_path / "requeued.out").read_text()
