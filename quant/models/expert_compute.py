"""One MoE layer's routed experts computed by quant: weights kept narrower than the hidden states (a bf16
checkpoint's experts, exact as stored, beside fp32 activations) are widened a few experts at a time as they run,
and optionally transformed on the way (round-to-nearest at a scheme), so a layer's experts exist once, in their
stored dtype, whatever the compute dtype and whatever scheme a forward runs them at.

Dimension legend: E experts, T tokens, D hidden, I expert intermediate, k experts per token, N = T·k routed rows.

``install(view, dtype)`` replaces the experts' forward for as long as the handle lives (``remove``):

- fused (transformers 5): the experts module's forward ``(x [T, D], top_idx [T, k], top_w [T, k]) -> [T, D]``,
  with transformers' own semantics (rows sorted by expert, ``gate_up`` then the module's gating, ``down``, the
  routing weight, the k rows of a token summed in that order);
- per-expert (remote code): each expert ``nn.Linear``'s forward (the module's own MLP code runs around it).

Each projection is one autograd function: its backward widens the weights again instead of keeping the widened copy
(a DeepSeek-V3 layer's experts are 45 GB in fp32), and the stored weights get no gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from quant.diag.hostsync import on_device
from quant.errors import ModelError
from quant.models.experts import ExpertsView

Transform = Callable[[torch.Tensor], torch.Tensor]  # w [e, out, in] in the compute dtype -> the same shape and dtype
WIDEN_BYTES = 1 << 30  # one projection of the experts widened at once (fp32: 8 DeepSeek-V3 gate_up projections)


class ExpertsCompute:
    """The handle ``install`` returns: ``transform`` (None: the weights as stored) applies from the next forward on."""

    def __init__(self, view: ExpertsView, dtype: torch.dtype):
        self.view: ExpertsView | None = view
        self.dtype = dtype
        self.transform: Transform | None = None
        self._undo: list[Callable[[], None]] = []

    def widen(self, w: torch.Tensor, transform: Transform | None) -> torch.Tensor:
        """``w [e, out, in]`` in the compute dtype, transformed (never written back: the stored weights stay)."""
        wide = w.to(self.dtype)
        return wide if transform is None else transform(wide)

    def remove(self) -> None:
        """The module's own forward back; the handle lets go of the layer's weights."""
        for undo in reversed(self._undo):
            undo()
        self._undo, self.view = [], None


def install(view: ExpertsView, dtype: torch.dtype) -> ExpertsCompute:
    """Route every forward of ``view``'s experts through quant's computation in ``dtype`` (module docstring)."""
    compute = ExpertsCompute(view, dtype)
    if isinstance(view.module, nn.ModuleList):
        for mlp in view.module:
            for lin in (m for m in mlp.modules() if isinstance(m, nn.Linear)):
                _override(compute, lin, functools.partial(_linear_forward, compute, lin))
        return compute
    m = view.module
    if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True):
        raise ModelError(f"{type(m).__name__}: quant computes fused experts stored [E, 2I, D] gate rows first, without "
                         "biases; these are stored otherwise")
    _override(compute, m, functools.partial(_fused_forward, compute))
    return compute


def _override(compute: ExpertsCompute, module: nn.Module, forward: Callable) -> None:
    module.forward = forward
    compute._undo.append(lambda: module.__dict__.pop("forward", None))


def _linear_forward(compute: ExpertsCompute, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """One expert's projection of the per-expert layout: ``x [..., in] -> [..., out]``."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    offs = on_device([n], x.device, torch.int32)
    y = _Projection.apply(flat.to(compute.dtype), lin.weight[None], offs, [n], compute, compute.transform)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _fused_forward(compute: ExpertsCompute, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor
                   ) -> torch.Tensor:
    """The fused experts' forward: ``x [T, D]``, ``top_idx``/``top_w [T, k]`` -> ``[T, D]`` in ``x``'s dtype."""
    view = compute.view
    T, k = top_idx.shape
    E, D = view.n_experts, x.shape[-1]
    flat = top_idx.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    host = counts.tolist()  # the expert ranges' row counts: one read back per forward
    token, weight = order // k, top_w.reshape(-1)
    xc = x.to(compute.dtype)
    out = torch.zeros(T * k, D, dtype=compute.dtype, device=x.device)  # routed rows in token order, [T * k, D]
    start = 0
    for e0, e1 in _ranges(len(host), _chunk(view)):
        sizes = host[e0:e1]
        part = slice(start, start + sum(sizes))  # this expert range's rows, sorted by expert
        start = part.stop
        if part.stop == part.start:
            continue
        rows, offs = order[part], torch.cumsum(counts[e0:e1], 0).to(torch.int32)
        gu = _Projection.apply(xc[token[part]], view.gate_up[e0:e1], offs, sizes, compute, compute.transform)
        if hasattr(view.module, "_apply_gate"):
            a = view.module._apply_gate(gu)  # the module's own gating (transformers' default: act(gate) * up)
        else:
            gate, up = gu.chunk(2, dim=-1)
            a = view.act(gate) * up
        y = _Projection.apply(a, view.down[e0:e1], offs, sizes, compute, compute.transform)
        out[rows] = (y * weight[rows].unsqueeze(-1)).to(out.dtype)
    return out.view(T, k, D).sum(dim=1).to(x.dtype)  # a token's k rows summed in routing order, as transformers does


