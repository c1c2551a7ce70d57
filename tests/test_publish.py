"""``quant publish``: only a run whose gates passed and whose checkpoint is unchanged since export is uploaded,
byte for byte, through an injected hub client; failures are one ``error:`` line, never a traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from quant.errors import CheckpointError, GateFailed, QuantError, RunDirError
from quant.publish import publish_run
from tests.conftest import REPO, run_cli

RECIPE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=4", "calibration.seq_len=32", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=32", "plan.group_size=32")
# one expert scheme for the whole model: transformers serves the compressed-tensors checkpoint
SERVED = (*FAST, "plan.policy=uniform")


class FakeHub:
    """The two ``HfApi`` methods publish uses; a repo is a folder under ``root``."""

    def __init__(self, root: Path, fail: Exception | None = None):
        self.root, self.fail = root, fail
        self.calls: list[tuple] = []

    def create_repo(self, repo_id: str, *, private: bool = False, exist_ok: bool = False, **kw):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        if self.fail is not None:
            raise self.fail
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_folder(self, *, repo_id: str, folder_path: str, commit_message: str | None = None, **kw):
        self.calls.append(("upload_folder", repo_id, folder_path, commit_message))
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)

    def upload_file(self, *, path_or_fileobj, path_in_repo: str, repo_id: str, **kw):
        """For a model card uploaded beside the checkpoint (README.md)."""
        self.calls.append(("upload_file", repo_id, path_in_repo))
        data = path_or_fileobj if isinstance(path_or_fileobj, bytes) else Path(path_or_fileobj).read_bytes()
        (self.root / repo_id / path_in_repo).write_bytes(data)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(quant_cache, tmp_path_factory) -> dict[str, Path]:
    """A finished run whose gates passed, and a copy re-evaluated with an impossible gate (eval, card and report rerun)."""
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    root = tmp_path_factory.mktemp("publish")
    passed = root / "passed"
    assert run(load_recipe(RECIPE, overrides=SERVED), passed).passed is True
    failed = root / "failed"
    shutil.copytree(passed, failed)
    with pytest.raises(GateFailed):
        run(load_recipe(RECIPE, overrides=(*SERVED, "eval.gates.perplexity.max_rel_increase=-1")), failed)
    # the headline plan (8- and 4-bit experts in one layer) on a model too narrow for the vLLM plugin's kernel:
    # nothing serves its compressed-tensors checkpoint; GPTQModel serves the GPTQ export
    experts = root / "experts"
    assert run(load_recipe(RECIPE, overrides=(*FAST, "export.formats=[compressed-tensors,gptq]")), experts).passed
    return {"passed": passed, "failed": failed, "experts": experts}


def test_uploads_the_validated_checkpoint_byte_for_byte(runs, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    before = _files(runs["passed"] / "checkpoint")
    url = publish_run(runs["passed"], "acme/tiny-moe-w4", private=True, api=hub)
    assert url == "https://huggingface.co/acme/tiny-moe-w4"
    uploaded = _files(tmp_path / "hub" / "acme" / "tiny-moe-w4")
    assert uploaded == before  # the checkpoint as validated, with the model card the card stage wrote
    assert uploaded["README.md"].startswith(b"---\n") and b"All quality gates passed" in uploaded["README.md"]
    assert "quant_manifest.json" in before and any(k.endswith(".safetensors") for k in before)
    assert [c[0] for c in hub.calls][:2] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1:] == ("acme/tiny-moe-w4", True, True)
    assert Path(hub.calls[1][2]) == runs["passed"] / "checkpoint" and "mixed_int8_int4" in hub.calls[1][3]


def test_failed_gates_are_refused(runs, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(RunDirError, match="quality gates failed.*perplexity"):
        publish_run(runs["failed"], "acme/x", api=hub)
    assert hub.calls == []


@pytest.mark.parametrize("tamper", ["modify", "add", "remove"])
def test_checkpoint_changed_after_export_is_refused(runs, tmp_path, tamper):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["passed"], run_dir)
    ckpt = run_dir / "checkpoint"
    if tamper == "modify":
        (ckpt / "config.json").write_text((ckpt / "config.json").read_text() + " ")
    elif tamper == "add":
        (ckpt / "extra.safetensors").write_bytes(b"not in the manifest")
    else:
        (ckpt / "tokenizer.json").unlink()
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(CheckpointError, match="changed since export"):
        publish_run(run_dir, "acme/x", api=hub)
    assert hub.calls == []


def test_not_a_run_directory_is_refused(runs, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    for path in (tmp_path / "empty", runs["passed"] / "checkpoint"):
        path.mkdir(exist_ok=True)
        with pytest.raises(RunDirError, match="not a quant run directory"):
            publish_run(path, "acme/x", api=hub)
    with pytest.raises(RunDirError, match="ORG/NAME"):
        publish_run(runs["passed"], "no-slash", api=hub)
    assert hub.calls == []


def test_hub_failure_is_a_quant_error(runs, tmp_path):
    hub = FakeHub(tmp_path / "hub", fail=ConnectionError("Name or service not known"))
    with pytest.raises(QuantError, match="acme/x"):
        publish_run(runs["passed"], "acme/x", api=hub)


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline", "unreachable"])
def test_cli_without_network_is_one_error_line(runs, env):
    p = run_cli("publish", str(runs["passed"]), "--repo-id", "x/y", env={**env, "HF_TOKEN": "hf_fake"}, timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "x/y" in errors[0], p.stderr[-3000:]


def test_cli_refusal_is_one_error_line(runs):
    p = run_cli("publish", str(runs["failed"]), "--repo-id", "x/y")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "quality gates failed" in errors[0]


def test_model_card_is_in_the_manifest_and_verified(runs, tmp_path):
    import hashlib
    import json

    run_dir = tmp_path / "run"
    shutil.copytree(runs["passed"], run_dir)
    ckpt = run_dir / "checkpoint"
    listed = json.loads((ckpt / "quant_manifest.json").read_text())["files"]
    assert listed["README.md"] == hashlib.sha256((ckpt / "README.md").read_bytes()).hexdigest()
    (ckpt / "README.md").write_text((ckpt / "README.md").read_text().replace("All quality gates passed", "Great"))
    with pytest.raises(CheckpointError, match="changed since export \\(README.md\\)"):
        publish_run(run_dir, "acme/x", api=FakeHub(tmp_path / "hub"))


def test_truncated_checkpoint_is_redone_by_the_advised_command(runs, tmp_path):
    """A truncated shard: publish refuses and names `quant run`; that command re-exports (it is not 'up to date')
    and publish then uploads what was evaluated."""
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    run_dir = tmp_path / "run"
    shutil.copytree(runs["passed"], run_dir)
    shard = run_dir / "checkpoint" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4096])
    with pytest.raises(CheckpointError, match="changed since export .*re-run the `quant run` command"):
        publish_run(run_dir, "acme/x", api=FakeHub(tmp_path / "hub"))
    result = run(load_recipe(RECIPE, overrides=SERVED), run_dir)
    assert "export" in result.ran and "card" in result.ran
    assert publish_run(run_dir, "acme/x", api=FakeHub(tmp_path / "hub")).endswith("acme/x")
    assert _files(tmp_path / "hub" / "acme" / "x") == _files(runs["passed"] / "checkpoint")  # deterministic export


def test_checkpoint_exported_after_eval_is_refused(runs, tmp_path):
    """`quant export` with other settings after eval: the checkpoint is intact but is not what eval measured."""
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    run_dir = tmp_path / "run"
    shutil.copytree(runs["passed"], run_dir)
    run(load_recipe(RECIPE, overrides=(*FAST, "export.formats=[gptq]")), run_dir, until="export")
    with pytest.raises(CheckpointError, match="not the checkpoint the eval stage evaluated"):
        publish_run(run_dir, "acme/x", api=FakeHub(tmp_path / "hub"))


def test_published_means_servable(runs, tmp_path):
    """The per-expert run: its compressed-tensors checkpoint is served by no runtime on its card, so the GPTQ folder
    (GPTQModel) is what goes up; asked for the compressed-tensors one, or with no servable folder, publish refuses
    with what to run instead."""
    import json

    hub = FakeHub(tmp_path / "hub")
    publish_run(runs["experts"], "acme/x", api=hub)
    assert Path(hub.calls[1][2]) == runs["experts"] / "checkpoint-gptq"
    assert _files(tmp_path / "hub" / "acme" / "x") == _files(runs["experts"] / "checkpoint-gptq")
    with pytest.raises(QuantError, match="no runtime serves .*checkpoint; run recipes/mixed_vllm.yaml"):
        publish_run(runs["experts"], "acme/x", api=hub, fmt="compressed-tensors")
    gone = tmp_path / "ct-only"
    shutil.copytree(runs["experts"], gone)
    m = json.loads((gone / "manifest.json").read_text())
    m["stages"]["export"]["served_by"].pop("checkpoint-gptq")  # as a run that exported compressed-tensors only
    (gone / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(QuantError, match="vllm-quant .*add gptq to export.formats"):
        publish_run(gone, "acme/x", api=hub)
    p = run_cli("publish", str(runs["experts"]), "--repo-id", "acme/x", "--format", "compressed-tensors",
                env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 1 and p.stderr.count("error:") == 1 and "no runtime serves" in p.stderr


def test_publish_without_huggingface_hub_names_the_pip_command_before_any_check(capsys, monkeypatch, tmp_path):
    from quant.cli import cli_exit_code

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as where the publish extra is not installed
    code = cli_exit_code(["publish", str(tmp_path), "--repo-id", "acme/x"])  # not even a run directory
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith("error: ") and "pip install 'moe-quant[publish]'" in err, err
