"""A model folder is checked against its config.json from headers before any stage: every tensor the architecture
implies is present with its shape and a floating dtype, nothing else is there, and the config's sizes agree with the
tensors. Each mismatch is one ModelError from both ``resolve_model`` (``quant run``) and ``load_headers`` (``quant
estimate``), in bounded time and memory."""

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.errors import ModelError
from quant.models import BUILTINS, resolve_model
from quant.models.builtin import builtin_path
from quant.models.headers import load_headers
from tests.conftest import REPO, make_per_expert_model, run_cli


def variant(tmp_path: Path, base: str = "qwen3-moe-tiny", tensors=None, config=None) -> Path:
    """A copy of a builtin whose tensors (``tensors(dict) -> None``, edited in place) or config.json (``config``:
    keys to set, None values removed) are changed."""
    dst = tmp_path / "m"
    shutil.copytree(builtin_path(base), dst)
    if tensors is not None:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def drop(*keys):
    def edit(t):
        for k in keys:
            del t[k]
    return edit


def put(key, value):
    return lambda t: t.__setitem__(key, value)


Q = "model.layers.0.self_attn.q_proj.weight"
EXPERT5 = [f"model.layers.2.mlp.experts.5.{p}_proj.weight" for p in ("gate", "up", "down")]
CASES = {  # id -> (base, tensor edit, config edit, message)
    "lm_head missing": ("qwen3-moe-tiny", drop("lm_head.weight"), None,
                        r"lm_head.weight is missing \(config.json: tie_word_embeddings false\)"),
    "final norm missing": ("qwen3-moe-tiny", drop("model.norm.weight"), None, "model.norm.weight is missing"),
    "a layer norm missing": ("mixtral-tiny", drop("model.layers.1.input_layernorm.weight"), None,
                             "model.layers.1.input_layernorm.weight is missing"),
    "an expert missing": ("qwen3-moe-tiny", drop(*EXPERT5), None, r"layer 2 holds no weight of expert 5, but one of expert 15 \(15 experts in all\)"),
    "one projection missing": ("olmoe-tiny", drop(EXPERT5[1]), None, "layer 2's expert 5 lacks its up"),
    "the last expert missing": ("qwen3-moe-tiny", drop(*(k.replace(".5.", ".15.") for k in EXPERT5)), None,
                                "experts 16 but layer 2 holds 15 experts"),
    "a shared expert missing": ("deepseek-v3-tiny", drop("model.layers.2.mlp.shared_experts.down_proj.weight"), None,
                                "model.layers.2.mlp.shared_experts.down_proj.weight is missing"),
    "an extra tensor": ("qwen3-moe-tiny", put("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)), None,
                        "holds tensors its config.json does not describe: model.layers.0.self_attn.q_proj.bias"),
    "an extra layer-less tensor": ("qwen3-moe-tiny", put("junk", torch.zeros(3)), None, "does not describe: junk"),
    "a wrong shape": ("qwen3-moe-tiny", put(Q, torch.zeros(64, 63, dtype=torch.bfloat16)), None,
                      rf"{Q} is \[64, 63\] where config.json implies \[64, 64\]"),
    "an int32 weight": ("qwen3-moe-tiny", put(Q, torch.zeros(64, 64, dtype=torch.int32)), None,
                        f"{Q} is I32, not a floating-point weight"),
    "FP8 without scales": ("qwen3-moe-tiny", put(Q, torch.zeros(64, 64, dtype=torch.float8_e4m3fn)), None,
                           f"{Q} is stored in F8_E4M3 without a block scale"),
    "hidden_size": ("qwen3-moe-tiny", None, {"hidden_size": 128},
                    r"model.embed_tokens.weight is \[1024, 64\] where config.json implies \[1024, 128\]"),
    "vocab_size": ("mixtral-tiny", None, {"vocab_size": 2048}, r"implies \[2048, 64\]"),
    "expert count": ("qwen3-moe-tiny", None, {"num_experts": 32}, "num_experts 32 but layer 0 holds 16 experts"),
    "expert count, DeepSeek": ("deepseek-v3-tiny", None, {"n_routed_experts": 8}, "n_routed_experts 8 but layer 1"),
    "moe_intermediate_size": ("qwen3-moe-tiny", None, {"moe_intermediate_size": 48}, r"where config.json implies \[48"),
    "num_experts_per_tok 0": ("qwen3-moe-tiny", None, {"num_experts_per_tok": 0},
                              "num_experts_per_tok must be a positive integer, got 0"),
    "num_experts_per_tok above the experts": ("mixtral-tiny", None, {"num_experts_per_tok": 9},
                                              "num_experts_per_tok 9 exceeds the 8 experts"),
    "vocab_size 0": ("qwen3-moe-tiny", None, {"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    "hidden_size a string": ("olmoe-tiny", None, {"hidden_size": "64"}, "hidden_size must be a positive integer"),
    "hidden_size true": ("olmoe-tiny", None, {"hidden_size": True}, "hidden_size must be a positive integer"),
    "unknown rope_type": ("qwen3-moe-tiny", None, {"rope_scaling": {"rope_type": "bogus", "factor": 2.0},
                                                   "rope_parameters": {"rope_type": "bogus", "factor": 2.0}},
                          "transformers cannot"),
    "quantization_config a list": ("qwen3-moe-tiny", None, {"quantization_config": [1, 2]},
                                   "quantization_config is a JSON list, not an object"),
    "layers 10^9": ("qwen3-moe-tiny", None, {"num_hidden_layers": 10**9},
                    r"num_hidden_layers 1000000000 but the weights hold 4 decoder layer\(s\) \(0-3"),
    "layers 3 of 4": ("olmoe-tiny", None, {"num_hidden_layers": 3}, "the weights hold decoder layer 3"),
    "a layer missing": ("qwen3-moe-tiny",
                        lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")], None,
                        r"hold 3 decoder layer\(s\) \(0, 2, 3; layer 1 is missing\)"),
    "experts in two dtypes": ("mixtral-tiny", lambda t: t.__setitem__(
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        t["model.layers.0.block_sparse_moe.experts.3.w1.weight"].half()), None,
        r"layer 0's expert weights are stored in different dtypes \(BF16, F16\)"),
    "an expert index of 10^9": ("olmoe-tiny", put("model.layers.1.mlp.experts.1000000000.up_proj.weight",
                                                  torch.zeros(32, 64, dtype=torch.bfloat16)), None,
                                "layer 1 holds no weight of expert 16, but one of expert 1000000000"),
    "a layer index of 10^9": ("qwen3-moe-tiny", put("model.layers.1000000000.input_layernorm.weight",
                                                    torch.zeros(64, dtype=torch.bfloat16)),
                              {"num_hidden_layers": 10**9 + 1}, r"hold 5 decoder layer\(s\) \(0, 1, 2, \.\.\.; layer 4"),
    "routing groups": ("deepseek-v3-tiny", None, {"n_group": 3}, "routing does not fit 16 experts"),
    "topk_group above n_group": ("deepseek-v3-tiny", None, {"topk_group": 4}, "topk_group 4 be at most n_group"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_that_disagrees_with_its_config_is_one_model_error(case, tmp_path, quant_cache):
    base, tensors, config, message = CASES[case]
    path = variant(tmp_path, base, tensors, config)
    for open_model in (resolve_model, load_headers):
        with pytest.raises(ModelError, match=message):
            open_model(str(path))


@pytest.mark.parametrize("name", [*BUILTINS, "reference-moe"])
def test_every_builtin_matches_its_config(name, quant_cache):
    resolve_model(f"builtin:{name}")
    load_headers(f"builtin:{name}")


def test_a_tied_lm_head_may_be_absent(tmp_path, quant_cache):
    path = variant(tmp_path, tensors=drop("lm_head.weight"), config={"tie_word_embeddings": True})
    assert "lm_head.weight" not in resolve_model(str(path)).weight_map
    load_headers(str(path))


def test_float32_and_float16_weights_and_old_rotary_buffers_are_accepted(tmp_path, quant_cache):
    """A rotary buffer old transformers versions saved is left out when the folder is opened, as transformers leaves
    it out (before: the layer's load refused it as unexpected, in the profile stage)."""
    from quant.models.layers import build_skeleton, load_layer

    def edit(t):
        t[Q] = t[Q].float()
        t["model.norm.weight"] = t["model.norm.weight"].half()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # saved by transformers < 4.35

    path = variant(tmp_path, tensors=edit)
    source = resolve_model(str(path))
    assert not any("inv_freq" in k for k in [*source.weight_map, *source.shapes(), *load_headers(str(path)).shapes()])
    load_layer(source, build_skeleton(source, torch.bfloat16), 0, "cpu", torch.bfloat16)


def test_a_remote_code_per_expert_model_is_checked_through_its_own_modules(tmp_path, quant_cache):
    path = make_per_expert_model(tmp_path / "remote")
    resolve_model(str(path), trust_remote_code=True, family="qwen3_moe")
    t = load_file(path / "model.safetensors")
    del t["model.norm.weight"]
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="model.norm.weight is missing"):
        resolve_model(str(path), trust_remote_code=True, family="qwen3_moe")


def test_a_missing_lm_head_is_refused_before_any_stage(tmp_path, quant_cache):
    """Before: exit 0, gates passed, top-1 agreement 0.0 (transformers initialised the missing lm_head) and the
    checkpoint shipped without it."""
    path = variant(tmp_path, tensors=drop("lm_head.weight"))
    proc = run_cli("run", "recipes/mixed_int8_int4.yaml", "--model", str(path), "-o", str(tmp_path / "r"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "lm_head.weight is missing" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "calibration.safetensors").exists()


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_a_billion_layers_is_refused_at_once_in_bounded_memory(command, tmp_path, quant_cache):
    """Before: `run` built a 10^9-layer skeleton (20.9 GB before it was stopped) and `estimate` hung the same way."""
    path = variant(tmp_path, config={"num_hidden_layers": 10**9})
    where = ["-o", str(tmp_path / "r")] if command == "plan" else []
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quant.cli", command, "recipes/mixed_int8_int4.yaml", "--model",
                           str(path), *where], cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_memory)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "num_hidden_layers 1000000000" in lines[0], proc.stderr[-2000:]
    assert time.perf_counter() - t0 < 120
