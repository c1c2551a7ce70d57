"""AWQ (Lin et al., 2023, arXiv:2306.00978): activation-aware smoothing-factor search, batched over experts.

Dimensions: ``B`` batch (experts of one shape and bit width, or 1), ``C`` calibration rows per element (the
tokens routed to it, zero-padded to a common length; ``mask [B, C]`` marks the real ones), ``O`` output
features, ``I`` input features.

For any per-input-channel factors ``s > 0``, ``x Wᵀ = (x / s)(W · s)ᵀ``; quantizing ``W · s`` instead of
``W`` gives the channels that carry large activations a finer effective grid. The search tries
``s = m^α / sqrt(max(m^α) · min(m^α))`` with ``m = mean |x|`` per channel over the real rows and ``α`` in
``linspace(0, 1, n_grid)``, and keeps the ``α`` with the least output error
``Σ_rows ||x Wᵀ − (x / s) Q(W · s)ᵀ||²``. ``α = 0`` is ``s = 1``, plain round-to-nearest, so the result is
never worse than RTN on the calibration rows. One ``s`` per batch element, or with ``share_across_batch`` one
``s`` for all of them (loss summed over the batch). ``extra`` adds other weights fed by the same input: they
count in the loss and are quantized with the same ``s``.

What the caller folds where. The returned ``weight`` is ``Q(W · s)``: the weights' input columns are already
multiplied by ``s``, and ``1 / s`` must be folded into whatever produces the input, exactly once:

* fused expert gate/up fed by ``post_attention_layernorm`` (stack gate and up along ``O``; their input is the
  same): one shared ``s`` (``share_across_batch=True``, B = experts). Norm weight ÷ ``s``; router weight
  columns × ``s`` (the router is kept in bf16, so its logits change only by rounding); shared-expert gate/up
  columns × ``s`` (pass them as ``extra`` so they count in the search and are quantized with the same ``s``).
* expert down_proj: per-expert ``s`` (``share_across_batch=False``). That expert's up_proj rows ÷ ``s``, exact
  because down's input is ``act(gate x) · (up x)``, elementwise in the up rows. This changes up's weights, so
  search down before gate/up (down's input does not depend on gate/up's ``s`` in exact arithmetic) or
  re-quantize up afterwards.
* attention q/k/v fed by ``input_layernorm`` (stack q, k, v along ``O``, B = 1): ``input_layernorm`` ÷ ``s``.
* o_proj with v_proj as the producer: v_proj rows ÷ ``s``, only when v's outputs map one-to-one onto o's
  inputs (``num_key_value_heads == num_attention_heads``); with GQA a v channel feeds several o channels that
  would need one tied factor, so leave o_proj unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.algos import triton_runs
from quant.algos.grid import QuantizedWeight, all_finite, quantize_weight
from quant.errors import NumericalError
from quant.scheme import Scheme

# Channels whose mean |x| is below this fraction of the largest are floored to it, so s stays finite and a
# channel that was (nearly) silent in calibration is not blown up by 1/s.
_MIN_RELATIVE_MEAN = 1e-4


@dataclass(frozen=True)
class AWQExtra:
    """More weights fed by the same input: ``w [B', O', I]``, their input rows ``x [B', C', I]`` with
    ``mask [B', C']`` and their own ``spec`` (e.g. a shared expert kept at 8 bits). ``B' == B`` unless the
    search is shared across the batch."""

    w: torch.Tensor
    x: torch.Tensor
    mask: torch.Tensor
    spec: Scheme


@dataclass(frozen=True)
class AWQResult:
    """``scales``: ``s [B, I]`` (``[I]`` when shared), fp32. ``weight``: ``Q(w · s)``. ``alpha [B]``: the
    exponent chosen. ``error [B]`` / ``rtn_error [B]``: summed squared output error of ``w`` over the real
    rows at the chosen ``α`` / at ``α = 0``. ``extra_*``: the same for ``extra`` (``[B']``), or None."""

    scales: torch.Tensor
    weight: QuantizedWeight
    alpha: torch.Tensor
    error: torch.Tensor
    rtn_error: torch.Tensor
    extra_weight: QuantizedWeight | None = None
    extra_error: torch.Tensor | None = None
    extra_rtn_error: torch.Tensor | None = None


def awq_search(
    w: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    spec: Scheme,
    scale_dtype: torch.dtype,
    *,
    n_grid: int = 20,
    share_across_batch: bool = False,
    extra: AWQExtra | None = None,
    channel_means: torch.Tensor | None = None,
    batch_chunk: int | None = None,
) -> AWQResult:
    """Search ``s`` for ``w [B, O, I]`` given its input rows ``x [B, C, I]`` (``mask [B, C]`` bool).

    ``channel_means [N, I]`` (N = 1 when shared, else B): mean |x| per channel measured elsewhere, for callers
    whose rows are not activations but a square root of their second moment (``x = Lᵀ`` with ``L Lᵀ = Σ x xᵀ``
    gives the same loss from a Hessian, without keeping activations). ``batch_chunk``: batch elements whose
    trial errors are computed at once (bounds the search's working memory; the result does not depend on it).

    The search is :func:`smoothing_grid`, :func:`trial_errors` per part and :func:`pick_scales`; a caller that
    cannot hold every element's input at once (a shared search over experts whose Hessians come in chunks) runs
    those three itself: every element's trial errors depend on that element alone."""
    assert n_grid >= 1, n_grid
    parts = [AWQExtra(w, x, mask, spec)] + ([extra] if extra is not None else [])
    for part in parts:
        _check_part(part, w.shape[0], w.shape[2], share_across_batch)
    means = _channel_means(parts, share_across_batch) if channel_means is None else channel_means
    alphas, s_grid = smoothing_grid(means, n_grid)
    errors = [trial_errors(part, s_grid, scale_dtype, share_across_batch, batch_chunk) for part in parts]
    s, best, picked = pick_scales(errors, s_grid, share_across_batch)
    weights = [quantize_scaled(part.w, s, part.spec, scale_dtype) for part in parts]
    alpha = alphas[best].expand(w.shape[0])
    extra_fields = (weights[1], picked[1], errors[1][0]) if extra is not None else (None, None, None)
    return AWQResult(s[0] if share_across_batch else s, weights[0], alpha, picked[0], errors[0][0], *extra_fields)


def smoothing_grid(channel_means: torch.Tensor, n_grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``channel_means [N, I]`` -> ``(alphas [n_grid], s_grid [n_grid, N, I])``, ``α`` in ``linspace(0, 1)``;
    means below ``_MIN_RELATIVE_MEAN`` of a row's largest are floored to it."""
    means = _floor_means(channel_means.float())
    alphas = torch.linspace(0.0, 1.0, n_grid, device=means.device)
    return alphas, torch.stack([_smoothing(means, alpha) for alpha in alphas.tolist()])


def trial_errors(part: AWQExtra, s_grid: torch.Tensor, scale_dtype: torch.dtype, shared: bool,
                 batch_chunk: int | None = None, split: bool | None = None) -> torch.Tensor:
    """Output error of ``part`` at every grid point: ``[n_grid, B']``, element ``b``'s column computed from
    element ``b`` alone. ``s_grid [n_grid, 1, I]`` when ``shared``, else ``[n_grid, B', I]``. The loop runs over
    α, each step batched over ``batch_chunk`` elements at a time.

    ``split`` (default: on a GPU with Triton) computes ``‖Δ xᵀ‖²`` with ``Δ = Q(W·s)/s − W`` from one fused kernel
    for the deltas' bf16 halves (:mod:`quant.algos.awq_triton`) and one bf16 product of split operands with fp32
    accumulation (:func:`split_rows`, ~1e-5 relative) on the tensor cores, instead of ``(x/s) Q(W·s)ᵀ − x Wᵀ`` in
    fp32 torch ops: there the deltas took ~20 passes over the weights per α and the products ran on the fp32
    units (``20 · 2·I²·O`` flops per expert, 33 TFLOP a Qwen3-30B-A3B layer). Only near-ties (errors within
    ~1e-5) can pick another α; the shipped codes are quantized at the chosen α by ``grid.quantize_weight``."""
    _check_part(part, part.w.shape[0], part.w.shape[2], True)
    split = triton_runs(part.x, "quant.algos.awq_triton") if split is None else split
    step = batch_chunk or part.w.shape[0]
    chunks = []
    for b0 in range(0, part.w.shape[0], step):
        sl = slice(b0, b0 + step)
        sub = AWQExtra(part.w[sl], part.x[sl], part.mask[sl], part.spec)
        grid = s_grid if shared else s_grid[:, sl]
        if split:
            from quant.algos.awq_triton import trial_deltas

            rows = split_rows(sub.x, sub.mask)
            chunks.append(torch.stack([_squared_norms(split_product(trial_deltas(sub.w, s, sub.spec, scale_dtype),
                                                                    rows)) for s in grid]))
            del rows
            continue
        ref = torch.bmm(sub.x.float(), sub.w.float().transpose(1, 2))
        chunks.append(torch.stack([_output_error(sub, ref, s, scale_dtype) for s in grid]))
        del ref
    return torch.cat(chunks, dim=1)


def _split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``t`` -> bf16 ``(hi, lo)`` with ``t ≈ hi + lo`` to ~2^-16 relative."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


def split_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows ``x [B, C, I]`` (``mask [B, C]``; rows outside it zeroed) -> ``[B, 3I, C]`` bf16: ``[Xᵀ_hi; Xᵀ_hi;
    Xᵀ_lo]``, the right operand that pairs with ``[Δ_hi | Δ_lo | Δ_hi]`` (:func:`split_cat`): one product of
    inner dimension ``3I`` is ``Δ_hi Xᵀ_hi + Δ_lo Xᵀ_hi + Δ_hi Xᵀ_lo``."""
    B, C, n_in = x.shape
    xt = x.transpose(1, 2)  # [B, I, C], a view
    out = torch.empty(B, 3 * n_in, C, dtype=torch.bfloat16, device=x.device)
    hi = out[:, :n_in]
    hi.copy_(xt)  # rounded to nearest even, as _split's cast
    out[:, n_in : 2 * n_in] = hi
    out[:, 2 * n_in :] = xt - hi  # computed in fp32 (type promotion), then rounded: no fp32 copy of hi
    out.mul_(mask[:, None, :])  # exact: padding rows become zeros
    return out


def split_cat(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t [B, O, I]`` -> ``[B, O, 3I]`` bf16 ``[t_hi | t_lo | t_hi]``: the layout of the fused kernel's
    deltas, as torch ops (its reference)."""
    hi, lo = _split(t)
    return torch.cat([hi, lo, hi], dim=-1)


def split_product(a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[B, O, 3I] @ [B, 3I, C]`` (bf16, :func:`split_cat` and :func:`split_rows` layouts) with fp32 output: fp32
    accuracy to ~1e-5 relative at tensor-core speed on a GPU. On a CPU (tests) the same product in fp32 (a
    bf16 product is exact in fp32)."""
    if a.is_cuda:
        return torch.bmm(a, rows, out_dtype=torch.float32)
    return torch.bmm(a.float(), rows.float())


def _squared_norms(y: torch.Tensor) -> torch.Tensor:
    """``Σ y²`` per batch element of ``y [B, ...]``, in one pass (no ``y²`` tensor)."""
    return torch.linalg.vector_norm(y.flatten(1), dim=1).square()


def pick_scales(errors: list[torch.Tensor], s_grid: torch.Tensor, shared: bool):
    """The grid point with the least error (summed over parts, and over the batch when ``shared``; ties keep the
    smaller α) -> ``(s [N, I], best [N], picked)``, ``picked``: each part's errors at it ``[B']``. Raises
    NumericalError when a picked error is not finite."""
    objective = sum(e.sum(dim=1, keepdim=True) for e in errors) if shared else sum(errors)
    best = torch.nan_to_num(objective, nan=float("inf")).argmin(dim=0)  # [N]
    s = s_grid[best, torch.arange(best.shape[0], device=best.device)]  # [N, I]
    picked = [e[best.expand(e.shape[1]) if shared else best, torch.arange(e.shape[1], device=e.device)]
              for e in errors]
    _check_finite_error(picked)
    return s, best, picked


def _check_part(part: AWQExtra, B: int, n_in: int, shared: bool) -> None:
    Bp, Cp, _ = part.x.shape
    assert part.w.ndim == 3 and part.w.shape[2] == n_in, f"w must be [B, O, {n_in}], got {tuple(part.w.shape)}"
    assert part.x.shape == (part.w.shape[0], Cp, n_in), f"x must be [B, C, I], got {tuple(part.x.shape)}"
    assert part.mask.shape == (Bp, Cp) and part.mask.dtype == torch.bool, "mask must be bool [B, C]"
    assert shared or Bp == B, f"extra has batch {Bp} but w has {B}: only a shared search mixes batch sizes"
    assert n_in % part.spec.group_size == 0, f"group size {part.spec.group_size} does not divide {n_in}"
    finite = all_finite(part.w) & all_finite(part.x)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise NumericalError(f"AWQ input has NaN/Inf at batch index {bad} (weights or activations)")


def _channel_means(parts: list[AWQExtra], shared: bool) -> torch.Tensor:
    """mean |x| per channel over the real rows of every part: ``[B, I]``, or ``[1, I]`` when shared (zero for an
    element without rows: :func:`smoothing_grid` floors it to all ones)."""
    sums = [(p.x.float().abs() * p.mask[..., None]).sum(dim=1) for p in parts]  # [B', I]
    counts = [p.mask.sum(dim=1).float() for p in parts]  # [B']
    if shared:
        sums, counts = [t.sum(dim=0, keepdim=True) for t in sums], [c.sum(dim=0, keepdim=True) for c in counts]
    return sum(sums) / sum(counts).clamp_min(1.0)[:, None]


def _floor_means(mean: torch.Tensor) -> torch.Tensor:
    floor = mean.amax(dim=-1, keepdim=True) * _MIN_RELATIVE_MEAN
    return torch.where(floor > 0, torch.maximum(mean, floor), torch.ones_like(mean))


def _smoothing(means: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = m^α / sqrt(max · min)`` per row of ``means [N, I]``; exactly 1 at ``α = 0``."""
    s = means.pow(alpha)
    return s / (s.amax(dim=-1, keepdim=True) * s.amin(dim=-1, keepdim=True)).sqrt()


def quantize_scaled(w: torch.Tensor, s: torch.Tensor, spec: Scheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    """``Q(W · s)`` for ``w [B', O, I]`` and ``s [B' or 1, I]``."""
    return quantize_weight(w.float() * s[:, None, :], spec, scale_dtype)


def _output_error(part: AWQExtra, ref: torch.Tensor, s: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """``Σ_real rows ||x Wᵀ − (x / s) Q(W · s)ᵀ||²`` per element ``[B']`` for ``s [B' or 1, I]`` and
    ``ref = x Wᵀ [B', C', O']``."""
    w_hat = quantize_scaled(part.w, s, part.spec, scale_dtype).dequantize().float()
    y = torch.bmm(part.x.float() / s[:, None, :], w_hat.transpose(1, 2))
    return (((y - ref) ** 2).sum(dim=-1) * part.mask).sum(dim=-1)


def _check_finite_error(errors: list[torch.Tensor]) -> None:
    for err in errors:
        if not bool(torch.isfinite(err).all()):
            bad = (~torch.isfinite(err)).nonzero().flatten().tolist()
            raise NumericalError(f"AWQ output error is not finite at batch index {bad} for every α")
