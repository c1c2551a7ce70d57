"""Stage freshness: a stage is redone only when what it reads changed."""

import json
import shutil
from pathlib import Path

import pytest

from quant.cli import cli_exit_code
from quant.recipe import load_recipe
from quant.run.pipeline import preview, run

REPO = Path(__file__).resolve().parents[2]
HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=64", "profile.layer_sensitivity.n_samples=2")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "r"
    assert run(load_recipe(HEADLINE, overrides=FAST), out).passed
    return out


@pytest.fixture
def copy(finished, tmp_path):
    """A copy of the finished run directory, for a test that reruns it with other values."""
    return Path(shutil.copytree(finished, tmp_path / "r"))


def _cli_args(out, *overrides):
    return [a for o in FAST + overrides for a in ("--set", o)] + ["-o", str(out)]


def test_dry_run_names_the_changed_values_and_the_stages_to_redo_and_writes_nothing(finished, capsys):
    manifest = (finished / "manifest.json").read_bytes()
    assert cli_exit_code(["run", str(HEADLINE), "--dry-run", *_cli_args(finished, "quantize.algorithm=rtn")]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"{finished}: recipe changed since the last run (quantize.algorithm: gptq -> rtn); will redo "
                    "quantize, export, eval, card, report (up to date: calibrate, profile, plan)")
    assert (finished / "manifest.json").read_bytes() == manifest
    assert preview(load_recipe(HEADLINE, overrides=FAST), finished).line().endswith("up to date, nothing to redo")


def test_a_preview_knows_an_export_format_leaves_the_plan_s_modules_and_so_quantize_alone(finished):
    p = preview(load_recipe(HEADLINE, overrides=FAST + ("export.formats=[compressed-tensors,gptq]",)), finished)
    assert p.changed == ("export.formats: [compressed-tensors] -> [compressed-tensors, gptq]",)
    assert p.redo == ("plan", "export", "eval", "card", "report"), p.redo


def test_a_run_says_what_changed_before_any_work(finished, caplog):
    caplog.set_level("INFO", logger="quant")
    run(load_recipe(HEADLINE, overrides=FAST + ("report.plots=false",)), finished)
    first = next(r for r in caplog.records if r.name == "quant.run.pipeline")
    assert first.levelname == "WARNING" and "report.plots: true -> false" in first.getMessage()
    assert first.getMessage().endswith("will redo report (up to date: calibrate, profile, plan, quantize, export, eval, card)")


def test_another_export_format_or_shard_size_does_not_requantize(copy):
    both = run(load_recipe(HEADLINE, overrides=FAST + ("export.formats=[compressed-tensors,gptq]",)), copy)
    assert "quantize" not in both.ran and {"plan", "export"} <= set(both.ran), both.ran
    shards = run(load_recipe(HEADLINE, overrides=FAST + ("export.formats=[compressed-tensors,gptq]",
                                                         "export.max_shard_gb=0.001")), copy)
    assert shards.ran[0] == "export" and "plan" not in shards.ran and "quantize" not in shards.ran, shards.ran


