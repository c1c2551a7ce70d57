"""Per-layer damage: the exact pass against a slow reference (the whole transformers model, one MoE layer's experts
replaced by round-to-nearest copies, KL of the next-token distributions), the bounded pass against the exact one,
what each runs (as quant estimate forecasts it) and its progress."""

import logging
import re

import pytest
import torch

from quant.algos.grid import effective_group_size, quantize_weight
from quant.layerwise import Layerwise
from quant.models import resolve_model
from quant.models.layers import experts_of
from quant.parallel.world import World
from quant.profile.layer_damage import STAGE, measure_layer_damage, pass_cost, spread_rows
from quant.progress import Step
from quant.scheme import Scheme

SCHEMES = ("w2g32", "w4g32", "w4g16", "w8g32")


@pytest.fixture(scope="module")
def source(quant_cache):
    return resolve_model("builtin:qwen3-moe-tiny")


def _reference_kl(source, tokens: torch.Tensor, layer: int, bits: int, group: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    with torch.no_grad():
        base = torch.log_softmax(model(tokens).logits.float(), dim=-1)
        view = experts_of(source, model.model.layers[layer], layer)
        for p in (view.gate_up, view.down):
            spec = Scheme(bits, effective_group_size(group, p.shape[2]))
            p.data.copy_(quantize_weight(p.data, spec, p.dtype).dequantize())
        quant = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    return (base.exp() * (base - quant)).sum(-1).mean().item()


def test_matches_whole_model_reference(source):
    tokens = torch.randint(0, source.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    damage = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()), SCHEMES, "exact").damage
    moe = source.moe_layers()
    assert set(damage) == set(SCHEMES) and all(d.shape == (len(moe),) for d in damage.values())
    for row in (0, len(moe) - 1):
        for name, bits, group in (("w2g32", 2, 32), ("w4g16", 4, 16)):
            want = _reference_kl(source, tokens, moe[row], bits, group)
            # fp32 noise of a KL between nearly equal distributions is ~5e-8 absolute (the W8 figures here are
            # +-5e-8: noise alone), and the two sides sum in different orders (grouped experts, whole-model kernels)
            assert damage[name][row].item() == pytest.approx(want, rel=2e-3, abs=1e-7), (row, name)
    assert (damage["w2g32"] > damage["w4g32"]).all() and (damage["w4g32"] > damage["w8g32"]).all()
    # smaller groups, less damage: over the model (one layer's KL on 72 positions of a random model is noise-sized)
    assert damage["w4g16"].sum() < damage["w4g32"].sum()


def test_branches_do_not_leak_into_each_other(source):
    """A scheme measured alone gives the same damage as in a pass with other schemes (each branch starts from the
    original weights and the clean stream runs on them)."""
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for method in ("exact", "bounded"):
        alone = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()), ("w4g32",), method)
        mixed = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()),
                                     ("w2g32", "w4g32", "w8g32"), method)
        if method == "exact":
            assert torch.allclose(alone.damage["w4g32"], mixed.damage["w4g32"], rtol=1e-5, atol=0)
        else:  # each MoE layer's flip law is fit over the schemes that reach it: the same only where none is used
            assert torch.allclose(alone.damage["w4g32"][-2:], mixed.damage["w4g32"][-2:], rtol=1e-5, atol=0)


def test_spread_rows_cover_every_source_block():
    assert spread_rows(32, 4).tolist() == [0, 8, 16, 24]
    assert spread_rows(5, 16).tolist() == [0, 1, 2, 3, 4]


def test_a_layer_s_expert_weights_are_gone_before_the_next_layer_loads(monkeypatch):
    """As in the profile (tests/profile/test_profile.py): the pass's experts view must not keep a layer's expert weights
    alive through the next layer's load. The bounded walk back keeps the ``carry`` layers above the one it loads (its
    branches run through them): those, and no others."""
    from quant.profile import layer_damage
    from tests.profile.test_profile import expert_weights_alive_at_each_load

    src = resolve_model("builtin:deepseek-v3-tiny")
    L, first = src.n_layers, src.moe_layers()[0]
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    # bounded: the clean walk (no experts handed out), then back from the last layer to the first MoE layer
    for method, carry, want in (("exact", 1, [0] * L),
                                ("bounded", 1, [0] * L + [0] + [1] * (L - 1 - first)),
                                ("bounded", 2, [0] * L + [0, 1] + [2] * (L - 2 - first))):
        alive = expert_weights_alive_at_each_load(
            monkeypatch, layer_damage,
            lambda method=method, carry=carry: measure_layer_damage(
                src, tokens, Layerwise(src, "float32", "cpu", 2, World()), ("w4g32",), method, carry))
        assert alive == want, (method, carry)
        monkeypatch.undo()


