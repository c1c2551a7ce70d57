"""transformers modules for one model, materialized one decoder layer at a time.

The skeleton is the real transformers model built on the meta device (the folder's own code when
``trust_remote_code``), so forward semantics are exactly the model's. A layer is materialized by loading its tensors
from safetensors (per-expert on disk, fused ``gate_up [E, 2I, D]`` / ``down [E, D, I]`` in memory: transformers'
own parameters, or for a per-expert ``nn.ModuleList`` fused storage the expert Linears view, see ``experts.py``)
and released back to meta afterwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from quant.errors import ModelError
from quant.io.direct_read import TORCH_DTYPES
from quant.models.experts import ExpertsView, experts_view, moe_block, per_expert_layout
from quant.models.names import module_kind
from quant.models.source import ModelSource

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_KEEP_FP32 = ("e_score_correction_bias",)


def build_skeleton(source: ModelSource, dtype: torch.dtype) -> nn.Module:
    """The full transformers model on the meta device (no memory), attention through SDPA."""
    from transformers import AutoModelForCausalLM

    config = source.config
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, trust_remote_code=source.trust_remote_code)
    return model.eval()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def read_layer_tensors(source: ModelSource, idx: int, device="cpu") -> dict[str, torch.Tensor]:
    """Every on-disk tensor of decoder layer ``idx``, by on-disk name."""
    return source.read_tensors(source.layer_keys(idx), device)


def _expert_keys(source: ModelSource, idx: int, keys) -> dict[str, dict[int, str]]:
    """Layer ``idx``'s routed expert tensors among on-disk ``keys``: {"gate"|"up"|"down": {expert: key}}."""
    prefix, fam = f"model.layers.{idx}.", source.family
    inv = {v: k for k, v in fam.expert_proj.items()}
    expert_re = re.compile(re.escape(prefix + fam.disk_moe) + r"\.experts\.(\d+)\.(\w+)\.weight$")
    experts: dict[str, dict[int, str]] = {"gate": {}, "up": {}, "down": {}}
    for key in keys:
        m = expert_re.match(key)
        if m and m.group(2) in inv:
            experts[inv[m.group(2)]][int(m.group(1))] = key
    return experts


def _layer_state(source: ModelSource, idx: int, device, moe_attr: str, raw: dict | None = None,
                 expert_dtype: torch.dtype | None = None):
    """On-disk tensors of layer ``idx`` renamed to the in-memory decoder layer's state-dict keys (the MoE block
    under ``moe_attr``), with the routed experts stacked apart: (state, (gate_up [E, 2I, D], down [E, D, I]) or None).
    ``raw``: the layer's tensors already read (any device), else they are read onto ``device``. Each expert tensor
    is copied straight into its slice of the stacked tensors on ``device`` (no per-expert copies there first), cast
    to ``expert_dtype`` on the way (default: as stored); expert tensors already in their slots (``expert_slots``)
    are not copied at all."""
    prefix = f"model.layers.{idx}."
    fam = source.family
    if raw is None:
        raw = read_layer_tensors(source, idx, device)
    keys = _expert_keys(source, idx, raw)
    routed = {k for by_expert in keys.values() for k in by_expert.values()}
    state = {}
    for key, tensor in raw.items():
        if key in routed:
            continue
        local = key[len(prefix):]
        if local.startswith(fam.disk_moe + "."):
            local = moe_attr + "." + local[len(fam.disk_moe) + 1:]
        state[local] = tensor.to(device, non_blocking=True)
    if not keys["gate"]:
        return state, None
    n = len(keys["gate"])
    if any(sorted(keys[p]) != list(range(n)) for p in keys):
        raise ModelError(f"{source.path}: layer {idx} has an incomplete set of expert tensors")
    blocks = lambda projs: [[raw[keys[p][e]] for p in projs] for e in range(n)]  # noqa: E731
    return state, (_stacked(source, idx, blocks(("gate", "up")), device, expert_dtype),
                   _stacked(source, idx, blocks(("down",)), device, expert_dtype))


