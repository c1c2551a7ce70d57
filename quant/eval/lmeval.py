"""lm-eval integration: score an exported model directory on lm-eval tasks, offline or on a cluster.

`run_lm_eval(model_dir, tasks, ...)` calls `lm_eval.simple_evaluate` with the `hf` backend (or `vllm` when
asked and installed) on the directory as written by export, `trust_remote_code` off unless asked for, and
returns one `TaskScore` per requested task. lm-eval is imported lazily, only when this runs.

Models bigger than one GPU: with `gpus > 1` the hf backend loads the model over GPUs 0..gpus-1 through
accelerate's big-model dispatch (`dispatch_map`: `infer_auto_device_map` over a balanced `max_memory`, whole
decoder layers per GPU, passed to lm-eval with `parallelize=True`); the vllm backend takes
`tensor_parallel_size` / `data_parallel_size` in `model_args`. In a torchrun job lm-eval runs in the calling
(writer) process alone: the launcher's variables are hidden from it, so accelerate does not make it one member
of a data-parallel group the other ranks never join.

Task names:
- Offline equivalents live in `<repo>/evals/tasks` and are registered through
  `TaskManager(include_path=...)`: `quant_mmlu` (the MMLU test set bundled in `evals/data`, 4-way
  log-likelihood multiple choice, 5-shot from a held-out per-subject pool) and `quant_humaneval` (the 164
  bundled HumanEval problems, greedy generation, pass@1). They need no network and no hub.
- Any other name (`mmlu`, `humaneval`, `gsm8k`, ...) passes straight to lm-eval's own registry, for
  cluster runs with hub access; lm-eval's built-in tasks are only indexed (~10 s) when such a name is asked.

Code execution: `quant_humaneval` scores with its own metric function, `evals/tasks/quant_humaneval.py`
(wired into the task YAML with `!function`), which runs every completion through `quant.eval.humaneval` /
`quant.eval.sandbox`: namespaces, a minimal read-only root, no privileges, a seccomp filter and rlimits. Where
the machine lacks one of the required kernel layers, `run_lm_eval` refuses such a task before loading anything
(SandboxUnavailable) unless `humaneval_sandbox="allow_weak"` (the recipe's `eval.humaneval_sandbox`). It
does not use lm-eval's `code_eval` metric (that one is fetched from the hub by the `evaluate` library and
executes code in-process-tree with only `HF_ALLOW_CODE_EVAL=1` as a guard), so the offline task needs
neither. lm-eval's own `humaneval` is refused unless `allow_unsandboxed_code=True` (and the caller exports
`HF_ALLOW_CODE_EVAL=1`), because it would run generated code outside our sandbox.

Progress: while lm-eval runs, its progress bars are replaced (`_bars_as_steps`): nothing is drawn on stderr (its
request bars pass `disable=False`, which overrides `TQDM_DISABLE`), and each bar with a description (`Running
loglikelihood requests`, `Running generate_until requests`, ...) reports as quant progress steps
(`quant.progress`, stage `lm-eval`, unit requests): a log line when it starts, at every tenth of its total and at
its end, which the console shows as a bar on a TTY and as plain lines with elapsed time and ETA in a batch log.
`check_tasks` runs before any stage of a run: unknown names, unsandboxed code tasks and, offline, datasets missing
from the local cache are one RecipeError there instead of a failure in the eval stage.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import logging
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quant.errors import CheckpointError, MissingDependency, RecipeError
from quant.eval.sandbox import isolation_policy, require_isolation
from quant.progress import step

logger = logging.getLogger(__name__)

BACKENDS = ("hf", "vllm")
BACKEND_MODULES = {"hf": "lm_eval.models.huggingface", "vllm": "lm_eval.models.vllm_causallms"}
PROGRESS_STEPS = 10  # log lines per lm-eval bar (besides its start)
OFFLINE_TASK_PREFIX = "quant_"
# Metric reported for a task, first match wins; within a metric, the first matching lm-eval filter wins.
PRIMARY_METRICS = ("acc", "pass@1", "exact_match", "acc_norm", "mc2", "f1", "em")
PREFERRED_FILTERS = ("none", "sandbox", "strict-match", "create_test", "flexible-extract")
DEFAULT_BOOTSTRAP_ITERS = 1000
# offline tasks whose metric executes generated code (in quant.eval.sandbox)
SANDBOXED_TASKS = ("quant_humaneval",)


@dataclass(frozen=True)
class TaskScore:
    """A task's headline number: `value` of lm-eval `metric` (e.g. "acc", "pass@1"), its standard error
    (None when lm-eval reports none), and `n`, the number of documents scored (summed over subtasks for
    a group such as `mmlu`)."""

    value: float
    stderr: float | None
    n: int
    metric: str


def default_tasks_dir() -> Path:
    """`<repo>/evals/tasks`, located relative to this package (source checkouts and editable installs)."""
    return Path(__file__).resolve().parents[2] / "evals" / "tasks"


def run_lm_eval(
    model_dir: str | Path,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    seed: int = 0,
    device: str = "cpu",
    backend: str = "hf",
    max_gen_toks: int | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    model_args: Mapping[str, Any] | None = None,
    tasks_dir: str | Path | None = None,
    allow_unsandboxed_code: bool = False,
    gpus: int = 1,
    max_memory_per_gpu: int | None = None,
    humaneval_sandbox: str = "require",
    results_path: str | Path | None = None,
) -> dict[str, TaskScore]:
    """Evaluate the model saved in `model_dir` on `tasks`; returns {task name: TaskScore} in input order.

    `limit` caps documents per task (per subtask for groups), `num_fewshot=None` keeps each task's own
    default, `max_gen_toks=None` keeps each generative task's own budget. `model_args` adds backend options
    (e.g. `tensor_parallel_size`, `max_model_len` for vllm). `tasks_dir` defaults to `default_tasks_dir()`.
    `gpus > 1` (hf): the model is dispatched over GPUs 0..gpus-1 by an accelerate device map (`dispatch_map`,
    at most `max_memory_per_gpu` bytes each) and lm-eval loads it with `parallelize=True`.
    `humaneval_sandbox`: the sandbox policy for `SANDBOXED_TASKS` ("require" or "allow_weak", see
    `check_sandboxed_tasks`). Raises SandboxUnavailable as `check_sandboxed_tasks` does; CheckpointError for a directory without config.json; RecipeError for an unknown backend or task
    name (naming the closest ones), misplaced `model_args`, or an lm-eval task that would execute code
    outside the sandbox; FileNotFoundError for a missing tasks directory; ModuleNotFoundError when lm-eval
    (or vllm for that backend) is not installed. `results_path`: where lm-eval's own results go as JSON (what it
    writes with `--output_path`: scores, task configs, versions, n-shot, sample counts; no per-sample logs).
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(
            f"{model_dir} is not a model directory (no config.json); pass an exported model"
        )
    if not tasks:
        raise RecipeError("run_lm_eval needs at least one task name")
    check_sandboxed_tasks(tasks, humaneval_sandbox)
    lm_eval = _import_lm_eval()
    task_manager = _task_manager(list(tasks), Path(tasks_dir) if tasks_dir else default_tasks_dir())
    if gpus > 1 and backend != "hf":
        raise RecipeError("gpus dispatches an hf model over GPUs; vllm takes tensor_parallel_size instead")
    args = _model_args(backend, model_dir, dtype, trust_remote_code, seed, model_args)
    if gpus > 1:
        args.update(parallelize=True, device_map=dispatch_map(model_dir, gpus, max_memory_per_gpu,
                                                              trust_remote_code=trust_remote_code))
    logger.info("lm-eval %s on %s: tasks=%s limit=%s", backend, model_dir, list(tasks), limit)
    try:
        with _one_process(), isolation_policy(humaneval_sandbox), _bars_as_steps(backend):
            results = lm_eval.simple_evaluate(
                model=backend,
                model_args=args,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                batch_size=batch_size,
                device=device,
                limit=limit,
                task_manager=task_manager,
                gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks is not None else None,
                log_samples=False,
                bootstrap_iters=DEFAULT_BOOTSTRAP_ITERS,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                confirm_run_unsafe_code=allow_unsandboxed_code,
            )
    except ConnectionError as exc:  # a dataset neither cached nor reachable (check_tasks sees the offline case first)
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise RecipeError(f"lm-eval could not fetch a dataset of eval.tasks {list(tasks)} ({reason}); check the "
                          "network, or use the offline tasks (quant_mmlu, quant_humaneval)") from None
    except ValueError as exc:
        if "unsafe" not in str(exc):
            raise
        raise RecipeError(
            f"{exc} -- quant runs generated code only in its sandbox: use quant_humaneval, or pass "
            "allow_unsandboxed_code=True (and export HF_ALLOW_CODE_EVAL=1) on a disposable machine"
        ) from exc
    scores = scores_from_results(results, tasks)
    if results_path is not None:
        save_results(results, Path(results_path))
    for name, score in scores.items():
        logger.info("%s: %s=%.4f (n=%d)", name, score.metric, score.value, score.n)
    return scores


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_installed(tasks: Sequence[str], backend: str) -> None:
    """Before any work: lm-eval is installed when ``tasks`` name any, and vLLM for its backend (MissingDependency,
    one line naming the pip command)."""
    if tasks and not _installed("lm_eval"):
        raise MissingDependency(f"eval.tasks ({', '.join(tasks)}) need lm-eval, which is not installed: pip install "
                                "'moe-quant[eval]' (or set eval.tasks: [])")
    if tasks and backend == "vllm" and not _installed("vllm"):
        raise MissingDependency("eval.backend vllm needs vLLM, which is not installed: pip install vllm (or set "
                                "eval.backend: hf)")