def test_bounded_pass_carried_to_the_output_is_the_exact_pass(source):
    """Carried through every later layer, each bounded branch reaches the output and gets its exact KL: the same
    numbers as the exact pass (the gradients and flip laws are then unused)."""
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    exact = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()), SCHEMES, "exact")
    carried = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()), SCHEMES, "bounded",
                                   carry=source.n_layers)
    for name in SCHEMES:
        assert torch.allclose(carried.damage[name], exact.damage[name], rtol=1e-6, atol=1e-12), name


@pytest.mark.parametrize("model", ["builtin:qwen3-moe-tiny", "builtin:deepseek-v3-tiny"])
@pytest.mark.parametrize("method, carry, draws", [("exact", 1, 1), ("bounded", 1, 1), ("bounded", 2, 2)])
def test_pass_cost_counts_what_the_pass_runs_and_progress_reports_it(model, method, carry, draws, caplog):
    """pass_cost (quant estimate's forecast of the pass) is the pass's own count of layer forwards, and the pass
    reports it as progress: one step per layer walked (and the start), counting up to that total. DeepSeek-V3's
    first layer is dense: no branch starts there, and the bounded pass's gradients stop above its first MoE layer."""
    src = resolve_model(model)
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    caplog.set_level(logging.INFO, logger="quant")
    got = measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), ("w4g32", "w8g32"), method,
                               carry, draws)
    layers = [(1.0, i in src.moe_layers()) for i in range(src.n_layers)]
    cost = pass_cost(layers, 2, tokens.numel(), method, carry, draws)
    forwards = cost.layer_forwards
    assert got.layer_forwards == forwards and cost.param_tokens == forwards * tokens.numel()
    steps = [r.progress for r in caplog.records if isinstance(getattr(r, "progress", None), Step)]
    assert {(s.stage, s.unit, s.total) for s in steps} == {(STAGE, "layer forwards", forwards)}
    assert steps[0].done == 0 and steps[-1].done == forwards
    assert [s.done for s in steps] == sorted(s.done for s in steps)
    L, first = src.n_layers, src.moe_layers()[0]
    assert len(steps) == 1 + L + (0 if method == "exact" else L - first)
    (summary,) = [r.getMessage() for r in caplog.records if "KL x1e3 per layer" in r.getMessage()]
    assert re.search(r"per layer: w4g32 -?\d+\.\d{3}(, -?\d+\.\d{3})*; w8g32 ", summary) and "[" not in summary, summary


def test_a_model_whose_output_is_not_finite_is_one_numerical_error(source, tmp_path):
    """An infinite weight in the folder made the bounded pass's label draws a RuntimeError (an internal error)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quant.errors import NumericalError
    from quant.models import ModelSource

    folder = tmp_path / "m"
    shutil.copytree(source.path, folder)
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    bad = ModelSource(folder)
    tokens = torch.randint(0, bad.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NumericalError, match="next-token distribution holds NaN or infinite values"):
        measure_layer_damage(bad, tokens, Layerwise(bad, "float32", "cpu", 2, World()), ("w4g32",))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("method", ["bounded", "exact"])
def test_experts_kept_in_the_checkpoint_s_bf16_give_the_figures_of_fp32_copies(source, device, method):
    """The pass's routed experts stay in the checkpoint's bf16 (half a layer's bytes) and are widened as they run:
    the figures of a pass whose layers hold fp32 copies, bit for bit; the layers' expert weights are never written."""
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    run = lambda narrow: measure_layer_damage(  # noqa: E731
        source, tokens, Layerwise(source, "float32", device, 2, World(), narrow_experts=narrow), SCHEMES, method).damage
    narrow, wide = run(True), run(False)
    for name in SCHEMES:
        assert torch.equal(narrow[name], wide[name]), name


def test_more_label_draws_change_the_bounded_figures_not_the_exact_ones(source):
    """``draws`` reaches the gradients: other draws, other (less noisy) Fisher forms; carried to the output the branches
    take their exact KL and draws change nothing."""
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    run = lambda carry, draws: measure_layer_damage(  # noqa: E731
        source, tokens, Layerwise(source, "float32", "cpu", 2, World()), ("w4g32",), "bounded", carry, draws).damage
    one, four = run(1, 1)["w4g32"], run(1, 4)["w4g32"]
    assert not torch.equal(one[:-2], four[:-2])  # the layers whose branches stop before the output
    assert torch.equal(one[-1:], four[-1:])  # the last MoE layer's branch reaches the head: its exact KL
    L = source.n_layers
    assert torch.equal(run(L, 1)["w4g32"], run(L, 4)["w4g32"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_carry_whose_layers_do_not_fit_the_gpu_is_refused_before_any_branch(source, monkeypatch):
    from quant.errors import RecipeError
    from quant.profile import layer_damage

    monkeypatch.setattr(layer_damage, "FORWARD_MARGIN_BYTES", 1 << 60)
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with pytest.raises(RecipeError, match="carry_layers 2 keeps 2 more decoder layer"):
        measure_layer_damage(source, tokens, Layerwise(source, "float32", "cuda", 2, World()), ("w4g32",), "bounded", 2)


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "deepseek-v3-tiny", "mixtral-tiny", "olmoe-tiny"])
def test_a_layer_s_later_schemes_run_its_moe_block_alone_with_the_figures_of_whole_forwards(model, monkeypatch,
                                                                                          request):
    """After a MoE layer's first scheme, the others run only its MoE block on the recorded block input, added to the
    recorded residual: on every family the figures are those of whole layer forwards, bit for bit; and where the
    check against a whole forward fails (a layer that does not end in residual + MoE block), whole forwards run."""
    from quant.profile import layer_damage

    src = resolve_model(f"builtin:{model}")
    tokens = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(2))
    schemes = ("w4g32", "w4g16", "w8g32")
    runs = []
    run_block = layer_damage._BlockShortcut.run
    monkeypatch.setattr(layer_damage._BlockShortcut, "run",
                        lambda self, *a: (runs.append(1), run_block(self, *a))[1])

    def measure():
        return measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), schemes).damage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels' multi-threaded sums vary run to run in their last bits (OLMoE-tiny)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    short = measure()
    assert len(runs) == (len(schemes) - 1) * len(src.moe_layers())
    keep = layer_damage._BlockShortcut._keep
    monkeypatch.setattr(layer_damage._BlockShortcut, "_keep", lambda self, into, t: keep(self, into, t * 1.001))
    runs.clear()
    whole = measure()  # the recorded residual and input are off: the check sends every branch through its layer
    assert runs == []
    for name in schemes:
        assert torch.equal(short[name], whole[name]), name


