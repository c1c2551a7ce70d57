"""lm-eval through the pipeline, offline: MMLU-style and HumanEval-style tasks on base and exported model."""

import importlib.util
import json
from pathlib import Path

import pytest

from quant.errors import GateFailed
from quant.eval.sandbox import probe
from quant.recipe import load_recipe
from quant.run.pipeline import run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm-eval is not installed (the `eval` extra; the GPU machine lacks it)")
FAST = ("calibration.n_samples=8", "calibration.seq_len=64", "eval.perplexity.n_samples=2",
        "eval.perplexity.seq_len=64", "eval.tasks=[quant_mmlu,quant_humaneval]", "eval.limit=3",
        "eval.max_gen_toks=24", "eval.batch_size=4")


def test_tasks_run_offline_with_deltas_and_gates(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",
                         overrides=FAST + ("eval.gates.mmlu={max_drop: 100}",))
    result = run(recipe, tmp_path / "t")
    ev = json.loads((result.run_dir / "eval.json").read_text())
    assert set(ev["tasks"]) == {"quant_mmlu", "quant_humaneval"}
    for t in ev["tasks"].values():
        assert t["n"] == 3 and 0.0 <= t["base"] <= 1.0 and 0.0 <= t["quantized"] <= 1.0
        assert t["delta"] == pytest.approx(t["quantized"] - t["base"])
    assert ev["tasks"]["quant_mmlu"]["metric"] == "acc" and ev["tasks"]["quant_humaneval"]["metric"] == "pass@1"
    assert ev["sandbox"] == {"policy": "require", "layers": list(probe().layers), "missing": []}
    assert [g["name"] for g in ev["gates"]] == ["perplexity", "mmlu"] and ev["passed"]
    assert "quant_mmlu (acc, n=3)" in (result.run_dir / "report.md").read_text()
    # a gate that cannot pass: the same run (base scores cached) exits with GateFailed (CLI exit code 3)
    strict = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml",
                         overrides=FAST + ("eval.gates.mmlu={max_drop: -101}",))
    with pytest.raises(GateFailed, match="mmlu"):
        run(strict, tmp_path / "t", force="eval")


def test_a_damaged_base_score_cache_is_scored_again(tmp_path):
    """A corrupt or hand-edited entry of $QUANT_CACHE/eval/ (base-model scores) is a cache miss with one warning,
    and rewritten; it used to fail every later eval of that model and those settings."""
    from quant.eval.evaluate import base_scores_path
    from quant.models import resolve_model
    from tests.conftest import run_cli

    overrides = FAST[:4] + ("eval.tasks=[quant_mmlu]", "eval.limit=2", "eval.num_fewshot=1")
    recipe = load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", overrides=overrides)
    entry = base_scores_path(resolve_model(recipe.model.path), recipe)
    args = ["eval", str(REPO / "recipes" / "mixed_int8_int4.yaml"), "-o", str(tmp_path / "r")]
    args += [a for o in overrides for a in ("--set", o)]
    p = run_cli(*args)
    assert p.returncode == 0 and entry.is_file(), p.stderr[-3000:]
    # lm-eval's bars kept out: no tqdm drawing, its request bars only as quant's own progress lines
    assert "it/s]" not in p.stderr
    bars = [ln for ln in p.stderr.splitlines() if "Running loglikelihood requests" in ln]
    assert bars and all("quant.eval.lmeval: lm-eval: " in ln and "[lm-eval " in ln for ln in bars), bars[:3]
    good = json.loads(entry.read_text())
    for damage in (b"\x00\xff not json", json.dumps({"quant_mmlu": {"value": "high"}}).encode()):
        entry.write_bytes(damage)
        p = run_cli(*args, "--force", "eval")
        assert p.returncode == 0, p.stderr[-3000:]
        assert len([ln for ln in p.stderr.splitlines() if "cached base-model scores" in ln]) == 1, p.stderr[-3000:]
        assert json.loads(entry.read_text()) == good