def save_results(results: Mapping[str, Any], path: Path) -> None:
    """lm-eval's results dict as its own JSON output has it (non-JSON values as lm-eval writes them), atomically."""
    import json

    from lm_eval.utils import handle_non_serializable

    from quant.io.rundir import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in results.items() if k != "samples"}
    atomic_write_text(path, json.dumps(kept, indent=1, default=handle_non_serializable))


def check_sandboxed_tasks(tasks: Sequence[str], humaneval_sandbox: str) -> None:
    """Before any work: when ``tasks`` include one that executes generated code (``SANDBOXED_TASKS``), the sandbox
    must have every kernel layer, or ``humaneval_sandbox`` must be "allow_weak". Raises SandboxUnavailable (one
    line naming what is missing and the opt-out)."""
    if any(name in SANDBOXED_TASKS for name in tasks):
        require_isolation(humaneval_sandbox)


def check_tasks(tasks: Sequence[str], tasks_dir: Path | None = None, allow_unsandboxed_code: bool = False) -> None:
    """Before any work, a RecipeError for what ``run_lm_eval`` would only find after every other stage: lm-eval
    missing, an unknown task name (naming the closest), a task that runs generated code outside quant's sandbox
    (lm-eval's ``unsafe_code`` tasks, e.g. ``humaneval``), and, offline (``datasets``' ``HF_DATASETS_OFFLINE``), a
    dataset of lm-eval's tasks that is not in the local cache (``mmlu`` offline was a ConnectionError in eval)."""
    try:
        _import_lm_eval()
    except ModuleNotFoundError as e:
        raise RecipeError(f"eval.tasks needs lm-eval: {e}") from None
    manager = _task_manager(list(tasks), tasks_dir or default_tasks_dir())
    leaves = _leaf_tasks(manager, tasks)
    unsafe = sorted(n for n, cfg in leaves.items() if cfg.get("unsafe_code"))
    if unsafe and not allow_unsandboxed_code:
        raise RecipeError(f"eval.tasks: lm-eval's {', '.join(unsafe[:3])} would run generated code outside quant's "
                          "sandbox; use quant_humaneval (HumanEval graded in the sandbox) or drop it")
    from datasets import config as datasets_config

    if datasets_config.HF_DATASETS_OFFLINE:
        missing = sorted({f"{cfg['dataset_path']}" for n, cfg in leaves.items()
                          if cfg.get("dataset_path") and not _cached_offline(cfg)})
        if missing:
            raise RecipeError(f"eval.tasks: the dataset(s) {', '.join(missing[:3])} of lm-eval's tasks are not in the "
                              "local cache and the hub is off (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE); download them "
                              "first, or use the offline tasks (quant_mmlu, quant_humaneval)")


