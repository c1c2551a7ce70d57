"""The servable study's arithmetic (studies.servable, run by benchmarks/study_servable.py): the share of the
per-expert plan's KL gain over uniform INT4 that a plan keeps, per seed then averaged, and tables over sizes that
ran only some configurations, or studies that ran only some (no reference, no baseline)."""

import json
import statistics

import pytest

from studies import servable as ss

BASE, REF, LAYER = (f"{n}|gptq" for n in (ss.BASELINE, ss.REFERENCE, "layer_sensitivity W4/W8 g128"))


def _task(seed: int, size: str, kls: dict[str, float]) -> dict:
    results = {k: {"kl": kl, "ppl": 35.0 + kl, "top1": 0.9, "bits": 4.5, "storage_bits": 4.625,
                   "servable": k != REF, "predicted_kl": 0.7 * kl, "layers": {"0": "w8g128", "1": "w4g128"}}
               for k, kl in kls.items()}
    if size == "1x":
        for r in results.values():
            r["nextline_em"] = 0.05
    return {"seed": seed, "size": size, "damage": {s: [1e-3, 2e-3] for s in ss.SCHEMES}, "results": results}


@pytest.fixture
def data() -> dict:
    tasks = [_task(0, "1x", {BASE: 0.040, REF: 0.020, LAYER: 0.010}),
             _task(1, "1x", {BASE: 0.036, REF: 0.026, LAYER: 0.031}),
             _task(0, "16x", {BASE: 0.030, REF: 0.020}), _task(1, "16x", {BASE: 0.028, REF: 0.018})]
    return {"sizes": {"1x": 32, "16x": 512}, "seq_len": 256, "schemes": ss.SCHEMES, "tasks": tasks}


def test_gain_kept_is_per_seed_against_that_seeds_baseline_and_reference(data):
    kept = ss.recovered(data, "1x", LAYER)
    assert kept == pytest.approx([(0.040 - 0.010) / (0.040 - 0.020), (0.036 - 0.031) / (0.036 - 0.026)])
    row = next(r for r in ss.table_1x(data).splitlines() if r.startswith("| layer_sensitivity W4/W8 g128 |"))
    spread = 100 * statistics.stdev(kept)
    assert f"| {100 * statistics.fmean(kept):.0f} ± {spread:.0f} % |" in row and "| 20.50 ± 14.85 |" in row  # KL x1e3
    assert ss.recovered(data, "1x", BASE) == [0.0, 0.0] and ss.recovered(data, "1x", REF) == [1.0, 1.0]


def test_a_size_that_did_not_run_a_configuration_shows_a_dash(data):
    assert ss.recovered(data, "16x", LAYER) == [] and ss.keys_run(data) == [BASE, REF, LAYER]
    rows = {r.split(" | ")[0][2:]: r for r in ss.table_scaling(data).splitlines()[2:]}
    assert rows["layer_sensitivity W4/W8 g128"].endswith("| 20.50 ± 14.85 | — | 100 ± 71 % | — | — |")
    assert rows[ss.REFERENCE].endswith("| 23.00 ± 4.24 | 19.00 ± 1.41 | 100 ± 0 % | 100 ± 0 % | 35.019 ± 0.001 |")
    layers = ss.table_layers(data).splitlines()[2:]
    assert layers == ["| layer_sensitivity W4/W8 g128 | 1x | 0 | w8g128 w4g128 |",
                      "| layer_sensitivity W4/W8 g128 | 1x | 1 | w8g128 w4g128 |"]


def test_report_only_tables_the_finished_tasks_and_names_the_rest(data, tmp_path):
    (tmp_path / "tasks").mkdir()
    for t in data["tasks"]:
        (tmp_path / "tasks" / f"{t['seed']}-{t['size']}.json").write_text(json.dumps(t | {"cpu_seconds": 10.0}))
    (tmp_path / "tasks" / "1-16x.json").unlink()
    got = ss.collect([0, 1, 2], tmp_path, {"1x": 32, "16x": 512})
    assert got["missing"] == ["2-1x", "1-16x", "2-16x"] and got["task_cpu_seconds"] == 30.0
    assert json.loads((tmp_path / "servable.json").read_text())["missing"] == got["missing"]
    text = ss.report(got, tmp_path)
    assert text.startswith("**Partial: tasks (seed-size) not finished: 2-1x, 1-16x, 2-16x.**")
    assert (tmp_path / "servable_table.md").read_text() == text + "\n" and (tmp_path / "servable_kl.png").is_file()
    assert (tmp_path / "tasks" / "0-1x.json").is_file()  # nothing is removed


