"""``quant`` command line: argv -> Recipe (+ --set, --model) -> pipeline. Exit codes: 0 ok, 1 bad input or
unusable model/run directory (one line on stderr), 2 usage, 3 quality gates failed, 75 stopped on request
(SIGUSR1/SIGTERM or a STOP file; rerun to resume), 130 interrupted.
Logging is configured here and only here (through quant/console.py). Under torchrun the pipeline commands join the
process group here; ranks other than 0 log warnings only and print nothing to stdout."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from quant.errors import QuantError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Mixed-precision quantization of Mixture-of-Experts LLMs.")
log = logging.getLogger("quant")

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML (see recipes/)")]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="run directory (default runs/<name>)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a recipe key: a.b=value (repeatable)")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="model folder, hub id or builtin:NAME")]
ForceOpt = Annotated[str | None, typer.Option("--force", help="redo this stage and all later ones ('all': every stage)")]


def _recipe(recipe: Path, overrides: list[str] | None, model: str | None):
    from quant.recipe import load_recipe

    return load_recipe(recipe, overrides=tuple(overrides or ()), model=model)


def _on_stop_signals(world) -> None:
    """SIGUSR1 (a scheduler's warning) and SIGTERM ask the run to stop after the layer in hand (exit 75). Repeats
    change nothing (under Slurm and torchrun a rank receives SIGTERM twice: from slurmstepd and forwarded by the
    agent); SIGINT (Ctrl-C) and SIGKILL stop at once."""
    import signal

    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        log.warning("%s received: stopping after the layer in hand (rerun to resume)", name)
        world.stop.set(name)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)


def _stage(until: str, recipe: Path, output: Path | None, overrides, model, force) -> None:
    from quant.dist import close_world, init_world
    from quant.layerwise import pick_device
    from quant.pipeline import run

    r = _recipe(recipe, overrides, model)
    world = init_world(pick_device(r.quantize.device).type)
    _on_stop_signals(world)
    if not world.is_writer:
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    try:
        result = run(r, output or Path("runs") / r.name, until=until, force=force, world=world)
    finally:
        close_world(world)
    if not world.is_writer:
        return
    typer.echo(f"{until}: ran {', '.join(result.ran) or 'nothing'}"
               f"{'; up to date: ' + ', '.join(result.skipped) if result.skipped else ''} -> {result.run_dir}")
    if until == "plan":
        plan_json = json.loads((result.run_dir / "plan.json").read_text())
        typer.echo(f"plan: {plan_json['notes'][-1] if plan_json.get('notes') else ''}")
    if until == "report":
        typer.echo(f"report: {result.run_dir / 'report.md'}")


@app.command("run")
def run_cmd(recipe: RecipeArg, output: OutputOpt = None, set_: SetOpt = None, model: ModelOpt = None,
            force: ForceOpt = None) -> None:
    """Run every stage (resuming a run directory: finished stages with unchanged inputs are skipped)."""
    _stage("report", recipe, output, set_, model, force)


def _make_stage_command(name: str) -> None:
    def command(recipe: RecipeArg, output: OutputOpt = None, set_: SetOpt = None, model: ModelOpt = None,
                force: ForceOpt = None) -> None:
        _stage(name, recipe, output, set_, model, force)

    command.__doc__ = f"Run the pipeline up to and including '{name}' (earlier stages only if needed)."
    app.command(name)(command)


for _name in ("calibrate", "profile", "plan", "quantize", "export", "eval", "report"):
    _make_stage_command(_name)


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None, model: ModelOpt = None) -> None:
    """Validate a recipe and print it fully resolved (defaults filled in)."""
    typer.echo(_recipe(recipe, set_, model).to_yaml(), nl=False)


@app.command()
def estimate(recipe: RecipeArg, set_: SetOpt = None, model: ModelOpt = None,
             gpus: Annotated[int, typer.Option("--gpus", help="GPUs of the job (experts divided over ranks)")] = 1,
             gpu_memory_gb: Annotated[float, typer.Option("--gpu-memory-gb", help="memory of one GPU")] = 80.0) -> None:
    """Forecast peak GPU/host memory, disk and time per stage from config.json and tensor shapes (no weights);
    exit 1 if the plan cannot fit."""
    from quant.estimate import check_fits, forecast, render
    from quant.models.headers import load_headers

    r = _recipe(recipe, set_, model)
    source = load_headers(r.model.path, r.model.trust_remote_code, r.model.family)
    f = forecast(r, source, gpus, gpu_memory_gb)
    typer.echo(render(f, r))
    check_fits(f, r)


@app.command()
def inspect(checkpoint: Annotated[Path, typer.Argument(help="a checkpoint folder written by quant")]) -> None:
    """Print the per-module bits table of a checkpoint (compressed-tensors or GPTQ format)."""
    from quant.export.inspect import format_table, read_checkpoint_bits

    typer.echo(format_table(read_checkpoint_bits(checkpoint)))


@app.command()
def publish(run_dir: Annotated[Path, typer.Argument(help="a finished run directory")],
            repo_id: Annotated[str, typer.Option("--repo-id", help="ORG/NAME on the Hugging Face hub")],
            private: bool = False) -> None:
    """Upload the run's checkpoint (refused unless the run passed its gates)."""
    from quant.export.publish import publish_run

    url = publish_run(run_dir, repo_id, private=private)
    typer.echo(f"published {run_dir / 'checkpoint'} -> {url}")


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show debug lines and third-party "
                                                "output (library logs, progress bars, warnings)")] = False) -> None:
    from quant.console import configure

    configure(verbose)


def main() -> None:
    try:
        app(standalone_mode=False)
    except QuantError as e:
        if not getattr(e, "elsewhere", False):  # a rank that only relays another rank's error stays quiet
            typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