def _leaf_tasks(manager, names: Sequence[str]) -> dict[str, dict]:
    """Every task (name -> its config from lm-eval's index) that ``names`` (tasks, groups, tags) stand for."""
    out: dict[str, dict] = {}
    todo, seen = list(names), set()
    while todo:
        item = todo.pop()
        if isinstance(item, dict):  # a group's inline task config
            todo += [item["task"]] if isinstance(item.get("task"), str) and "dataset_path" not in item else []
            if "dataset_path" in item or "unsafe_code" in item:
                out[str(item.get("task", "?"))] = item
            continue
        if not isinstance(item, str) or item in seen:
            continue
        seen.add(item)
        entry = manager.task_index.get(item)
        if entry is None:
            continue
        cfg = entry.cfg or {}
        kind = getattr(entry.kind, "name", "")
        if kind == "TAG":
            todo += sorted(entry.tags)
        elif kind == "GROUP":
            members = cfg.get("task", [])
            todo += members if isinstance(members, list) else [members]
        else:
            out[item] = cfg
    return out


def _cached_offline(cfg: Mapping[str, Any]) -> bool:
    """Whether ``datasets`` finds a task's dataset without the hub (only a missing dataset counts: anything else
    this cannot judge is left to lm-eval)."""
    import datasets

    kwargs = cfg.get("dataset_kwargs") or {}
    try:
        datasets.load_dataset_builder(cfg["dataset_path"], cfg.get("dataset_name"),
                                      **({"data_files": kwargs["data_files"]} if "data_files" in kwargs else {}))
    except (ConnectionError, FileNotFoundError):
        return False
    except Exception:  # noqa: BLE001 - a builder this check cannot build offline for another reason
        return True
    return True


