"""The tensors a model's config.json implies, checked against the folder's safetensors headers before any stage.

A folder whose weights and config disagree would run: transformers initialises a tensor the checkpoint lacks (a
missing ``lm_head.weight`` gave top-1 agreement 0.0 with every gate passing), a tensor nobody reads is dropped from
the checkpoint, and a config claiming 10^9 layers builds a 10^9-layer skeleton. So, in this order, every check
bounded by the number of tensors on disk:

1. config.json's sizes are positive integers (``vocab_size``, ``hidden_size``, expert counts, ``num_experts_per_tok``).
2. its layer count is the number of decoder layers the tensors hold (multi-token-prediction layers are already left
   out: ``source.prediction_layers``), and each MoE layer holds experts ``0..E-1``, each with gate, up and down, ``E``
   being the config's expert count; routing settings fit ``E``. Nothing proportional to a config value exists yet.
3. transformers' own model is built from the config on the meta device (no memory) and its state dict is mapped to
   on-disk names (``implied_tensors``): fused experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]`` to
   per-expert ``gate/up/down``, the MoE block to the family's checkpoint name, a tied ``lm_head`` optional. Every
   implied tensor must be on disk with that shape and a floating dtype (an FP8 release is checked as the dense
   weights it is read as: its ``*_scale_inv`` tensors are parts of them); a tensor the model does not have is refused
   too (it would be left out of the checkpoint silently, or it means the config describes another model).

Each failure is one ModelError naming the first few tensors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch

from quant.errors import ModelError
from quant.io.direct_read import DTYPE_NAMES
from quant.models.families import FamilySpec
from quant.models.source import ModelSource, error_reason, layer_of_key

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk")
POSITIVE_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "moe_intermediate_size", "head_dim", *EXPERT_COUNT_KEYS, *TOP_K_KEYS)
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(.+)\.experts\.(gate_up_proj|down_proj)$")
SHOWN = 3  # tensors named in a message


def check_model(source: ModelSource) -> None:
    """Raise one ModelError unless ``source``'s tensors (names, shapes, dtypes from headers) are exactly those its
    config.json implies. Cheap checks bound everything proportional to a config value before it is built."""
    where = source.display_name
    cfg = source.config_dict
    _check_sizes(cfg, where)
    _check_layer_count(source)
    experts = _expert_counts(source)
    _check_experts(cfg, experts, source.family, where)
    model = _meta_model(source)
    if model is None:
        return
    implied, optional = implied_tensors(model, source.family, experts, where)
    _compare(source, implied, optional, tied_hint=_tied(model))


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_sizes(cfg: dict, where: str) -> None:
    for key in POSITIVE_KEYS:
        if key in cfg and cfg[key] is not None and not _positive_int(cfg[key]):
            raise ModelError(f"{where}: config.json's {key} must be a positive integer, got {cfg[key]!r}")


def _check_layer_count(source: ModelSource) -> None:
    """config.json's num_hidden_layers against the decoder layers the tensors hold (counted, never ranged over)."""
    n = source.n_layers
    held = {layer_of_key(k) for k in source.shapes() if k.startswith("model.layers.")} - {None}
    if len(held) == n:
        return
    if not held:
        raise ModelError(f"{source.display_name}: config.json has num_hidden_layers {n} but the weights hold no "
                         "decoder layer (model.layers.*); the config does not describe these weights")
    first_gap = next(i for i in range(len(held) + 1) if i not in held)
    raise ModelError(f"{source.display_name}: config.json has num_hidden_layers {n} but the weights hold "
                     f"{len(held)} decoder layer(s) ({_span(sorted(held))}; layer {first_gap} is missing): the config "
                     "does not describe these weights (fix num_hidden_layers, or re-download the model)")


def _span(layers: list[int]) -> str:
    """Sorted distinct ``layers`` as ``0-3``, or the first few."""
    return f"{layers[0]}-{layers[-1]}" if layers[-1] - layers[0] + 1 == len(layers) else \
        ", ".join(map(str, layers[:SHOWN])) + (", ..." if len(layers) > SHOWN else "")