class _StopAt(logging.Handler):
    """Sets ``world``'s stop flag (as the CLI's SIGTERM handler does) when a logger's line is ``at``, and keeps every
    line after that one."""

    def __init__(self, world, at: str):
        super().__init__(logging.INFO)
        self.world, self.at, self.after = world, at, None

    def emit(self, record):
        if self.after is not None:
            self.after.append(record.getMessage())
        elif record.getMessage() == self.at:
            self.world.stop.set("SIGTERM")
            self.after = []


@pytest.mark.parametrize("method, at", [("bounded", "clean through layer 1"), ("bounded", "back through layer 2"),
                                        ("exact", "exact: branches through layer 1")])
def test_a_stop_request_ends_the_pass_after_the_layer_in_hand(source, method, at):
    """SIGTERM in the pass (its clean walk or its walk back) ends it after that layer with the stop error (exit 75
    from the CLI), not after the rest of the pass: a scheduler's grace period is a layer's time, not a pass's."""
    from quant.errors import StopRequested

    lw = Layerwise(source, "float32", "cpu", 2, World())
    stop = _StopAt(lw.world, f"layer damage: {at}")
    logger = logging.getLogger("quant.profile.layer_damage")
    logger.addHandler(stop)
    level = logger.level
    logger.setLevel(logging.INFO)
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    try:
        with pytest.raises(StopRequested, match=f"after layer damage: {at}; rerun"):
            measure_layer_damage(source, tokens, lw, ("w4g32",), method)
    finally:
        logger.removeHandler(stop)
        logger.setLevel(level)
    assert stop.after == []  # nothing ran after the layer in hand


def test_the_flip_law_prices_no_w8_branch_above_a_w4_one(request):
    """Each MoE layer's flip law is fit over the branches that reach it; from a few W4 points at nearly one size
    (OLMoE-tiny: the W8 branches' increases not positive) the free least-squares slope came out near -12, and the
    law priced the W8 branches, two decades smaller, at 8.7e3 and 1.4e5 nats. The slope is held to FLIP_EXPONENTS:
    more bits never cost more damage, and a W8 layer's figure is of its own size."""
    from quant.profile import layer_damage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    src = resolve_model("builtin:olmoe-tiny")
    tokens = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(2))
    d = measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, World()), ("w4g32", "w4g16", "w8g32")).damage
    assert (d["w8g32"] <= d["w4g16"]).all() and (d["w8g32"].abs() < 1e-6).all(), d
    steep = [(1e-4 * (1 + 1e-3 * i), 10.0 ** (-12 * i)) for i in range(3)]  # a slope of about -1e4 in log-log
    assert layer_damage._law(steep)[1] == layer_damage.FLIP_EXPONENTS[0]
    assert layer_damage._law([(1e-6, 1e-9), (1e-2, 1e3)])[1] == layer_damage.FLIP_EXPONENTS[1]