def test_joint_table_compares_each_seed_with_the_best_per_layer_plan():
    joint, g = "joint (by sensitivity) + g32/g64|gptq", "layer_sensitivity + g32/g64|gptq"
    tasks = [_task(s, "1x", {BASE: 0.040, REF: 0.020, LAYER: lay, g: lg, joint: j})
             for s, (lay, lg, j) in enumerate([(0.018, 0.015, 0.012), (0.019, 0.016, 0.016)])]
    for t in tasks:
        t["results"][REF]["servable"] = t["results"][joint]["servable"] = False
        t["results"][joint]["storage_bits"] = 4.875
    data = {"sizes": {"1x": 32}, "seq_len": 256, "schemes": ss.SCHEMES, "tasks": tasks}
    assert ss.best_per_layer(data, "1x", "gptq") == g  # the servable plan with the least mean KL
    rows = ss.table_joint(data, "1x").splitlines()
    assert "| layer_sensitivity + g32/g64 | joint (by sensitivity) + g32/g64 | change |" in rows[0]
    assert rows[2] == "| GPTQ | 0 | 20.00 (4.625) | 15.00 (4.625) | 12.00 (4.875) | -20.0 % |"
    assert rows[3] == "| GPTQ | 1 | 20.00 (4.625) | 16.00 (4.625) | 16.00 (4.875) | +0.0 % |"
    assert rows[4] == "| GPTQ | mean | 20.00 ± 0.00 | 15.50 ± 0.71 | 14.00 ± 2.83 | -10.0 ± 14.1 % |"
    assert len(rows) == 5  # no RTN results: no RTN rows
    assert ss.table_joint(data | {"tasks": [_task(0, "1x", {BASE: 0.04, REF: 0.02})]}, "1x") == ""


def test_a_study_of_one_per_layer_and_one_joint_plan_reports_only_what_it_measured(tmp_path):
    """``--configs "layer_sensitivity + g32/g64" "joint (by sensitivity) + g32/g64"``: no per-expert reference, no
    uniform baseline, so no reference column and no share of its gain; the joint plan against the per-layer one."""
    layer, joint = "layer_sensitivity + g32/g64", "joint (by sensitivity) + g32/g64"
    kls = {f"{layer}|gptq": 0.016, f"{joint}|gptq": 0.012, f"{layer}|rtn": 0.030, f"{joint}|rtn": 0.033}
    task = _task(0, "1x", kls)
    for algo in ss.ALGORITHMS:
        task["results"][f"{joint}|{algo}"] |= {"servable": False, "plugin": True, "storage_bits": 4.875}
    data = {"sizes": {"1x": 32}, "seq_len": 256, "schemes": ss.SCHEMES, "missing": [], "tasks": [task]}
    text = ss.report(data, tmp_path)
    assert ss.REFERENCE not in text and ss.BASELINE not in text and "gain kept" not in text
    rows = ss.table_joint(data, "1x").splitlines()
    assert rows[0] == f"| algorithm | seed | {layer} | {joint} | change |" and rows[1] == "|---|---|---|---|---|"
    assert rows[2:] == ["| GPTQ | 0 | 16.00 (4.625) | 12.00 (4.875) | -25.0 % |",
                        "| GPTQ | mean | 16.00 ± 0.00 | 12.00 ± 0.00 | -25.0 ± 0.0 % |",
                        "| RTN | 0 | 30.00 (4.625) | 33.00 (4.875) | +10.0 % |",
                        "| RTN | mean | 30.00 ± 0.00 | 33.00 ± 0.00 | 10.0 ± 0.0 % |"]
    assert "\n".join(rows) in text
    one = next(r for r in ss.table_1x(data).splitlines() if r.startswith(f"| {joint} | GPTQ |"))
    assert one == f"| {joint} | GPTQ | plugin | 4.50 ± 0.00 | 4.875 ± 0.000 | 35.012 ± 0.000 | 12.00 ± 0.00 | " \
                  "0.9000 ± 0.0000 | 0.050 ± 0.000 |"
    assert ss.table_scaling(data).splitlines()[0] == "| configuration | algorithm | KL ×1e3 1x | perplexity 1x |"
