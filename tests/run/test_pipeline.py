"""Stage freshness: a stage is redone only when what it reads changed."""

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


def _cli_args(out, *overrides):
    return [a for o in FAST + overrides for a in ("--set", o)] + ["-o", str(out)]


def test_dry_run_names_the_changed_values_and_the_stages_to_redo_and_writes_nothing(finished, capsys):
    manifest = (finished / "manifest.json").read_bytes()
    assert cli_exit_code(["run", str(HEADLINE), "--dry-run", *_cli_args(finished, "quantize.algorithm=rtn")]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"{finished}: recipe changed since the last run (quantize.algorithm: gptq -> rtn); will redo "
                    "plan, quantize, export, eval, card, report (up to date: calibrate, profile)")
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


def test_another_export_format_or_shard_size_does_not_requantize(finished):
    both = run(load_recipe(HEADLINE, overrides=FAST + ("export.formats=[compressed-tensors,gptq]",)), finished)
    assert "quantize" not in both.ran and {"plan", "export"} <= set(both.ran), both.ran
    shards = run(load_recipe(HEADLINE, overrides=FAST + ("export.formats=[compressed-tensors,gptq]",
                                                         "export.max_shard_gb=0.001")), finished)
    assert shards.ran[0] == "export" and "plan" not in shards.ran and "quantize" not in shards.ran, shards.ran
