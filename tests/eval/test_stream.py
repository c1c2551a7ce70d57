"""Streamed eval: the shipped checkpoint dequantized per layer by compressed-tensors, one decoder layer resident at
a time, chunked sums equal to full log-probabilities, the same numbers at world size 1 and 2 (torchrun, gloo), the
auto rule. Streamed vs whole-model proxies on every builtin family: tests/integration/test_pipeline.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant import layerwise
from quant.errors import CheckpointError, RecipeError
from quant.eval import stream as evalstream
from quant.eval.evaluate import evaluate_run, proxy_mode
from quant.eval.stream import ProxySums, ShippedCheckpoint, streamed_proxies
from quant.models import ModelSource, dequant, resolve_model
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan
from quant.recipe import load_recipe
from quant.run.pipeline import run
from tests.conftest import REPO, repo_pythonpath

HEADLINE = REPO / "recipes" / "mixed_int8_int4.yaml"
MODEL = "builtin:deepseek-v3-tiny"  # MLA attention, a shared expert, a dense first layer
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=5",
        "eval.perplexity.seq_len=64", "eval.batch_size=2")


def _recipe(*overrides):
    return load_recipe(HEADLINE, overrides=FAST + overrides, model=MODEL)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The headline recipe (per-expert 4/8-bit mix, which transformers cannot load) exported on deepseek-v3-tiny."""
    d = tmp_path_factory.mktemp("evalstream") / "run"
    run(_recipe(), d, until="export")
    return d


def _close(a: dict, b: dict, rel: float) -> None:
    for k in ("perplexity", "kl", "top1_agreement"):
        for kk in a[k]:
            assert math.isclose(a[k][kk], b[k][kk], rel_tol=rel), (k, kk, a[k][kk], b[k][kk])
    assert a["n_tokens"] == b["n_tokens"]


def test_shipped_checkpoint_reads_what_compressed_tensors_dequantizes(exported):
    """Per-layer reads equal compressed-tensors' dequantization of the whole checkpoint file, bit for bit, under
    the dense names the base model uses; the packed tensors themselves are not listed."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16)
    assert set(shipped.weight_map) == set(src.weight_map)
    dense = CompressedTensorsDequantizer(exported / "checkpoint").process(
        load_file(str(exported / "checkpoint" / "model.safetensors")))
    for layer in range(src.n_layers):
        keys = [k for k in shipped.weight_map if k.startswith(f"model.layers.{layer}.")]
        got = shipped.read_tensors(keys)
        assert all(torch.equal(got[k], dense[k]) for k in keys)
    assert any(k.endswith(".weight_packed") for k in shipped.raw_map)


def _whole_file_dequantized(exported: Path) -> dict:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    return CompressedTensorsDequantizer(exported / "checkpoint").process(
        load_file(str(exported / "checkpoint" / "model.safetensors")))


def _read_in_chunks_into_a_buffer(exported: Path, device: str, monkeypatch) -> None:
    """A layer read (as the read-ahead reads: ``into`` a staging buffer) dequantized ~4 kB of stored bytes at a time
    on ``device`` equals compressed-tensors' whole-file dequantization bit for bit; every tensor is a 64-byte
    aligned view of the one buffer, in the dense dtype and shape; without ``into`` the tensors come back on the
    device asked for, kept ones as copies rather than views of the packed read."""
    monkeypatch.setattr(dequant, "DEQUANT_CHUNK_BYTES", 4096)
    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16, device)
    dense = _whole_file_dequantized(exported)
    calls = []
    shipped.dequantizer.process = (lambda f: lambda raw: calls.append(len(raw)) or f(raw))(shipped.dequantizer.process)
    for layer in range(src.n_layers):
        keys = [k for k in shipped.weight_map if k.startswith(f"model.layers.{layer}.")]
        bufs: list[torch.Tensor] = []
        got = shipped.read_tensors(keys, "cpu", into=lambda n, bufs=bufs: bufs.append(
            torch.empty(n, dtype=torch.uint8)) or bufs[-1])
        lo, hi = bufs[0].data_ptr(), bufs[0].data_ptr() + bufs[0].numel()
        for k in keys:
            assert got[k].device.type == "cpu" and torch.equal(got[k], dense[k]), k
            assert lo <= got[k].data_ptr() < hi and (got[k].data_ptr() - lo) % 64 == 0, k
        direct = shipped.read_tensors(keys, device)
        for k in keys:
            assert direct[k].device.type == torch.device(device).type and torch.equal(direct[k].cpu(), dense[k]), k
            if k not in shipped.parts:
                assert direct[k].untyped_storage().nbytes() == direct[k].numel() * direct[k].element_size(), k
    assert len(calls) > 4 * src.n_layers  # chunks, not one call a layer


def test_shipped_checkpoint_dequantizes_in_chunks_into_one_buffer(exported, monkeypatch):
    _read_in_chunks_into_a_buffer(exported, "cpu", monkeypatch)


@pytest.mark.gpu
def test_shipped_checkpoint_dequantizes_on_the_gpu_bit_for_bit(exported, monkeypatch):
    """The GPU path (packed tensors uploaded, dequantized on the GPU's own stream, copied back into the buffer)."""
    _read_in_chunks_into_a_buffer(exported, "cuda", monkeypatch)


def test_shipped_checkpoint_shapes_are_the_dense_shapes(exported):
    """A rank's share of a layer is balanced on ``shapes()``: dense names and shapes, as the base model's."""
    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16)
    assert shipped.shapes() == {k: src.shapes()[k] for k in shipped.weight_map}
    assert any(k in shipped.parts for k in shipped.shapes())


