"""The report's serving section: servable or not, the best plan vLLM/SGLang serve, and its predicted price."""

import os
import re

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


def test_a_smaller_servable_plan_is_not_priced_as_if_it_were_the_same_size():
    """On the tiny builtin the report compared a 5.25-bit plan with a 4.50-bit one and called the difference the
    price of serving: whole-layer schemes left 0.75 bits unspent."""
    smaller = dict(PER_EXPERT, expert_storage_bits=5.25, predicted_kl=0.0100,
                   best_servable=dict(PER_EXPERT["best_servable"], expert_storage_bits=4.50, runtimes=["vllm"]))
    text = "\n".join(serving_lines(smaller))
    assert "+0.0066 (not at equal size" in text and "price" not in text
    assert "best plan vLLM serve within this size" in text and "(stored expert bits 4.500)" in text


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
    plan = plan_bits(prof, src.modules, PlanSpec(group_size=32, layer_schemes={"2": "w4g16"}), src.n_layers)
    grid, labels = scheme_grid(plan, src, prof)
    assert labels == ["W4 g16", "W4 g32", "W8 g32"]
    for name, m in src.modules.items():
        if m.kind == "expert":
            p = plan.modules[name]
            assert labels[grid[prof.row(m.layer), m.expert]] == f"W{p.bits} g{p.group_size}", name
    assert "bit_map.png" in plot_all(plan, src, prof, tmp_path) and (tmp_path / "bit_map.png").stat().st_size > 0


def test_the_bits_figures_have_one_name_each_in_the_log_line_the_report_and_the_card():
    """The terminal line, report.md and the model card name the plan's bits figures as ``BITS_TERMS`` does, each
    mapping by bits as text (``4: 39, 8: 9``), never a Python dict."""
    from quant.card.render import _plan
    from quant.plan.bitplan import Headline
    from quant.plan.summary import BITS_TERMS, PlanSummary
    from quant.report import _plan_lines

    h = Headline(avg_bits_experts=4.75, avg_bits_all=7.66, size_gb=0.0006, expert_pct_by_bits={8: 18.75, 4: 81.25},
                 traffic_share_by_bits={4: 0.4766, 8: 0.5234}, traffic_weighted_bits=6.094)
    layer = {"layer": 0, "modules_by_bits": {4: 39, 8: 9}, "traffic_share_by_bits": {4: 0.4819, 8: 0.5181},
             "traffic_weighted_bits": 6.072}
    outputs = {"line": h.line(), "report": "\n".join(_plan_lines(PlanSummary(h, [layer]))), "card": "\n".join(_plan(h))}
    named = {"expert bits": "4.75", "bits over all weights": "7.66", "traffic-weighted expert bits": "6.094"}
    for where, text in outputs.items():
        for term, value in named.items():
            assert term in BITS_TERMS and re.search(rf"{term}( \(.*?\))?:? \**{re.escape(value)}", text), (where, term, text)
        assert not re.search(r"average bits|bits per expert weight|traffic-weighted bits|\{\d", text), (where, text)
    assert "expert projections by bits 4: 81.25%, 8: 18.75%; routed traffic by bits 4: 47.7%, 8: 52.3%" in outputs["line"]
    assert "| 0 | 4: 39, 8: 9 | 4: 48.2%, 8: 51.8% | 6.072 |" in outputs["report"]


def test_plots_keep_matplotlib_s_caches_under_quant_s_cache(tmp_path):
    """A run with plots wrote matplotlib's font cache into ~/.cache/matplotlib and made ~/.config/matplotlib, outside
    the run directory and quant's cache: they now live in $QUANT_CACHE/matplotlib (MPLCONFIGDIR, unless set)."""
    import subprocess
    import sys

    from tests.conftest import REPO, repo_pythonpath

    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")}
    env.update(HOME=str(home), QUANT_CACHE=str(cache), PYTHONPATH=repo_pythonpath())
    code = ("from quant.report import pyplot; plt = pyplot(); fig = plt.figure(); fig.text(0.5, 0.5, 'quant'); "
            f"fig.savefig({str(tmp_path / 'x.png')!r})")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "x.png").stat().st_size > 0
    assert not (home / ".cache").exists() and not (home / ".config").exists()
    assert any((cache / "matplotlib").glob("fontlist*.json"))
