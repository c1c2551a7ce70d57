"""The console: plain progress lines with elapsed time and ETA off a TTY, a live display on one, third-party
chatter kept out unless -v; and the real CLI in a batch-job setting (stderr is not a TTY)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

from quant.console import QUIET_ENV, Clock, LiveHandler, PlainFormatter
from quant.progress import step
from tests.conftest import REPO, run_cli

HEADLINE = str(REPO / "recipes" / "mixed_int8_int4.yaml")
FAST = ("--set", "calibration.n_samples=4", "--set", "calibration.seq_len=32", "--set", "eval.perplexity.n_samples=2",
        "--set", "eval.perplexity.seq_len=32")


def _record(msg: str, extra: dict | None = None) -> logging.LogRecord:
    record = logging.LogRecord("quant.quantize.driver", logging.INFO, __file__, 1, msg, (), None)
    for key, value in (extra or {}).items():
        setattr(record, key, value)
    return record


def test_plain_lines_carry_position_elapsed_and_eta():
    now = [100.0]
    fmt = PlainFormatter(Clock(lambda: now[0]))
    assert fmt.format(_record("quantize: 4 layers", step("quantize", 0, 4))).endswith(
        "[quantize 0/4 layers, elapsed 0:00:00]")
    now[0] = 130.0
    assert fmt.format(_record("layer 0: ...", step("quantize", 1, 4))).endswith(
        "layer 0: ... [quantize 1/4 layers, elapsed 0:00:30, ETA 0:01:30]")
    now[0] = 3700.0
    assert fmt.format(_record("layer 3: ...", step("quantize", 4, 4))).endswith(
        "[quantize 4/4 layers, elapsed 1:00:00, ETA 0:00:00]")
    assert fmt.format(_record("stage eval: running", step("run", 5, 7, "stages", eta=False))).endswith(
        "[run 5/7 stages, elapsed 0:00:00]")
    assert fmt.format(_record("no progress")).endswith(": no progress")


def test_live_display_on_a_tty():
    from rich.console import Console

    out = io.StringIO()
    handler = LiveHandler(Console(file=out, force_terminal=True, width=160))
    handler.emit(_record("quantize: 4 layers", step("quantize", 0, 4)))
    for i in range(4):
        handler.emit(_record(f"layer {i}: 52 modules", step("quantize", i + 1, 4)))
    assert not handler.tasks  # every bar complete: the display closed itself (later stdout lands below it)
    handler.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "layer 3: 52 modules" in text
    final = [ln for ln in text.splitlines() if "quantize" in ln and "4/4" in ln]
    assert final and "layers" in final[-1] and "elapsed" in final[-1] and "ETA" in final[-1], text[-800:]
    assert re.search(r"\d:\d\d:\d\d", final[-1])


QUIET_SCRIPT = r"""
import logging, sys, warnings
import tqdm  # imported before the CLI's setup, as something does on the GPU image: its env was read already
from quant.console import configure
configure(sys.argv[1] == "verbose")
logging.getLogger("transformers.modeling_utils").warning("3P-LOGGING")
warnings.warn("past_key_values 3P-FUTURE", FutureWarning)
import compressed_tensors  # its loguru logger, called from a compressed_tensors module as the library does
exec("logger.info('3P-LOGURU')", {"__name__": "compressed_tensors.entrypoints.x", "logger": compressed_tensors.logger})
for _ in tqdm.tqdm(range(3), desc="3P-TQDM"):
    pass
for _ in tqdm.tqdm(range(3), desc="3P-EXPLICIT", disable=False):  # as compressed-tensors' "Dispatching model"
    pass
from tqdm.auto import tqdm as auto_tqdm  # as lm-eval's "Running loglikelihood requests"
bar = auto_tqdm(total=2, desc="3P-AUTO", disable=False)
bar.update(2)
bar.close()
positional = tqdm.tqdm(range(2), "3P-POSITIONAL", 2, True, None, None, 0.1, 10.0, None, None, False)
list(positional)
logging.getLogger("quant.x").info("OUR-LINE")
"""


def test_third_party_chatter_is_kept_out_unless_verbose():
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}  # in-process CLI tests set them here

    def stderr(mode: str) -> str:
        p = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                           cwd=REPO, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stderr + p.stdout

    quiet, loud = stderr("quiet"), stderr("verbose")
    assert "OUR-LINE" in quiet and "OUR-LINE" in loud
    for needle in ("3P-LOGGING", "3P-FUTURE", "3P-LOGURU", "3P-TQDM", "3P-EXPLICIT", "3P-AUTO", "3P-POSITIONAL"):
        assert needle not in quiet, quiet
        assert needle in loud, (needle, loud)


def test_batch_job_log_has_per_layer_progress_and_no_chatter(tmp_path):
    """`quant run` with stderr redirected (a Slurm log): one plain line per layer with elapsed time and ETA, and no
    loguru / tqdm / torch / FutureWarning lines (the eval stage dequantizes through compressed-tensors)."""
    p = run_cli("run", HEADLINE, "-o", str(tmp_path / "r"), *FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    for stage in ("profile", "quantize"):
        lines = [ln for ln in err.splitlines() if re.search(rf"\[{stage} \d/4 layers, elapsed \d+:\d\d:\d\d, ETA ", ln)]
        assert len(lines) == 4, (stage, err[-3000:])
    assert re.search(r"stage eval: running \[run 5/8 stages", err)
    for chatter in ("| INFO ", "| WARNING ", "Validating", "Converting", "torchao", "_pytree", "FutureWarning",
                    "it/s]"):
        assert chatter not in err, (chatter, err[-3000:])