def test_shipped_checkpoint_refuses_a_model_that_is_not_compressed_tensors():
    src = resolve_model(MODEL)
    with pytest.raises(CheckpointError, match="compressed-tensors"):
        ShippedCheckpoint(src.path, src, torch.bfloat16)


class _Tracker:
    """Instruments the layer loader: decoder layers materialized at once, weight bytes resident in every model
    skeleton whenever a layer has just been loaded, and the bytes of each read from disk."""

    def __init__(self, monkeypatch):
        self.live_layers: set[int] = set()
        self.skeletons: dict[int, torch.nn.Module] = {}
        self.max_layers = self.max_resident = self.max_read = 0
        self.layer_bytes: list[int] = []
        load, release = layerwise.load_layer, layerwise.release

        def tracked_load(source, model, idx, device, dtype, raw=None, narrow_experts=False):
            layer = load(source, model, idx, device, dtype, raw, narrow_experts)
            self.skeletons[id(model)] = model
            self.live_layers.add(id(layer))
            self.max_layers = max(self.max_layers, len(self.live_layers))
            self.layer_bytes.append(_bytes(layer))
            self.max_resident = max(self.max_resident, sum(map(_bytes, self.skeletons.values())))
            return layer

        def tracked_release(module):
            self.live_layers.discard(id(module))
            release(module)

        monkeypatch.setattr(layerwise, "load_layer", tracked_load)
        monkeypatch.setattr(layerwise, "release", tracked_release)
        for cls in (ModelSource, ShippedCheckpoint):
            monkeypatch.setattr(cls, "read_tensors", self._reads(cls.read_tensors))

    def _reads(self, read):
        def tracked(source, keys, device="cpu"):
            out = read(source, keys, device)
            self.max_read = max(self.max_read, sum(t.numel() * t.element_size() for t in out.values()))
            return out
        return tracked


