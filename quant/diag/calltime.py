"""Wall time spent in chosen functions, added up per name: for benchmarks that split a stage's time by what it calls.

``CallTimes.wrap(owner, name, key)`` replaces ``owner.name`` (a module's function, a class's method) with a wrapper
that adds each call's wall time to ``seconds[key]``; by default after a device sync on entry and exit, so queued
GPU work is charged to the call that queued it (``device_sync=False`` for calls on a background thread, which must
not wait for the compute stream). Meant for benchmark processes: the wrapper stays until the process ends.
"""

from __future__ import annotations

import functools
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CallTimes:
    """Seconds per key of the wrapped functions' calls (``seconds``), cleared with ``clear``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, key: str, device_sync: bool = True) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if device_sync:
                _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if device_sync:
                    _sync()
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapped)

    def get(self, key: str) -> float:
        return self.seconds.get(key, 0.0)

    def clear(self) -> None:
        self.seconds.clear()
