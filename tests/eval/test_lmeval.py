"""quant.eval.lmeval + evals/tasks: offline lm-eval tasks end to end on a tiny random MoE, and their pieces."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from quant.errors import CheckpointError, RecipeError
from quant.eval.humaneval import load_problems
from quant.eval.lmeval import TaskScore, default_tasks_dir, run_lm_eval, scores_from_results
from quant.progress import Step
from tests.conftest import run_without_namespaces

REPO = Path(__file__).resolve().parents[2]
needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed (the `eval` extra; the GPU machine lacks it)")
MMLU_PATH = REPO / "evals" / "data" / "mmlu.jsonl.gz"


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        yield


def _training_text() -> list[str]:
    """Text to train the fixture tokenizer on: the bundled HumanEval prompts and MMLU questions."""
    texts = [p.prompt + p.canonical_solution for p in load_problems()]
    with gzip.open(MMLU_PATH, "rt", encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if index == 3000:
                break
            row = json.loads(line)
            texts.append(row["question"] + "\n" + "\n".join(row["choices"]) + "\nAnswer: A B C D")
    return texts


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 4-expert Qwen3-MoE with seeded random weights and a byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen3_moe")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_training_text(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def _load_task_module(name: str) -> ModuleType:
    """Import an `evals/tasks/*.py` file by path, the way lm-eval's `!function` does."""
    spec = importlib.util.spec_from_file_location(name, default_tasks_dir() / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_lm_eval
def test_offline_tasks_run_end_to_end(
    tiny_moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # data paths must not depend on the working directory
    scores = run_lm_eval(
        tiny_moe_dir,
        ["quant_mmlu", "quant_humaneval"],
        limit=3,
        num_fewshot=None,
        batch_size=4,
        seed=0,
        device="cpu",
        max_gen_toks=16,
        dtype="float32",
    )
    assert list(scores) == ["quant_mmlu", "quant_humaneval"]
    assert scores["quant_mmlu"].metric == "acc"
    assert scores["quant_humaneval"].metric == "pass@1"
    for score in scores.values():
        assert isinstance(score, TaskScore)
        assert 0.0 <= score.value <= 1.0
        assert score.n == 3
        assert score.stderr is None or score.stderr >= 0.0
    assert list(tmp_path.iterdir()) == []


@needs_lm_eval
def test_lm_eval_bars_report_progress_steps_and_draw_nothing(
    tiny_moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture
) -> None:
    """lm-eval's request bars pass disable=False, which beats TQDM_DISABLE: they drew on stderr inside eval. Now
    nothing is drawn and the request bar logs quant progress steps, from 0 to its total (2 questions x 4 choices),
    at most one line per tenth; lm-eval's own tqdm is back afterwards."""
    import lm_eval.models.huggingface as hf
    import tqdm

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="quant")
    run_lm_eval(tiny_moe_dir, ["quant_mmlu"], limit=2, num_fewshot=0, batch_size=4, seed=0, device="cpu",
                dtype="float32")
    err = capfd.readouterr().err
    assert "Running loglikelihood requests" not in err and "Tokenizing inputs" not in err, err[-2000:]
    steps = [(r.getMessage(), r.progress) for r in caplog.records if isinstance(getattr(r, "progress", None), Step)]
    requests = [s for msg, s in steps if "Running loglikelihood requests" in msg]
    assert requests[0].done == 0 and requests[-1].done == requests[-1].total == 8, steps
    assert [s.done for s in requests] == sorted(s.done for s in requests) and len(requests) <= 11
    assert {(s.stage, s.unit) for _, s in steps} == {("lm-eval", "requests")}
    assert hf.tqdm is tqdm.tqdm


@needs_lm_eval
def test_quant_mmlu_holds_out_five_questions_per_subject() -> None:
    mmlu = _load_task_module("quant_mmlu")
    test = mmlu.load_dataset(version=1.0)["test"]
    # 57 subjects x 5 held out, minus 5 verbatim repeats of held-out questions later in their subject.
    assert len(test) == 14042 - 57 * 5 - 5
    subjects = list(mmlu._questions_by_subject())
    assert len(subjects) == 57
    scored = {(row["subject"], row["question"], tuple(row["choices"])) for row in test}
    held_out = {(s, q["question"], tuple(q["choices"])) for s in subjects for q in mmlu.fewshot_pool(s)}
    assert len(held_out) == 57 * 5
    assert not scored & held_out
    # Round-robin order: the first 57 scored questions cover every subject once.
    assert len({row["subject"] for row in test.select(range(57))}) == 57
    assert all(row["answer"] in (0, 1, 2, 3) and len(row["choices"]) == 4 for row in test.select(range(200)))


@needs_lm_eval
def test_quant_mmlu_fewshot_comes_from_the_same_subject_in_order() -> None:
    mmlu = _load_task_module("quant_mmlu")
    sampler = mmlu.HeldOutSubjectSampler([], rnd=1234)
    doc = {"subject": "virology", "question": "q", "choices": ["a", "b", "c", "d"], "answer": 0}
    shots = sampler.sample(3, eval_doc=doc)
    assert [s["subject"] for s in shots] == ["virology"] * 3
    assert shots == mmlu._questions_by_subject()["virology"][:3]
    with pytest.raises(ValueError, match="holds out 5"):
        sampler.sample(6, eval_doc=doc)


def test_quant_humaneval_metric_runs_completions_in_the_sandbox() -> None:
    task = _load_task_module("quant_humaneval")
    problem = load_problems()[2]
    assert task.pass_at_1([problem.task_id], [problem.canonical_solution]) == {"pass@1": 1.0}
    assert task.pass_at_1([problem.task_id], ["    import os\n    os.system('true')\n"]) == {"pass@1": 0.0}
    assert task.truncate_responses([["    return 1\ndef extra():\n"]], [{}]) == [["    return 1"]]
    assert len(task.load_dataset()["test"]) == 164


def test_quant_humaneval_is_refused_before_loading_where_the_sandbox_lacks_namespaces(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    script = f"""
import json, sys
from quant.errors import SandboxUnavailable
from quant.eval.lmeval import check_sandboxed_tasks, run_lm_eval
check_sandboxed_tasks(["quant_mmlu"], "require")  # no generated code: nothing to refuse
check_sandboxed_tasks(["quant_humaneval"], "allow_weak")  # the explicit opt-out
try:
    run_lm_eval({str(tmp_path)!r}, ["quant_mmlu", "quant_humaneval"])
except SandboxUnavailable as exc:
    print(json.dumps({{"refused": str(exc), "lm_eval_loaded": "lm_eval" in sys.modules}}))
"""
    proc = run_without_namespaces("-c", script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert "lacks namespaces" in out["refused"] and "eval.humaneval_sandbox: allow_weak" in out["refused"]
    assert not out["lm_eval_loaded"]


def test_a_run_with_quant_humaneval_is_refused_before_any_stage_where_the_sandbox_lacks_namespaces(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = run_without_namespaces("-m", "quant.cli", "run", str(REPO / "recipes" / "mixed_int8_int4.yaml"),
                                  "--set", "eval.tasks=[quant_humaneval]", "-o", str(run_dir))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "lacks namespaces" in lines[0] and "eval.humaneval_sandbox: allow_weak" in lines[0]
    assert not (run_dir / "calibration.safetensors").exists() and not (run_dir / "manifest.json").exists()


@needs_lm_eval
def test_unknown_offline_task_names_the_closest(tiny_moe_dir: Path) -> None:
    with pytest.raises(RecipeError, match="quant_mmlu"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlx"], limit=1)


@needs_lm_eval
def test_bad_arguments_are_rejected_before_evaluating(tiny_moe_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        run_lm_eval(tmp_path, ["quant_mmlu"])
    with pytest.raises(RecipeError, match="unknown lm-eval backend"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu"], backend="onnx")
    with pytest.raises(RecipeError, match="trust_remote_code"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu"], model_args={"trust_remote_code": True})
    with pytest.raises(FileNotFoundError, match="task directory"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu"], tasks_dir=tmp_path / "nowhere")


def test_scores_from_results_picks_headline_metrics_and_sums_groups() -> None:
    results = {
        "results": {
            "mmlu": {"acc,none": 0.7, "acc_stderr,none": 0.01, "alias": "mmlu"},
            "gsm8k": {
                "exact_match,flexible-extract": 0.6,
                "exact_match_stderr,flexible-extract": 0.02,
                "exact_match,strict-match": 0.5,
                "exact_match_stderr,strict-match": "N/A",
            },
            "humaneval": {"pass@1,create_test": 0.25, "pass@1_stderr,create_test": 0.03},
        },
        "group_subtasks": {"mmlu": ["mmlu_stem"], "mmlu_stem": ["mmlu_anatomy", "mmlu_virology"]},
        "n-samples": {
            "mmlu_anatomy": {"original": 135, "effective": 10},
            "mmlu_virology": {"original": 166, "effective": 10},
            "gsm8k": {"original": 1319, "effective": 1319},
            "humaneval": {"original": 164, "effective": 164},
        },
    }
    scores = scores_from_results(results, ["mmlu", "gsm8k", "humaneval"])
    assert scores["mmlu"] == TaskScore(value=0.7, stderr=0.01, n=20, metric="acc")
    assert scores["gsm8k"] == TaskScore(value=0.5, stderr=None, n=1319, metric="exact_match")
    assert scores["humaneval"] == TaskScore(value=0.25, stderr=0.03, n=164, metric="pass@1")
    with pytest.raises(ValueError, match="no result for 'arc_easy'"):
        scores_from_results(results, ["arc_easy"])


@needs_lm_eval
def test_unknown_lm_eval_task_is_checked_against_lm_evals_own_registry(tiny_moe_dir: Path) -> None:
    # A name outside our offline tasks makes run_lm_eval index lm-eval's built-in tasks (real names
    # such as `mmlu` pass straight through); a typo is reported with lm-eval's closest names.
    with pytest.raises(RecipeError, match="'mmlux' \\(closest: mmlu"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu", "mmlux"], limit=1)


def test_gate_presets_are_well_formed() -> None:
    import yaml

    gates = yaml.safe_load((REPO / "evals" / "gates.yaml").read_text(encoding="utf-8"))
    assert gates["schema_version"] == 1
    assert set(gates["presets"]) >= {"strict", "lenient"}
    for preset in gates["presets"].values():
        assert set(preset) == {"mmlu", "humaneval", "perplexity"}
        assert preset["mmlu"]["max_drop"] > 0 and preset["humaneval"]["max_drop"] > 0
        assert 0 < preset["perplexity"]["max_rel_increase"] < 1
    strict, lenient = gates["presets"]["strict"], gates["presets"]["lenient"]
    assert strict["mmlu"]["max_drop"] <= lenient["mmlu"]["max_drop"]
    assert strict["humaneval"]["max_drop"] <= lenient["humaneval"]["max_drop"]


def test_dispatch_map_spreads_whole_decoder_layers_over_the_gpus() -> None:
    """accelerate's device map for the 8-layer reference MoE on 2 GPUs: balanced (4 layers each), every decoder
    layer whole on one GPU, embedding on the first and lm_head on the last; a model that does not fit is refused
    before anything loads."""
    from quant.eval.lmeval import dispatch_map
    from quant.models.builtin import builtin_path

    model_dir = builtin_path("reference-moe")
    device_map = dispatch_map(model_dir, 2, max_memory_per_gpu=10**9, dtype="bfloat16")
    layers = {k: v for k, v in device_map.items() if k.startswith("model.layers")}
    assert layers == {f"model.layers.{i}": i // 4 for i in range(8)}
    assert device_map["model.embed_tokens"] == 0 and device_map["lm_head"] == 1
    with pytest.raises(CheckpointError, match="does not fit on 2 GPU"):
        dispatch_map(model_dir, 2, max_memory_per_gpu=3_000_000, dtype="bfloat16")


class _Stop(Exception):
    pass


def test_hf_dispatch_reaches_lm_eval_as_one_process(
    tiny_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpus=2: lm-eval gets parallelize=True and accelerate's device map, and (inside a torchrun rank) sees none
    of the launcher's variables; they are restored afterwards. The real 2-GPU run is in BENCHMARKS.md."""
    import os

    import lm_eval

    from quant.eval.lmeval import dispatch_map

    seen: dict = {}

    def spy(**kwargs):
        seen.update(kwargs, env={k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "RANK")})
        raise _Stop

    monkeypatch.setattr(lm_eval, "simple_evaluate", spy)
    for name, value in (("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(_Stop):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu"], limit=1, gpus=2, max_memory_per_gpu=10**9, dtype="float32")
    assert seen["model"] == "hf" and seen["model_args"]["parallelize"] is True
    assert seen["model_args"]["device_map"] == dispatch_map(tiny_moe_dir, 2, 10**9, "float32")
    assert seen["env"] == {"LOCAL_RANK": None, "WORLD_SIZE": None, "RANK": None}
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "2"
    with pytest.raises(RecipeError, match="tensor_parallel_size"):
        run_lm_eval(tiny_moe_dir, ["quant_mmlu"], backend="vllm", gpus=2)