@pytest.mark.parametrize("tasks,pattern", [
    ("[mmlu]", "cais/mmlu of lm-eval's tasks are not in the local cache"),
    ("[quant_mmlu,humaneval]", "would run generated code outside quant's sandbox"),
])
def test_tasks_that_cannot_run_are_refused_before_any_stage(tmp_path, tasks, pattern):
    """lm-eval's mmlu offline (its dataset not cached: a ConnectionError) and lm-eval's humaneval (unsandboxed code)
    failed in the eval stage, after every other stage; now one line before the run directory is made."""
    from tests.conftest import run_cli

    p = run_cli("run", str(REPO / "recipes" / "mixed_int8_int4.yaml"), "-o", str(tmp_path / "r"), "--set",
                f"eval.tasks={tasks}", env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and pattern in lines[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()
def test_lm_eval_s_own_results_are_kept_in_the_run_directory_and_linked_from_the_report(tmp_path):
    overrides = tuple(o for o in FAST if not o.startswith("eval.tasks")) + ("eval.tasks=[quant_mmlu]", "eval.limit=2")
    result = run(load_recipe(REPO / "recipes" / "mixed_int8_int4_rtn.yaml", overrides=overrides), tmp_path / "r")
    for which in ("base", "quantized"):
        raw = json.loads((result.run_dir / f"lm_eval_{which}.json").read_text())
        assert {"results", "configs", "versions", "n-shot", "n-samples"} <= raw.keys(), raw.keys()
        assert "quant_mmlu" in raw["results"] and "samples" not in raw
        assert f"[lm_eval_{which}.json](lm_eval_{which}.json)" in (result.run_dir / "report.md").read_text()
    assert run(load_recipe(REPO / "recipes" / "mixed_int8_int4_rtn.yaml", overrides=overrides),
               tmp_path / "r").ran == []  # the new outputs count toward the eval stage's freshness


def test_the_checkpoint_carries_lm_eval_s_results_its_card_links_and_tabulates(tmp_path):
    """The card travels with the checkpoint (``quant publish``), the run directory does not: lm-eval's results
    are copied into the checkpoint, covered by its manifest, uploaded with it, and gone once no task is run."""
    from quant.export.writer import LM_EVAL_FILES, read_manifest, verify_manifest
    from quant.publish import check_publishable, publish_run
    from tests.test_publish import FakeHub, _files

    recipe_path = REPO / "recipes" / "mixed_int8_int4_rtn.yaml"
    plain = tuple(o for o in FAST if not o.startswith("eval.tasks")) + ("plan.policy=uniform", "plan.group_size=32")
    result = run(load_recipe(recipe_path, overrides=plain + ("eval.tasks=[quant_mmlu]", "eval.limit=2")), tmp_path / "r")
    ckpt = result.run_dir / "checkpoint"
    raw = {w: json.loads((result.run_dir / f"lm_eval_{w}.json").read_text()) for w in LM_EVAL_FILES}
    for which, name in LM_EVAL_FILES.items():
        assert json.loads((ckpt / name).read_text()) == raw[which]
        assert name in read_manifest(ckpt)["files"]
    assert verify_manifest(ckpt) == []
    card = (ckpt / "README.md").read_text()
    assert all(f"[{name}]({name})" in card for name in LM_EVAL_FILES.values()), card
    q, b = raw["quantized"], raw["base"]
    row = next(ln for ln in card.splitlines() if ln.startswith("| quant_mmlu |"))
    assert row == (f"| quant_mmlu | {q['versions']['quant_mmlu']} | {q['n-shot']['quant_mmlu']} | "
                   f"{q['n-samples']['quant_mmlu']['effective']} | acc | {b['results']['quant_mmlu']['acc,none']:.4f} | "
                   f"{q['results']['quant_mmlu']['acc,none']:.4f} |"), row
    hub = FakeHub(tmp_path / "hub")
    publish_run(result.run_dir, "acme/tiny", api=hub)
    uploaded = _files(tmp_path / "hub" / "acme" / "tiny")
    assert uploaded == _files(ckpt) and set(LM_EVAL_FILES.values()) <= set(uploaded)

    # tasks removed from the recipe: the checkpoint is not re-exported, and carries no stale results
    again = run(load_recipe(recipe_path, overrides=plain + ("eval.tasks=[]",)), result.run_dir)
    assert "export" not in again.ran and {"eval", "card"} <= set(again.ran), again.ran
    assert not any((ckpt / name).exists() or (result.run_dir / f"lm_eval_{w}.json").exists()
                   for w, name in LM_EVAL_FILES.items())
    assert not set(LM_EVAL_FILES.values()) & set(read_manifest(ckpt)["files"]) and verify_manifest(ckpt) == []
    assert "lm_eval" not in (ckpt / "README.md").read_text()
    assert check_publishable(result.run_dir) == ckpt