# torchrun / srun variables: accelerate (inside lm-eval's hf backend) reads LOCAL_RANK and would turn a torchrun
# rank into one process of a data-parallel lm-eval run that the other ranks never join
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """lm-eval runs in this process alone (the writer rank of a torchrun job): launcher variables are hidden from it
    for the duration and restored afterwards."""
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class _Steps:
    """Stands in for ``tqdm`` inside lm-eval: draws nothing; a bar with a description and a known total logs
    progress steps (start, each tenth of the total, end). The subset of tqdm's interface lm-eval uses: iterate,
    ``update``, ``close``, context manager, ``set_description`` / ``set_postfix`` (ignored)."""

    def __init__(self, iterable: Iterable | None = None, desc: str | None = None, total: int | None = None,
                 *_args, **_kwargs):
        self.iterable, self.desc, self.n = iterable, desc, 0
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total = total
        self._reported = -1
        self._report()

    def _report(self, final: bool = False) -> None:
        if not self.desc or not self.total or self.n <= self._reported:
            return
        done = min(self.n, self.total)
        every = max(1, math.ceil(self.total / PROGRESS_STEPS))
        if final or done in (0, self.total) or done // every > max(self._reported, 0) // every:
            self._reported = self.n
            logger.info("lm-eval: %s %d/%d", self.desc, done, self.total,
                        extra=step("lm-eval", done, self.total, "requests"))

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)

    def __len__(self) -> int:
        return self.total or 0

    def __enter__(self) -> _Steps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._report()

    def close(self) -> None:
        self._report(final=True)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    @staticmethod
    def write(text: str, *args, **kwargs) -> None:
        logger.info("lm-eval: %s", text)