def _written(path: Path) -> dict[str, tuple[bytes, int]]:
    """Each file under ``path`` (or ``path`` itself): its bytes and modification time (a rewrite changes it)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def _checkpoint(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """The exported checkpoint's files as written, without the card stage's (the card and the manifest entry)."""
    return {k: v for k, v in _written(run_dir / "checkpoint").items()
            if k not in ("checkpoint/README.md", "checkpoint/quant_manifest.json")}


def test_a_profile_that_moves_only_the_plan_s_notes_leaves_the_checkpoint_and_its_eval(copy):
    """More label draws move the layer damage, so the plan's predicted KL, not its modules (the policy ranks
    experts by routed tokens): profile and plan are redone, and the card and report that print the KL, while
    quantize, export and eval, which read only the plan's module schemes, stay up to date; the preview says so."""
    recipe = load_recipe(HEADLINE, overrides=FAST + ("profile.layer_sensitivity.draws=2",))
    plan = json.loads((copy / "plan.json").read_text())
    before = {"checkpoint": _checkpoint(copy), "eval": _written(copy / "eval.json"),
              "quantized": _written(copy / "quantized")}
    p = preview(recipe, copy)
    result = run(recipe, copy)
    assert result.ran == ["profile", "plan", "card", "report"], result.ran
    assert result.skipped == ["calibrate", "quantize", "export", "eval"], result.skipped
    now = json.loads((copy / "plan.json").read_text())
    assert now["modules"] == plan["modules"] and now["serving"]["predicted_kl"] != plan["serving"]["predicted_kl"]
    assert {"checkpoint": _checkpoint(copy), "eval": _written(copy / "eval.json"),
            "quantized": _written(copy / "quantized")} == before
    # the new plan is made from a profile not yet measured: whether quantize, export and eval are redone turns on it
    assert (p.redo, p.maybe, p.fresh) == (("profile", "plan", "card", "report"), ("quantize", "export", "eval"),
                                          ("calibrate",))
    assert p.line().endswith("will redo profile, plan, card, report; quantize, export, eval only if what they read "
                             "of the redone stages' outputs changes (up to date: calibrate)"), p.line()
    assert preview(recipe, copy).line().endswith("up to date, nothing to redo")


def test_a_preview_knows_a_plan_with_the_same_modules_leaves_the_checkpoint_and_its_eval(copy):
    """plan.group_size 64 instead of 128 gives every module of the tiny model the group size it had (their widths
    are at most 64) and changes only the plan's group rule: the preview, made from the profile in place, and the
    run agree that the checkpoint and its eval stay."""
    recipe = load_recipe(HEADLINE, overrides=FAST + ("plan.group_size=64",))
    before = {"checkpoint": _checkpoint(copy), "eval": _written(copy / "eval.json")}
    p = preview(recipe, copy)
    assert (p.redo, p.maybe) == (("plan", "card", "report"), ()), p.line()
    result = run(recipe, copy)
    assert tuple(result.ran) == p.redo and tuple(result.skipped) == p.fresh, (result.ran, p.line())
    assert {"checkpoint": _checkpoint(copy), "eval": _written(copy / "eval.json")} == before


def test_a_plan_with_other_modules_redoes_the_checkpoint_and_its_eval(copy):
    """plan.top_fraction 0.3 puts more experts at 8 bits: quantize, export and eval are redone, as the preview
    says."""
    recipe = load_recipe(HEADLINE, overrides=FAST + ("plan.top_fraction=0.3",))
    modules = json.loads((copy / "plan.json").read_text())["modules"]
    checkpoint = _checkpoint(copy)
    p = preview(recipe, copy)
    assert (p.redo, p.maybe) == (("plan", "quantize", "export", "eval", "card", "report"), ()), p.line()
    result = run(recipe, copy)
    assert tuple(result.ran) == p.redo and result.skipped == ["calibrate", "profile"], result.ran
    assert json.loads((copy / "plan.json").read_text())["modules"] != modules
    assert _checkpoint(copy)["checkpoint/model.safetensors"][0] != checkpoint["checkpoint/model.safetensors"][0]


def test_an_export_redone_with_the_same_bytes_leaves_eval_up_to_date(copy):
    """Another shard size limit the tiny checkpoint stays under redoes export, which writes the same files; with
    new serving notes in the plan too (more label draws), eval, which reads the checkpoint by content and only the
    plan's module schemes, is not redone."""
    recipe = load_recipe(HEADLINE, overrides=FAST + ("profile.layer_sensitivity.draws=2", "export.max_shard_gb=10"))
    checkpoint = {k: data for k, (data, _) in _checkpoint(copy).items()}
    evaluated = _written(copy / "eval.json")
    result = run(recipe, copy)
    assert result.ran == ["profile", "plan", "export", "card", "report"], result.ran
    assert {k: data for k, (data, _) in _checkpoint(copy).items()} == checkpoint
    assert _written(copy / "eval.json") == evaluated
