"""The routed experts of one materialized MoE layer behind one view, whatever their in-memory layout.

Dimension legend: E experts, T tokens, D hidden, I expert intermediate, k experts per token.

Layouts (the on-disk keys are per-expert in both):

- fused (transformers 5): ``experts.gate_up_proj [E, 2I, D]`` (gate rows first) and ``experts.down_proj [E, D, I]``;
  the MoE block calls ``experts(x [T, D], top_idx [T, k], top_w [T, k])``, so routing is read by a forward
  pre-hook on the experts module.
- per-expert (remote code, transformers-4.x style): ``experts`` is an ``nn.ModuleList`` of MLPs computing
  ``down(act_fn(gate(x)) * up(x))`` with bias-free nn.Linear projections named as in the checkpoint
  (``gate_proj/up_proj/down_proj``; Mixtral ``w1/w3/w2`` under ``block_sparse_moe``), and the MoE block routes
  with its ``gate``. ``PerExpertLayout.attach`` allocates fused ``gate_up``/``down`` storage and re-points every
  expert Linear's ``weight`` to a view of it (zero copy): the engine reads and writes the fused tensors, the
  remote forward sees the same memory. Routing is read by a forward hook on the gate: a tuple output
  ``(topk_idx, topk_weight, ...)`` (DeepSeek's ``MoEGate``) is taken as is; a Linear gate's logits go through
  ``LogitRouting`` (the family's rule, ``FamilySpec.logit_routing`` / ``renormalize``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from quant.errors import ModelError
from quant.models.families import FamilySpec
from quant.models.names import PROJ

RouteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # fn(x [T, D], top_idx [T, k], top_w [T, k])
FUSED_GATE_UP, FUSED_DOWN = "quant_fused_gate_up", "quant_fused_down"  # fused storage on a per-expert ModuleList


@dataclass
class ExpertsView:
    """The experts of one MoE layer as fused ``gate_up [E, 2I, D]`` (gate rows first) and ``down [E, D, I]``.

    Writing into ``gate_up`` / ``down`` changes the weights the layer's forward uses, in either layout.
    """

    module: nn.Module  # the fused experts module, or the per-expert nn.ModuleList
    gate_up: nn.Parameter
    down: nn.Parameter
    act: Callable[[torch.Tensor], torch.Tensor]  # the experts' activation (applied to the gate projection)
    _install: Callable[[RouteFn], RemovableHandle]

    @property
    def n_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    def on_route(self, fn: RouteFn) -> RemovableHandle:
        """Call ``fn(x [T, D], top_idx [T, k], top_w [T, k])`` once per forward of the MoE block, with the tokens
        entering the experts and the routing the block applies. ``.remove()`` on the handle stops it."""
        return self._install(fn)

    @contextlib.contextmanager
    def outputs_unused(self) -> Iterator[None]:
        """Inside the block the routed experts compute nothing and return zeros of their input's shape; routing
        hooks still see every call. For passes whose layer output is discarded (the statistics passes): the
        experts' forward is most of a MoE layer's forward time and its largest transient (DeepSeek-V3: ~12 GB
        for 8 × 2048 tokens in transformers' grouped_mm path)."""
        modules = list(self.module) if isinstance(self.module, nn.ModuleList) else [self.module]
        for m in modules:
            m.forward = _zeros_like_input
        try:
            yield
        finally:
            for m in modules:
                del m.forward


def _zeros_like_input(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.zeros_like(x)


@dataclass(frozen=True)
class LogitRouting:
    """Router logits ``[T, E]`` -> ``(top_idx [T, k], top_w [T, k])``: softmax over experts in fp32, top-k, the k
    weights renormalized to sum 1 when ``renormalize``, cast back to the logits' dtype (transformers 4.x
    Mixtral / Qwen-MoE / OLMoE semantics)."""

    top_k: int
    renormalize: bool

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(logits.dtype)


def logit_routing(family: FamilySpec, config, top_k: int) -> LogitRouting | None:
    """The family's rule for a Linear router's logits, or None when the family does not route by softmax top-k."""
    if not family.logit_routing:
        return None
    renorm = family.renormalize if family.renormalize is not None else bool(getattr(config, "norm_topk_prob", False))
    return LogitRouting(top_k, renorm)


def moe_block(family: FamilySpec, layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(attribute, module) of a decoder layer's MoE/MLP block: the checkpoint's name when the module keeps it
    (remote Mixtral's ``block_sparse_moe``), else ``mlp``; None when there is neither."""
    for attr in dict.fromkeys((family.disk_moe, "mlp")):
        mod = getattr(layer, attr, None)
        if isinstance(mod, nn.Module):
            return attr, mod
    return None


def fused_view(experts: nn.Module) -> ExpertsView:
    def install(fn: RouteFn) -> RemovableHandle:
        return experts.register_forward_pre_hook(lambda _m, args: fn(*args[:3]))

    return ExpertsView(experts, experts.gate_up_proj, experts.down_proj, experts.act_fn, install)


@dataclass
class PerExpertLayout:
    """A per-expert ``nn.ModuleList`` of expert MLPs and the gate that routes to them."""

    prefix: str  # in-memory name of the ModuleList inside the decoder layer, e.g. ``mlp.experts``
    experts: nn.ModuleList
    gate: nn.Module
    names: dict[str, str]  # canonical projection (gate/up/down) -> Linear attribute of an expert MLP

    def linear(self, e: int, proj: str) -> nn.Linear:
        return getattr(self.experts[e], self.names[proj])

    def attach(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Make ``gate_up [E, 2I, D]`` / ``down [E, D, I]`` the storage of every expert Linear's weight (views)."""
        E, I = len(self.experts), self.linear(0, "gate").out_features
        D = self.linear(0, "gate").in_features
        if tuple(gate_up.shape) != (E, 2 * I, D) or tuple(down.shape) != (E, D, I):
            raise ModelError(f"{self.prefix}: checkpoint experts {tuple(gate_up.shape)}/{tuple(down.shape)} do not "
                             f"match the module's {E} experts of [{I}, {D}]")
        gate_up, down = nn.Parameter(gate_up, requires_grad=False), nn.Parameter(down, requires_grad=False)
        self.experts.register_parameter(FUSED_GATE_UP, gate_up)
        self.experts.register_parameter(FUSED_DOWN, down)
        for e in range(E):
            views = {"gate": gate_up.data[e, :I], "up": gate_up.data[e, I:], "down": down.data[e]}
            for proj, w in views.items():
                self.linear(e, proj).weight = nn.Parameter(w, requires_grad=False)

    def attached(self) -> bool:
        fused = getattr(self.experts, FUSED_GATE_UP, None)
        w = self.linear(0, "gate").weight
        return fused is not None and not fused.is_meta and w.data_ptr() == fused.data_ptr()

    def fuse_in_place(self) -> None:
        """Attach fused storage holding the current expert weights (a layer not materialized by ``load_layer``)."""
        w = self.linear(0, "gate").weight
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([self.linear(e, "gate").weight, self.linear(e, "up").weight])
                                   for e in range(len(self.experts))]).to(w.dtype)
            down = torch.stack([self.linear(e, "down").weight for e in range(len(self.experts))]).to(w.dtype)
        self.attach(gate_up, down)

    def view(self, routing: LogitRouting | None) -> ExpertsView:
        gate_up, down = getattr(self.experts, FUSED_GATE_UP), getattr(self.experts, FUSED_DOWN)
        gate, D = self.gate, gate_up.shape[2]
        if isinstance(gate, nn.Linear) and routing is None:
            raise ModelError(f"{self.prefix}: the router is a plain nn.Linear, but this family does not route by "
                             "softmax top-k; quant needs a gate module returning (topk_idx, topk_weight)")

        def install(fn: RouteFn) -> RemovableHandle:
            def hook(_m, args, kwargs, out) -> None:
                x = args[0] if args else next(iter(kwargs.values()))
                idx, w = _decode_route(out, routing if isinstance(gate, nn.Linear) else None, self.prefix)
                fn(x.reshape(-1, D), idx, w)

            return gate.register_forward_hook(hook, with_kwargs=True)

        return ExpertsView(self.experts, gate_up, down, self.experts[0].act_fn, install)


def _decode_route(out, routing: LogitRouting | None, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate's output -> (top_idx [T, k], top_w [T, k]): logits through ``routing``, or from a tuple the first
    integer tensor (indices) and the first floating tensor of the same shape (weights)."""
    if isinstance(out, torch.Tensor) and routing is not None:
        return routing(out)
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if isinstance(t, torch.Tensor)]
        idx = next((t for t in tensors if not t.is_floating_point()), None)
        w = next((t for t in tensors if idx is not None and t.is_floating_point() and t.shape == idx.shape), None)
        if idx is not None and w is not None:
            k = idx.shape[-1]
            return idx.reshape(-1, k), w.reshape(-1, k)
    raise ModelError(f"{where}: the MoE gate returned {type(out).__name__}; quant reads routing from logits of a "
                     "Linear gate or a (topk_idx, topk_weight, ...) tuple")


def per_expert_layout(family: FamilySpec, layer: nn.Module, idx: int) -> PerExpertLayout | None:
    """The per-expert layout of decoder layer ``idx``, or None when its experts are fused or it has none.

    Raises ModelError for an ``nn.ModuleList`` of experts quant cannot read as fused gate/up/down.
    """
    found = moe_block(family, layer)
    experts = getattr(found[1], "experts", None) if found else None
    if not isinstance(experts, nn.ModuleList):
        return None
    attr, block = found
    prefix = f"{attr}.experts"
    names = {p: family.expert_proj[p] for p in PROJ}
    problem = _layout_problem(experts, getattr(block, "gate", None), names)
    if problem:
        raise ModelError(
            f"layer {idx}: {prefix} is an nn.ModuleList of {type(experts[0]).__name__ if len(experts) else 'nothing'} "
            f"that quant cannot read as per-expert Linear experts ({problem}); supported: expert MLPs with bias-free "
            f"nn.Linear {'/'.join(names.values())} and act_fn, routed by {attr}.gate"
        )
    return PerExpertLayout(prefix, experts, block.gate, names)


def _layout_problem(experts: nn.ModuleList, gate, names: dict[str, str]) -> str | None:
    if len(experts) == 0:
        return "no experts"
    if not isinstance(gate, nn.Module):
        return "no gate module"
    shapes = set()
    for e, mlp in enumerate(experts):
        lin = {p: getattr(mlp, n, None) for p, n in names.items()}
        bad = [names[p] for p, m in lin.items() if not isinstance(m, nn.Linear) or m.bias is not None]
        if bad:
            return f"expert {e} has no bias-free nn.Linear {', '.join(bad)}"
        if not callable(getattr(mlp, "act_fn", None)):
            return f"expert {e} has no act_fn"
        shapes.add(tuple(tuple(lin[p].weight.shape) for p in PROJ))
    g, u, d = shapes.pop() if len(shapes) == 1 else (None, None, None)
    if g is None or g != u or d != g[::-1]:
        return "expert projections differ in shape"
    return None


def experts_view(family: FamilySpec, config, top_k: int, layer: nn.Module, idx: int) -> ExpertsView | None:
    """The experts of decoder layer ``idx`` (fused, or per-expert with fused storage attached), None if dense."""
    found = moe_block(family, layer)
    experts = getattr(found[1], "experts", None) if found else None
    if experts is not None and hasattr(experts, "gate_up_proj"):
        return fused_view(experts)
    layout = per_expert_layout(family, layer, idx)
    if layout is None:
        return None
    if not layout.attached():
        layout.fuse_in_place()
    return layout.view(logit_routing(family, config, top_k))
