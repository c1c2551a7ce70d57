"""``quant`` command line: argv -> Recipe (+ --set, --model) -> pipeline. Exit codes: 0 ok, 1 bad input or
unusable model/run directory (one ``error:`` line on stderr), 2 usage (click's message), 3 quality gates failed,
70 internal error (a bug: one line naming the log file that holds the traceback), 75 stopped on request
(SIGUSR1/SIGTERM or a STOP file; rerun to resume), 130 interrupted.
Logging is configured here and only here (through quant/console.py). Under torchrun the pipeline commands join the
process group here; ranks other than 0 log warnings only and print nothing to stdout."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from quant.errors import QuantError, RecipeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Mixed-precision quantization of Mixture-of-Experts LLMs.")
log = logging.getLogger("quant")
EXIT_INTERNAL = 70  # sysexits.h EX_SOFTWARE: distinct from 1 (bad input) so scripts can tell a bug from a mistake
EXIT_INTERRUPTED = 130

def _utf8_path(value: Path | None) -> Path | None:
    """Every path argument as given, refused in one line where it is not valid UTF-8: a run directory's records, logs
    and messages are UTF-8 text, and a name with undecodable bytes (a surrogate escape here) cannot be written there."""
    if value is not None:
        try:
            os.fsdecode(value).encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(value).decode("utf-8", "backslashreplace")
            raise RecipeError(f"the path '{shown}' is not valid UTF-8: rename it, or pass another") from None
    return value


RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML (see recipes/)", callback=_utf8_path)]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="run directory (default runs/<name>)",
                                                callback=_utf8_path)]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a recipe key: a.b=value (repeatable)")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="model folder, hub id or builtin:NAME")]
ForceOpt = Annotated[str | None, typer.Option("--force", help="redo this stage and all later ones ('all': every stage)")]


def _recipe(recipe: Path, overrides: list[str] | None, model: str | None):
    from quant.recipe import load_recipe

    return load_recipe(recipe, overrides=tuple(overrides or ()), model=model)


@contextmanager
def _stop_signals(world):
    """While a run is in hand, SIGUSR1 (a scheduler's warning) and SIGTERM ask it to stop after the layer in hand
    (exit 75). Repeats change nothing (under Slurm and torchrun a rank receives SIGTERM twice: from slurmstepd and
    forwarded by the agent); SIGINT (Ctrl-C) and SIGKILL stop at once. The previous handlers come back when the run
    ends, so a process that called the CLI in-process (a test runner, a notebook) still dies on SIGTERM."""
    import signal

    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        log.warning("%s received: stopping after the layer in hand (rerun to resume)", name)
        world.stop.set(name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stage(until: str, recipe: Path, output: Path | None, overrides, model, force) -> None:
    from quant.layerwise import pick_device
    from quant.parallel.world import close_world, init_world
    from quant.run.pipeline import run

    r = _recipe(recipe, overrides, model)
    run_dir = output or Path("runs") / r.name
    world = init_world(pick_device(r.quantize.device).type)
    if not world.is_writer:
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    clean = False
    try:
        with _crash_log_in(run_dir), _stop_signals(world):
            result = run(r, run_dir, until=until, force=force, world=world)
        clean = True
    finally:
        close_world(world, clean)
    if not world.is_writer:
        return
    typer.echo(f"{until}: ran {', '.join(result.ran) or 'nothing'}"
               f"{'; up to date: ' + ', '.join(result.skipped) if result.skipped else ''} -> {result.run_dir}")
    if until == "plan":
        from quant.plan.bitplan import BitPlan

        typer.echo(f"plan: {BitPlan.load(result.run_dir / 'plan.json').headline.line()}")
    if until == "report":
        typer.echo(f"report: {result.run_dir / 'report.md'}")


DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the recipe values changed since the run "
                                          "directory's last run and the stages that would be redone, then stop")]


@app.command("run")
def run_cmd(recipe: RecipeArg, output: OutputOpt = None, set_: SetOpt = None, model: ModelOpt = None,
            force: ForceOpt = None, dry_run: DryRunOpt = False) -> None:
    """Run every stage (resuming a run directory: finished stages with unchanged inputs are skipped)."""
    if dry_run:
        from quant.run.pipeline import preview

        r = _recipe(recipe, set_, model)
        typer.echo(preview(r, output or Path("runs") / r.name, force=force).line())
        return
    _stage("report", recipe, output, set_, model, force)


def _make_stage_command(name: str) -> None:
    def command(recipe: RecipeArg, output: OutputOpt = None, set_: SetOpt = None, model: ModelOpt = None,
                force: ForceOpt = None) -> None:
        _stage(name, recipe, output, set_, model, force)

    command.__doc__ = f"Run the pipeline up to and including '{name}' (earlier stages only if needed)."
    app.command(name)(command)


for _name in ("calibrate", "profile", "plan", "quantize", "export", "eval", "card", "report"):
    _make_stage_command(_name)


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None, model: ModelOpt = None) -> None:
    """Validate a recipe and print it fully resolved (defaults filled in); exit 1 if this machine cannot run it
    (a device it lacks, a library the eval stage needs)."""
    from quant.run.pipeline import check_machine

    r = _recipe(recipe, set_, model)
    check_machine(r)
    typer.echo(r.to_yaml(), nl=False)


@app.command()
def estimate(recipe: RecipeArg, set_: SetOpt = None, model: ModelOpt = None,
             gpus: Annotated[int, typer.Option("--gpus", help="GPUs of the job (experts divided over ranks)")] = 1,
             gpu_memory_gb: Annotated[float, typer.Option("--gpu-memory-gb", help="memory of one GPU")] = 80.0,
             host_memory_gb: Annotated[float | None, typer.Option(
                 "--host-memory-gb", help="memory of the job's host (default: this machine's)")] = None) -> None:
    """Forecast peak GPU/host memory, disk and time per stage from config.json and tensor shapes (no weights);
    exit 1 if the plan cannot fit (a GPU, or the host)."""
    from quant.forecast.estimate import check_fits, check_machine, forecast, render
    from quant.io.staging import host_total_bytes
    from quant.models.headers import load_headers

    r = _recipe(recipe, set_, model)
    host = host_memory_gb if host_memory_gb is not None else host_total_bytes() / 1e9
    check_machine(gpus, gpu_memory_gb, host)  # before the headers are read (from the hub, maybe)
    source = load_headers(r.model.path, r.model.trust_remote_code, r.model.family)
    f = forecast(r, source, gpus, gpu_memory_gb, host_memory_gb=host)
    typer.echo(render(f, r))
    check_fits(f, r)


@app.command()
def inspect(checkpoint: Annotated[Path, typer.Argument(help="a checkpoint folder written by quant",
                                                      callback=_utf8_path)]) -> None:
    """Print the per-module bits table of a checkpoint (compressed-tensors or GPTQ format)."""
    from quant.export.inspect import format_table, read_checkpoint_bits

    typer.echo(format_table(read_checkpoint_bits(checkpoint)))


@app.command()
def publish(run_dir: Annotated[Path, typer.Argument(help="a finished run directory", callback=_utf8_path)],
            repo_id: Annotated[str, typer.Option("--repo-id", help="ORG/NAME on the Hugging Face hub")],
            private: bool = False,
            fmt: Annotated[str | None, typer.Option("--format", help="the export format to upload (default: the "
                                                    "first one a runtime on its card serves)")] = None) -> None:
    """Upload the run's checkpoint (refused unless the run passed its gates and some runtime serves it)."""
    from quant.publish import check_publishable, hub_api, publish_run

    api = hub_api()
    folder = check_publishable(run_dir, fmt)
    url = publish_run(run_dir, repo_id, private=private, fmt=fmt, api=api)
    typer.echo(f"published {folder} -> {url}")


def _print_version(value: bool) -> None:
    if value:
        from quant import version

        typer.echo(f"quant {version()}")
        raise typer.Exit()


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show debug lines and third-party "
                                                "output (library logs, progress bars, warnings)")] = False,
          _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                 help="print quant's version and exit")] = False) -> None:
    from quant.console import configure

    configure(verbose)