def _expert_counts(source: ModelSource) -> dict[int, int]:
    """MoE layer -> its number of routed experts, after checking each holds experts 0..E-1 with every projection
    (counted over the tensors: an expert index in a tensor name is never ranged over)."""
    held: dict[int, dict[int, set[str]]] = {}
    dtypes, stored = source.dtypes(), {}
    for m in source.modules.values():
        if m.kind == "expert":
            held.setdefault(m.layer, {}).setdefault(m.expert, set()).add(m.name.rsplit(".", 1)[1])
            stored.setdefault(m.layer, set()).add(dtypes.get(m.disk_prefix + ".weight"))
    out = {}
    for layer, by_expert in sorted(held.items()):
        if len(stored[layer]) > 1:  # they are stacked into one [E, ., .] tensor per projection
            raise ModelError(f"{source.display_name}: layer {layer}'s expert weights are stored in different dtypes "
                             f"({', '.join(sorted(map(str, stored[layer])))}); re-save the model in one dtype")
        E = max(by_expert) + 1
        if len(by_expert) < E:
            e = next(i for i in range(len(by_expert) + 1) if i not in by_expert)
            raise ModelError(f"{source.display_name}: layer {layer} holds no weight of expert {e}, but one of expert "
                             f"{E - 1} ({len(by_expert)} experts in all); re-download the model")
        gaps = sorted(e for e, projs in by_expert.items() if projs != {"gate", "up", "down"})
        if gaps:
            e = gaps[0]
            lacks = ", ".join(p for p in ("gate", "up", "down") if p not in by_expert[e])
            raise ModelError(f"{source.display_name}: layer {layer}'s expert {e} lacks its {lacks} weight(s) "
                             f"({len(gaps)} of the layer's {E} experts are incomplete); re-download the model")
        out[layer] = E
    return out


def _first(cfg: dict, keys: tuple[str, ...]) -> tuple[str, int] | None:
    return next(((k, cfg[k]) for k in keys if cfg.get(k) is not None), None)


def _check_experts(cfg: dict, experts: dict[int, int], family: FamilySpec, where: str) -> None:
    counts = sorted(set(experts.values()))
    for key in EXPERT_COUNT_KEYS:  # every spelling present (transformers maps them onto one attribute)
        if cfg.get(key) is not None and counts and counts != [cfg[key]]:
            layer = next(L for L, E in experts.items() if E != cfg[key])
            raise ModelError(f"{where}: config.json has {key} {cfg[key]} but layer {layer} holds {experts[layer]} "
                             "experts: the config does not describe these weights")
    E = counts[0] if counts else None
    top_k = _first(cfg, TOP_K_KEYS)
    if E is not None and top_k is not None and top_k[1] > E:
        raise ModelError(f"{where}: config.json's {top_k[0]} {top_k[1]} exceeds the {E} experts of a layer")
    if E is not None and not family.logit_routing and cfg.get("n_group") is not None:
        _check_groups(cfg, E, top_k[1] if top_k else 1, where)


def _check_groups(cfg: dict, E: int, top_k: int, where: str) -> None:
    """DeepSeek-V3's grouped routing: experts in ``n_group`` equal groups (two best scores each), ``topk_group``
    groups kept, the top-k drawn from them."""
    groups, kept = cfg.get("n_group"), cfg.get("topk_group")
    if not _positive_int(groups) or not _positive_int(kept):
        raise ModelError(f"{where}: config.json's n_group and topk_group must be positive integers, got "
                         f"{groups!r} and {kept!r}")
    if E % groups or E // groups < 2 or kept > groups or top_k > kept * (E // groups):
        raise ModelError(f"{where}: config.json's routing does not fit {E} experts: n_group {groups} must divide "
                         f"them into groups of 2 or more, topk_group {kept} be at most n_group, and "
                         f"num_experts_per_tok {top_k} at most topk_group x the group size")


