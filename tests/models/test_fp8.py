"""FP8 releases with block scales (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8) read as their dense weights: block arithmetic
against a slow reference and transformers' own dequantization, the dense view of the folder, chunked reads into a
staging buffer, malformed releases, and whole runs equal to runs on the dequantized copy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.errors import ModelError, RecipeError
from quant.models import ModelSource, dequant, resolve_model
from quant.models.fp8 import Fp8BlockSource, dequantize_blocks, quantize_blocks, write_fp8_release
from tests.conftest import REPO, run_cli

BLOCK = (16, 16)  # the tiny widths (64, 32, 24): several blocks a weight, ragged ones where a width is 24


def _reference(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's weight_dequant, one block at a time: block (i, j) covers rows i*bo.., cols j*bi.. (cut at the
    edges) and is multiplied by scale[i, j] in float32."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    bo, bi = block
    for i in range(math.ceil(codes.shape[0] / bo)):
        for j in range(math.ceil(codes.shape[1] / bi)):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            out[rows, cols] = codes[rows, cols].float() * scale[i, j]
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(64, 64), (24, 64), (64, 40), (7, 5), (576, 300)])
def test_block_dequantization_matches_the_reference_also_on_ragged_edges(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05
    codes, scale = quantize_blocks(w, BLOCK)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == tuple(math.ceil(n / 16) for n in shape)
    got = dequantize_blocks(codes, scale, BLOCK, torch.bfloat16)
    assert torch.equal(got, _reference(codes, scale, BLOCK))
    assert (got.float() - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    src = resolve_model("builtin:deepseek-v3-tiny")
    return write_fp8_release(src, tmp_path_factory.mktemp("fp8") / "dsv3-fp8", BLOCK)


@pytest.fixture(scope="module")
def dequantized(release, tmp_path_factory) -> Path:
    """The release as DeepSeek's fp8_cast_bf16.py leaves it: bf16 weights, no scales (config without
    quantization_config)."""
    out = tmp_path_factory.mktemp("bf16") / "dsv3-bf16"
    shutil.copytree(release, out)
    stored = load_file(out / "model.safetensors")
    dense = {k: _reference(t, stored[k + "_scale_inv"], BLOCK) if k + "_scale_inv" in stored else t
             for k, t in stored.items() if not k.endswith("_scale_inv")}
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_an_fp8_release_opens_as_its_dense_model(release, dequantized):
    fp8, bf16 = resolve_model(str(release)), resolve_model(str(dequantized))
    assert isinstance(fp8, Fp8BlockSource) and type(bf16) is ModelSource
    assert set(fp8.weight_map) == set(bf16.weight_map) and not any(k.endswith("_scale_inv") for k in fp8.weight_map)
    assert fp8.shapes() == bf16.shapes() and fp8.dtypes() == bf16.dtypes()
    assert list(fp8.modules) == list(bf16.modules)
    assert len(fp8.parts) == sum(1 for k in load_file(release / "model.safetensors") if k.endswith("_scale_inv"))
    got = fp8.read_tensors(list(fp8.weight_map))
    want = load_file(dequantized / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_reads_equal_transformers_own_fp8_dequantization_where_blocks_divide(release):
    """transformers (FineGrainedFP8Config(dequantize=True)) as the reference loader: every weight whose block
    grid divides it is bit-equal (the routed experts compared in its fused layout). Where a block does not divide
    (the tiny kv_a_proj_with_mqa, 24 rows in 16-row blocks; DeepSeek-V3's is 576 rows in 128-row blocks) transformers
    derives the block from the scale grid (24 / 2 = 12 rows) and differs from DeepSeek's own weight_dequant
    (the test above), which quant follows."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(release, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(
        dequantize=True, weight_block_size=BLOCK))
    ref = model.state_dict()
    src = resolve_model(str(release))
    ours = src.read_tensors(list(src.weight_map))
    compared = 0
    for k, t in ours.items():
        if ".experts." in k or (k in src.parts and any(n % b for n, b in zip(t.shape, BLOCK, strict=True))):
            continue
        assert torch.equal(t, ref[k]), k
        compared += k in src.parts
    layer = max(src.moe_layers())
    fused = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    e_key = lambda e, p: f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"  # noqa: E731
    for e in range(fused.shape[0]):
        assert torch.equal(fused[e], torch.cat([ours[e_key(e, "gate")], ours[e_key(e, "up")]])), e
    assert compared >= 10


