"""A broken (non-finite) evaluation never passes and never looks like perfect agreement."""

import math

import pytest
import torch

from quant.evaluate import gate_results, proxies
from quant.recipe import parse_recipe


def _lp(n=2, s=5, v=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, s, v, generator=g), dim=-1)


def test_nan_logits_give_nan_agreement_and_a_failing_default_gate():
    tokens = torch.randint(0, 7, (2, 6), generator=torch.Generator().manual_seed(1))
    base, broken = _lp(), torch.full((2, 5, 7), float("nan"))
    p = proxies(base, broken, tokens)
    assert math.isnan(p["top1_agreement"]["quantized"]) and math.isnan(p["perplexity"]["quantized"])
    gates = gate_results(parse_recipe({"name": "x"}), p, {})  # no gates configured
    assert [g["name"] for g in gates] == ["finite_proxies"] and gates[0]["passed"] is False


@pytest.mark.parametrize("gate", [{"perplexity": {"max_rel_increase": 10.0}}, {"kl": {"max_value": 10.0}},
                                  {"top1_agreement": {"max_value": 0.0}}])
def test_a_nan_metric_never_passes_its_gate(gate):
    tokens = torch.randint(0, 7, (2, 6), generator=torch.Generator().manual_seed(1))
    base = _lp()
    broken = base.clone()
    broken[:, 2] = float("nan")  # one position of every sample: every proxy is NaN
    gates = gate_results(parse_recipe({"name": "x", "eval": {"gates": gate}}), proxies(base, broken, tokens), {})
    assert [g["name"] for g in gates] == [*gate, "finite_proxies"] and not any(g["passed"] for g in gates)


def test_finite_metrics_pass_as_before():
    tokens = torch.randint(0, 7, (2, 6), generator=torch.Generator().manual_seed(1))
    base = _lp()
    p = proxies(base, base.clone(), tokens)
    assert p["top1_agreement"]["quantized"] == 1.0 and abs(p["kl"]["quantized"]) < 1e-6
    assert gate_results(parse_recipe({"name": "x", "eval": {"gates": {"kl": {"max_value": 0.01}}}}), p, {})[0]["passed"]
