"""Typed, frozen recipe schema and strict YAML loading.

A recipe is the whole description of a run. Loading is strict: the YAML is plain data (``strict_yaml``: no tags,
dates stay strings, duplicate keys and unbounded alias expansion refused), an unknown key is an error naming the
closest valid key, values are validated once here with strict types (a boolean is not a number, a float is not an
integer, no NaN or infinity) and ranges (bits in {2,3,4,8}, fractions in (0, 1], sizes that fit in memory, gates
naming a metric the run computes), and ``--set a.b=c`` overrides are applied to the raw mapping before validation
so they get the same checks.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quant import strict_yaml
from quant.errors import RecipeError
from quant.scheme import VALID_BITS, Scheme

SCHEMA_VERSION = 1
Keep = Literal["keep"]
BitsOrKeep = Union[int, Keep]  # noqa: UP007 - a runtime alias pydantic evaluates
MAX_SEED = 2**63 - 1
MAX_GB = 1e6  # a petabyte: any larger size or budget is a typo
MAX_CARRY_LAYERS = 64  # profile.layer_sensitivity.carry_layers: past this, method exact costs no more
MAX_DRAWS = 64  # profile.layer_sensitivity.draws
DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")
# proxy gates -> the limit each one takes; any other gate names an eval task and takes max_drop (points)
PROXY_GATES = {"perplexity": "max_rel_increase", "kl": "max_value", "top1_agreement": "max_value"}


def _check_bits(value: Any, what: str) -> Any:
    if value == "keep" or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value not in VALID_BITS:
        raise ValueError(f"{what} must be one of {VALID_BITS} (or 'keep'), got {value!r}")
    return value


def _check_group(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value != -1 and (value < 8 or value & (value - 1))):
        raise ValueError(f"{what} must be -1 (per channel) or a power of two >= 8, got {value!r}")
    return value


def _check_fraction(value: float, what: str) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {value}")
    return value


def _check_device(value: str, what: str) -> str:
    if not DEVICE.fullmatch(value):
        raise ValueError(f"{what} must be auto, cpu, cuda, cuda:N, mps or xpu[:N], got {value!r}")
    return value


class _Strict(BaseModel):
    # strict: YAML gives real types, so true is not 1 and 0.5 is not an int; validated in JSON mode (lists -> tuples)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    path: str = "builtin:qwen3-moe-tiny"
    trust_remote_code: bool = False
    # for a remote-code model_type transformers does not define: the family whose checkpoint names and routing
    # it follows (qwen3_moe, qwen2_moe, deepseek_v3, mixtral, olmoe)
    family: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class CalibrationSpec(_Strict):
    dataset: str = "calibration/bundled.yaml"
    n_samples: int = Field(32, ge=1, le=1_000_000)
    seq_len: int = Field(256, ge=8, le=1 << 20)
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @model_validator(mode="after")
    def _tokens(self) -> CalibrationSpec:
        if self.n_samples * self.seq_len > 1 << 31:
            raise ValueError(f"calibration.n_samples x seq_len is {self.n_samples * self.seq_len} tokens; at most "
                             f"{1 << 31} fit one token tensor")
        return self


class LayerSensitivitySpec(_Strict):
    """Per MoE layer and scheme: KL(model ‖ model with only that layer's experts at the scheme, RTN), measured
    in the profile stage on ``n_samples`` calibration samples (``quant.profile.layer_damage``). ``method``: ``bounded``
    (each scheme's copy of the model runs ``carry_layers`` decoder layers past its own, the rest is valued by
    gradients and each MoE layer's routing flips: cost linear in depth) or ``exact`` (every copy runs to the output:
    cost quadratic in depth, for studies)."""

    schemes: tuple[str, ...] = ("w4g128", "w4g64", "w4g32", "w8g128")
    n_samples: int = Field(16, ge=1)
    # float32 keeps the residual stream's rounding out of the small (W8) damages; the model dtype halves memory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    method: Literal["bounded", "exact"] = "bounded"
    carry_layers: int = Field(1, ge=1, le=MAX_CARRY_LAYERS)
    # label draws per position for the bounded pass's gradients: each adds a backward pass through every layer walked
    # back; 4 ranks the W4 schemes' layers closer to the exact pass (reference MoE: 9 of 12 vectors at Spearman
    # >= 0.95 against 7 of 12 with 1)
    draws: int = Field(1, ge=1, le=MAX_DRAWS)

    @field_validator("schemes")
    @classmethod
    def _schemes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("profile.layer_sensitivity.schemes must name at least one scheme")
        parsed = [Scheme.parse(s) for s in v]
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"profile.layer_sensitivity.schemes has duplicates: {list(v)}")
        return tuple(p.label for p in parsed)

    @model_validator(mode="after")
    def _carry_read(self) -> LayerSensitivitySpec:
        for key in ("carry_layers", "draws"):
            if self.method == "exact" and key in self.model_fields_set:
                raise ValueError(f"profile.layer_sensitivity.{key} is read by method 'bounded' only (method "
                                 "'exact' runs every copy to the output)")
        return self


class ProfileSpec(_Strict):
    batch_size: int = Field(8, ge=1)
    min_tokens: int = Field(4, ge=0)
    layer_sensitivity: LayerSensitivitySpec | None = None


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


@dataclass(frozen=True)
class PolicyRules:
    """What a plan policy needs of the recipe, checked when it loads (the policy itself, registered under the same
    name, is ``quant.plan.policies``). ``reads``: plan keys read by the policies naming them only; ``one_budget``:
    exactly one of ``budget_avg_bits`` and ``budget_gb``; ``layer_damage``: a layer policy, priced with the
    profile's layer damage, in the words its errors use; ``granularity``: the one a layer policy needs, ``hint``
    its advice where the recipe asks the other one."""

    reads: tuple[str, ...] = ()
    one_budget: bool = False
    layer_damage: str = ""
    granularity: str = "per_layer"
    hint: str = ""


POLICY_RULES = {
    "top_fraction": PolicyRules(), "budget": PolicyRules(one_budget=True), "sensitivity": PolicyRules(),
    "random": PolicyRules(), "inverse": PolicyRules(), "uniform": PolicyRules(),
    "layer_sensitivity": PolicyRules(("layer_group_sizes",), layer_damage="one symmetric scheme per MoE layer"),
    "joint": PolicyRules(("layer_group_sizes", "split_by"), granularity="per_expert",
                         layer_damage="up to two symmetric scheme groups per MoE layer, for quant's vLLM plugin",
                         hint="; for one scheme per MoE layer use plan.policy: layer_sensitivity"),
}


class PlanSpec(_Strict):
    policy: Literal[tuple(POLICY_RULES)] = "top_fraction"
    top_fraction: float = 0.2
    score: Literal["tokens", "weight_mass", "product"] = "tokens"
    ranking: Literal["per_layer", "global"] = "per_layer"
    high_bits: int = 8
    low_bits: int = 4
    budget_avg_bits: float | None = None
    budget_gb: float | None = Field(None, gt=0.0, le=MAX_GB)
    group_size: int = 128
    # layer policies: further group sizes a whole MoE layer may get, paying for the extra scales from the budget
    layer_group_sizes: tuple[int, ...] = ()
    # policy joint: what ranks a MoE layer's experts for its hot scheme group and shares the layer's damage among them
    split_by: Literal["sensitivity", "tokens", "weight_mass"] = "sensitivity"
    symmetric: bool = True
    granularity: Literal["per_expert", "per_layer"] = "per_expert"
    target_runtime: Literal["any", "vllm", "vllm-quant", "sglang", "transformers", "gptqmodel"] = "any"
    seed: int = Field(0, ge=0, le=MAX_SEED)
    protect: ProtectSpec = ProtectSpec()
    # MoE layer index (a quoted string: YAML keys are strings) -> the scheme all its experts get (w<bits>g<group>),
    # whatever the policy decides: {"0": w8g128, "5": w4g32}
    layer_schemes: dict[str, str] = Field(default_factory=dict)

    @field_validator("layer_schemes")
    @classmethod
    def _layer_schemes(cls, v: dict[str, str]) -> dict[str, str]:
        for layer, scheme in v.items():
            if not layer.isdigit() or len(layer) > 6:
                raise ValueError(f"plan.layer_schemes: key {layer!r} is not a layer index (0, 1, ...)")
            parsed = Scheme.parse(scheme)
            _check_bits(parsed.bits, f"plan.layer_schemes[{layer}]")
            _check_group(parsed.group_size, f"plan.layer_schemes[{layer}]")
        return v

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
        return _check_group(v, "plan.group_size")

    @field_validator("layer_group_sizes")
    @classmethod
    def _layer_groups(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for g in v:
            if _check_group(g, "plan.layer_group_sizes entries") == -1:
                raise ValueError("plan.layer_group_sizes: per channel (-1) is not offered to layer policies")
        return v

    @model_validator(mode="after")
    def _cross(self) -> PlanSpec:
        if self.high_bits < self.low_bits:
            raise ValueError(f"plan.high_bits ({self.high_bits}) must be >= plan.low_bits ({self.low_bits})")
        rules = POLICY_RULES[self.policy]
        if rules.one_budget and (self.budget_avg_bits is None) == (self.budget_gb is None):
            raise ValueError(f"plan.policy '{self.policy}' needs exactly one of plan.budget_avg_bits or plan.budget_gb")
        if self.budget_avg_bits is not None and not self.low_bits <= self.budget_avg_bits <= self.high_bits:
            raise ValueError(
                f"plan.budget_avg_bits ({self.budget_avg_bits}) must lie between low_bits ({self.low_bits}) "
                f"and high_bits ({self.high_bits})"
            )
        if rules.layer_damage:
            self._check_layer_policy(rules)
        for key in dict.fromkeys(k for r in POLICY_RULES.values() for k in r.reads):
            if key not in rules.reads and getattr(self, key) != PlanSpec.model_fields[key].default:
                readers = " or ".join(f"'{n}'" for n, r in POLICY_RULES.items() if key in r.reads)
                raise ValueError(f"plan.{key} is read by plan.policy {readers} only (the policy is '{self.policy}')")
        return self

    def pinned_layers(self) -> dict[int, Scheme]:
        """``layer_schemes`` as MoE layer index -> its experts' scheme (the group size as asked)."""
        return {int(k): Scheme.parse(v) for k, v in self.layer_schemes.items()}

    def _check_layer_policy(self, rules: PolicyRules) -> None:
        fix = {"plan.budget_avg_bits": self.budget_avg_bits is not None and self.budget_gb is None,
               f"plan.granularity: {rules.granularity}": self.granularity == rules.granularity,
               "plan.symmetric: true": self.symmetric, "plan.group_size other than -1": self.group_size != -1}
        missing = [k for k, ok in fix.items() if not ok]
        if missing:
            hint = rules.hint if self.granularity != rules.granularity else ""
            raise ValueError(f"plan.policy '{self.policy}' ({rules.layer_damage}, within an average-bits budget) "
                             f"needs {', '.join(missing)}{hint}")


class QuantizeSpec(_Strict):
    algorithm: Literal["rtn", "gptq", "awq"] = "rtn"
    device: str = "auto"
    dampening: float = Field(0.01, gt=0.0, lt=1.0)
    block_size: int = Field(128, ge=1)
    act_order: bool = True
    min_tokens: int = Field(0, ge=0)
    gate_weighted: bool = False
    all_experts: bool = False
    awq_grid: int = Field(20, ge=2, le=1000)
    batch_size: int = Field(8, ge=1)
    hessian_budget_gb: float = Field(16.0, gt=0.0, le=MAX_GB)
    solve_budget_gb: float = Field(3.0, gt=0.0, le=MAX_GB)
    statistics: Literal["auto", "ordered", "reduce"] = "auto"

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return _check_device(v, "quantize.device")


class ExportSpec(_Strict):
    formats: tuple[Literal["compressed-tensors", "gptq"], ...] = ("compressed-tensors",)
    max_shard_gb: float = Field(5.0, gt=0.0, le=MAX_GB)

    @field_validator("formats")
    @classmethod
    def _nonempty(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("export.formats must name at least one format")
        if len(set(v)) != len(v):
            raise ValueError(f"export.formats names a format twice ({', '.join(v)}); list each once")
        return v


class PerplexitySpec(_Strict):
    dataset: str = "calibration/heldout.yaml"
    n_samples: int = Field(8, ge=1, le=100_000)
    seq_len: int = Field(256, ge=8, le=1 << 20)


class GateSpec(_Strict):
    max_drop: float | None = None
    max_rel_increase: float | None = None
    max_value: float | None = None


class EvalSpec(_Strict):
    perplexity: PerplexitySpec = PerplexitySpec()
    tasks: tuple[str, ...] = ()
    limit: int | None = Field(None, ge=1)
    num_fewshot: int | None = Field(None, ge=0, le=1000)
    batch_size: int = Field(8, ge=1)
    backend: Literal["hf", "vllm"] = "hf"
    max_gen_toks: int = Field(256, ge=1, le=1 << 20)
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
    # generated code (quant_humaneval) runs only where every kernel layer of the sandbox works (require), or
    # with the layers the machine has (allow_weak: an explicit opt-out for machines that refuse namespaces)
    humaneval_sandbox: Literal["require", "allow_weak"] = "require"

    @model_validator(mode="after")
    def _parallel(self) -> EvalSpec:
        if self.backend == "hf" and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("eval.tensor_parallel_size / data_parallel_size are vllm options; with eval.backend "
                             "hf set eval.gpus to dispatch the model over several GPUs")
        if self.backend == "vllm" and (self.gpus is not None or self.max_memory_per_gpu_gb is not None):
            raise ValueError("eval.gpus / max_memory_per_gpu_gb are hf options; with eval.backend vllm set "
                             "eval.tensor_parallel_size (and data_parallel_size)")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return _check_device(v, "eval.device")

    @model_validator(mode="after")
    def _gates(self) -> EvalSpec:
        """Every gate names a metric this run computes and sets exactly the limit that metric takes."""
        for name, gate in self.gates.items():
            if name in PROXY_GATES:
                kind = PROXY_GATES[name]
            elif name in self.tasks or f"quant_{name}" in self.tasks:
                kind = "max_drop"
            else:
                raise ValueError(f"eval.gates.{name}: no such metric; gate {', '.join(PROXY_GATES)} or one of "
                                 f"eval.tasks ({', '.join(self.tasks) or 'none set'})")
            given = [k for k, v in gate.model_dump().items() if v is not None]
            if given != [kind]:
                raise ValueError(f"eval.gates.{name} takes {kind}" + (f", not {', '.join(given)}" if given else ""))
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

    @model_validator(mode="after")
    def _layer_damage_measured(self) -> Recipe:
        """A layer policy chooses among schemes the profile measured: its base schemes must be among them."""
        p = self.plan
        if not POLICY_RULES[p.policy].layer_damage:
            return self
        ls = self.profile.layer_sensitivity
        need = [Scheme(b, p.group_size).label for b in sorted({p.low_bits, p.high_bits})]
        have = set(ls.schemes) if ls else set()
        lacking = [s for s in need if s not in have]
        if lacking:
            raise ValueError(f"plan.policy '{p.policy}' needs profile.layer_sensitivity.schemes to include "
                             f"{', '.join(lacking)} (have: {', '.join(sorted(have)) or 'profile.layer_sensitivity unset'})")
        for g in p.layer_group_sizes:
            if not any(Scheme.parse(s).group_size == g for s in have):
                raise ValueError(f"plan.layer_group_sizes has {g}, but profile.layer_sensitivity.schemes measures "
                                 f"no scheme with group {g}: add e.g. w{p.low_bits}g{g}")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip() or any(c in v for c in "/\\") or v.startswith(".") or len(v.encode()) > 200:
            raise ValueError(f"name must be a plain file name (no slashes, not hidden, at most 200 bytes), got {v!r}")
        return v

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections or dotted keys (``quantize``, ``export.formats``): what a stage's
        result depends on."""
        data = self.model_dump(mode="json")
        blob = json.dumps({s: _at(data, s) for s in sections}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _at(data: dict, key: str) -> Any:
    """The value at a dotted key of a dumped recipe."""
    for part in key.split("."):
        data = data[part]
    return data


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
    # a union's member type ('int', "literal['keep']") is part of pydantic's location, not of the recipe key
    where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))
    where = where or "recipe"
    msg = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) or first["type"] == "value_error" else f" (got {got!r})"
    if first["type"] == "float_type" and isinstance(got, str) and _YAML_TEXT_FLOAT.fullmatch(got.strip()):
        mantissa, exponent = got.strip().lower().split("e")
        shown += f"; YAML reads {got.strip()} as text: write {float(mantissa)!r}e{exponent}"
    return f"invalid recipe value at '{where}': {msg}{shown}"


_YAML_TEXT_FLOAT = re.compile(r"[-+]?\d+[eE][-+]?\d+")  # 1e-6: a float in JSON, a string in YAML 1.1


_TYPE_TAGS = {"int", "float", "str", "bool", "none"}
_KEY = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")


def _schema_depth(model: type[BaseModel]) -> int:
    """Levels of the deepest key of ``model`` (a dict section's entry names count as one)."""
    depths = [1]
    for f in model.model_fields.values():
        sub = _submodel(f.annotation)
        if sub is not None:
            depths.append(1 + (get_origin(f.annotation) is dict) + _schema_depth(sub))
    return max(depths)


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as (strict) YAML: numbers, lists, bools."""
    if "=" not in assignment:
        raise RecipeError(f"--set expects KEY=VALUE (e.g. plan.top_fraction=0.3), got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    shown = key if len(key) <= 80 else key[:77] + "..."
    if not _KEY.fullmatch(key):
        raise RecipeError(f"--set key {shown!r} must be dotted recipe keys (e.g. plan.top_fraction)")
    parts = key.split(".")
    if len(parts) > strict_yaml.MAX_DEPTH:  # nested mappings that deep are refused in a file too
        raise RecipeError(f"unknown recipe key '{shown}': {len(parts)} levels deep, recipe keys have at most "
                          f"{_schema_depth(Recipe)} (e.g. eval.gates.perplexity.max_rel_increase)")
    value = strict_yaml.load(raw, f"--set {key}", RecipeError) if raw.strip() else ""
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _empty_sections(data: dict) -> None:
    """``section:`` with nothing under it (YAML null) means that section's defaults."""
    for name, f in Recipe.model_fields.items():
        if _submodel(f.annotation) is not None and name in data and data[name] is None:
            data[name] = {}


def parse_recipe(data: Any, *, overrides: tuple[str, ...] = (), model: str | None = None) -> Recipe:
    """Validate a raw mapping (plus overrides) into a Recipe, raising RecipeError with one clear line."""
    if not isinstance(data, dict):
        raise RecipeError("a recipe must be a YAML mapping of sections (name, model, calibration, plan, ...)")
    data = strict_yaml.plain(data, "", RecipeError)  # a deep copy holding plain values only
    _empty_sections(data)
    for assignment in overrides:
        apply_override(data, assignment)
    if model is not None:
        if not isinstance(data.get("model", {}), dict):
            raise RecipeError(f"'model' must be a section (model: {{path: ...}}), got {data['model']!r}; "
                              "--model sets model.path")
        data.setdefault("model", {})["path"] = model
    data = strict_yaml.plain(data, "", RecipeError)  # overrides and --model checked the same way
    _check_keys(data, Recipe, "")
    try:
        recipe = Recipe.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as e:
        raise RecipeError(_format_validation(e)) from None
    if recipe.schema_version != SCHEMA_VERSION:  # the loader's own key: which schema the file was written for
        raise RecipeError(f"invalid recipe value at 'schema_version': schema_version {recipe.schema_version} is not "
                          f"supported (this quant reads {SCHEMA_VERSION})")
    return recipe


def load_recipe(path: str | Path, *, overrides: tuple[str, ...] = (), model: str | None = None) -> Recipe:
    """Read a recipe file with the strict YAML loader and validate it (see ``parse_recipe``)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from None
    text = strict_yaml.decode(raw, f"recipe {path}", RecipeError)
    data = strict_yaml.load(text, str(path), RecipeError)
    return parse_recipe(data, overrides=overrides, model=model)
