"""Per-layer damage from one streamed pass against a slow reference: the whole transformers model, one MoE layer's
experts replaced by round-to-nearest copies, KL of the next-token distributions."""

import pytest
import torch

from quant.algos.grid import QuantSpec, effective_group_size, quantize_weight
from quant.dist.world import World
from quant.engine.layerwise import Layerwise
from quant.measure.layer_damage import measure_layer_damage, spread_rows
from quant.models import resolve_model
from quant.models.layers import experts_of

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
            spec = QuantSpec(bits, effective_group_size(group, p.shape[2]))
            p.data.copy_(quantize_weight(p.data, spec, p.dtype).dequantize())
        quant = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    return (base.exp() * (base - quant)).sum(-1).mean().item()


def test_matches_whole_model_reference(source):
    tokens = torch.randint(0, source.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    damage = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, world=World()), SCHEMES)
    moe = source.moe_layers()
    assert set(damage) == set(SCHEMES) and all(d.shape == (len(moe),) for d in damage.values())
    for row in (0, len(moe) - 1):
        for name, bits, group in (("w2g32", 2, 32), ("w4g16", 4, 16)):
            want = _reference_kl(source, tokens, moe[row], bits, group)
            # fp32 noise of a KL between nearly equal distributions is ~1e-8 absolute
            assert damage[name][row].item() == pytest.approx(want, rel=2e-3, abs=5e-8), (row, name)
    assert (damage["w2g32"] > damage["w4g32"]).all() and (damage["w4g32"] > damage["w8g32"]).all()
    # smaller groups, less damage: over the model (one layer's KL on 72 positions of a random model is noise-sized)
    assert damage["w4g16"].sum() < damage["w4g32"].sum()


def test_branches_do_not_leak_into_each_other(source):
    """A scheme measured alone gives the same damage as in a pass with other schemes (each branch starts from the
    original weights and the clean stream runs on them)."""
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    alone = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, world=World()), ("w4g32",))
    mixed = measure_layer_damage(source, tokens, Layerwise(source, "float32", "cpu", 2, World()),
                                 ("w2g32", "w4g32", "w8g32"))
    assert torch.allclose(alone["w4g32"], mixed["w4g32"], rtol=1e-5, atol=0)


def test_spread_rows_cover_every_source_block():
    assert spread_rows(32, 4).tolist() == [0, 8, 16, 24]
    assert spread_rows(5, 16).tolist() == [0, 1, 2, 3, 4]


def test_a_layer_s_expert_weights_are_gone_before_the_next_layer_loads(monkeypatch):
    """As in the profile (tests/measure/test_profile.py): the pass's experts view must not keep a layer's expert weights
    alive through the next layer's load."""
    from quant.measure import layer_damage
    from tests.measure.test_profile import expert_weights_alive_at_each_load

    src = resolve_model("builtin:deepseek-v3-tiny")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    alive = expert_weights_alive_at_each_load(
        monkeypatch, layer_damage,
        lambda: measure_layer_damage(src, tokens, Layerwise(src, "float32", "cpu", 2, world=World()), ("w4g32",)))
    assert alive == [0] * src.n_layers
