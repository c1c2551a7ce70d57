"""Exit codes and faults at the command line: usage 2, bad input 1 (one ``error:`` line), internal error 70 (one
line naming the crash log in the run directory), Ctrl-C 130; failed stages recorded truthfully; a full disk, a
read-only file system and a file in the way are one line."""

import json
import os
import shutil
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
MAIN = "import sys; from quant.cli import main; sys.argv = ['quant'] + sys.argv[1:]; main()\n"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _one_error_line(proc, code: int, pattern: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and pattern in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _patched(code: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``quant ARGS`` after ``code`` ran in the same interpreter (to make a component fail on purpose)."""
    return subprocess.run([sys.executable, "-c", code + MAIN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())


@pytest.mark.parametrize("argv", [[], ["run"], ["run", HEADLINE, "--bogus"], ["frobnicate"], ["run", HEADLINE, "--set"],
                                  ["publish", "runs/x"], ["inspect"]])
def test_usage_errors_exit_2_with_clicks_message(argv, capsys):
    from quant.cli import cli_exit_code

    assert cli_exit_code(argv) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err  # bare `quant` prints the help (click's no_args_is_help), others the error
    assert ("Error:" in text or "Usage:" in text) and "Traceback" not in text


def test_usage_error_through_the_console_entry_point():
    p = run_cli("run", HEADLINE, "--no-such-option")
    assert p.returncode == 2 and "No such option: --no-such-option" in p.stderr and "Traceback" not in p.stderr


def test_a_bad_launcher_variable_is_one_error_line_before_any_work(tmp_path, monkeypatch, capsys):
    """LOCAL_WORLD_SIZE is read where the process group is set up (once, before any stage): a value that is not a
    number of processes is one line, exit 1, and no run directory is made."""
    from quant.cli import cli_exit_code

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert cli_exit_code(["run", HEADLINE, "-o", str(tmp_path / "r"), *FAST]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == ["error: LOCAL_WORLD_SIZE is 'eight': it must be a whole number of processes on this node "
                     "(torchrun sets it; unset it outside a launcher)"], err
    assert "Traceback" not in err and not (tmp_path / "r").exists()


def test_help_exits_0(capsys):
    from quant.cli import cli_exit_code

    assert cli_exit_code(["--help"]) == 0 and "publish" in capsys.readouterr().out


def test_crash_in_export_exits_70_logs_traceback_and_records_failure(tmp_path):
    """A writer that raises after another format was written: exit 70, one line naming the crash log in the run
    directory, manifest 'failed' with the error, no finished-looking checkpoint left; a rerun finishes the run."""
    out = tmp_path / "run"
    boom = ("import quant.export.gptq as g\n"
            "def broken(*a, **k):\n    raise RuntimeError('writer exploded')\n"
            "g.write_gptq = broken\n")
    formats = ["--set", "export.formats=[compressed-tensors,gptq]", "--set", "plan.group_size=32"]
    p = _patched(boom, "export", HEADLINE, "-o", str(out), *FAST, *formats)
    line = _one_error_line(p, 70, "internal error (RuntimeError: writer exploded)")
    assert "bug" in line
    log = Path(line.split("the traceback is in ")[1].strip())
    assert log.parent == out and log.name.startswith("crash-")
    assert "Traceback" in log.read_text() and "writer exploded" in log.read_text()
    entry = json.loads((out / "manifest.json").read_text())["stages"]["export"]
    assert entry["status"] == "failed" and "RuntimeError: writer exploded" in entry["error"]
    assert "outputs" not in entry
    assert not (out / "checkpoint").exists() and not (out / "checkpoint-gptq").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".checkpoint")]
    p = run_cli("export", HEADLINE, "-o", str(out), *FAST, *formats)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ran export; up to date: calibrate, profile, plan, quantize" in p.stdout
    entry = json.loads((out / "manifest.json").read_text())["stages"]["export"]
    assert entry["status"] == "done" and set(entry["outputs"]) == {"checkpoint", "checkpoint-gptq"}


def test_ctrl_c_exits_130_and_records_interruption(tmp_path):
    out = tmp_path / "k"
    slow = ("import time, quant.quantize.qstore as q\n"
            "orig = q.write_layer\n"
            "def slow(path, *a, **k):\n    orig(path, *a, **k)\n    open(str(path) + '.written', 'w').close()\n"
            "    time.sleep(60)\n"
            "q.write_layer = slow\n")
    proc = subprocess.Popen([sys.executable, "-c", slow + MAIN, "run", HEADLINE, "-o", str(out), *FAST], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    deadline = time.time() + 240
    while not list((out / "quantize.partial").glob("*.written")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; rerun the same command to resume" in stderr and "Traceback" not in stderr
    assert json.loads((out / "manifest.json").read_text())["stages"]["quantize"]["status"] == "interrupted"
    # the resumed run's eval dequantizes the mixed checkpoint into the temp dir: it first removes the dense copies
    # that killed runs left there, and only theirs
    tmp = tmp_path / "tmp"
    dead, live = tmp / f"quant-dense-{_dead_pid()}-abc", tmp / f"quant-dense-{os.getppid()}-def"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_text("big")
    p = run_cli("run", HEADLINE, "-o", str(out), *FAST, env={"TMPDIR": str(tmp)})
    assert p.returncode == 0 and "ran quantize, export, eval, card, report" in p.stdout, p.stderr[-2000:]
    assert json.loads((out / "eval.json").read_text())["loader"] == "compressed-tensors-dequantize"
    assert not dead.exists() and live.exists() and sorted(tmp.glob("quant-dense-*")) == [live]


def test_output_that_is_a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("mine")
    _one_error_line(run_cli("plan", HEADLINE, "-o", str(f), *FAST), 1, "is a file, not a run directory")
    _one_error_line(run_cli("plan", HEADLINE, "-o", str(f / "sub"), *FAST), 1, "cannot write")
    assert f.read_text() == "mine"


def _in_small_fs(tmp_path: Path, options: str, script: str) -> subprocess.CompletedProcess:
    """``script`` (sh) inside a private mount namespace where ``$FS`` is a fresh tmpfs mounted with ``options``."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare (user and mount namespaces) to mount a small file system")
    fs = tmp_path / "fs"
    fs.mkdir()
    q = f"{sys.executable} -m quant.cli"
    cmd = f"mount -t tmpfs -o {options} none {fs} && cd {REPO} && {script.replace('QUANT', q).replace('$FS', str(fs))}"
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", cmd], capture_output=True,
                          text=True, timeout=600, env=os.environ.copy())