def _chunk(view: ExpertsView) -> int:
    """Experts widened at once: their larger projection within ``WIDEN_BYTES`` in fp32."""
    per_expert = max(view.gate_up[0].numel(), view.down[0].numel()) * 4
    return max(1, WIDEN_BYTES // per_expert)


def _ranges(n_experts: int, size: int) -> list[tuple[int, int]]:
    return [(e, min(e + size, n_experts)) for e in range(0, n_experts, size)]


class _Projection(torch.autograd.Function):
    """``x [n, in]`` sorted by expert (group ends ``offs``, sizes ``sizes``) times each group's widened (and
    transformed) ``w [g, out, in]`` transposed -> ``[n, out]``; the backward widens ``w`` again for ``dy @ w``."""

    @staticmethod
    def forward(ctx, x, w, offs, sizes, compute, transform):
        ctx.save_for_backward(w, offs)
        ctx.sizes, ctx.compute, ctx.transform = sizes, compute, transform
        return grouped_mm(x, compute.widen(w, transform), offs, sizes)

    @staticmethod
    def backward(ctx, dy):
        w, offs = ctx.saved_tensors
        wide = ctx.compute.widen(w, ctx.transform)
        return grouped_mm(dy, wide.transpose(1, 2), offs, ctx.sizes), None, None, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x [n, in]`` times each group's ``w [g, out, in]`` transposed: torch's grouped GEMM where it runs this dtype
    on this device (tried once, ``_grouped_ok``), else one GEMM per group."""
    if _grouped_ok(x.device, x.dtype):
        return torch.nn.functional.grouped_mm(x, w.transpose(1, 2), offs=offs)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.mm(x[start : start + n], w[g].t(), out=out[start : start + n])
        start += n
    return out


_GROUPED: dict[tuple, bool] = {}


def _grouped_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes ``dtype`` on ``device`` with either operand layout the
    projections pass (a transposed view, forward; a contiguous one, backward) and an empty group: the same values as
    one GEMM per group."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED:
        ok = hasattr(torch.nn.functional, "grouped_mm")
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(3, 16, generator=gen).to(device, dtype)
                w = torch.randn(3, 8, 16, generator=gen).to(device, dtype)
                offs = on_device([1, 1, 3], device, torch.int32)
                ref = torch.cat([x[:1] @ w[0].t(), x[1:] @ w[2].t()])
                for mat_b in (w.transpose(1, 2), w.transpose(1, 2).contiguous()):
                    got = torch.nn.functional.grouped_mm(x, mat_b, offs=offs)
                    ok = ok and got.dtype == dtype and torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                ok = False
        _GROUPED[key] = ok
    return _GROUPED[key]
