"""Typed, frozen recipe schema and strict YAML loading.

A recipe is the whole description of a run. Loading is strict: an unknown key is an error naming the closest
valid key, values are validated once here (bits in {2,3,4,8}, fractions in (0, 1], group sizes), and
``--set a.b=c`` overrides are applied to the raw mapping before validation so they get the same checks.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quant.errors import RecipeError

SCHEMA_VERSION = 1
VALID_BITS = (2, 3, 4, 8)
Keep = Literal["keep"]
BitsOrKeep = Union[int, Keep]  # noqa: UP007 - a runtime alias pydantic evaluates


def _check_bits(value: Any, what: str) -> Any:
    if value == "keep" or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value not in VALID_BITS:
        raise ValueError(f"{what} must be one of {VALID_BITS} (or 'keep'), got {value!r}")
    return value


def _check_fraction(value: float, what: str) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {value}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    path: str = "builtin:qwen3-moe-tiny"
    trust_remote_code: bool = False
    # for a remote-code model_type transformers does not define: the family whose checkpoint names and routing
    # it follows (qwen3_moe, qwen2_moe, deepseek_v3, mixtral, olmoe)
    family: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class CalibrationSpec(_Strict):
    dataset: str = "calibration/bundled.yaml"
    n_samples: int = Field(32, ge=1)
    seq_len: int = Field(256, ge=8)
    seed: int = 0


class ProfileSpec(_Strict):
    batch_size: int = Field(8, ge=1)
    min_tokens: int = Field(4, ge=0)
    extra_datasets: tuple[str, ...] = ()


class ProtectSpec(_Strict):
    """Rules that override scores. ``keep`` leaves the weight in the model dtype."""

    attention: BitsOrKeep = 8
    shared_experts: BitsOrKeep = 8
    dense_mlp: BitsOrKeep = 8
    super_experts: BitsOrKeep | None = None
    super_expert_ratio: float = Field(50.0, gt=1.0)
    first_layers: int = Field(0, ge=0)
    last_layers: int = Field(0, ge=0)
    edge_layer_bits: BitsOrKeep = 8

    @field_validator("attention", "shared_experts", "dense_mlp", "super_experts", "edge_layer_bits")
    @classmethod
    def _bits(cls, v: Any, info) -> Any:
        return _check_bits(v, f"plan.protect.{info.field_name}")


class PlanSpec(_Strict):
    policy: Literal["top_fraction", "budget", "sensitivity", "random", "inverse", "uniform"] = "top_fraction"
    top_fraction: float = 0.2
    score: Literal["tokens", "weight_mass", "product"] = "tokens"
    ranking: Literal["per_layer", "global"] = "per_layer"
    high_bits: int = 8
    low_bits: int = 4
    budget_avg_bits: float | None = None
    budget_gb: float | None = None
    group_size: int = 128
    symmetric: bool = True
    granularity: Literal["per_expert", "per_layer"] = "per_expert"
    target_runtime: Literal["any", "vllm", "sglang", "transformers", "gptqmodel"] = "any"
    seed: int = 0
    protect: ProtectSpec = ProtectSpec()

    @field_validator("high_bits", "low_bits")
    @classmethod
    def _bits(cls, v: int, info) -> int:
        return _check_bits(v, f"plan.{info.field_name}")

    @field_validator("top_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        return _check_fraction(v, "plan.top_fraction")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and (v < 8 or v & (v - 1)):
            raise ValueError(f"plan.group_size must be -1 (per channel) or a power of two >= 8, got {v}")
        return v

    @model_validator(mode="after")
    def _cross(self) -> PlanSpec:
        if self.high_bits < self.low_bits:
            raise ValueError(f"plan.high_bits ({self.high_bits}) must be >= plan.low_bits ({self.low_bits})")
        if self.policy == "budget" and (self.budget_avg_bits is None) == (self.budget_gb is None):
            raise ValueError("plan.policy 'budget' needs exactly one of plan.budget_avg_bits or plan.budget_gb")
        if self.budget_avg_bits is not None and not self.low_bits <= self.budget_avg_bits <= self.high_bits:
            raise ValueError(
                f"plan.budget_avg_bits ({self.budget_avg_bits}) must lie between low_bits ({self.low_bits}) "
                f"and high_bits ({self.high_bits})"
            )
        return self


class QuantizeSpec(_Strict):
    algorithm: Literal["rtn", "gptq", "awq"] = "rtn"
    device: str = "auto"
    dampening: float = Field(0.01, gt=0.0, lt=1.0)
    block_size: int = Field(128, ge=1)
    act_order: bool = True
    min_tokens: int = Field(0, ge=0)
    gate_weighted: bool = False
    all_experts: bool = False
    awq_grid: int = Field(20, ge=2)
    batch_size: int = Field(8, ge=1)
    hessian_budget_gb: float = Field(16.0, gt=0.0)
    solve_budget_gb: float = Field(3.0, gt=0.0)


class ExportSpec(_Strict):
    formats: tuple[Literal["compressed-tensors", "gptq"], ...] = ("compressed-tensors",)
    max_shard_gb: float = Field(5.0, gt=0.0)

    @field_validator("formats")
    @classmethod
    def _nonempty(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("export.formats must name at least one format")
        return v


class PerplexitySpec(_Strict):
    dataset: str = "calibration/heldout.yaml"
    n_samples: int = Field(8, ge=1)
    seq_len: int = Field(256, ge=8)


class GateSpec(_Strict):
    max_drop: float | None = None
    max_rel_increase: float | None = None
    max_value: float | None = None


class EvalSpec(_Strict):
    perplexity: PerplexitySpec = PerplexitySpec()
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = Field(8, ge=1)
    backend: Literal["hf", "vllm"] = "hf"
    max_gen_toks: int = Field(256, ge=1)
    gates: dict[str, GateSpec] = {}
    device: str = "auto"
    # proxies: whole models (fast, small models), layer-by-layer streaming (any size), or auto (a size rule)
    mode: Literal["auto", "whole", "streamed"] = "auto"
    # lm-eval hf backend: GPUs to dispatch the model over (accelerate device map); None: all visible GPUs when
    # the model does not fit in one, else one
    gpus: int | None = Field(None, ge=1)
    max_memory_per_gpu_gb: float | None = Field(None, gt=0.0)
    # lm-eval vllm backend: passed to vllm.LLM
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _parallel(self) -> EvalSpec:
        if self.backend == "hf" and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("eval.tensor_parallel_size / data_parallel_size are vllm options; with eval.backend "
                             "hf set eval.gpus to dispatch the model over several GPUs")
        if self.backend == "vllm" and (self.gpus is not None or self.max_memory_per_gpu_gb is not None):
            raise ValueError("eval.gpus / max_memory_per_gpu_gb are hf options; with eval.backend vllm set "
                             "eval.tensor_parallel_size (and data_parallel_size)")
        return self


class ReportSpec(_Strict):
    plots: bool = True


class Recipe(_Strict):
    schema_version: int = SCHEMA_VERSION
    name: str
    description: str = ""
    model: ModelSpec = ModelSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    profile: ProfileSpec = ProfileSpec()
    plan: PlanSpec = PlanSpec()
    quantize: QuantizeSpec = QuantizeSpec()
    export: ExportSpec = ExportSpec()
    eval: EvalSpec = EvalSpec()
    report: ReportSpec = ReportSpec()

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is not supported (this quant reads {SCHEMA_VERSION})")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or any(c in v for c in "/\\") or v.startswith("."):
            raise ValueError(f"name must be a plain file name (no slashes, not hidden), got {v!r}")
        return v

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named top-level sections (what a stage's result depends on)."""
        data = self.model_dump(mode="json")
        blob = json.dumps({s: data[s] for s in sections}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class a field holds (directly or as dict values), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is dict:
        value_type = get_args(annotation)[1]
        return value_type if isinstance(value_type, type) and issubclass(value_type, BaseModel) else None
    return None


def _check_keys(data: Any, model: type[BaseModel], path: str) -> None:
    """Reject unknown keys with the closest valid key, recursively; pydantic's message lacks the hint."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        where = f"{path}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{path}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise RecipeError(f"unknown recipe key '{where}'{hint}")
        sub = _submodel(fields[key].annotation)
        if sub is None:
            continue
        if get_origin(fields[key].annotation) is dict and isinstance(value, dict):
            for name, item in value.items():
                _check_keys(item, sub, f"{where}.{name}.")
        else:
            _check_keys(value, sub, f"{where}.")


def _format_validation(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "recipe"
    msg = first["msg"].removeprefix("Value error, ")
    return f"invalid recipe value at '{where}': {msg}"


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (numbers, lists, bools)."""
    if "=" not in assignment:
        raise RecipeError(f"--set expects KEY=VALUE (e.g. plan.top_fraction=0.3), got {assignment!r}")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError(f"--set has an empty key in {assignment!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {key}: value {raw!r} is not valid YAML ({e.problem})") from None
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_recipe(data: Any, *, overrides: tuple[str, ...] = (), model: str | None = None) -> Recipe:
    """Validate a raw mapping (plus overrides) into a Recipe, raising RecipeError with one clear line."""
    if not isinstance(data, dict):
        raise RecipeError("a recipe must be a YAML mapping of sections (name, model, calibration, plan, ...)")
    data = json.loads(json.dumps(data))  # deep copy, and YAML-only types out
    for assignment in overrides:
        apply_override(data, assignment)
    if model is not None:
        data.setdefault("model", {})["path"] = model
    _check_keys(data, Recipe, "")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation(e)) from None


def load_recipe(path: str | Path, *, overrides: tuple[str, ...] = (), model: str | None = None) -> Recipe:
    """Read a recipe file with the safe YAML loader and validate it (see ``parse_recipe``)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RecipeError(f"malformed YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    return parse_recipe(data, overrides=overrides, model=model)
