"""Progress steps ride on ordinary log records: the seam between long loops and the console.

A loop reports ``log.info("layer %d: ...", i, extra=step("quantize", i + 1, n_layers))`` (and ``done=0`` once
before its first item, which starts the clock). The package never renders anything; the CLI's console (quant/
console.py) turns such records into a progress display on a TTY or a plain line with elapsed time and ETA in a
batch log. Without the console (library use, tests) they are plain log records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """``done`` of ``total`` ``unit`` of ``stage`` finished; ``eta``: whether a remaining-time estimate means
    anything (items of similar cost)."""

    stage: str
    done: int
    total: int
    unit: str = "layers"
    eta: bool = True


def step(stage: str, done: int, total: int, unit: str = "layers", eta: bool = True) -> dict:
    """``extra=`` mapping for a logging call that reports a progress step."""
    return {"progress": Step(stage, done, total, unit, eta)}