class _Crash(Exception):
    """An unexpected exception, its traceback already written to ``log_path``."""

    def __init__(self, error: BaseException, log_path: Path | None):
        super().__init__(f"{type(error).__name__}: {error}")
        self.log_path = log_path


def _write_crash_log(error: BaseException, directory: Path) -> Path | None:
    """The traceback in ``directory/crash-<time>-<pid>.log`` (the temp dir if that is not writable)."""
    text = "".join(traceback.format_exception(error))
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for d in (directory, Path(tempfile.gettempdir())):
        try:
            (d / name).write_text(f"quant {' '.join(sys.argv[1:])}\n{text}", errors="backslashreplace")
            return d / name
        except OSError:
            continue
    return None


@contextmanager
def _crash_log_in(run_dir: Path) -> Iterator[None]:
    """Unexpected exceptions inside the block get their traceback logged in the run directory."""
    try:
        yield
    except (QuantError, _Crash):
        raise
    except Exception as e:  # noqa: BLE001 - anything else is a bug: log it where the run's artifacts are
        raise _Crash(e, _write_crash_log(e, run_dir if run_dir.is_dir() else Path(tempfile.gettempdir()))) from e


def _one_line(message: str) -> str:
    """A message as one printable line (user input in it may hold newlines or control characters)."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: "\\n" if m.group() == "\n" else f"\\x{ord(m.group()):02x}",
                  message.strip()).encode("utf-8", "backslashreplace").decode("utf-8")


def _usage_error(e: BaseException) -> bool:
    """click's usage errors, from typer's vendored click (typer >= 0.2x) or click itself."""
    types: list[type] = [t for t in (getattr(typer, "TyperException", None),) if t is not None]
    try:
        import click

        types.append(click.ClickException)
    except ImportError:
        pass
    return isinstance(e, tuple(types)) and hasattr(e, "exit_code")


@functools.cache
def _command():
    """The click command typer builds from ``app`` (built once: it is most of a short command's time)."""
    return typer.main.get_command(app)


def cli_exit_code(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code, printing at most one ``error:`` line for a failure."""
    try:
        rv = _command().main(args=argv, prog_name="quant", standalone_mode=False)
    except QuantError as e:
        if not getattr(e, "elsewhere", False):  # a rank that only relays another rank's error stays quiet
            typer.echo(f"error: {_one_line(str(e))}", err=True)
        return e.exit_code
    except KeyboardInterrupt:  # outside typer's own handling (startup)
        rv = EXIT_INTERRUPTED
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        rv = EXIT_INTERRUPTED
    except _Crash as e:
        return _report_crash(e, e.log_path)
    except Exception as e:  # noqa: BLE001 - usage errors, and bugs outside a run
        if _usage_error(e):
            e.show() if hasattr(e, "show") else typer.echo(f"error: {_one_line(str(e))}", err=True)
            return int(e.exit_code)
        return _report_crash(_Crash(e, None), _write_crash_log(e, Path(tempfile.gettempdir())))
    if rv == EXIT_INTERRUPTED:  # typer turns KeyboardInterrupt into Exit(130) and returns the code
        typer.echo("interrupted; rerun the same command to resume", err=True)
    return rv if isinstance(rv, int) else 0


def _report_crash(e: _Crash, log_path: Path | None) -> int:
    where = f"; the traceback is in {log_path}" if log_path else ""
    typer.echo(f"error: internal error ({_one_line(str(e))}): this is a bug in quant, please file a bug report "
               f"with the command you ran{where}", err=True)
    return EXIT_INTERNAL


def main() -> None:
    from quant.parallel.world import exit_process

    exit_process(cli_exit_code())


if __name__ == "__main__":
    main()
