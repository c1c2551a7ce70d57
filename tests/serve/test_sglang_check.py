"""``quant.serve.sglang_check`` on CPU against a stand-in ``sglang`` package shaped as SGLang 0.5.17's offline engine
(``Engine(**server_args)``, ``generate`` returning ``meta_info.input_top_logprobs`` as ``(logprob, id, None)``
lists with None at position 0, and ``output_ids``): the spec goes in, each model in a process of its own, and the
results come out as the serving tests read them; an engine that fails leaves its error and its log lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

FAKE = '''
__version__ = "0.5.17"
import sys
from types import SimpleNamespace


class Engine:
    def __init__(self, **kw):
        print("engine starting", sorted(kw), file=sys.stderr)
        if kw["model_path"].endswith("broken"):
            raise RuntimeError("Scheduler died during initialization")
        assert kw["skip_tokenizer_init"] and kw["disable_cuda_graph"], kw
        self.shift = 1 if kw["model_path"].endswith("ckpt") else 0
        self.tokenizer_manager = SimpleNamespace(model_config=SimpleNamespace(
            quantization="compressed-tensors" if self.shift else None))

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None,
                 top_logprobs_num=None):
        out = []
        for ids in input_ids:
            if return_logprob:
                assert logprob_start_len == 0 and top_logprobs_num == 1
                top = [None] + [[(-0.5, (t + self.shift) % 7, None)] for t in ids[1:]]
                out.append({"meta_info": {"input_top_logprobs": top}})
            else:
                out.append({"output_ids": [ids[-1]] * sampling_params["max_new_tokens"]})
        return out

    def shutdown(self):
        pass
'''


def test_sglang_check_serves_each_model_apart_and_keeps_a_failures_log(tmp_path):
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text(textwrap.dedent(FAKE))
    spec = {"prompts": [[1, 2, 3, 4], [5, 6, 7, 8]], "greedy_tokens": 3,
            "models": [{"name": m, "path": str(tmp_path / m)} for m in ("ref", "ckpt", "broken")]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, "-m", "quant.serve.sglang_check", str(tmp_path / "spec.json"),
                        str(tmp_path / "out.json"), "--jobs", "2"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])},
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["ref"]["top1"] == [[2, 3, 4], [6, 0, 1]] and out["ref"]["greedy"] == [[4, 4, 4], [8, 8, 8]]
    assert out["ckpt"]["top1"] == [[3, 4, 5], [0, 1, 2]] and out["ckpt"]["quantization"] == "compressed-tensors"
    assert "Scheduler died" in out["broken"]["error"]
    assert any("engine starting" in line for line in out["broken"]["log"])
    assert "log" not in out["ref"]


def test_the_engine_arguments_are_sglang_server_args():
    """Every keyword ``serve_one`` passes ``sglang.Engine`` is a field of SGLang 0.5.17's ``ServerArgs``
    (``sglang/srt/server_args.py``, read from the wheel)."""
    import ast

    tree = ast.parse((REPO / "quant" / "serve" / "sglang_check.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "Engine"]
    used = {k.arg for k in call.keywords if k.arg}
    server_args = {"model_path", "skip_tokenizer_init", "dtype", "random_seed", "context_length",
                   "mem_fraction_static", "tp_size", "disable_cuda_graph", "disable_radix_cache",
                   "attention_backend", "sampling_backend", "log_level"}
    assert used <= server_args, used - server_args
    assert Path(REPO / "benchmarks" / "sglang-pins-0.5.17.txt").read_text().count("sglang==0.5.17") == 1