@contextlib.contextmanager
def _bars_as_steps(backend: str) -> Iterator[None]:
    """For the duration: every loaded lm-eval module's ``tqdm`` (the backend's module imported first, so that its
    request bars are among them) is ``_Steps``; restored afterwards."""
    with contextlib.suppress(ImportError):
        importlib.import_module(BACKEND_MODULES[backend])
    import tqdm
    import tqdm.auto
    import tqdm.std

    real = {tqdm.tqdm, tqdm.std.tqdm, tqdm.auto.tqdm}
    swapped = [m for name, m in list(sys.modules.items())
               if name.split(".")[0] == "lm_eval" and getattr(m, "tqdm", None) in real]
    saved = [m.tqdm for m in swapped]
    for m in swapped:
        m.tqdm = _Steps
    try:
        yield
    finally:
        for m, original in zip(swapped, saved, strict=True):
            m.tqdm = original


def _import_lm_eval():
    try:
        import lm_eval
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "lm-eval is not installed; install the eval extra: pip install 'moe-quant[eval]'"
        ) from exc
    return lm_eval


@functools.lru_cache(maxsize=4)
def _indexed(tasks_dir: str, include_defaults: bool):
    """A TaskManager (lm-eval indexes every task config it can see: ~10 s with its built-ins), built once per
    process: the check before any work, then the base and the quantized model's evaluations, share it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=tasks_dir, include_defaults=include_defaults)


def _task_manager(tasks: list[str], tasks_dir: Path):
    """A TaskManager over our offline tasks; lm-eval's built-ins are indexed only if a task needs them."""
    if not tasks_dir.is_dir():
        raise FileNotFoundError(f"offline lm-eval task directory {tasks_dir} not found; pass tasks_dir")
    offline = _indexed(str(tasks_dir), False)
    if all(name in offline.all_tasks for name in tasks):
        return offline
    unknown_offline = [n for n in tasks if n.startswith(OFFLINE_TASK_PREFIX) and n not in offline.all_tasks]
    if unknown_offline:
        raise RecipeError(_unknown_tasks_message(unknown_offline, offline.all_tasks))
    manager = _indexed(str(tasks_dir), True)
    unknown = [n for n in tasks if n not in manager.all_tasks]
    if unknown:
        raise RecipeError(_unknown_tasks_message(unknown, manager.all_tasks))
    return manager


def _unknown_tasks_message(unknown: list[str], known: Sequence[str]) -> str:
    hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
    return "unknown lm-eval task(s): " + "; ".join(
        f"{n!r} (closest: {', '.join(h) or 'none'})" for n, h in hints.items()
    )


