"""The run directory's claim: a finished run refuses another model, and says why without guessing at damage."""

import pytest

from quant.errors import RunDirError
from quant.io.rundir import RunDir


def _finished(path, identity):
    d = RunDir(path)
    m = d.claim(identity, force=False)
    d.mark(m, "calibrate", status="done", input_hash="x")
    d._lock_file.close()


@pytest.mark.parametrize("model, why", [("builtin:qwen3-moe-tiny", "a builtin model is rebuilt"),
                                        ("/models/m", "another copy, or files edited or downloaded again")])
def test_a_changed_model_is_refused_naming_both_fingerprints_not_damage(tmp_path, model, why):
    _finished(tmp_path / "r", {"recipe": "r", "model": model, "fingerprint": "aaaa"})
    with pytest.raises(RunDirError) as e:
        RunDir(tmp_path / "r").claim({"recipe": "r", "model": model, "fingerprint": "bbbb"}, force=False)
    msg = str(e.value)
    assert "damaged" not in msg and why in msg and "(aaaa, now bbbb" in msg and "--force all" in msg
