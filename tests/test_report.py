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


def test_bit_map_names_each_scheme_of_the_plan(tmp_path):
    """The bit map is one colour per scheme (bits and group size) named in a legend, not a 2-16 colour scale."""
    from quant.forecast.estimate import synthetic_profile
    from quant.models import resolve_model
    from quant.plan.bitplan import plan_bits
    from quant.recipe import PlanSpec
    from quant.report import plot_all, scheme_grid

    src = resolve_model("builtin:qwen3-moe-tiny")
    prof = synthetic_profile(src)
    plan = plan_bits(prof, src.modules, PlanSpec(group_size=32, layer_schemes={"2": "w4g16"}), "rtn", src.n_layers)
    grid, labels = scheme_grid(plan, src, prof)
    assert labels == ["W4 g16", "W4 g32", "W8 g32"]
    for name, m in src.modules.items():
        if m.kind == "expert":
            p = plan.modules[name]
            assert labels[grid[prof.row(m.layer), m.expert]] == f"W{p.bits} g{p.group_size}", name
    assert "bit_map.png" in plot_all(plan, src, prof, tmp_path) and (tmp_path / "bit_map.png").stat().st_size > 0