def test_read_only_file_system(tmp_path):
    p = _in_small_fs(tmp_path, "ro,size=1m", f"QUANT plan {HEADLINE} -o $FS/run {' '.join(FAST)}")
    _one_error_line(p, 1, "Read-only file system")


def test_disk_full_is_one_line_and_resumable(tmp_path):
    """The disk check before quantize/export cannot foresee everything (the report's plots, another writer): a run
    directory copied onto a file system with a few KiB to spare fills up in the report stage. One line with free and
    needed space, the report not recorded as done (the manifest itself may not fit: then it stays 'running', as
    after a kill), no temporary left behind; with space, the same command finishes."""
    out = tmp_path / "run"
    assert run_cli("eval", HEADLINE, "-o", str(out), *FAST).returncode == 0
    size_kib = int(subprocess.check_output(["du", "-sk", str(out)]).split()[0]) + 40
    script = (f"cp -r {out} $FS/run && QUANT report {HEADLINE} -o $FS/run {' '.join(FAST)}; echo rc=$? >&2; "
              f"cat $FS/run/manifest.json; ls -a $FS/run >&2; cp -r $FS/run {tmp_path}/copy")
    p = _in_small_fs(tmp_path, f"size={size_kib}k", script)
    assert "rc=1" in p.stderr, p.stderr[-3000:]
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "no space left on" in line[0] and "MB free, about" in line[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    m = json.loads(p.stdout)
    assert m["stages"]["report"]["status"] in ("failed", "running") and m["stages"]["eval"]["status"] == "done"
    assert ".tmp" not in p.stderr  # the ls: no temporary left
    p = run_cli("report", HEADLINE, "-o", str(tmp_path / "copy"), *FAST)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ran report; up to date: calibrate, profile, plan, quantize, export, eval, card" in p.stdout


def test_stop_handlers_are_the_runs_alone(tmp_path, capsys):
    """The CLI's SIGTERM / SIGUSR1 handlers (stop after the layer in hand) live only while its run does: a process
    that called it in-process (a pytest worker, a notebook) still ends on SIGTERM afterwards."""
    from quant.cli import cli_exit_code

    def before_calibration_handler(*_):  # a handler of the caller's, distinct from the defaults
        pass

    old_term = signal.signal(signal.SIGTERM, before_calibration_handler)
    old_usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        code = cli_exit_code(["calibrate", str(REPO / "recipes" / "mixed_int8_int4.yaml"), "-o", str(tmp_path / "r"),
                              "--set", "calibration.n_samples=2", "--set", "calibration.seq_len=16"])
        assert code == 0, capsys.readouterr().err[-2000:]
        assert (tmp_path / "r" / "calibration.safetensors").is_file()
        assert signal.getsignal(signal.SIGTERM) is before_calibration_handler
        assert signal.getsignal(signal.SIGUSR1) is old_usr1
    finally:
        signal.signal(signal.SIGTERM, old_term)


@pytest.mark.parametrize("value", ["bogus", "REDUCE", "1"])
def test_a_bad_statistics_mode_is_one_line(value):
    """``quantize.statistics`` takes auto, ordered or reduce; anything else is one line naming the key, exit 1."""
    p = run_cli("validate", HEADLINE, "--set", f"quantize.statistics={value}")
    _one_error_line(p, 1, "quantize.statistics")


def test_a_resumed_quantize_recomputes_damaged_partial_layers(tmp_path):
    """Killed after two layers were stored; then one stored layer gets a flipped byte and the other is truncated. The
    rerun recomputes both (one warning line each) and exports the checkpoint an uninterrupted run exports."""
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    kill = ("import os, quant.quantize.qstore as q\n"
            "orig = q.write_layer\n"
            "def write_then_die(path, *a, **k):\n    orig(path, *a, **k)\n"
            "    if path.name == 'layer_00001.safetensors':\n        os._exit(137)\n"
            "q.write_layer = write_then_die\n")
    assert _patched(kill, "export", HEADLINE, "-o", str(killed), *FAST).returncode == 137
    partial = killed / "quantize.partial"
    first, second = partial / "layer_00000.safetensors", partial / "layer_00001.safetensors"
    data = bytearray(first.read_bytes())
    data[-2] ^= 0x04
    first.write_bytes(bytes(data))
    with open(second, "r+b") as f:
        f.truncate(second.stat().st_size // 3)
    p = run_cli("export", HEADLINE, "-o", str(killed), *FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    warned = [ln for ln in p.stderr.splitlines() if "recomputing the layer" in ln]
    assert len(warned) == 2 and "damaged" in warned[0] and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert json.loads((killed / "manifest.json").read_text())["stages"]["quantize"]["resumed_layers"] == 0
    assert run_cli("export", HEADLINE, "-o", str(clean), *FAST).returncode == 0
    ckpt = "checkpoint/model.safetensors"
    assert (killed / ckpt).read_bytes() == (clean / ckpt).read_bytes()


@pytest.mark.parametrize("override,pattern", [
    ("export.formats=[gptq,gptq]", "export.formats names a format twice"),
    ("export.formats=[compressed-tensors,gptq,compressed-tensors]", "export.formats names a format twice"),
    (".".join(["a"] * 5000) + "=1", "5000 levels deep, recipe keys have at most 4"),
    ("export.max_shard_gb=1e-6", "YAML reads 1e-6 as text: write 1.0e-6"),
])
def test_recipe_mistakes_found_by_validate_are_one_line(override, pattern):
    _one_error_line(run_cli("validate", HEADLINE, "--set", override), 1, pattern)


def test_shards_smaller_than_a_module_still_evaluate(tmp_path):
    """export.max_shard_gb far below one module's size: every module in a file of its own, its parts together, and
    eval reads the checkpoint (a file holding only another module's scale was an internal error in eval)."""
    out = tmp_path / "tiny-shards"
    p = run_cli("eval", HEADLINE, "-o", str(out), *FAST, "--set", "export.max_shard_gb=0.000001")
    assert p.returncode == 0, p.stderr[-3000:]
    index = json.loads((out / "checkpoint" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 100
    assert index["model.layers.0.mlp.experts.0.up_proj.weight_scale"] == \
        index["model.layers.0.mlp.experts.0.up_proj.weight_packed"]


def test_a_gptq_only_export_is_evaluated_from_its_gptq_files(tmp_path):
    """export.formats: [gptq] alone (a documented format) runs to the report: eval reads the GPTQ files back (it
    failed in eval, after every other stage, looking for a compressed-tensors checkpoint)."""
    out = tmp_path / "gptq"
    p = run_cli("run", HEADLINE, "-o", str(out), *FAST, "--set", "export.formats=[gptq]", "--set", "plan.group_size=32")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["loader"] == "gptq-dequantize" and ev["passed"] is True
    assert json.loads((out / "checkpoint" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> Path:
    """A run directory finished up to eval (copied by the tests that edit it)."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    p = run_cli("eval", HEADLINE, "-o", str(out), *FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _edit_manifest(how: str, m: dict) -> bytes:
    if how == "list":
        return json.dumps([m]).encode()
    if how == "binary":
        return b"\x89PNG\r\n\x1a\n\x00\xff\xfe" + bytes(range(256))
    if how == "stage-as-string":
        m["stages"]["calibrate"] = "done"
    elif how == "failed-gates-7":
        m["stages"]["eval"].update(passed=False, failed_gates=7)
    return json.dumps(m).encode()


@pytest.mark.parametrize("how", ["list", "binary", "stage-as-string", "failed-gates-7"])
@pytest.mark.parametrize("command", ["run", "publish"])
def test_a_hand_edited_run_manifest_is_one_line(evaluated_run, tmp_path, how, command):
    d = tmp_path / "edited"
    shutil.copytree(evaluated_run, d)
    path = d / "manifest.json"
    path.write_bytes(_edit_manifest(how, json.loads(path.read_text())))
    argv = ["run", HEADLINE, "-o", str(d), *FAST] if command == "run" else ["publish", str(d), "--repo-id", "me/x"]
    line = _one_error_line(run_cli(*argv), 1, "manifest.json")
    assert ("damaged or was edited" if command == "run" else "not ") in line


@pytest.mark.parametrize("name", ["quantized", "quantize.partial", "checkpoint"])
def test_a_symlink_in_place_of_a_run_directory_entry_is_one_line(evaluated_run, tmp_path, name):
    """quant replaces and removes its own entries (rmtree of a link failed inside the quantize stage); a link is
    refused before any stage, and what it points to is left alone."""
    d, elsewhere = tmp_path / "linked", tmp_path / "elsewhere"
    shutil.copytree(evaluated_run, d)
    if (d / name).exists():
        shutil.move(d / name, elsewhere)
    else:
        elsewhere.mkdir()
    (d / name).symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.iterdir())
    line = _one_error_line(run_cli("run", HEADLINE, "-o", str(d), *FAST, "--force", "quantize"), 1, "symbolic link")
    assert name in line
    assert sorted(p.name for p in elsewhere.iterdir()) == before


@pytest.mark.parametrize("key", ["calibration.dataset", "eval.perplexity.dataset"])
def test_infinite_calibration_weights_are_one_line_before_any_stage(tmp_path, key):
    """A manifest weight of .inf (calibration or held-out set) is refused before any stage runs: the held-out set
    was read only in the eval stage, after every other stage."""
    shutil.copytree(REPO / "calibration" / "data", tmp_path / "data")
    text = (REPO / "calibration" / "bundled.yaml").read_text().replace("weight: 0.2", "weight: .inf")
    (tmp_path / "inf.yaml").write_text(text)
    out = tmp_path / "run"
    p = run_cli("run", HEADLINE, "-o", str(out), *FAST, "--set", f"{key}={tmp_path / 'inf.yaml'}")
    _one_error_line(p, 1, "weight: Input should be a finite number")
    stages = json.loads((out / "manifest.json").read_text())["stages"] if (out / "manifest.json").is_file() else {}
    assert all(s["status"] != "done" for s in stages.values()), stages


def _builtin_copy(dst: Path) -> Path:
    from quant.models.builtin import builtin_path

    return Path(shutil.copytree(builtin_path("qwen3-moe-tiny"), dst))


def test_a_model_folder_without_tokenizer_files_is_blamed_on_the_tokenizer(tmp_path):
    model = _builtin_copy(tmp_path / "no-tokenizer")
    for f in model.glob("tokenizer*"):
        f.unlink()
    line = _one_error_line(run_cli("run", HEADLINE, "-o", str(tmp_path / "r"), *FAST, "--model", str(model)), 1,
                           "has no tokenizer files")
    assert "0 tokens" not in line and "calibration" not in line


def test_token_ids_beyond_the_models_vocabulary_are_one_line_at_calibrate(tmp_path):
    """A tokenizer that gives ids the embedding has no rows for (here 'the' renumbered 1500 of 1024) is refused when
    the calibration set is tokenized (an IndexError in the profile stage before)."""
    model = _builtin_copy(tmp_path / "big-ids")
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["vocab"]["the"] = 1500
    (model / "tokenizer.json").write_text(json.dumps(tok))
    p = run_cli("run", HEADLINE, "-o", str(tmp_path / "r"), *FAST, "--model", str(model))
    _one_error_line(p, 1, "gives token id 1500")
    stages = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]
    assert stages["calibrate"]["status"] == "failed" and "profile" not in stages


def test_a_changed_tokenizer_redoes_the_stages_that_read_it(tmp_path):
    """The model fingerprint covers weights and config; the calibration tokens (and the checkpoint's copy of the
    tokenizer) depend on the tokenizer files too, so a rerun after they changed tokenizes again."""
    model = _builtin_copy(tmp_path / "model")
    args = ("calibrate", HEADLINE, "-o", str(tmp_path / "r"), *FAST, "--model", str(model))
    assert run_cli(*args).returncode == 0
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
    (model / "tokenizer.json").write_text(json.dumps(tok))
    p = run_cli(*args)
    assert p.returncode == 0 and "calibrate: ran calibrate" in p.stdout, p.stdout + p.stderr[-2000:]


def test_a_claim_stopped_by_a_full_disk_is_resumed_once_there_is_space(tmp_path):
    """The disk fills up while the run directory is claimed: one line, a directory holding only the lock; once space
    is freed the same command runs (it was refused: "exists and is not a quant run directory")."""
    args = f"calibrate {HEADLINE} -o $FS/run {' '.join(FAST)}"
    script = (f"dd if=/dev/zero of=$FS/filler bs=4k 2>/dev/null; QUANT {args}; echo rc=$? >&2; ls -A $FS/run >&2; "
              f"rm $FS/filler; QUANT {args} >&2; echo rc=$? >&2")
    p = _in_small_fs(tmp_path, "size=1m", script)
    first, _, second = p.stderr.partition("rc=1")
    assert "no space left on" in first and second.split("\n")[1] == ".lock", p.stderr[-3000:]
    assert "calibrate: ran calibrate" in second and second.rstrip().endswith("rc=0"), p.stderr[-3000:]
    assert "not a quant run directory" not in p.stderr
