"""Property: whatever bytes a recipe file holds, ``quant validate`` exits 0, or 1 with exactly one ``error:`` line,
quickly and in bounded memory. Generated: recipes over the real schema with hostile values (YAML tags, dates,
binary, sets, huge and non-finite numbers, booleans, control characters, duplicate keys), alias bombs, deep
nesting, byte flips of a valid recipe and raw bytes. In-process through ``cli_exit_code`` (what ``main`` runs);
a few real subprocesses check the console entry point. Bounds: each recipe under 2 s, the whole run's peak RSS under
1 GiB (it runs in a child process under a 4 GiB address-space limit).

The same property for model folders (``test_any_model_folder_is_ok_with_a_correct_checkpoint_or_one_error_line``,
slow): builtins with tensors dropped, added, reshaped or retyped, config values set to hostile ones and shards
indexed out of the folder, beside edits a consistent folder survives, through ``quant estimate`` and ``quant run``:
exit 0 with a checkpoint holding every tensor of the model, or one ``error:`` line and exit 1."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quant.cli import cli_exit_code
from quant.recipe import Recipe, _submodel
from tests.conftest import REPO

HEADLINE = (REPO / "recipes" / "mixed_int8_int4.yaml").read_bytes()
N_EXAMPLES = 1000
MAX_SECONDS_PER_RECIPE = 2.0
MAX_RSS_BYTES = 1 << 30  # the whole run's peak; validating one recipe needs ~100 MB


def _leaf_keys(model, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        sub = _submodel(f.annotation)
        if sub is None:
            out.append(prefix + name)
        elif sub.__name__ == "GateSpec":
            out += [f"{prefix}{name}.{g}.{k}" for g in ("perplexity", "kl", "top1_agreement", "mmlu")
                    for k in sub.model_fields]
        else:
            out += _leaf_keys(sub, f"{prefix}{name}.")
    return out


KEYS = _leaf_keys(Recipe)
WORDS = ["true", "false", "yes", "off", "null", "~", "''", "keep", "auto", "cpu", "cuda", "cuda:3", "rtn", "gptq",
         "awq", "budget", "uniform", "per_layer", "global", "compressed-tensors", "[compressed-tensors, gptq]", "[]",
         "{}", "[quant_mmlu]", "2024-01-01", "2024-01-01T10:00:00Z", "2001-12-14 21:59:43.10 -5", "0x1F", "0o17",
         "1_000", "1e400", "-0", "+.inf", "-.inf", ".NaN", "builtin:olmoe-tiny", "calibration/bundled.yaml", "8", "4",
         "0.2", "-1", "128", "32"]
TAGGED = ["!!binary aGVsbG8=", "!!set {a, b}", "!!timestamp 2001-12-14", "!!omap [a: 1]", "!!pairs [a: 1]",
          "!!python/object:os.system x", "!!python/name:os.system ''", "!local x", "!!str 12", "!!int '7'",
          "!!float 1", "!!bool yes", "!!null ''"]
scalars = st.one_of(
    st.sampled_from(WORDS), st.sampled_from(WORDS), st.sampled_from(WORDS), st.sampled_from(TAGGED),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=12).map(json.dumps),  # YAML double-quoted: escapes give control characters, surrogates
    st.lists(st.sampled_from(WORDS), max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
)
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.text(min_size=1, max_size=8).map(json.dumps))


def _render(entries: list[tuple[str, str]]) -> str:
    """Block-style YAML from dotted keys; repeated keys stay repeated (duplicate-key documents)."""
    lines, open_path = [], []
    for key, value in entries:
        parts = key.split(".") if not key.startswith('"') else [key]
        common = 0
        while common < min(len(open_path), len(parts) - 1) and open_path[common] == parts[common]:
            common += 1
        for depth in range(common, len(parts) - 1):
            lines.append("  " * depth + f"{parts[depth]}:")
        open_path = parts[:-1]
        lines.append("  " * (len(parts) - 1) + f"{parts[-1]}: {value}")
    return "\n".join(lines) + "\n"


@st.composite
def schema_recipes(draw) -> bytes:
    tidy = draw(st.integers(0, 4)) > 0  # mostly distinct keys grouped by section; else duplicates and reopened sections
    entries = draw(st.lists(st.tuples(keys, scalars), max_size=6, unique_by=(lambda kv: kv[0]) if tidy else None))
    if tidy:
        entries.sort(key=lambda kv: kv[0].split(".")[:-1])
    if draw(st.integers(0, 9)):
        name = draw(st.sampled_from(["fuzz"] * 6 + ["2024-01-01", "'x'", "a/b", ".h", "!!binary eA=="]))
        entries = [("name", name)] + [e for e in entries if e[0] != "name"]
    return _render(entries).encode("utf-8", "surrogatepass")


@st.composite
def alias_bombs(draw) -> bytes:
    levels, fanout = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    lines = ['l0: &l0 ["lol", "lol"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fanout) + "]" for i in range(1, levels + 1)]
    lines.append(f"name: fuzz\n{draw(st.sampled_from(['description', 'eval.tasks', 'plan']))}: *l{levels}")
    return "\n".join(lines).encode()


@st.composite
def deep_documents(draw) -> bytes:
    depth = draw(st.integers(1, 3000))
    kind = draw(st.sampled_from(["[", "{a: ", "block"]))
    if kind == "[":
        body = "[" * depth + "]" * depth
    elif kind == "{a: ":
        body = "{a: " * depth + "1" + "}" * depth
    else:
        depth = min(depth, 200)
        body = "\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, depth)) + "  " * depth + "v"
    return f"name: fuzz\nplan: {body}\n".encode()


@st.composite
def byte_flips(draw) -> bytes:
    data = bytearray(HEADLINE)
    for _ in range(draw(st.integers(1, 8))):
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if op == "set":
            data[pos] = byte
        elif op == "insert":
            data.insert(pos, byte)
        else:
            del data[pos]
    return bytes(data)


documents = st.one_of(schema_recipes(), schema_recipes(), schema_recipes(), schema_recipes(), alias_bombs(),
                      deep_documents(), byte_flips(), st.binary(max_size=300))


def _validate(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_exit_code(["validate", str(path)])
    return code, out.getvalue(), err.getvalue()


def _kind(line: str) -> str:
    for needle, kind in [("unsupported YAML tag", "tag"), ("duplicate key", "duplicate"), ("nesting deeper", "nesting"),
                         ("expands to more than", "aliases"), ("recursive YAML alias", "aliases"),
                         ("not UTF-8", "utf-8"), ("invalid recipe value", "value"), ("unknown recipe key", "unknown key"),
                         ("malformed YAML", "malformed"), ("control character", "control"),
                         ("unpaired surrogate", "control"), ("must be a YAML mapping", "shape")]:
        if needle in line:
            return kind
    return "other"


def run_fuzz(n_examples: int, workdir: str) -> dict:
    """The property over ``n_examples`` generated files (runs in a child process: its peak RSS is the memory bound)."""
    path = Path(workdir) / "recipe.yaml"
    outcomes: Counter = Counter()
    seconds: list[float] = []
    _validate(REPO / "recipes" / "mixed_int8_int4.yaml")  # imports and typer's command, before timing

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(documents)
    def check(data: bytes) -> None:
        path.write_bytes(data)
        t0 = time.perf_counter()
        code, out, err = _validate(path)
        seconds.append(time.perf_counter() - t0)
        assert code in (0, 1), (code, data[:300], err[-2000:])
        if code == 1:
            lines = err.strip("\n").split("\n")
            assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 8, (data[:300], err)
            outcomes[_kind(lines[0])] += 1
        else:
            assert "schema_version: 1" in out, (data[:300], out, err)
            outcomes["ok"] += 1

    t0 = time.perf_counter()
    check()
    return {"n": len(seconds), "max_s": max(seconds), "total_s": time.perf_counter() - t0, "outcomes": dict(outcomes),
            "max_rss_bytes": _peak_rss_bytes()}


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it does not carry the forking parent's peak over
    exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # an alias bomb needed 12.6 GB before


def test_any_recipe_file_is_ok_or_one_error_line(tmp_path):
    code = ("import json, sys; from tests.test_recipe_fuzz import run_fuzz; "
            "print(json.dumps(run_fuzz(int(sys.argv[1]), sys.argv[2])))")
    # the address-space cap measures the parser, not the machine: one BLAS/OpenMP thread (each reserves its own
    # buffers: OpenBLAS on a 32-core node could not start its threads under the cap) and no CUDA (its context
    # reserves address space by the GB; parsing a recipe never needs a GPU)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", code, str(N_EXAMPLES), str(tmp_path)], cwd=REPO, capture_output=True,
                           text=True, timeout=900, preexec_fn=_limit_memory, env=env)
    assert child.returncode == 0, child.stderr[-6000:]
    summary = json.loads(child.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["n"] >= N_EXAMPLES
    assert summary["max_s"] < MAX_SECONDS_PER_RECIPE, summary
    assert summary["max_rss_bytes"] < MAX_RSS_BYTES, summary
    # the generator reached every class it is meant to (and valid recipes too)
    for kind in ("ok", "tag", "duplicate", "nesting", "aliases", "utf-8", "value", "unknown key", "malformed",
                 "control"):
        assert summary["outcomes"].get(kind, 0) > 0, summary


def _cli(*args: str, data: bytes | None = None, tmp_path: Path) -> subprocess.CompletedProcess:
    """The console entry point under a 4 GiB address-space limit (an alias bomb needed 12.6 GB before)."""
    if data is not None:
        (tmp_path / "r.yaml").write_bytes(data)

    return subprocess.run([sys.executable, "-m", "quant.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, preexec_fn=_limit_memory)


def test_real_cli_cases(tmp_path):
    bomb = "\n".join(['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'] +
                     [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)] +
                     ["name: *a9"]).encode()
    cases = [(bomb, 1, "expands to more than"), (b"name: caf\xe9\n", 1, "not UTF-8"),
             (b"name: x\nplan: " + b"[" * 50000 + b"]" * 50000, 1, "nesting deeper"),
             (b"name: x\nname: y\n", 1, "duplicate key"), (b"name: 2024-01-01\n", 0, "")]
    recipe = str(tmp_path / "r.yaml")
    for data, code, needle in cases:
        t0 = time.perf_counter()
        p = _cli("validate", recipe, data=data, tmp_path=tmp_path)
        assert p.returncode == code and time.perf_counter() - t0 < 60, (data[:80], p.returncode, p.stderr[-2000:])
        if code:
            assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr
    p = _cli("validate", str(REPO / "recipes" / "mixed_int8_int4.yaml"), "--set", "name=a\x1b[2Jb", tmp_path=tmp_path)
    assert p.returncode == 1 and "control character" in p.stderr and "\x1b" not in p.stderr


# ---- model folders: generated configs and tensor sets, inconsistent on purpose, through `quant estimate` and `quant run`

MODEL_EXAMPLES = 24
MAX_ESTIMATE_SECONDS = 60.0
MAX_RUN_SECONDS = 600.0  # a whole pipeline on a tiny model, on 2 busy cores
MAX_MODEL_RSS_BYTES = 3 << 30
BASES = ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny", "deepseek-v3-tiny"]
FAST = ["--set", "calibration.n_samples=4", "--set", "calibration.seq_len=32", "--set", "eval.perplexity.n_samples=2",
        "--set", "eval.perplexity.seq_len=32", "--set", "profile.layer_sensitivity=null"]
CONFIG_KEYS = ["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "num_experts",
               "num_local_experts", "n_routed_experts", "n_group", "topk_group", "first_k_dense_replace",
               "tie_word_embeddings", "rope_parameters", "quantization_config", "model_type", "rms_norm_eps",
               "hidden_act", "max_position_embeddings", "num_nextn_predict_layers"]
HOSTILE = [0, -1, 1, 2, 3, 15, 17, 63, 65, 10**9, 2**63, 0.5, 1e-30, "x", "64", None, True, False, [], {}, [1, 2],
           {"rope_type": "bogus"}, {"rope_type": "default", "rope_theta": 0}, {"quant_method": "gptq"}, "qwen3_moe"]
DTYPES = ["float32", "float16", "float64", "int32", "int8", "uint8", "bool", "float8_e4m3fn"]
edits = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 10**6)),
    st.tuples(st.just("extra"), st.sampled_from(["model.layers.1.self_attn.q_proj.bias", "lm_head.bias", "junk",
                                                 "model.layers.0.mlp.experts.99.gate_proj.weight",
                                                 "model.layers.9.input_layernorm.weight",
                                                 "model.layers.0.self_attn.rotary_emb.inv_freq"])),
    st.tuples(st.just("reshape"), st.integers(0, 10**6), st.sampled_from([-1, 1, "transpose", "flatten"])),
    st.tuples(st.just("dtype"), st.integers(0, 10**6), st.sampled_from(DTYPES)),
    st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS), st.sampled_from(HOSTILE)),
    st.tuples(st.just("index"), st.sampled_from(["split", "absolute", "parent", "missing", "symlink out"])),
)
# edits a consistent folder survives (it must then run to a correct checkpoint), drawn as often as hostile ones
benign = st.one_of(
    st.tuples(st.just("dtype all"), st.sampled_from(["float32", "float16"])),
    st.tuples(st.just("index"), st.just("split")),
    st.tuples(st.just("extra"), st.just("model.layers.0.self_attn.rotary_emb.inv_freq")),
    st.tuples(st.just("config"), st.sampled_from(["rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                                                  "topk_group"]), st.sampled_from([1e-5, 2048, True, 1])),
)
model_plans = st.tuples(st.sampled_from(BASES), st.one_of(st.lists(benign, min_size=1, max_size=2),
                                                          st.lists(edits, min_size=1, max_size=3)))


def make_folder(plan, root: Path) -> Path:
    """Builtin ``plan[0]`` with ``plan[1]``'s edits applied, in ``root/model``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from quant.models.builtin import builtin_path

    base, todo = plan
    out = root / "model"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(builtin_path(base), out)
    tensors, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    index = None
    for edit in todo:
        keys = sorted(tensors)
        if edit[0] == "drop":
            del tensors[keys[edit[1] % len(keys)]]
        elif edit[0] == "extra":
            tensors[edit[1]] = torch.zeros(64, dtype=torch.bfloat16)
        elif edit[0] == "reshape":
            key = keys[edit[1] % len(keys)]
            t = tensors[key]
            if edit[2] == "transpose":
                t = t.T.contiguous() if t.dim() == 2 else t.reshape(1, -1)
            elif edit[2] == "flatten":
                t = t.reshape(-1)
            else:
                t = torch.zeros(max(1, t.shape[0] + edit[2]), *t.shape[1:], dtype=t.dtype)
            tensors[key] = t
        elif edit[0] == "dtype":
            key = keys[edit[1] % len(keys)]
            tensors[key] = tensors[key].float().to(getattr(torch, edit[2]))
        elif edit[0] == "dtype all":
            tensors = {k: t.to(getattr(torch, edit[1])) for k, t in tensors.items()}
        elif edit[0] == "config":
            config[edit[1]] = edit[2]
        else:
            index = edit[1]
    if index is None:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    else:
        _shards(tensors, out, index)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _shards(tensors: dict, out: Path, how: str) -> None:
    """Two shards and an index; the second one where ``how`` puts it."""
    from safetensors.torch import save_file

    (out / "model.safetensors").unlink()
    keys = sorted(tensors)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    elsewhere = out.parent / "elsewhere.safetensors"
    for name, part in zip(names, (keys[: len(keys) // 2], keys[len(keys) // 2 :]), strict=True):
        save_file({k: tensors[k] for k in part}, out / name, metadata={"format": "pt"})
    second = {"split": names[1], "absolute": str(elsewhere), "parent": "../elsewhere.safetensors",
              "missing": "model-00003-of-00003.safetensors", "symlink out": names[1]}[how]
    if how in ("absolute", "parent", "symlink out"):
        (out / names[1]).rename(elsewhere)
    if how == "symlink out":
        (out / names[1]).symlink_to(elsewhere)
    weight_map = {k: names[0] if i < len(keys) // 2 else second for i, k in enumerate(keys)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _in_process(*argv: str) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_exit_code(list(argv))
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def _one_error_line(code: int, err: str, what) -> str:
    assert code in (0, 1), (code, what, err[-3000:])
    if code == 0:
        return "ok"
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in lines[0], (what, err[-3000:])
    return lines[0]


def _checkpoint_is_the_models(run_dir: Path, model: Path) -> None:
    """The exported checkpoint, read back dense, holds every tensor of the (checked) model folder with its shape,
    and the run's gates passed."""
    import torch

    from quant.eval.stream import ShippedCheckpoint
    from quant.models import resolve_model

    base = resolve_model(str(model))
    shipped = ShippedCheckpoint(run_dir / "checkpoint", base, torch.bfloat16)
    assert shipped.shapes() == base.shapes()
    assert json.loads((run_dir / "manifest.json").read_text())["passed"] is True


def run_model_fuzz(n_examples: int, workdir: str) -> dict:
    """The property over ``n_examples`` generated model folders (in a child process: its peak RSS is the bound)."""
    recipe = str(REPO / "recipes" / "mixed_int8_int4.yaml")
    root = Path(workdir)
    outcomes: Counter = Counter()
    seconds = {"estimate": [0.0], "run": [0.0]}

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(model_plans)
    def check(plan) -> None:
        model = make_folder(plan, root / "case")
        code, _, err, s = _in_process("estimate", recipe, "--model", str(model), "--host-memory-gb", "64")
        seconds["estimate"].append(s)
        estimated = _one_error_line(code, err, ("estimate", plan))
        run_dir = root / "case" / "run"
        code, _, err, s = _in_process("run", recipe, "--model", str(model), "-o", str(run_dir), *FAST)
        seconds["run"].append(s)
        ran = _one_error_line(code, err, ("run", plan))
        if ran == "ok":
            _checkpoint_is_the_models(run_dir, model)
        kind = ("ok" if estimated == "ok" else "refused", "ok" if ran == "ok" else "refused")
        outcomes[kind] += 1
        if kind == ("ok", "refused"):  # found by the run only (a later stage): worth a look
            later.append(f"{plan}: {ran}")

    later: list[str] = []
    check()
    return {"outcomes": {"/".join(k): v for k, v in outcomes.items()}, "max_estimate_s": max(seconds["estimate"]),
            "max_run_s": max(seconds["run"]), "max_rss_bytes": _peak_rss_bytes(), "refused_by_run_only": later}


def _limit_model_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # torch and transformers reserve address space


@pytest.mark.slow
def test_any_model_folder_is_ok_with_a_correct_checkpoint_or_one_error_line(tmp_path, quant_cache):
    """Generated model folders (a builtin with tensors dropped, added, reshaped or retyped, config values set to
    hostile ones, shards indexed outside the folder), through `quant estimate` and `quant run`: exit 0 (for run,
    with a checkpoint that holds every tensor of the model and passed its gates) or exactly one `error:` line with
    exit 1, within a time bound per command and a memory bound for the whole property."""
    code = ("import json, sys; from tests.test_recipe_fuzz import run_model_fuzz; "
            "print(json.dumps(run_model_fuzz(int(sys.argv[1]), sys.argv[2])))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", code, str(MODEL_EXAMPLES), str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=3600, preexec_fn=_limit_model_memory, env=env)
    assert child.returncode == 0, child.stderr[-6000:]
    summary = json.loads(child.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["max_estimate_s"] < MAX_ESTIMATE_SECONDS and summary["max_run_s"] < MAX_RUN_SECONDS, summary
    assert summary["max_rss_bytes"] < MAX_MODEL_RSS_BYTES, summary
    assert summary["outcomes"].get("ok/ok", 0) > 0 and summary["outcomes"].get("refused/refused", 0) > 0, summary