def test_reads_into_a_staging_buffer_in_chunks(release, monkeypatch):
    """As the read-ahead reads a layer: into one buffer, a few kB of stored bytes dequantized at a time."""
    monkeypatch.setattr(dequant, "DEQUANT_CHUNK_BYTES", 2048)
    src = resolve_model(str(release))
    calls = []
    real = src.dequantize
    src.dequantize = lambda raw, keys: calls.append(len(keys)) or real(raw, keys)
    keys = [k for k in src.weight_map if k.startswith("model.layers.1.")]
    bufs: list[torch.Tensor] = []
    got = src.read_tensors(keys, "cpu", into=lambda n: bufs.append(torch.empty(n, dtype=torch.uint8)) or bufs[-1])
    direct = src.read_tensors(keys)
    lo = bufs[0].data_ptr()
    assert len(bufs) == 1 and len(calls) > 4
    for k in keys:
        assert torch.equal(got[k], direct[k]) and lo <= got[k].data_ptr() < lo + bufs[0].numel(), k


def test_estimate_sizes_an_fp8_release_as_its_dense_model(release, dequantized):
    """`quant estimate` on the release: the dense model's shapes, dtypes, GPU memory and checkpoint; the host holds
    half a layer more per rank (the stored bytes' buffer); the eval streams."""
    from quant.forecast.estimate import forecast
    from quant.models.headers import load_headers

    fp8, bf16 = load_headers(str(release)), load_headers(str(dequantized))
    assert fp8.stored_quantized and not bf16.stored_quantized
    assert fp8.shapes() == bf16.shapes() and list(fp8.modules) == list(bf16.modules)
    assert {d for d, _ in fp8.tensors.values()} == {d for d, _ in bf16.tensors.values()}
    got = {name: forecast(_recipe(src), src, gpus=2) for name, src in (("fp8", fp8), ("bf16", bf16))}
    stages = {n: {s.stage: s for s in f.stages} for n, f in got.items()}
    assert got["fp8"].checkpoint_bytes == got["bf16"].checkpoint_bytes
    layer = max(sum(math.prod(s) for k, s in bf16.shapes().items() if k.startswith(f"model.layers.{i}."))
                for i in range(bf16.n_layers)) * 2
    for stage in ("profile", "quantize"):
        assert stages["fp8"][stage].gpu_bytes == stages["bf16"][stage].gpu_bytes
        assert stages["fp8"][stage].host_bytes - stages["bf16"][stage].host_bytes == pytest.approx(layer / 2 / 2)
    assert stages["fp8"]["eval"].note.startswith("proxies streamed") and stages["bf16"]["eval"].note.startswith(
        "proxies whole")