def _meta_model(source: ModelSource):
    """transformers' model of the config on the meta device, None where no config object can be made here (a
    remote-code model known only by its hub metadata)."""
    from transformers import AutoModelForCausalLM

    config = source.hf_config()
    if config is None:
        log.info("%s: remote-code model read from hub metadata; its tensors are checked when it is run",
                 source.display_name)
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=source.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a config's values reach arbitrary transformers code: all are bad input
        reason = error_reason(e)
        raise ModelError(f"{source.display_name}: transformers cannot build the model config.json describes "
                         f"({type(e).__name__}: {reason}); fix config.json or re-download the model") from None


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def implied_tensors(model: torch.nn.Module, family: FamilySpec, experts: dict[int, int] | None = None,
                    where: str = "") -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
    """(on-disk name -> (shape, in-memory dtype) of every tensor ``model``'s state dict implies, the names that may
    be absent: a tied ``lm_head``). Fused experts become per-expert tensors; ``experts`` (layer -> count on disk):
    a fused tensor whose expert count differs is a ModelError before any per-expert name is made."""
    implied: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, t in model.state_dict().items():
        m = _FUSED.match(key)
        if m is None or t.dim() != 3:
            layer = re.match(r"model\.layers\.(\d+)\.(.+)$", key)
            implied[family.disk_key(int(layer[1]), layer[2]) if layer else key] = (tuple(t.shape), t.dtype)
            continue
        L, E = int(m[1]), t.shape[0]
        if experts is not None and experts.get(L) != E:
            raise ModelError(f"{where}: config.json implies {E} experts in layer {L} but the weights hold "
                             f"{experts.get(L, 0)}: the config does not describe these weights")
        implied.update(_per_expert(family, L, m[2], m[3], tuple(t.shape), t.dtype))
    tied = getattr(model, "_tied_weights_keys", None) or {}
    optional = set(tied) if getattr(model.config, "tie_word_embeddings", False) else set()
    return implied, optional


def _per_expert(family: FamilySpec, layer: int, block: str, fused: str, shape: tuple[int, ...], dtype
                ) -> Iterator[tuple[str, tuple[tuple[int, ...], torch.dtype]]]:
    E, rows, cols = shape
    parts = {"gate": rows // 2, "up": rows // 2} if fused == "gate_up_proj" else {"down": rows}
    for e in range(E):
        for proj, r in parts.items():
            yield family.disk_key(layer, f"{block}.experts.{e}.{family.expert_proj[proj]}.weight"), ((r, cols), dtype)


def _compare(source: ModelSource, implied: dict, optional: set[str], tied_hint: bool) -> None:
    shapes, dtypes = source.shapes(), source.dtypes()
    problems = []
    for key, (shape, dtype) in implied.items():
        if key not in shapes:
            if key not in optional:
                hint = " (config.json: tie_word_embeddings false)" if key == "lm_head.weight" and not tied_hint else ""
                problems.append(f"{key} is missing{hint}")
        elif tuple(shapes[key]) != shape:
            problems.append(f"{key} is {list(shapes[key])} where config.json implies {list(shape)}")
        elif (bad := _dtype_problem(dtypes.get(key, "?"), dtype)) is not None:
            problems.append(f"{key} {bad}")
    if problems:
        raise ModelError(f"{source.display_name} does not match its config.json: {_listed(problems)}; the weights "
                         "and config.json must be of one model (re-download it, or fix config.json)")
    extra = sorted(k for k in shapes if k not in implied)
    if extra:
        raise ModelError(f"{source.display_name} holds tensors its config.json does not describe: {_listed(extra)}; "
                         "they would be left out of the quantized checkpoint: remove them, or use the config they "
                         "belong to")


def _dtype_problem(stored: str, implied: torch.dtype) -> str | None:
    if not implied.is_floating_point:
        return None if stored == DTYPE_NAMES.get(implied) else f"is {stored}, where the model holds {implied}"
    if stored in FLOAT_DTYPES:
        return None
    if stored.startswith("F8_"):
        return (f"is stored in {stored} without a block scale (quant reads FP8 weights of releases whose config.json "
                "declares quant_method fp8 with weight_block_size, each with its *_scale_inv)")
    return f"is {stored}, not a floating-point weight (F16, BF16 or F32)"


def _listed(items: list[str]) -> str:
    return "; ".join(items[:SHOWN]) + (f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else "")

