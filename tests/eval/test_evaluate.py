"""A broken (non-finite) evaluation never passes and never looks like perfect agreement."""

import pytest
import torch

from quant.eval.evaluate import gate_results
from quant.eval.stream import ProxySums
from quant.recipe import parse_recipe


def _metrics(logits_base: torch.Tensor, logits_quant: torch.Tensor) -> dict:
    target = torch.randint(0, logits_base.shape[-1], (logits_base.shape[0],), generator=torch.Generator().manual_seed(1))
    sums = ProxySums("cpu")
    sums.add(logits_base, logits_quant, target)
    return sums.metrics()


def _logits(seed=0, c=6, v=7) -> torch.Tensor:
    return torch.randn(c, v, generator=torch.Generator().manual_seed(seed))


def test_nan_logits_give_nan_agreement_and_a_failing_default_gate():
    p = _metrics(_logits(), torch.full((6, 7), float("nan")))
    assert p["top1_agreement"]["quantized"] != p["top1_agreement"]["quantized"]  # NaN, not 1.0
    gates = gate_results(parse_recipe({"name": "x"}), p, {})  # no gates configured
    assert [g["name"] for g in gates] == ["finite_proxies"] and gates[0]["passed"] is False


@pytest.mark.parametrize("gate", [{"perplexity": {"max_rel_increase": 10.0}}, {"kl": {"max_value": 10.0}},
                                  {"top1_agreement": {"max_value": 0.0}}])
def test_a_nan_metric_never_passes_its_gate(gate):
    broken = _logits()
    broken[2] = float("nan")  # one position: every proxy is NaN
    gates = gate_results(parse_recipe({"name": "x", "eval": {"gates": gate}}), _metrics(_logits(), broken), {})
    assert [g["name"] for g in gates] == [*gate, "finite_proxies"] and not any(g["passed"] for g in gates)


def test_finite_metrics_pass_as_before():
    p = _metrics(_logits(), _logits())
    assert p["top1_agreement"]["quantized"] == 1.0 and abs(p["kl"]["quantized"]) < 1e-6
    assert gate_results(parse_recipe({"name": "x", "eval": {"gates": {"kl": {"max_value": 0.01}}}}), p, {})[0]["passed"]
