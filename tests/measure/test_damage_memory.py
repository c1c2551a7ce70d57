"""Where the layer-damage pass keeps its streams and original experts: the placement rule on real shapes, the exact
compact copy of the originals, and (on a GPU) the same figures whichever way the clean inputs are kept."""

import pytest
import torch

from quant.dist.world import World
from quant.engine.layerwise import Layerwise
from quant.errors import RecipeError
from quant.measure import damage_memory
from quant.measure.damage_memory import CleanInputs, ExpertOriginals, PassMemory, compact_dtype, place
from quant.measure.layer_damage import measure_layer_damage
from quant.models import resolve_model
from quant.models.layers import ExpertsView

GB = 1 << 30
H200_FREE = 138 * GB
HOST = 128 * GB


def _stream(n_samples: int, seq_len: int, hidden: int, dtype_bytes: int = 4) -> int:
    return n_samples * seq_len * hidden * dtype_bytes


def test_every_stream_of_a_qwen3_pass_48_layers_deep_stays_on_an_h200():
    """The headline pass (fp32, 16 x 2048 tokens, 4 schemes, carry 1): 49 inputs of 268 MB and 12 working streams are
    16 GB, over the 8 GB activation budget that sent them all to pageable host memory."""
    numel = 128 * 3 * 768 * 2048 + 4 * 2048 * 4096  # one layer: 128 experts, attention
    working, inputs, _ = place(H200_FREE, numel, 4, _stream(16, 2048, 2048), 49, 12, 1, HOST)
    assert working and inputs


def test_a_deepseek_v3_pass_keeps_its_inputs_on_the_host_and_a_window_on_the_device():
    """DeepSeek-V3 (61 layers, fp32 layers of 46 GB, two resident): the working streams fit beside the layers and the
    originals, the 62 inputs (940 MB each) do not; they are page-locked while a quarter of the host holds them."""
    numel = 256 * 3 * 2048 * 7168 + 200_000_000
    stream = _stream(16, 2048, 7168)
    assert place(H200_FREE, numel, 4, stream, 62, 12, 1, HOST) == (True, False, False)  # 58 GB > HOST / 4
    assert place(H200_FREE, numel, 4, stream, 62, 12, 1, 1 << 40)[2]
    # with no room for the inputs' window beside the working streams, the window wins
    tight = (2 * 4 + 2) * numel + damage_memory.ORIGINALS_MARGIN_BYTES + 12 * stream
    assert place(tight, numel, 4, stream, 62, 12, 1, HOST)[:2] == (False, False)
    assert place(tight + 3 * stream, numel, 4, stream, 62, 12, 1, HOST)[:2] == (True, False)


def test_a_compact_copy_is_taken_only_where_it_is_exact():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(20, 8, 16, generator=gen)
    assert compact_dtype((w,)) == torch.float32
    assert compact_dtype((w.bfloat16().float(),)) == torch.bfloat16
    assert compact_dtype((w.half().float(),)) == torch.float16  # 10-bit mantissas: not bf16's 7
    odd = w.bfloat16().float()
    odd[19, 7, 15] += 2.0**-20  # one value in the last chunk of experts is not bf16
    assert compact_dtype((w.bfloat16().float(), odd)) == torch.float32
    assert compact_dtype((w.bfloat16(),)) == torch.bfloat16  # already 16 bits: nothing narrower to try


def _view(gate_up: torch.nn.Parameter, down: torch.nn.Parameter) -> ExpertsView:
    return ExpertsView(torch.nn.Module(), gate_up, down, torch.nn.functional.silu, lambda route: None)


def test_originals_kept_compact_restore_the_layer_bit_for_bit_and_write_the_same_rtn():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.nn.Parameter(torch.randn(20, 64, 32, generator=gen).bfloat16().float())
    down = torch.nn.Parameter(torch.randn(20, 32, 32, generator=gen).bfloat16().float())
    before = (gate_up.detach().clone(), down.detach().clone())
    view = _view(gate_up, down)
    with ExpertOriginals(view) as experts:
        assert all(o.dtype == torch.bfloat16 for o in experts.originals)
        experts.write(4, 32)
        written = (gate_up.detach().clone(), down.detach().clone())
    assert torch.equal(gate_up, before[0]) and torch.equal(down, before[1])
    full = (torch.nn.Parameter(before[0].clone()), torch.nn.Parameter(before[1].clone()))
    full_view = _view(*full)
    with ExpertOriginals(full_view) as experts:
        experts.originals = tuple(p.detach().clone() for p in full)  # the full-precision copy
        experts.write(4, 32)
        assert torch.equal(full[0], written[0]) and torch.equal(full[1], written[1])


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
    from quant.measure import layer_damage

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
