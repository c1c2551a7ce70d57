"""Errors raised at the boundary (recipes, models, checkpoints, run directories).

Every message says what is wrong and what to change. The CLI prints ``str(error)`` as one line on stderr and
exits with ``error.exit_code``; anything else escaping is a bug.
"""

from __future__ import annotations


class QuantError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class RecipeError(QuantError):
    """The recipe (YAML, --set overrides) is malformed or inconsistent."""


class ModelError(QuantError):
    """The model path, builtin name or model architecture cannot be used."""


class CheckpointError(QuantError):
    """A checkpoint on disk is missing files, unsafe (pickle) or not one this project wrote."""


class RunDirError(QuantError):
    """The run directory holds something we must not overwrite or cannot resume."""


class PlanError(QuantError):
    """A bit plan cannot be built or cannot be served by the target runtime."""


class CalibrationError(QuantError):
    """A calibration manifest or its sources cannot be read."""


class NumericalError(QuantError):
    """Numerical failure that could not be repaired (NaN/Inf weights, an unusable Hessian)."""


class MissingDependency(QuantError):
    """An optional dependency the recipe or command needs is not installed (the message names the pip command)."""


class PublishError(QuantError):
    """Uploading to the hub failed (network, authentication, offline mode, missing client)."""


class DistError(QuantError):
    """A collective failed: another rank died, raised or did not answer within the timeout."""


class SandboxUnavailable(QuantError):
    """The machine lacks a kernel layer the sandbox for generated code (HumanEval) requires, and the recipe did
    not opt out of it."""


class StopRequested(QuantError):
    """A stop was requested (SIGUSR1/SIGTERM, a stop file) and the run stopped after the layer in hand, leaving
    the run directory resumable (distinct exit code, EX_TEMPFAIL: rerun to resume)."""

    exit_code = 75


class GateFailed(QuantError):
    """Evaluation finished but at least one quality gate failed (distinct exit code)."""

    exit_code = 3