def _bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's materialized (non-meta) parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def test_streamed_eval_holds_one_decoder_layer_at_a_time(exported, monkeypatch):
    """No whole-model load: one decoder layer materialized at a time, every read from disk at most a layer (or the
    embedding / head), and the weights resident in both models at most one layer plus the two lm_heads."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("streamed eval must not load a whole model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    tracker = _Tracker(monkeypatch)
    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16)
    tokens = torch.randint(0, 1000, (3, 32), generator=torch.Generator().manual_seed(0))
    streamed_proxies(src, shipped, tokens, "bfloat16", "cpu", 2, World())
    shapes = src.shapes()
    head = math.prod(shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])) * 2
    model_bytes = sum(math.prod(s) for s in shapes.values()) * 2
    layer = max(tracker.layer_bytes)
    assert tracker.max_layers == 1 and len(tracker.layer_bytes) == 2 * src.n_layers
    assert tracker.max_read <= max(layer, head) and tracker.max_resident <= layer + 2 * head < model_bytes


def test_streamed_eval_reports_progress_layer_by_layer(exported, caplog):
    """A streamed eval of a 61-layer model runs for minutes: it reports one progress step per layer of each model
    (the console turns them into elapsed time and an ETA), base layers first, counted over both models."""
    import logging

    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16)
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="quant.eval.stream"):
        streamed_proxies(src, shipped, tokens, "bfloat16", "cpu", 2, World())
    steps = [(r.progress.stage, r.progress.done, r.progress.total, r.getMessage()) for r in caplog.records
             if hasattr(r, "progress")]
    n = src.n_layers
    assert [(st, d, t) for st, d, t, _ in steps] == [("eval", d, 2 * n) for d in range(2 * n + 1)]
    assert [m for *_, m in steps[1:]] == [f"eval: base layer {i}" for i in range(n)] + [
        f"eval: quantized layer {i}" for i in range(n)]


def test_proxy_sums_match_full_log_probabilities():
    """Chunked sums (chunks far smaller than a sample) equal the reference computed from full [N, S, V]
    log-probabilities."""
    g = torch.Generator().manual_seed(0)
    N, S, D, V = 3, 17, 8, 50
    hb, hq = torch.randn(N, S, D, generator=g), torch.randn(N, S, D, generator=g)
    head_b, head_q = torch.nn.Linear(D, V, bias=False), torch.nn.Linear(D, V, bias=False)
    tokens = torch.randint(0, V, (N, S), generator=g)
    old = evalstream.LOGIT_CHUNK_BYTES
    evalstream.LOGIT_CHUNK_BYTES = 5 * evalstream.TEMPORARIES * 4 * V  # 5 positions a chunk
    try:
        sums = ProxySums("cpu")
        sums.score(hb, head_b, hq, head_q, tokens, "cpu")
        got = sums.metrics()
    finally:
        evalstream.LOGIT_CHUNK_BYTES = old
    with torch.no_grad():
        lb = torch.log_softmax(head_b(hb)[:, :-1].double(), -1)
        lq = torch.log_softmax(head_q(hq)[:, :-1].double(), -1)
    t = tokens[:, 1:].unsqueeze(-1)
    assert got["n_tokens"] == N * (S - 1)
    assert math.isclose(got["perplexity"]["base"], math.exp(-lb.gather(-1, t).mean().item()), rel_tol=1e-5)
    assert math.isclose(got["perplexity"]["quantized"], math.exp(-lq.gather(-1, t).mean().item()), rel_tol=1e-5)
    assert math.isclose(got["kl"]["quantized"], (lb.exp() * (lb - lq)).sum(-1).mean().item(), rel_tol=1e-5)
    assert got["top1_agreement"]["quantized"] == (lb.argmax(-1) == lq.argmax(-1)).double().mean().item()


def test_two_ranks_give_the_numbers_of_one(exported, tmp_path):
    """torchrun --nproc-per-node 2 (gloo): each rank streams its share of 5 samples; every rank reports the
    single-process numbers."""
    overrides = ("eval.mode=streamed", *FAST[2:])
    single = evaluate_run(_recipe("eval.mode=streamed"), resolve_model(MODEL), exported, World())
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "fixtures" / "eval_worker.py"), str(exported), MODEL, str(tmp_path), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["proxies"] == ranks[1]["proxies"]
    _close(single["proxies"], ranks[0]["proxies"], 1e-6)


@pytest.mark.gpu
def test_two_gpus_read_shares_of_each_layer_and_give_the_numbers_of_one(exported, tmp_path):
    """torchrun --nproc-per-node 2 with NCCL: each rank reads and dequantizes (on its GPU) half of every layer of
    both models, the halves broadcast; the proxies equal one GPU's (the same batches, so to rounding)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 kind)")
    overrides = ("eval.mode=streamed", *FAST[2:])
    single = evaluate_run(_recipe("eval.mode=streamed"), resolve_model(MODEL), exported, World())
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "QUANT_TEST_WORLD_DEVICE": "cuda",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "fixtures" / "eval_worker.py"), str(exported), MODEL, str(tmp_path), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 and r["proxy_mode"] == "streamed" for r in ranks)
    assert ranks[0]["proxies"] == ranks[1]["proxies"]
    _close(single["proxies"], ranks[0]["proxies"], 1e-4)


