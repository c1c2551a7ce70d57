"""Model folders that cannot be used are one ModelError (one CLI line), and the fingerprint sees every byte."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.errors import CheckpointError, ModelError, RunDirError
from quant.models import ModelSource, resolve_model
from quant.models.builtin import builtin_path
from tests.conftest import run_cli


@pytest.fixture
def model(tmp_path, quant_cache) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(builtin_path("qwen3-moe-tiny"), dst)
    return dst


def _shard(model: Path) -> Path:
    return model / "model.safetensors"


@pytest.mark.parametrize("damage", ["truncate_end", "truncate_header", "garbage", "empty", "header_json"])
def test_damaged_safetensors(model, damage):
    p = _shard(model)
    data = p.read_bytes()
    p.write_bytes({"truncate_end": data[:-1000], "truncate_header": data[:50], "garbage": b"not safetensors at all",
                   "empty": b"", "header_json": data[:8] + b"{" * 20 + data[28:]}[damage])
    with pytest.raises(ModelError, match="is not a readable safetensors file .* truncated or damaged"):
        ModelSource(model)


@pytest.mark.parametrize("config,match", [("{", "is not valid JSON"), ("[1, 2]", "holds a JSON list, not an object"),
                                          ('"x"', "JSON str"), ('{"model_type": 3}', "model_type must be a string"),
                                          ("{}", "model_type '\\?'"),
                                          ('{"model_type": "qwen3_moe", "num_hidden_layers": "4"}', "num_hidden_layers"),
                                          (b"\xff\xfe{", "is not valid JSON")])
def test_bad_config_json(model, config, match):
    (model / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(ModelError, match=match):
        ModelSource(model)


def _split_into_two_shards(model: Path) -> dict:
    tensors = load_file(str(_shard(model)))
    keys = sorted(tensors)
    half = len(keys) // 2
    parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in parts.items():
        save_file({k: tensors[k] for k in ks}, str(model / name), metadata={"format": "pt"})
    _shard(model).unlink()
    index = {"metadata": {}, "weight_map": {k: n for n, ks in parts.items() for k in ks}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_index_naming_a_missing_shard(model):
    _split_into_two_shards(model)
    ModelSource(model)  # intact
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="lacks model-00002-of-00002.safetensors, which model.safetensors.index.json"):
        ModelSource(model)


def test_index_that_is_not_an_index(model):
    index = _split_into_two_shards(model)
    for text, match in [("nope", "is not valid JSON"), ("[]", "not an object"), ('{"weight_map": 3}', "no weight_map")]:
        (model / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ModelError, match=match):
            ModelSource(model)
    index["weight_map"]["model.layers.0.no_such.weight"] = "model-00001-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="no_such.weight is not in model-00001-of-00002.safetensors"):
        ModelSource(model)


def test_damaged_model_is_one_cli_line(model, tmp_path):
    p = _shard(model)
    p.write_bytes(p.read_bytes()[:-4096])
    proc = run_cli("plan", "recipes/mixed_int8_int4.yaml", "--model", str(model), "-o", str(tmp_path / "r"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "not a readable safetensors file" in lines[0]


def test_inspect_on_a_damaged_checkpoint(model, tmp_path):
    from quant.export.inspect import read_checkpoint_bits

    tensors = load_file(str(_shard(model)))
    tensors["model.layers.0.mlp.experts.0.up_proj.weight_packed"] = torch.zeros(32, 8, dtype=torch.int32)
    save_file(tensors, str(_shard(model)))
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": 3}}}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="malformed compressed-tensors quantization_config"):
        read_checkpoint_bits(model)
    _shard(model).write_bytes(_shard(model).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_checkpoint_bits(model)
    (model / "config.json").write_text("[")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint_bits(model)
    proc = run_cli("inspect", str(model))
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def _pad(model: Path) -> None:
    """Make the shard large enough (> 2 MiB past its header) that its middle is far from both ends: a vocabulary
    grown by rows the tokenizer never produces (a tensor the config does not describe would be refused)."""
    tensors = load_file(str(_shard(model)))
    extra = 16 << 10
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[key] = torch.cat([tensors[key], torch.ones(extra, tensors[key].shape[1], dtype=tensors[key].dtype)])
    save_file(tensors, str(_shard(model)), metadata={"format": "pt"})
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"vocab_size": cfg["vocab_size"] + extra}))


def _flip_low_mantissa_bit_mid_file(p: Path) -> None:
    """Damage one byte in the middle of the tensor data, keeping size and mtime (a finite bf16 value changes)."""
    st = p.stat()
    header = 8 + int.from_bytes(p.read_bytes()[:8], "little")
    pos = header + ((st.st_size - header) // 2) // 2 * 2  # low (mantissa) byte of a little-endian 2-byte value
    with open(p, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 1]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_fingerprint_sees_damage_in_the_middle_and_survives_a_copy(model, tmp_path):
    _pad(model)
    before = ModelSource(model).fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert ModelSource(copy).fingerprint == before  # content, not location
    _flip_low_mantissa_bit_mid_file(_shard(model))
    assert ModelSource(model).fingerprint != before


def test_profile_reruns_after_a_shard_is_damaged_in_the_middle(model, tmp_path):
    from quant.recipe import load_recipe
    from quant.run.pipeline import run
    from tests.conftest import REPO

    _pad(model)
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(model),
                         overrides=("calibration.n_samples=4", "calibration.seq_len=32"))
    assert run(recipe, tmp_path / "r", until="profile").ran == ["calibrate", "profile"]
    assert run(recipe, tmp_path / "r", until="profile").ran == []
    _flip_low_mantissa_bit_mid_file(_shard(model))
    with pytest.raises(RunDirError, match="changed since .* was made: its files no longer match the recorded fingerprint"):
        run(recipe, tmp_path / "r", until="profile")
    assert run(recipe, tmp_path / "r", until="profile", force="all").ran == ["calibrate", "profile"]


def test_nan_in_an_expert_is_an_error_naming_it(model, tmp_path):
    from quant.errors import NumericalError
    from quant.recipe import load_recipe
    from quant.run.pipeline import run
    from tests.conftest import REPO

    src = resolve_model(str(model))
    key = src.modules["layers.2.experts.5.up"].disk_prefix + ".weight"
    tensors = load_file(str(_shard(model)))
    tensors[key][3, 7] = float("nan")
    save_file(tensors, str(_shard(model)), metadata={"format": "pt"})
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(model),
                         overrides=("calibration.n_samples=4", "calibration.seq_len=32"))
    with pytest.raises(NumericalError, match="layers.2.experts.5.up: 1 source weight\\(s\\) are NaN or infinite"):
        run(recipe, tmp_path / "r", until="quantize")


def test_nan_in_a_kept_tensor_is_refused_at_export(model, tmp_path):
    from quant.errors import NumericalError
    from quant.recipe import load_recipe
    from quant.run.pipeline import run
    from tests.conftest import REPO

    tensors = load_file(str(_shard(model)))
    tensors["model.layers.3.post_attention_layernorm.weight"][0] = float("inf")
    save_file(tensors, str(_shard(model)), metadata={"format": "pt"})
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(model),
                         overrides=("calibration.n_samples=4", "calibration.seq_len=32",
                                    "quantize.algorithm=rtn", "profile.layer_sensitivity=null"))  # GPTQ's
    # Hessians and the layer-damage pass (its own NumericalError) would meet the infinity first
    with pytest.raises(NumericalError, match="model.layers.3.post_attention_layernorm.weight holds NaN or infinite"):
        run(recipe, tmp_path / "r", until="export")
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["export"]["status"] == "failed"
    assert torch.isinf(tensors["model.layers.3.post_attention_layernorm.weight"]).any()


FP8_PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}  # no weight_block_size


@pytest.mark.parametrize("qcfg, words", [(FP8_PER_TENSOR, ["'fp8'", "block scales"]),
                                         ({"quant_method": "gptq", "bits": 4}, ["'gptq'"])])
def test_an_already_quantized_model_is_refused_at_once(model, tmp_path, qcfg, words):
    """A quantized release quant cannot read as weights (FP8 without block scales, a GPTQ model) is refused when it
    is opened, by the run and by `quant estimate`, with what to use instead; the CLI prints one line. (FP8 with
    block scales is read dequantized: tests/models/test_fp8.py.)"""
    from quant.models.headers import load_headers

    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"quantization_config": qcfg}))
    for open_model in (resolve_model, load_headers):
        with pytest.raises(ModelError, match="already quantized") as err:
            open_model(str(model))
        assert all(w in str(err.value) for w in words) and "unquantized weights" in str(err.value)
    proc = run_cli("plan", "recipes/mixed_int8_int4.yaml", "--model", str(model), "-o", str(tmp_path / "r"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "already quantized" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "r" / "calibration.safetensors").exists()


def test_a_quantized_hub_model_is_refused_before_its_weights_are_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "gptq"}}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **kw: str(config))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: pytest.fail("weights downloaded"))
    with pytest.raises(ModelError, match="model someone/DeepSeek-V3-GPTQ is already quantized"):
        resolve_model("someone/DeepSeek-V3-GPTQ")


def _with_layer_past_the_config(tmp_path, declared: int | None) -> Path:
    """builtin:deepseek-v3-tiny with a copy of its last decoder layer stored as layer n (= num_hidden_layers) plus
    DeepSeek's MTP extras (enorm, hnorm, eh_proj, shared_head.norm), as DeepSeek-V3/R1 store their layer 61;
    ``declared``: config.json's num_nextn_predict_layers (None: absent)."""
    dst = tmp_path / "dsv3-mtp"
    shutil.copytree(builtin_path("deepseek-v3-tiny"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors = load_file(_shard(dst))
    D = tensors["model.embed_tokens.weight"].shape[1]
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone() for k, v in tensors.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    extra |= {f"model.layers.{n}.{k}.weight": torch.ones(D, dtype=torch.bfloat16)
              for k in ("enorm", "hnorm", "shared_head.norm")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(D, 2 * D, dtype=torch.bfloat16)
    save_file(tensors | extra, _shard(dst), metadata={"format": "pt"})
    cfg.pop("num_nextn_predict_layers", None)  # transformers' DeepseekV3Config writes 1 by default
    (dst / "config.json").write_text(json.dumps(cfg | ({} if declared is None else {"num_nextn_predict_layers": declared})))
    return dst


def test_a_declared_multi_token_prediction_layer_is_left_out(tmp_path, quant_cache, caplog):
    """DeepSeek-V3/R1 store a multi-token-prediction layer as model.layers.61 beside 61 decoder layers: the source
    (and `quant estimate`'s header view) leave it out, as transformers does; before, its experts entered the plan and
    the run stopped at the plan stage with an internal error (ValueError: 4 is not in list)."""
    import logging

    from quant.models.headers import load_headers

    path = _with_layer_past_the_config(tmp_path, declared=1)
    with caplog.at_level(logging.INFO, logger="quant.models.source"):
        src = resolve_model(str(path))
    n = src.n_layers
    assert src.left_out and all(k.startswith(f"model.layers.{n}.") for k in src.left_out)
    assert not any(k.startswith(f"model.layers.{n}.") for k in [*src.weight_map, *src.shapes(), *src.dtypes()])
    assert max(m.layer for m in src.modules.values() if m.layer is not None) == n - 1
    assert f"multi-token-prediction layer(s) {n}" in caplog.text
    headers = load_headers(str(path))
    assert sorted(headers.left_out) == sorted(src.left_out) and set(headers.weight_map) == set(src.weight_map)


@pytest.mark.parametrize("declared", [None, 0])
def test_a_layer_the_config_does_not_declare_is_one_clear_error(tmp_path, quant_cache, declared):
    from quant.models.headers import load_headers

    path = _with_layer_past_the_config(tmp_path, declared)
    for open_model in (resolve_model, load_headers):
        with pytest.raises(ModelError, match="the weights hold decoder layer 4 .* num_hidden_layers 4.*re-download"):
            open_model(str(path))
    proc = run_cli("plan", "recipes/mixed_int8_int4.yaml", "--model", str(path), "-o", str(tmp_path / "r"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "decoder layer 4" in lines[0], proc.stderr[-2000:]


def test_a_model_with_a_prediction_layer_runs_end_to_end_without_it(tmp_path, quant_cache):
    """The whole run on such a folder: the checkpoint holds no tensor of the left-out layer, transformers loads it,
    and the model card says what is not included."""
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    path = _with_layer_past_the_config(tmp_path, declared=1)
    recipe = load_recipe(Path("recipes/mixed_int8_int4.yaml"), model=str(path), overrides=(
        "calibration.n_samples=4", "calibration.seq_len=32", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=32", "profile.layer_sensitivity=null", "quantize.algorithm=rtn", "eval.tasks=[]",
        "plan.granularity=per_layer", "plan.protect.attention=8"))
    ckpt = run(recipe, tmp_path / "run").run_dir / "checkpoint"
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith(f"model.layers.{n}.") for k in keys)
    assert any(k.startswith(f"model.layers.{n - 1}.") for k in keys)
    assert f"multi-token-prediction layer(s) {n}" in (ckpt / "README.md").read_text()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)


def _index_pointing_at(model: Path, shard: str) -> None:
    """The split model's second shard named as ``shard`` in its index (the file moved there first)."""
    index = _split_into_two_shards(model)
    index["weight_map"] = {k: (shard if f.startswith("model-00002") else f) for k, f in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["absolute", "parent", "nested parent"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(model, tmp_path, where):
    """Before: the shard was read, quantized and shipped in the checkpoint."""
    from quant.models.headers import load_headers

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    names = {"absolute": str(outside / "x.safetensors"), "parent": "../elsewhere/x.safetensors",
             "nested parent": "sub/../../elsewhere/x.safetensors"}
    _index_pointing_at(model, names[where])
    (model / "sub").mkdir()
    (model / "model-00002-of-00002.safetensors").rename(outside / "x.safetensors")
    for open_model in (ModelSource, resolve_model, load_headers):
        with pytest.raises(ModelError, match="which is not a file inside .*no absolute paths, no '..'"):
            open_model(str(model) if open_model is not ModelSource else model)
    proc = run_cli("plan", "recipes/mixed_int8_int4.yaml", "--model", str(model), "-o", str(tmp_path / "r"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "not a file inside" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "r" / "calibration.safetensors").exists()


def test_a_shard_symlinked_out_of_the_folder_is_refused(model, tmp_path):
    from quant.models.headers import load_headers

    _split_into_two_shards(model)
    shard = model / "model-00002-of-00002.safetensors"
    shard.rename(tmp_path / "x.safetensors")
    shard.symlink_to(tmp_path / "x.safetensors")
    for open_model in (resolve_model, load_headers):
        with pytest.raises(ModelError, match="names 'model-00002-of-00002.safetensors', which is not a file inside"):
            open_model(str(model))
    single = tmp_path / "single"
    shutil.copytree(builtin_path("qwen3-moe-tiny"), single)
    (single / "model.safetensors").rename(tmp_path / "y.safetensors")
    (single / "model.safetensors").symlink_to(tmp_path / "y.safetensors")
    for open_model in (resolve_model, load_headers):
        with pytest.raises(ModelError, match="names 'model.safetensors', which is not a file inside"):
            open_model(str(single))


def test_symlinks_inside_the_folder_and_a_symlinked_folder_are_fine(model, tmp_path):
    _split_into_two_shards(model)
    (model / "shards").mkdir()
    (model / "model-00002-of-00002.safetensors").rename(model / "shards" / "two.safetensors")
    (model / "model-00002-of-00002.safetensors").symlink_to(model / "shards" / "two.safetensors")
    link = tmp_path / "link"
    link.symlink_to(model)
    assert resolve_model(str(link)).shapes() == resolve_model(str(model)).shapes()
