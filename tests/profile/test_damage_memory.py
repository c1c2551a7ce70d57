"""Where the layer-damage pass keeps its layers and streams: the placement rule on real shapes, a layer's bytes with
its experts narrow, clean inputs in files (the same figures, nothing left behind), and (on a GPU) the same figures
whichever way the clean inputs are kept."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from quant.errors import RecipeError
from quant.io.storage import temp_pid
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.parallel.world import World
from quant.profile import damage_memory
from quant.profile.damage_memory import CleanInputs, PassMemory, pass_layer_bytes, place
from quant.profile.layer_damage import measure_layer_damage

GB = 1 << 30
H200_FREE = 138 * GB
H100_FREE = 78 * GB
HOST = 128 * GB
QWEN3_LAYER = 128 * 3 * 768 * 2048 * 2 + 4 * 2048 * 4096 * 4  # experts in bf16, attention in fp32
DSV3_LAYER = 256 * 3 * 2048 * 7168 * 2 + 200_000_000 * 4


def _stream(n_samples: int, seq_len: int, hidden: int, dtype_bytes: int = 4) -> int:
    return n_samples * seq_len * hidden * dtype_bytes


def test_every_stream_of_a_qwen3_pass_48_layers_deep_stays_on_an_h200():
    """The headline pass (fp32, 16 x 2048 tokens, 4 schemes, carry 1): 49 inputs of 268 MB and 14 working streams."""
    assert place(H200_FREE, QWEN3_LAYER, _stream(16, 2048, 2048), 49, 14, 1, HOST)[:2] == (True, "device")


def test_a_deepseek_v3_pass_keeps_every_stream_on_an_h200_and_spills_its_inputs_on_an_h100():
    """DeepSeek-V3 (61 layers; 24 GB layers with bf16 experts, two resident): on an H200 the working streams and the
    62 inputs (940 MB each) fit beside them; on an 80 GB card the inputs go to the host while a quarter of it holds
    them, else to files, and the host holds no stream that grows with depth."""
    stream = _stream(16, 2048, 7168)
    assert place(H200_FREE, DSV3_LAYER, stream, 62, 14, 1, HOST) == (True, "device", True)
    assert place(H100_FREE, DSV3_LAYER, stream, 62, 14, 1, HOST) == (True, "disk", True)
    assert place(H100_FREE, DSV3_LAYER, stream, 62, 14, 1, 1 << 40) == (True, "host", True)
    # with no room for the inputs' window beside the working streams, the window wins
    tight = 2 * DSV3_LAYER + damage_memory.FORWARD_MARGIN_BYTES + 14 * stream
    assert place(tight, DSV3_LAYER, stream, 62, 14, 1, HOST)[:2] == (False, "disk")
    assert place(tight + 3 * stream, DSV3_LAYER, stream, 62, 14, 1, HOST)[:2] == (True, "disk")


def test_a_layer_s_bytes_count_its_experts_narrow_where_the_pass_keeps_them_so():
    src = resolve_model("builtin:deepseek-v3-tiny")
    wide = Layerwise(src, "float32", "cpu", 2, World())
    narrow = Layerwise(src, "float32", "cpu", 2, World(), narrow_experts=True)
    moe = src.moe_layers()[0]
    experts = sum(m.numel for m in src.modules.values() if m.layer == moe and m.kind == "expert")
    assert pass_layer_bytes(wide) - pass_layer_bytes(narrow) == 2 * experts  # fp32 -> bf16
    with narrow.layer(moe) as layer:
        held = [*layer.parameters(), *layer.buffers()]
        assert sum(t.numel() * t.element_size() for t in held) == pass_layer_bytes(narrow)


def test_clean_inputs_in_files_give_the_figures_of_inputs_in_memory_and_leave_nothing(monkeypatch, tmp_path):
    from quant.profile import layer_damage

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    src = resolve_model("builtin:deepseek-v3-tiny")
    tokens = torch.randint(0, 100, (3, 32), generator=torch.Generator().manual_seed(5))
    run = lambda: measure_layer_damage(  # noqa: E731
        src, tokens, Layerwise(src, "float32", "cpu", 2, World(), narrow_experts=True), ("w4g32", "w8g32")).damage
    in_memory = run()
    cpu = torch.device("cpu")
    monkeypatch.setattr(layer_damage, "plan_memory", lambda *a, **k: PassMemory(cpu, cpu, False, spill=True))
    files, write = [], CleanInputs._write
    monkeypatch.setattr(CleanInputs, "_write", lambda self, i, h: (files.append(i), write(self, i, h))[1])
    stale = tmp_path / f"{damage_memory.SPILL_PREFIX}999999999-x"  # a killed run's
    stale.mkdir()
    spilled = run()
    assert files == list(range(src.n_layers))
    for name in in_memory:
        assert torch.equal(in_memory[name], spilled[name]), name
    assert list(tmp_path.iterdir()) == []  # its own files and the stale run's are gone
    assert temp_pid(f"{damage_memory.SPILL_PREFIX}{os.getpid()}-abc") == os.getpid()


def test_clean_inputs_are_refused_in_one_line_where_nothing_can_hold_them(monkeypatch):
    lw = Layerwise(resolve_model("builtin:qwen3-moe-tiny"), "float32", "cpu", 2, World())
    lw.device = torch.device("cuda", 0)  # placement only: nothing runs on it
    monkeypatch.setattr(damage_memory, "free_gpu_bytes", lambda d: 0)
    monkeypatch.setattr(damage_memory, "host_available_bytes", lambda: 4 * GB)
    monkeypatch.setattr(damage_memory, "free_bytes", lambda p: GB)
    with pytest.raises(RecipeError, match=r"clean inputs \(8.6 GB\) fit neither the GPU, the host's memory"):
        damage_memory.plan_memory(lw, 1 << 30, 8, 2, 1)
    monkeypatch.setattr(damage_memory, "host_available_bytes", lambda: 64 * GB)  # over a quarter: files, but no room
    memory = damage_memory.plan_memory(lw, 1 << 30, 20, 2, 1)
    assert memory.inputs.type == "cpu" and not memory.spill
    monkeypatch.setattr(damage_memory, "free_bytes", lambda p: 1 << 50)
    assert damage_memory.plan_memory(lw, 1 << 30, 20, 2, 1).spill
    assert Path(tempfile.gettempdir()).is_dir()


def test_clean_inputs_hand_back_copies_not_the_walks_own_tensor():
    h = torch.randn(2, 4, 8)
    inputs = CleanInputs(Layerwise(resolve_model("builtin:qwen3-moe-tiny"), "float32", "cpu", 2, World()),
                         PassMemory(torch.device("cpu"), torch.device("cpu"), False))
    inputs.keep(0, h)
    want = h.clone()
    h.zero_()  # the forward walk writes the next layer's input in place
    assert torch.equal(inputs.get(0), want)
    inputs.drop(0)
    inputs.drop(5)  # never kept: nothing to forget
    with pytest.raises(KeyError):
        inputs.get(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pinned", [True, False])
def test_clean_inputs_on_the_host_give_the_figures_of_inputs_on_the_gpu(pinned, monkeypatch):
    """Inputs kept on the host (page-locked or not), uploaded once each: the same figures bit for bit, with at most
    ``carry + 2`` of them on the GPU at any time."""
    from quant.profile import layer_damage

    src = resolve_model("builtin:deepseek-v3-tiny")
    tokens = torch.randint(0, 100, (3, 32), generator=torch.Generator().manual_seed(5))
    run = lambda: measure_layer_damage(  # noqa: E731
        src, tokens, Layerwise(src, "float32", "cuda", 2, World()), ("w4g32", "w8g32"), "bounded", 2).damage
    on_gpu = run()
    cuda, cpu = torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")
    monkeypatch.setattr(layer_damage, "plan_memory", lambda *a, **k: PassMemory(cuda, cpu, pinned))
    most = []
    get = CleanInputs.get
    monkeypatch.setattr(CleanInputs, "get", lambda self, i: (most.append(len(self.on_device) + 1), get(self, i))[1])
    on_host = run()
    for name in on_gpu:
        assert torch.equal(on_gpu[name], on_host[name]), name
    assert most and max(most) <= 2 + 2


def _failing_above(lw: Layerwise, most_rows: int) -> list[int]:
    """Make ``lw``'s batches of more than ``most_rows`` sequences fail as a full GPU does (the batch's runner raises
    torch.OutOfMemoryError before any output); returns the batch sizes tried, in order."""
    run, tried = lw.runner, []

    def runner(layer, hidden):
        tried.append(hidden.shape[0])
        if hidden.shape[0] > most_rows:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return run(layer, hidden)

    lw.runner = runner
    return tried


@pytest.mark.parametrize("model", ["builtin:qwen3-moe-tiny", "builtin:deepseek-v3-tiny"])
def test_batches_the_device_has_no_memory_for_are_rerun_halved_with_the_same_figures(model):
    """A forward or backward batch that runs out of memory is run again at half the rows (its inputs intact, even
    where the output overwrites them in place), and the smaller batch stays: the pass's figures are those of a pass
    run at that batch from the start."""
    src = resolve_model(model)
    tokens = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(3))
    schemes = ("w4g32", "w8g32")
    want = measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), schemes).damage
    lw = Layerwise(src, "float32", "cpu", 8, World())
    tried = _failing_above(lw, 2)
    got = measure_layer_damage(src, tokens, lw, schemes).damage
    assert tried[:3] == [8, 4, 2] and set(tried[3:]) == {2}  # halved once, then kept
    assert lw.batch_size == 2
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_single_sequence_that_does_not_fit_is_one_clear_error():
    src = resolve_model("builtin:qwen3-moe-tiny")
    lw = Layerwise(src, "float32", "cpu", 2, World())
    _failing_above(lw, 0)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RecipeError, match="one sequence through a layer does not fit the GPU"):
        measure_layer_damage(src, tokens, lw, ("w4g32",))
