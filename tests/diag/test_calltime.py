"""CallTimes adds up the wall time of the calls it wraps, per key, and leaves their results alone."""

from __future__ import annotations

import time
import types

from quant.diag.calltime import CallTimes


def test_wrapped_calls_add_up_per_key():
    mod = types.SimpleNamespace(nap=lambda s: time.sleep(s) or s)
    times = CallTimes()
    times.wrap(mod, "nap", "nap_s")
    assert mod.nap(0.02) == 0.02 and mod.nap(0.03) == 0.03
    assert 0.05 <= times.get("nap_s") < 1.0 and times.get("other") == 0.0
    times.clear()
    assert times.seconds == {}