def _rewrite(release: Path, out: Path, edit) -> Path:
    shutil.copytree(release, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _drop_scale(t):
    del t[next(k for k in sorted(t) if k.endswith("q_a_proj.weight_scale_inv"))]


def _bad_scale(t):
    k = next(k for k in sorted(t) if k.endswith("q_a_proj.weight_scale_inv"))
    t[k] = t[k][:1]


@pytest.mark.parametrize("edit, words", [(_drop_scale, "in FP8 without a"), (_bad_scale, "needs F8_E4M3 codes and a")])
def test_a_malformed_release_is_one_clear_error(release, tmp_path, edit, words):
    bad = _rewrite(release, tmp_path / "bad", edit)
    with pytest.raises(ModelError, match=words):
        resolve_model(str(bad))
    proc = run_cli("plan", "recipes/mixed_int8_int4.yaml", "--model", str(bad), "-o", str(tmp_path / "r"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and words in lines[0], proc.stderr[-2000:]


def test_a_dequantized_copy_that_kept_the_release_config_reads_as_stored(release, dequantized, tmp_path):
    """fp8_cast_bf16.py converts the weights only: the copied config.json still declares FP8."""
    out = tmp_path / "kept-config"
    shutil.copytree(dequantized, out)
    shutil.copy2(release / "config.json", out / "config.json")
    src = resolve_model(str(out))
    assert isinstance(src, Fp8BlockSource) and not src.parts
    want = load_file(dequantized / "model.safetensors")
    got = src.read_tensors(list(want))
    assert all(torch.equal(got[k], want[k]) for k in want)


def _recipe(path: Path, *extra: str):
    from quant.recipe import load_recipe

    return load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", model=str(path), overrides=(
        "calibration.n_samples=8", "calibration.seq_len=32", "eval.perplexity.n_samples=4",
        "eval.perplexity.seq_len=32", "profile.layer_sensitivity=null", "quantize.algorithm=gptq", "eval.tasks=[]",
        *extra))


def test_a_run_on_the_release_equals_a_run_on_its_dequantized_copy(release, dequantized, tmp_path):
    """The whole pipeline on the FP8 release: the same profile, plan, codes and proxies as on the bf16 copy that
    fp8_cast_bf16.py would write; the eval streams (transformers cannot load the release as those weights), and
    kept tensors ship in bf16."""
    from safetensors import safe_open

    from quant.quantize.qstore import layer_file
    from quant.run.pipeline import run

    runs = {name: run(_recipe(path), tmp_path / name).run_dir for name, path in
            (("fp8", release), ("bf16", dequantized))}
    same = lambda d: {k: v for k, v in d.items() if k not in ("model", "model_fingerprint")}  # noqa: E731
    for art in ("profile.json", "plan.json"):
        a, b = (json.loads((runs[n] / art).read_text()) for n in ("fp8", "bf16"))
        assert same(a) == same(b), art
    src = resolve_model(str(dequantized))
    for layer in range(src.n_layers):
        a, b = (load_file(layer_file(runs[n] / "quantized", layer)) for n in ("fp8", "bf16"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), layer
    ev = {n: json.loads((runs[n] / "eval.json").read_text()) for n in runs}
    assert ev["fp8"]["proxy_mode"] == "streamed" and "FP8 blocks" in ev["fp8"]["proxy_mode_reason"]
    flat = lambda p: {f"{k}.{j}": v for k, d in p.items() if isinstance(d, dict) for j, v in d.items()}  # noqa: E731
    assert flat(ev["fp8"]["proxies"]) == pytest.approx(flat(ev["bf16"]["proxies"]), rel=1e-6)
    assert ev["fp8"]["proxies"]["n_tokens"] == ev["bf16"]["proxies"]["n_tokens"]
    with safe_open(runs["fp8"] / "checkpoint" / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert not any(k.endswith("_scale_inv") for k in f.keys())
    assert not dtypes & {"F8_E4M3", "F8_E5M2"}
    with pytest.raises(RecipeError, match="eval.mode: whole cannot load"):
        run(_recipe(release, "eval.mode=whole"), tmp_path / "whole")
    assert not (tmp_path / "whole" / "calibration.safetensors").exists()
    proc = run_cli("run", "recipes/mixed_int8_int4.yaml", "--model", str(release), "--set", "eval.mode=whole", "-o",
                   str(tmp_path / "whole-cli"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "eval.mode: whole cannot load" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "whole-cli" / "calibration.safetensors").exists()


@pytest.mark.gpu
def test_gpu_reads_share_one_page_locked_buffer_safely(release):
    """On a GPU the stored bytes are read into one page-locked buffer per source, reused read after read; reads
    from several threads at once (the read-ahead thread beside the main thread's embedding read) take turns, and
    every one equals the CPU's dequantization."""
    from concurrent.futures import ThreadPoolExecutor

    src = resolve_model(str(release))
    assert src.work_device().type == "cuda"
    cpu = Fp8BlockSource(release, device="cpu")
    layers = [sorted(k for k in src.weight_map if k.startswith(f"model.layers.{i}.")) for i in range(src.n_layers)]
    want = [cpu.read_tensors(keys) for keys in layers]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(src.read_tensors, layers * 3))
    for i, g in enumerate(got):
        assert all(torch.equal(g[k], want[i % len(layers)][k]) for k in layers[i % len(layers)]), i
    assert src.stored_staging.bufs[0] is not None