def test_auto_mode_streams_when_the_model_outgrows_the_device(exported, monkeypatch):
    from quant.eval import evaluate

    src = resolve_model(MODEL)
    plan = BitPlan.load(exported / "plan.json")
    mode, why = proxy_mode("auto", src, plan, torch.bfloat16, "cpu")
    assert mode == "whole" and "auto" in why
    monkeypatch.setattr(evaluate, "device_memory_bytes", lambda device: 1 << 20)
    mode, why = proxy_mode("auto", src, plan, torch.bfloat16, "cpu")
    assert mode == "streamed" and "memory" in why
    assert proxy_mode("whole", src, plan, torch.bfloat16, "cpu")[0] == "whole"


def test_more_gpus_than_visible_is_refused_before_any_work(exported):
    """eval.gpus beyond the visible GPUs is one clear error before the proxies run."""
    from quant.eval.evaluate import task_gpus

    visible = torch.cuda.device_count()
    n = max(visible, 1) + 1
    recipe = _recipe(f"eval.gpus={n}", "eval.tasks=[quant_mmlu]")
    with pytest.raises(RecipeError, match=f"eval.gpus is {n} but {visible} CUDA GPU"):
        task_gpus(recipe.eval, 10**9)
    with pytest.raises(RecipeError, match=f"eval.gpus is {n}"):
        evaluate_run(recipe, resolve_model(MODEL), exported, World())
    if visible <= 1:
        assert task_gpus(_recipe().eval, 10**12) == 1  # auto with at most one GPU: one device


def test_layer_walks_share_reads_only_where_the_backend_can_carry_them():
    """NCCL moves GPU tensors only: an NCCL job evaluating on CPUs walks the layers per rank (each reading whole
    layers); gloo and NCCL-on-GPU jobs walk them as a world (shares read and broadcast under NCCL)."""
    nccl, gloo, one = World(0, 2, 0, "nccl"), World(0, 2, 0, "gloo"), World()
    alone = evalstream.layer_world(nccl, "cpu")
    assert not alone.distributed and alone.stop is nccl.stop  # this rank by itself, under the run's stop flag
    assert evalstream.layer_world(nccl, torch.device("cuda", 0)) is nccl
    assert evalstream.layer_world(gloo, "cpu") is gloo
    assert evalstream.layer_world(one, "cpu") is one


def test_a_stop_request_ends_the_streamed_eval_after_the_layer_in_hand(exported):
    """SIGTERM during the streamed proxies (a 61-layer model's walk takes minutes) ends the eval after the layer in
    hand, as the quantize stage does, with the stop error."""
    import logging

    from quant.errors import StopRequested

    src = resolve_model(MODEL)
    shipped = ShippedCheckpoint(exported / "checkpoint", src, torch.bfloat16)
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    world, seen = World(), []

    class StopAtBaseLayer1(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
            if record.getMessage() == "eval: base layer 1":
                world.stop.set("SIGTERM")

    logger, handler = logging.getLogger("quant.eval.stream"), StopAtBaseLayer1(logging.INFO)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(StopRequested, match="after eval: base layer 1; rerun"):
            streamed_proxies(src, shipped, tokens, "bfloat16", "cpu", 2, world)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen[-1] == "eval: base layer 1"
