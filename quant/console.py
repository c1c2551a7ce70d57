"""The terminal of a run (CLI layer only): logging setup, third-party chatter kept out, progress with ETA.

Off a TTY (batch jobs, Slurm logs) every log line is plain text, and a line that reports a progress step
(quant/progress.py) ends with ``[quantize 3/48 layers, elapsed 0:01:10, ETA 0:17:00]``. On a TTY the same lines
scroll above a live display with one bar per stage (done/total, elapsed, remaining).

By default third-party output stays out of the user's terminal: library loggers below ERROR (transformers,
torch, torchao, compressed-tensors, ...), compressed-tensors' loguru messages, tqdm bars (forced off in tqdm's class,
also where a library asks for them explicitly; ``TQDM_DISABLE`` for subprocesses), and FutureWarning /
DeprecationWarning. ``-v`` shows all of it, plus quant's DEBUG lines.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable

from quant.progress import Step

FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
QUIET_LOGGERS = ("transformers", "compressed_tensors", "datasets", "urllib3", "filelock", "matplotlib", "torchao",
                 "torch", "httpx", "huggingface_hub", "lm_eval", "gptqmodel", "accelerate")
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
             "COMPRESSED_TENSORS_LOG_DISABLED": "1",  # its loguru setup re-enables itself on import otherwise
             "TORCH_LOGS": "-torch"}  # torch's own handler (e.g. torch.utils._pytree warnings at import)
DISABLE_POSITION = 10  # tqdm(iterable, desc, total, leave, file, ncols, mininterval, maxinterval, miniters, ascii, disable)


def hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Clock:
    """Start time of each stage (its ``done=0`` step, else its first step); elapsed time and ETA of a step."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.start: dict[str, float] = {}

    def timing(self, step: Step) -> tuple[float, float | None]:
        """(seconds since the stage started, estimated seconds left or None)."""
        t = self.now()
        if step.done == 0:
            self.start[step.stage] = t
        elapsed = t - self.start.setdefault(step.stage, t)
        eta = elapsed / step.done * (step.total - step.done) if step.eta and step.done > 0 else None
        return elapsed, eta

    def suffix(self, step: Step) -> str:
        elapsed, eta = self.timing(step)
        eta_text = "" if eta is None else f", ETA {hms(eta)}"
        return f"[{step.stage} {step.done}/{step.total} {step.unit}, elapsed {hms(elapsed)}{eta_text}]"


class PlainFormatter(logging.Formatter):
    """The house log format; a progress record gets the stage's position, elapsed time and ETA appended."""

    def __init__(self, clock: Clock | None = None):
        super().__init__(FORMAT, DATE_FORMAT)
        self.clock = clock or Clock()

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        step = getattr(record, "progress", None)
        return f"{line} {self.clock.suffix(step)}" if isinstance(step, Step) else line


class LiveHandler(logging.Handler):
    """On a TTY: each log line printed above a live display holding one progress bar per stage; the display
    closes when every stage it shows is complete."""

    def __init__(self, console=None, clock: Clock | None = None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        self.clock = clock or Clock()
        self.progress = Progress(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[unit]}  elapsed"), TimeElapsedColumn(),
                                 TextColumn("{task.fields[eta]}"), console=console or Console(stderr=True))
        self.tasks: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            step = getattr(record, "progress", None)
            if isinstance(step, Step):
                self._update(step)
            self.progress.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
            if self.tasks and all(t.finished for t in self.progress.tasks):
                self._stop()
        except Exception:  # noqa: BLE001 - logging must never raise into the pipeline
            self.handleError(record)

    def _update(self, step: Step) -> None:
        if not self.tasks:
            self.progress.start()
        _, eta = self.clock.timing(step)
        fields = {"unit": step.unit, "eta": "" if eta is None else f"ETA {hms(eta)}"}
        if step.stage not in self.tasks or step.done == 0:
            self.tasks[step.stage] = self.progress.add_task(step.stage, total=step.total, **fields)
        self.progress.update(self.tasks[step.stage], completed=step.done, total=step.total, **fields)

    def _stop(self) -> None:
        self.progress.stop()
        for task in list(self.tasks.values()):
            self.progress.remove_task(task)
        self.tasks.clear()

    def close(self) -> None:
        if self.tasks:
            self._stop()
        super().close()


def _tqdm_off() -> None:
    """tqdm bars stay out of the terminal, also those a library makes with an explicit ``disable=False`` that
    ``TQDM_DISABLE`` (a default only, read when tqdm is imported) cannot turn off: lm-eval's "Running loglikelihood
    requests" / "Running generate_until requests", compressed-tensors' "Dispatching model". ``disable`` is forced on
    in tqdm's own class, which every bar (``tqdm.auto``, ``tqdm.asyncio``, subclasses) is made through."""
    import tqdm.std

    init = tqdm.std.tqdm.__init__
    if getattr(init, "quant_quiet", False):
        return

    @functools.wraps(init)
    def quiet(self, *args, **kwargs):
        if len(args) > DISABLE_POSITION:  # disable given by position
            args = (*args[:DISABLE_POSITION], True, *args[DISABLE_POSITION + 1:])
        else:
            kwargs["disable"] = True
        init(self, *args, **kwargs)

    quiet.quant_quiet = True
    tqdm.std.tqdm.__init__ = quiet


def _quiet_third_parties() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    _tqdm_off()
    try:
        # compressed-tensors logs through loguru, straight to stderr (if it was imported before this ran)
        from loguru import logger

        logger.disable("compressed_tensors")
    except ImportError:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def configure(verbose: bool, stream=None, tty: bool | None = None) -> logging.Handler:
    """Route the process's logging to ``stream`` (default stderr): a live display when it is a TTY, else plain
    lines. Unless ``verbose``, third-party output is kept out (module docstring). Returns the handler."""
    stream = stream or sys.stderr
    tty = stream.isatty() if tty is None else tty
    if tty:
        from rich.console import Console

        handler: logging.Handler = LiveHandler(Console(file=stream))
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(PlainFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if verbose:
        logging.getLogger("quant").setLevel(logging.DEBUG)
    else:
        _quiet_third_parties()
    return handler
