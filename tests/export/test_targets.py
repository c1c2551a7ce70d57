import random
import re

from quant.export.targets import name_regexes


def _universe():
    names = []
    for L in range(6):
        names += [f"model.layers.{L}.self_attn.{p}_proj" for p in "qkvo"]
        names += [f"model.layers.{L}.mlp.gate"]
        names += [f"model.layers.{L}.mlp.experts.{e}.{p}_proj" for e in range(12) for p in ("gate", "up", "down")]
    return names + ["lm_head"]


def _matched(patterns, universe):
    return {n for n in universe if any(re.match(p, n) for p in patterns)}


def test_exact_on_random_subsets():
    uni = _universe()
    rng = random.Random(0)
    for _ in range(40):
        chosen = rng.sample(uni, rng.randint(1, len(uni)))
        pats = name_regexes(chosen, uni)
        assert _matched(pats, uni) == set(chosen)


def test_compact_for_structured_sets():
    uni = _universe()
    all_experts = [n for n in uni if ".experts." in n]
    assert name_regexes(all_experts, uni) == [r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(up_proj|down_proj|gate_proj)$"]
    hot = [n for n in all_experts if n.split(".")[5] in ("1", "6")]
    pats = name_regexes(hot, uni)
    assert len(pats) == 1 and r"experts\.(1|6)\." in pats[0]
    layer3 = [n for n in all_experts if n.startswith("model.layers.3.")]
    assert name_regexes(layer3, uni) == [r"^model\.layers\.3\.mlp\.experts\.\d+\.(up_proj|down_proj|gate_proj)$"]


def test_layer_numbers_do_not_prefix_match():
    uni = [f"model.layers.{L}.self_attn.q_proj" for L in range(12)]
    pats = name_regexes(["model.layers.1.self_attn.q_proj"], uni)
    assert _matched(pats, uni) == {"model.layers.1.self_attn.q_proj"}