def _model_args(
    backend: str,
    model_dir: Path,
    dtype: str,
    trust_remote_code: bool,
    seed: int,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """lm-eval `model_args` for `backend`; `extra` may add options but not re-enable remote code."""
    if backend not in BACKENDS:
        raise RecipeError(f"unknown lm-eval backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ModuleNotFoundError("backend='vllm' needs vllm installed (pip install vllm); or use 'hf'")
    extra = dict(extra or {})
    if "trust_remote_code" in extra or "pretrained" in extra:
        raise RecipeError("set trust_remote_code and the model directory through run_lm_eval's own arguments")
    args: dict[str, Any] = {
        "pretrained": str(model_dir),
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
    }
    if backend == "vllm":
        args["seed"] = seed
    return {**args, **extra}


def dispatch_map(model_dir: Path, gpus: int, max_memory_per_gpu: int | None = None,
                 dtype: str = "auto", trust_remote_code: bool = False) -> dict[str, int]:
    """accelerate's big-model dispatch for an hf model over GPUs ``0..gpus-1``: module name -> GPU, whole decoder
    layers (the model's ``_no_split_modules``) in order, balanced over the GPUs (``get_balanced_memory``) within
    ``max_memory_per_gpu`` bytes each (default: each GPU's free memory). Built on the meta device: no weights
    are read. Raises CheckpointError when the model does not fit (accelerate would offload to cpu/disk)."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else (getattr(config, "dtype", None) or torch.bfloat16)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch_dtype)
    if max_memory_per_gpu is None:
        max_memory = {i: torch.cuda.mem_get_info(i)[0] for i in range(gpus)}
    else:
        max_memory = {i: max_memory_per_gpu for i in range(gpus)}
    no_split = list(model._no_split_modules or [])
    balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=torch_dtype)
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split,
                                       dtype=torch_dtype)
    offloaded = [name for name, dev in device_map.items() if not isinstance(dev, int)]
    if offloaded:
        raise CheckpointError(
            f"{model_dir} does not fit on {gpus} GPU(s) of {min(max_memory.values()) / 1e9:.3g} GB "
            f"({offloaded[0] or 'the model'} would go to {device_map[offloaded[0]]}); raise eval.gpus or "
            "eval.max_memory_per_gpu_gb"
        )
    logger.info("dispatching %s over %d GPUs: %s", model_dir, gpus, _placement(device_map))
    return device_map


def _placement(device_map: Mapping[str, int]) -> str:
    """``{gpu: number of top-level modules}`` for the log line."""
    counts: dict[int, int] = {}
    for dev in device_map.values():
        counts[dev] = counts.get(dev, 0) + 1
    return ", ".join(f"GPU {d}: {n} modules" for d, n in sorted(counts.items()))


def scores_from_results(results: Mapping[str, Any], tasks: Sequence[str]) -> dict[str, TaskScore]:
    """Extract one TaskScore per requested task from an lm-eval `simple_evaluate` result dict.

    The metric is the first of `PRIMARY_METRICS` the task reports (filters ranked by
    `PREFERRED_FILTERS`). Raises ValueError when a task is missing or reports no numeric metric.
    """
    table = results["results"]
    scores = {}
    for name in tasks:
        if name not in table:
            raise ValueError(f"lm-eval returned no result for {name!r}; it reported {sorted(table)}")
        metric, filter_name = _pick_metric(name, table[name])
        stderr = table[name].get(f"{metric}_stderr,{filter_name}")
        scores[name] = TaskScore(
            value=float(table[name][f"{metric},{filter_name}"]),
            stderr=float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None,
            n=_n_documents(name, results),
            metric=metric,
        )
    return scores


def task_records(results: Mapping[str, Any], tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What the model card lists per task, read from lm-eval's own results JSON (``save_results``): task ->
    ``{"version", "n_shot", "n", "metric", "value"}`` (version and n-shot None where lm-eval records none, as for a
    group). Raises ValueError as `scores_from_results` does."""
    scores = scores_from_results(results, tasks)
    return {name: {"version": results.get("versions", {}).get(name), "n_shot": results.get("n-shot", {}).get(name),
                   "n": s.n, "metric": s.metric, "value": s.value} for name, s in scores.items()}


def _pick_metric(name: str, row: Mapping[str, Any]) -> tuple[str, str]:
    """(metric, filter) of the headline number in one lm-eval results row."""
    keys = [k.split(",", 1) for k in row if "," in k and "_stderr" not in k]
    keys = [(m, f) for m, f in keys if isinstance(row[f"{m},{f}"], (int, float))]
    if not keys:
        raise ValueError(f"lm-eval reported no numeric metric for {name!r}: {dict(row)}")

    def rank(key: tuple[str, str]) -> tuple[int, int]:
        metric, filter_name = key
        metric_rank = PRIMARY_METRICS.index(metric) if metric in PRIMARY_METRICS else len(PRIMARY_METRICS)
        filter_rank = (
            PREFERRED_FILTERS.index(filter_name)
            if filter_name in PREFERRED_FILTERS
            else len(PREFERRED_FILTERS)
        )
        return metric_rank, filter_rank

    return min(keys, key=rank)


def _n_documents(name: str, results: Mapping[str, Any]) -> int:
    """Documents scored for a task, or summed over a group's subtasks (recursively)."""
    n_samples = results.get("n-samples", {})
    if name in n_samples:
        return int(n_samples[name]["effective"])
    subtasks = results.get("group_subtasks", {}).get(name, [])
    return sum(_n_documents(sub, results) for sub in subtasks)
