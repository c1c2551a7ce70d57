"""The report's serving section: servable or not, the best plan vLLM/SGLang serve, and its predicted price."""

from quant.report import serving_lines

PER_EXPERT = {"problems": {"vllm": ["vllm applies one quantization scheme to all experts of a fused MoE layer"],
                           "sglang": ["sglang applies one scheme"]},
              "predicted_kl": 0.0209, "expert_storage_bits": 4.875, "damage_measured": True,
              "best_servable": {"policy": "layer_sensitivity", "layers": {"0": "w8g128", "1": "w4g32"},
                                "predicted_kl": 0.0166, "expert_storage_bits": 4.87}}


def test_unservable_plan_names_the_best_servable_alternative_and_its_price():
    text = "\n".join(serving_lines(PER_EXPERT))
    assert "not servable by vllm, sglang" in text
    assert "0.0166 (stored expert bits 4.870)" in text and "(stored expert bits 4.875)" in text and "0: w8g128, 1: w4g32" in text
    assert "servable plan minus this plan, predicted KL: -0.0043 (the servable plan is predicted at least as good)" in text
    worse = dict(PER_EXPERT, predicted_kl=0.0100)
    assert "+0.0066 (this plan is predicted better by that much" in "\n".join(serving_lines(worse))


def test_servable_plan_and_missing_measurements():
    text = "\n".join(serving_lines(dict(PER_EXPERT, problems={"vllm": [], "sglang": []})))
    assert "servable by vllm and sglang" in text and "price" not in text
    text = "\n".join(serving_lines(dict(PER_EXPERT, damage_measured=False, best_servable=None, predicted_kl=None)))
    assert "set `profile.layer_sensitivity`" in text and "predicted KL" not in text
    assert serving_lines({}) == ["Not recorded (plan written by an older quant)."]