def expert_slots(source: ModelSource, idx: int, metas: dict[str, tuple[tuple[int, ...], torch.dtype]], device,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """For a reader that receives layer ``idx``'s tensors on ``device`` (NCCL shares broadcast): one view per routed
    expert tensor among ``metas`` ({on-disk name: (shape, stored dtype)}), its slot in freshly allocated stacked
    ``gate_up [E, 2I, D]`` / ``down [E, D, I]``. Tensors received into them are stacked already: ``_layer_state``
    copies nothing, the layer's experts exist once on the device, not once received and once stacked. Empty (the
    reader allocates per tensor, ``_layer_state`` stacks, or says what is wrong) when the stored dtype is not the
    compute ``dtype`` (stacking casts) or the experts are not a complete set of equal shapes."""
    keys = _expert_keys(source, idx, metas)
    n = len(keys["gate"])
    if not n or any(sorted(keys[p]) != list(range(n)) for p in keys):
        return {}
    slots = {}
    for projs in (("gate", "up"), ("down",)):
        metas_of = [metas[keys[p][e]] for p in projs for e in range(n)]
        shapes = {p: {tuple(metas[keys[p][e]][0]) for e in range(n)} for p in projs}
        if (any(len(v) != 1 or len(next(iter(v))) != 2 for v in shapes.values())
                or len({next(iter(v))[1] for v in shapes.values()}) != 1
                or {dt for _, dt in metas_of} != {dtype or metas_of[0][1]}):
            return {}
        heights = [next(iter(shapes[p]))[0] for p in projs]
        out = torch.empty((n, sum(heights), next(iter(shapes[projs[0]]))[1]), dtype=metas_of[0][1], device=device)
        for e in range(n):
            r = 0
            for p, h in zip(projs, heights, strict=True):
                slots[keys[p][e]] = out[e, r : r + h]
                r += h
    return slots


def _in_place(blocks: list[list[torch.Tensor]], device, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The stacked tensor when every block already is the view of its own slot in it (``expert_slots``), else None."""
    base = blocks[0][0]._base
    want = torch.device(device)
    if (base is None or base.dim() != 3 or base.shape[0] != len(blocks) or (dtype is not None and base.dtype != dtype)
            or base.device.type != want.type or (want.index is not None and base.device.index != want.index)):
        return None
    for e, parts in enumerate(blocks):
        r = 0
        for b in parts:
            if b._base is not base or b.shape != base[e, r : r + b.shape[0]].shape or \
                    b.data_ptr() != base[e, r : r + b.shape[0]].data_ptr():
                return None
            r += b.shape[0]
        if r != base.shape[1]:
            return None
    return base


def _stacked(source: ModelSource, idx: int, blocks: list[list[torch.Tensor]], device,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[E, rows, cols]`` in ``dtype`` on ``device`` from each expert's row blocks (gate then up), every block copied
    (and cast) into its slice: the layer's experts exist on the device once, not as per-expert copies,
    concatenations and their stack (a DeepSeek-V3 layer's load peaked at 2.4x its experts' 22.5 GB). Blocks
    received into their slots already (``expert_slots``) are that stacked tensor, returned as is."""
    placed = _in_place(blocks, device, dtype)
    if placed is not None:
        return placed
    first = blocks[0][0]
    shapes = {tuple(tuple(b.shape) for b in e) for e in blocks}
    if len(shapes) != 1 or any(len(s) != 2 for s in next(iter(shapes))) or len({b.dtype for e in blocks for b in e}) != 1:
        raise ModelError(f"{source.path}: layer {idx}'s experts differ in shape or dtype ({sorted(shapes)[:2]})")
    rows = sum(b.shape[0] for b in blocks[0])
    out = torch.empty((len(blocks), rows, first.shape[1]), dtype=dtype or first.dtype, device=device)
    for e, parts in enumerate(blocks):
        r = 0
        for b in parts:
            out[e, r : r + b.shape[0]].copy_(b, non_blocking=True)
            r += b.shape[0]
    return out


def load_layer(source: ModelSource, model: nn.Module, idx: int, device, dtype: torch.dtype,
               raw: dict | None = None, narrow_experts: bool = False) -> nn.Module:
    """Materialize decoder layer ``idx`` of the meta skeleton on ``device`` with its checkpoint weights (``raw``: the
    layer's on-disk tensors when the caller has read them, e.g. ahead of time). ``narrow_experts``: the routed
    experts stay in the dtype they are read in where that is narrower than ``dtype`` (exact: a bf16 checkpoint's
    experts beside an fp32 layer; their forward must then widen them, ``models.expert_compute``)."""
    layer = decoder_layers(model)[idx]
    found = moe_block(source.family, layer)
    moe_attr = found[0] if found else "mlp"
    cast = lambda k, v: v if k.endswith(_KEEP_FP32) or not v.is_floating_point() else v.to(dtype)  # noqa: E731
    raw, fused = _layer_state(source, idx, device, moe_attr, raw, None if narrow_experts else dtype)
    state = {k: cast(k, v) for k, v in raw.items()}
    if fused is not None:
        fused = tuple(t if narrow_experts and _narrower(t.dtype, dtype) else cast("", t) for t in fused)
    per_expert = per_expert_layout(source.family, layer, idx)
    if fused is not None and per_expert is not None:
        per_expert.attach(*fused)
    elif fused is not None:
        state[f"{moe_attr}.experts.gate_up_proj"], state[f"{moe_attr}.experts.down_proj"] = fused
    missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    if per_expert is not None:
        missing = [k for k in missing if not k.startswith(per_expert.prefix + ".")]
    if missing or unexpected:
        raise ModelError(
            f"{source.path}: layer {idx} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    still_meta = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
    if still_meta:
        raise ModelError(f"{source.path}: layer {idx} left tensors unloaded: {still_meta[:3]}")
    return layer


def largest_layer_bytes(source: ModelSource, dtype: torch.dtype, narrow_experts: bool = False) -> int:
    """Bytes of the largest decoder layer as ``load_layer`` materializes it in ``dtype`` (``narrow_experts``: the
    routed experts in the narrower dtype they are read in), from the headers: floating tensors in ``dtype`` (an FP8
    release's are read dequantized, in 16 bits), the rest and ``_KEEP_FP32`` tensors as stored."""
    shapes, stored = source.shapes(), source.dtypes()
    size = torch.finfo(dtype).bits // 8
    totals = []
    for idx in range(source.n_layers):
        keys = source.layer_keys(idx)
        routed = {k for by_expert in _expert_keys(source, idx, keys).values() for k in by_expert.values()}
        total = 0
        for k in keys:
            kind = TORCH_DTYPES.get(stored.get(k, "F32"), torch.float32)
            read = max(2, kind.itemsize) if kind.is_floating_point else kind.itemsize
            kept = k.endswith(_KEEP_FP32) or not kind.is_floating_point
            total += torch.Size(shapes[k]).numel() * (
                read if kept else min(size, read) if narrow_experts and k in routed else size)
        totals.append(total)
    return max(totals)


def _narrower(stored: torch.dtype, dtype: torch.dtype) -> bool:
    return stored.is_floating_point and torch.finfo(stored).bits < torch.finfo(dtype).bits


def release(module: nn.Module) -> None:
    """Give a materialized module's memory back (its tensors return to meta)."""
    module.to("meta")


def load_embedding(source: ModelSource, model: nn.Module, device, dtype) -> nn.Module:
    emb = model.model.embed_tokens
    emb.load_state_dict({"weight": source.read_tensors(["model.embed_tokens.weight"], device)[
        "model.embed_tokens.weight"].to(dtype)}, assign=True)
    return emb


def load_head(source: ModelSource, model: nn.Module, device, dtype) -> tuple[nn.Module, nn.Module]:
    """Final norm and lm_head (tied to the embedding when the checkpoint has no lm_head)."""
    norm_key = "model.norm.weight"
    head_key = "lm_head.weight" if "lm_head.weight" in source.weight_map else "model.embed_tokens.weight"
    t = source.read_tensors([norm_key, head_key], device)
    model.model.norm.load_state_dict({"weight": t[norm_key].to(dtype)}, assign=True)
    model.lm_head.load_state_dict({"weight": t[head_key].to(dtype)}, assign=True)
    return model.model.norm, model.lm_head


class LayerRunner:
    """Positional embeddings and the causal mask for running decoder layers directly on [B, S, D] inputs."""

    def __init__(self, model: nn.Module, device, dtype: torch.dtype):
        self.model = model
        if not isinstance(getattr(model.model, "rotary_emb", None), nn.Module):
            raise ModelError(
                f"{type(model).__name__} has no model.rotary_emb: quant runs decoder layers the transformers 5 way "
                "(position_embeddings passed in), which this (remote) model code does not support"
            )
        rotary_cls = type(model.model.rotary_emb)
        self.rotary = rotary_cls(config=model.config).to(device)
        self.device, self.dtype = device, dtype
        self._cached: tuple = (None, None)  # (batch shape, dtype, device) -> (positions, rotary, mask)

    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        pos, cos_sin, mask = self._inputs(hidden)
        out = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    def _inputs(self, hidden: torch.Tensor) -> tuple:
        """Positions, rotary embeddings and causal mask for a ``[B, S, D]`` batch: the same for every batch of one
        shape and dtype, so made once (transformers' mask builder reads a value back from the GPU each call)."""
        from transformers.masking_utils import create_causal_mask

        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device)
        if self._cached[0] != key:
            pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = create_causal_mask(config=self.model.config, inputs_embeds=hidden, attention_mask=None,
                                      past_key_values=None, position_ids=pos)
            self._cached = (key, (pos, self.rotary(hidden, pos), mask))
        return self._cached[1]


def experts_of(source: ModelSource, layer: nn.Module, idx: int) -> ExpertsView | None:
    """The routed experts of decoder layer ``idx`` as fused tensors (either in-memory layout), or None for a dense
    layer. A per-expert layout not materialized by ``load_layer`` (a full model) gets fused storage here, once."""
    return experts_view(source.family, source.config, source.top_k, layer, idx)


def layer_weights(source: ModelSource, layer: nn.Module, idx: int) -> dict[str, torch.Tensor]:
    """Every quantizable weight of decoder layer ``idx`` by canonical name, as in-memory tensors (expert
    projections are views into the fused ``gate_up`` / ``down``), so writing into one updates the layer."""
    out = {name: mod.weight.data for name, mod in linears_of(source, layer, idx).items()}
    view = experts_of(source, layer, idx)
    if view is not None:
        I = view.intermediate
        for e in range(view.n_experts):
            out[f"layers.{idx}.experts.{e}.gate"] = view.gate_up.data[e, :I]
            out[f"layers.{idx}.experts.{e}.up"] = view.gate_up.data[e, I:]
            out[f"layers.{idx}.experts.{e}.down"] = view.down.data[e]
    return out


def linears_of(source: ModelSource, layer: nn.Module, idx: int) -> dict[str, nn.Linear]:
    """Every nn.Linear of a decoder layer by canonical name (attention, dense MLP, shared experts, a Linear router);
    routed experts are not listed even when they are Linears (per-expert layout): they belong to ``experts_of``."""
    out = {}
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):
            canonical = source.family.canonical(f"model.layers.{idx}.{name}.weight")
            if canonical is not None and module_kind(canonical) != "expert":
                out[canonical] = mod
    return out


@dataclass
class SmoothingSites:
    """Where AWQ's 1/s can be folded in a decoder layer, as in-memory parameter names and modules.

    ``attn_norm`` feeds ``attn_linears`` (canonical names); ``mlp_norm`` feeds the routed experts' gate/up (and
    the shared experts' or dense MLP's gate/up); ``mlp_readers`` are kept weights that also read ``mlp_norm``'s
    output (routers): their input columns must be multiplied by s.
    """

    attn_norm: tuple[str, nn.Module]
    attn_linears: tuple[str, ...]
    mlp_norm: tuple[str, nn.Module]
    mlp_readers: tuple[tuple[str, nn.Parameter], ...]
    kept_mlp_inputs: tuple[tuple[str, nn.Linear], ...] = ()


def smoothing_sites(source: ModelSource, layer: nn.Module, idx: int, quantized: set[str] = frozenset()) -> SmoothingSites:
    """``quantized``: canonical names that will be quantized; other shared-expert gate/up reading the MoE norm are
    returned in ``kept_mlp_inputs`` (their columns must absorb s too)."""
    fam = source.family
    readers = []
    mlp_attr, mlp = moe_block(fam, layer)
    for attr in ("gate", "shared_expert_gate"):
        mod = getattr(mlp, attr, None)
        if mod is not None and isinstance(getattr(mod, "weight", None), nn.Parameter) and hasattr(mlp, "experts"):
            readers.append((f"{mlp_attr}.{attr}.weight", mod.weight))
    return SmoothingSites(
        attn_norm=("input_layernorm.weight", layer.input_layernorm),
        attn_linears=tuple(f"layers.{idx}.attn.{leaf}" for leaf in fam.attn_norm_fed),
        mlp_norm=("post_attention_layernorm.weight", layer.post_attention_layernorm),
        mlp_readers=tuple(readers),
        kept_mlp_inputs=tuple((n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)
                              and (c := fam.canonical(f"model.layers.{idx}.{n}.weight")) is not None
                              and ".shared." in c and c.rsplit(".", 1)[1] in ("gate", "up") and c not in quantized),
    )
