"""Read a checkpoint back into per-module schemes (``quant inspect``), from its config and tensor names alone.

compressed-tensors: each quantized module (a ``weight_packed`` tensor) gets the scheme of the config group
whose ``re:`` target matches its name (first group wins, as vLLM resolves it). GPTQ: each module with a
``qweight`` gets the base scheme overridden by the first matching ``dynamic`` rule. Modules stored as plain
``.weight`` 2-D tensors are reported as kept.
"""

from __future__ import annotations

import re
from pathlib import Path

from quant.errors import CheckpointError, ModelError
from quant.export.targets import NotCompact, compact_match, compile_compact
from quant.io.rundir import enclosing_run_dir, refuse_links
from quant.models.source import open_safetensors, read_json_object
from quant.serve.names import COMPRESSED_TENSORS_METHODS


def _tensor_names(ckpt: Path) -> dict[str, tuple[int, ...]]:
    index = ckpt / "model.safetensors.index.json"
    weight_map = read_json_object(index, "re-export it", CheckpointError).get("weight_map") if index.is_file() else None
    if index.is_file() and not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map; re-export the checkpoint")
    files = sorted(set(map(str, weight_map.values()))) if weight_map else ["model.safetensors"]
    out = {}
    for f in files:
        if not (ckpt / f).is_file():
            raise CheckpointError(f"{ckpt} lacks {f}")
        try:
            with open_safetensors(ckpt / f) as h:
                out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        except ModelError as e:
            raise CheckpointError(str(e)) from None
    return out


class _Patterns:
    """Regexes of a checkpoint's config, each compiled once in the compact form quant writes (``targets``); any
    other is a CheckpointError: matched by ``re``, a hostile one (``re:^(.*)*(.*)*Z$``) would run for hours."""

    def __init__(self, ckpt: Path):
        self.ckpt = ckpt
        self._compiled: dict[str, tuple] = {}

    def match(self, pattern: str, name: str) -> bool:
        if pattern not in self._compiled:
            try:
                self._compiled[pattern] = compile_compact(pattern)
            except NotCompact as e:
                shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
                raise CheckpointError(f"{self.ckpt}: quantization_config regex {shown!r} is not of the form quant "
                                      f"writes (literal names, \\d+, (a|b) alternatives; here: {e}); quant inspect "
                                      "reads checkpoints quant wrote") from None
        return compact_match(self._compiled[pattern], name)

    def target(self, target: str, name: str) -> bool:
        return self.match(target[3:], name) if target.startswith("re:") else target == name


def _compressed_tensors(cfg: dict, names: dict, patterns: _Patterns) -> dict[str, dict]:
    out = {}
    for key in names:
        if not key.endswith(".weight_packed"):
            continue
        module = key.removesuffix(".weight_packed")
        for group in cfg["config_groups"].values():
            if any(patterns.target(t, module) for t in group["targets"]):
                w = group["weights"]
                out[module] = {"bits": w["num_bits"], "group_size": w["group_size"], "symmetric": w["symmetric"]}
                break
        else:
            raise CheckpointError(f"{module} has packed weights but no config group targets it")
    return out


def _gptq(cfg: dict, names: dict, patterns: _Patterns) -> dict[str, dict]:
    out = {}
    for key in names:
        if not key.endswith(".qweight"):
            continue
        module = key.removesuffix(".qweight")
        scheme = {"bits": cfg["bits"], "group_size": cfg["group_size"], "symmetric": cfg["sym"]}
        for rule, override in (cfg.get("dynamic") or {}).items():
            sign, pattern = (rule[0], rule[2:]) if rule[:2] in ("+:", "-:") else ("+", rule)
            if patterns.match(pattern, module):
                if sign == "-":
                    raise CheckpointError(f"{module} is quantized but a '-:' dynamic rule skips it")
                scheme = {"bits": override.get("bits", scheme["bits"]),
                          "group_size": override.get("group_size", scheme["group_size"]),
                          "symmetric": override.get("sym", scheme["symmetric"])}
                break
        out[module] = scheme
    return out


def read_checkpoint_bits(ckpt: Path) -> dict[str, dict]:
    """On-disk module name -> {bits, group_size, symmetric} or {keep: True} for 2-D float weights."""
    ckpt = Path(ckpt)
    if (run_dir := enclosing_run_dir(ckpt)) is not None:  # a run's checkpoint: the run directory's link rule
        refuse_links(run_dir)
    if not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{ckpt} is not a checkpoint folder (no config.json)")
    qcfg = read_json_object(ckpt / "config.json", "not a checkpoint quant wrote", CheckpointError).get("quantization_config")
    if not qcfg or not isinstance(qcfg, dict):
        raise CheckpointError(f"{ckpt} has no quantization_config; it is not a quantized checkpoint")
    names = _tensor_names(ckpt)
    method = qcfg.get("quant_method")
    readers = {m: _compressed_tensors for m in COMPRESSED_TENSORS_METHODS} | {"gptq": _gptq}
    if method not in readers:
        raise CheckpointError(f"{ckpt}: quant_method '{method}' is not one quant writes ({', '.join(readers)})")
    try:
        out = readers[method](qcfg, names, _Patterns(ckpt))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: malformed {method} quantization_config ({type(e).__name__}: {e}); it is not "
                              "a checkpoint quant wrote, or it was edited") from None
    for key, shape in names.items():
        if key.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in key:
            out[key.removesuffix(".weight")] = {"keep": True}
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def format_table(bits: dict[str, dict]) -> str:
    rows = ["module\tbits\tgroup\tsym"]
    for name, s in bits.items():
        rows.append(f"{name}\tkeep\t-\t-" if s.get("keep") else f"{name}\t{s['bits']}\t{s['group_size']}\t{s['symmetric']}")
    counts: dict[str, int] = {}
    for s in bits.values():
        k = "keep" if s.get("keep") else f"W{s['bits']}"
        counts[k] = counts.get(k, 0) + 1
    rows.append("# modules by scheme: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return "\n".join(rows)
