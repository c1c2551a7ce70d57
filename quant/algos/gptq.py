"""GPTQ (Frantar et al., 2022, arXiv:2210.17323), batched over experts. Pure tensor functions.

Dimensions: ``B`` batch (experts of one shape and bit width, or 1), ``O`` output features, ``I`` input
features, ``G = I // group_size`` groups per row.

Given weights ``W [B, O, I]`` and input Hessians ``H = mean(x xᵀ) [B, I, I]``, GPTQ quantizes one input
column at a time and spreads that column's rounding error over the columns not yet quantized through the
upper Cholesky factor ``U`` of ``H⁻¹``, greedily minimising ``tr((W - Ŵ) H (W - Ŵ)ᵀ)``. Error updates are
applied lazily per block of columns (§3.4 of the paper). Block boundaries are aligned to group starts, so a
group's grid is always fitted on weights that have received every earlier column's update.

Grids come from ``grid.fit_grid`` and codes from ``grid.quantize``; the error that is propagated is the
difference to ``grid.dequantize``'s value, so GPTQ compensates for the weights that actually ship (scales
rounded to ``scale_dtype``).

``act_order`` uses *static* groups (also available alone as ``static_groups``): every group's grid is fitted
on the original weights in original column order before the loop, columns are then visited in descending
``diag(H)`` order (a separate permutation per batch element), and codes come back in original order, so the
serving layout stays ordered (``g_idx = i // group_size``; no g_idx tensor is needed).

Numerics, per batch element: a dead input (``H_ii == 0``) gets ``H_ii = 1`` and a zero weight column, as in
GPTQ; an element whose Hessian is entirely zero (no calibration token reached it) gets ``H = I`` instead, which
makes GPTQ round-to-nearest rather than zeroing the whole matrix; a Hessian that is not positive definite
after dampening is retried with ten times the dampening up to ``_MAX_DAMPENING``. Each of these is reported in
``GPTQResult.repairs``. NaN/Inf inputs, a Hessian that stays unusable, or a loop that diverges raise
``NumericalError`` naming the batch index.

Kernels: ``U`` comes from one Cholesky factorization of the reversed Hessian and a triangular inverse, both in
batched matrix products (``cholesky.py``). The column loop runs, on a GPU with Triton, as one fused kernel per
block of columns for the whole batch (``gptq_triton.py``); elsewhere (or with ``kernel="torch"``) as torch ops,
each block's loop captured once as a CUDA graph on a GPU. The two loops agree up to fp32 contraction (the fused
kernel may compute the rank-1 update with a fused multiply-add), which moves a rounding tie now and then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.algos import triton_runs
from quant.algos.cholesky import upper_inverse_factor
from quant.algos.grid import QuantizedWeight, all_finite, dequantize, fit_grid, quantize
from quant.errors import NumericalError
from quant.scheme import Scheme

_DAMPENING_GROWTH = 10.0
# Damping is a fraction of mean(diag H); at 10 GPTQ is close to RTN, and a Hessian that still fails is not
# a Gram matrix of real activations.
_MAX_DAMPENING = 10.0


@dataclass(frozen=True)
class GPTQResult:
    """``weight``: codes ``[B, O, I]`` in original column order with grids ``[B, O, G]``.
    ``loss [B]``: ``tr((W - Ŵ) H (W - Ŵ)ᵀ)`` with the caller's (undamped) H and ``Ŵ = weight.dequantize()``
    (NaN when not asked for).
    ``repairs``: ``(batch index, reason)`` for every element whose Hessian had to be repaired.
    ``diverged [B]`` (bool, on the device): elements whose column loop produced NaN/Inf, left for the caller to
    read with its own checks when ``gptq(..., check_diverged=False)``; None when gptq checked them itself."""

    weight: QuantizedWeight
    loss: torch.Tensor
    repairs: tuple[tuple[int, str], ...] = ()
    diverged: torch.Tensor | None = None


def gptq(
    w: torch.Tensor,
    H: torch.Tensor,
    spec: Scheme,
    scale_dtype: torch.dtype,
    *,
    dampening: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    kernel: str = "auto",
    with_loss: bool = True,
    check_diverged: bool = True,
) -> GPTQResult:
    """Quantize ``w [B, O, I]`` (any float dtype; computed in fp32) given Hessians ``H [B, I, I]``.

    ``spec.group_size`` must divide ``I``. ``dampening`` is added to the diagonal as a fraction of
    ``mean(diag H)`` per element; ``block_size`` is the lazy-update width (results do not depend on it beyond
    fp32 reassociation). ``static_groups``: fit every group's grid on the original weights up front (implied by
    ``act_order``) instead of on the updated weights when the group starts, as llm-compressor 0.14 always does.
    Alone it is no improvement: 1-3% lower symmetric W4 error on random Gaussian weights, but SmolLM2-135M W4 g64
    perplexity 36.8 against 33.5 for the default; ``act_order`` (static groups) gave 30.2 (base 24.3,
    benchmarks/smollm2_gptq.py). ``kernel``: "auto" (Triton on a GPU when it is installed, else torch),
    "torch" or "triton" (on a CPU: Triton's interpreter, for tests). ``with_loss=False`` skips the loss
    (``2·O·I²`` flops per element, as much as the rest of the solve) and returns NaN instead.
    ``check_diverged=False`` leaves the divergence check to the caller (``GPTQResult.diverged``).

    Host reads: one before the column loop (input checks, dead inputs and the first factorization's success, read
    together) and one after it (divergence) unless the caller takes that one over; more only when a Hessian needs
    more dampening. On a GPU each read drains the queue of launched kernels."""
    B, n_out, n_in = w.shape
    assert H.shape == (B, n_in, n_in), f"H must be [B, I, I] = {(B, n_in, n_in)}, got {tuple(H.shape)}"
    assert n_in % spec.group_size == 0, f"group size {spec.group_size} does not divide in_features {n_in}"
    assert block_size > 0 and dampening >= 0, (block_size, dampening)
    assert kernel in ("auto", "torch", "triton"), kernel
    finite = all_finite(w) & all_finite(H)
    W = w.detach().to(torch.float32, copy=True)
    dead, unseen = _dead_inputs(W, H)
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1).float(), dim=-1, descending=True, stable=True)
    Hr = reversed_hessian(H, perm, dead | unseen[:, None])
    applied, mean_diag = dampen(Hr, dampening)
    U, ok = upper_inverse_factor(Hr)
    flags = torch.stack([finite.long(), dead.sum(dim=-1), unseen.long(), ok.long()]).tolist()  # the one read
    _raise_non_finite(flags[0])
    repairs = _dead_repairs(flags[1], flags[2])
    if not all(flags[3]):
        U, damp_repairs = _more_dampening(Hr, U, ok, applied, mean_diag, dampening)
        repairs += damp_repairs
    del Hr
    grids = fit_grid(W, spec, scale_dtype) if act_order or static_groups else None
    if act_order:
        W = W.gather(-1, perm[:, None, :].expand(B, n_out, n_in))
    if _use_triton(kernel, W):
        from quant.algos.gptq_triton import quantize_columns

        q, scale, zero, diverged = quantize_columns(W, U, spec, scale_dtype, block_size, grids, perm)
    else:
        static = None if grids is None else _column_grids(*grids, _order(perm, B, n_in, W.device), spec.group_size)
        q, scale, zero, diverged = _quantize_columns(W, U, spec, scale_dtype, block_size, static)
    if check_diverged:
        raise_diverged(diverged)
        diverged = None
    del U, W
    if act_order:
        q = torch.empty_like(q).scatter_(-1, perm[:, None, :].expand(B, n_out, n_in), q)
    if grids is not None:
        scale, zero = grids
    weight = QuantizedWeight(q, scale, zero, spec)
    loss = hessian_error(w, weight.dequantize(), H) if with_loss else torch.full((B,), float("nan"), device=w.device)
    return GPTQResult(weight, loss, tuple(sorted(repairs)), diverged)


def _use_triton(kernel: str, W: torch.Tensor) -> bool:
    if kernel != "auto":
        return kernel == "triton"
    return triton_runs(W, "quant.algos.gptq_triton")  # else the torch loop (CUDA graphs) computes the same thing


def _order(perm: torch.Tensor | None, B: int, n_in: int, device) -> torch.Tensor:
    return torch.arange(n_in, device=device).expand(B, n_in) if perm is None else perm


def hessian_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``tr((W - Ŵ) H (W - Ŵ)ᵀ)`` per element, in fp32: ``[B, O, I], [B, O, I], [B, I, I] -> [B]``."""
    assert w.shape == w_hat.shape and H.shape == (w.shape[0], w.shape[2], w.shape[2])
    d = w.float() - w_hat.float()
    return (torch.bmm(d, H.float()) * d).sum(dim=(1, 2))


def _raise_non_finite(finite: list[int]) -> None:
    if not all(finite):
        raise NumericalError(
            f"GPTQ input has NaN/Inf at batch index {[b for b, f in enumerate(finite) if not f]} (weight or "
            "Hessian): check the checkpoint's weights and accumulate calibration Hessians in fp32"
        )


def diverged_message(where: str = "") -> str:
    return (f"GPTQ diverged (NaN/Inf in the updated weights){where}: raise the dampening or use more calibration "
            "tokens")


def raise_diverged(diverged: torch.Tensor) -> None:
    """Raise for the elements of ``diverged [B]`` that are set (one host read)."""
    bad = [b for b, d in enumerate(diverged.tolist()) if d]
    if bad:
        raise NumericalError(diverged_message(f" at batch index {bad}"))


def _dead_inputs(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dead inputs (``H_ii == 0``) get a zero weight column in ``W [B, O, I]`` (in place), to be factorized with
    ``H_ii = 1``; an all-zero Hessian (``unseen``) is to become ``I`` (round-to-nearest) instead of zeroing the
    whole matrix. Returns ``dead [B, I]`` (unseen elements' columns excluded) and ``unseen [B]``, on the device;
    ``H`` itself is not changed."""
    dead = torch.diagonal(H, dim1=-2, dim2=-1) == 0
    unseen = dead.all(dim=-1)
    dead &= ~unseen[:, None]
    W.masked_fill_(dead[:, None, :], 0.0)
    return dead, unseen


def _dead_repairs(n_dead: list[int], unseen: list[int]) -> list[tuple[int, str]]:
    return ([(b, "Hessian is all zero (no calibration tokens): quantized round-to-nearest")
             for b, u in enumerate(unseen) if u]
            + [(b, f"{n} dead input channels (H_ii == 0): weight columns zeroed") for b, n in enumerate(n_dead) if n])


def reversed_hessian(H: torch.Tensor, perm: torch.Tensor | None, repaired: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``H [B, I, I]`` with rows and columns in reversed processing order (``perm`` reversed, or
    ``I-1 .. 0``) and the ``repaired [B, I]`` diagonal entries set to 1: the input of cholesky.upper_inverse_factor."""
    B, n_in, _ = H.shape
    if perm is None:
        Hr = H.flip(-2, -1).float()
        fix = repaired.flip(-1)
    else:
        rev = perm.flip(-1)
        Hr = H.gather(-1, rev[:, None, :].expand(B, n_in, n_in)).gather(-2, rev[:, :, None].expand(B, n_in, n_in))
        Hr = Hr.float()
        fix = repaired.gather(-1, rev)
    torch.diagonal(Hr, dim1=-2, dim2=-1).masked_fill_(fix, 1.0)
    return Hr


def _column_grids(scale: torch.Tensor, zero: torch.Tensor | None, perm: torch.Tensor, group_size: int):
    """Per-column grids ``[B, O, I]`` in processing order: column j of element b is original column
    ``perm[b, j]`` and uses that column's group ``perm[b, j] // group_size`` of ``scale, zero [B, O, G]``."""
    B, n_out, _ = scale.shape
    idx = (perm // group_size)[:, None, :].expand(B, n_out, perm.shape[1])
    return scale.gather(-1, idx), None if zero is None else zero.gather(-1, idx)


def dampen(Hr: torch.Tensor, dampening: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``dampening · mean(diag H)`` to ``Hr``'s diagonal in place. -> (the added amounts ``[B]`` in ``Hr``'s
    dtype, ``mean(diag H) [B]`` in fp64)."""
    diag = torch.diagonal(Hr, dim1=-2, dim2=-1)
    mean_diag = diag.mean(dim=-1).double()
    applied = (float(dampening) * mean_diag).to(Hr.dtype)
    diag.add_(applied[:, None])
    return applied, mean_diag


def _more_dampening(Hr, U, ok, applied, mean_diag, dampening: float) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """The elements whose factorization failed (``ok [B]`` false) are factorized again from ``Hr`` (the reversed
    Hessian with ``applied`` dampening) with ten times the dampening fraction each time until they succeed.
    -> ``U`` with those elements replaced, and a repair for each."""
    B = Hr.shape[0]
    frac = torch.full((B,), float(dampening), dtype=torch.float64, device=Hr.device)
    todo = (~ok).nonzero().flatten()
    while todo.numel():
        frac[todo] = (frac[todo] * _DAMPENING_GROWTH).clamp_min(1e-3)
        if bool((frac[todo] > _MAX_DAMPENING).any()):
            raise NumericalError(
                f"GPTQ Hessian at batch index {todo.tolist()} is not positive definite even with dampening "
                f"{_MAX_DAMPENING:g} x mean(diag H): it is not a Gram matrix of real activations"
            )
        retry = Hr[todo]
        damp = (frac[todo] * mean_diag[todo]).to(Hr.dtype)
        torch.diagonal(retry, dim1=-2, dim2=-1).add_((damp - applied[todo])[:, None])
        U_todo, ok = upper_inverse_factor(retry)
        U[todo[ok]] = U_todo[ok]
        todo = todo[~ok]
    repaired = (frac != float(dampening)).nonzero().flatten().tolist()
    return U, [(b, f"Hessian not positive definite with dampening {dampening:g}: "
                   f"factorized with {frac[b].item():g} x mean(diag H)") for b in repaired]


def _blocks(n_in: int, group_size: int, block_size: int) -> list[tuple[int, int]]:
    """Column blocks ``[i1, i2)`` such that every group lies inside one block or starts at a block start."""
    if group_size <= block_size:
        width = block_size // group_size * group_size
        starts = list(range(0, n_in, width))
    else:
        starts = sorted(set(range(0, n_in, block_size)) | set(range(0, n_in, group_size)))
    return list(zip(starts, starts[1:] + [n_in], strict=True))


def _quantize_columns(W, U, spec: Scheme, scale_dtype: torch.dtype, block_size: int, static):
    """GPTQ's column loop on ``W [B, O, I]`` (processing order) with ``U [B, I, I]``. ``static``: per-column
    grids ``(scale, zero) [B, O, I]`` fixed in advance, or None to fit each group's grid when the group starts.
    -> codes ``[B, O, I]``, when fitted here ``scale, zero [B, O, G]``, and ``diverged [B]`` (NaN/Inf in the
    updated weights; not read here). Works on a transposed copy
    ``[B, I, O]`` so that a column, its grid and the rank-1 updates are contiguous. On CUDA each block's column
    loop is captured once as a CUDA graph and replayed (the loop is launch-bound: ~15 small kernels a column)."""
    B, n_out, n_in = W.shape
    gs = spec.group_size
    Wt = W.transpose(1, 2).contiguous()
    qt = torch.empty(B, n_in, n_out, dtype=torch.int8, device=W.device)
    scale = torch.empty(B, n_out, n_in // gs, dtype=scale_dtype, device=W.device)
    zero = None if spec.symmetric else torch.empty(B, n_out, n_in // gs, dtype=torch.int8, device=W.device)
    if static is not None:
        static = tuple(None if t is None else t.transpose(1, 2).contiguous() for t in static)
    runner = _BlockRunner(W.device.type == "cuda")
    wide = None  # (scale, zero) of a group wider than the block, fitted at its first column
    for i1, i2 in _blocks(n_in, gs, block_size):
        inputs = [Wt[:, i1:i2], U[:, i1:i2, i1:i2]]
        starts: tuple[int, ...] = ()
        if static is not None:
            inputs += [static[0][:, i1:i2]] + ([] if static[1] is None else [static[1][:, i1:i2]])
        elif gs > i2 - i1:  # the block lies inside one group; fit it (all earlier updates applied) at its start
            if i1 % gs == 0:
                wide = fit_grid(Wt[:, i1 : i1 + gs].transpose(1, 2), spec, scale_dtype)
                scale[:, :, i1 // gs] = wide[0][..., 0]
                if zero is not None:
                    zero[:, :, i1 // gs] = wide[1][..., 0]
            inputs += [t[..., 0][:, None, :].expand(B, i2 - i1, n_out).contiguous() for t in wide if t is not None]
        else:
            starts = tuple(j for j in range(i2 - i1) if (i1 + j) % gs == 0)
        key = (tuple(inputs[0].shape), starts, len(inputs))
        out = runner.run(key, lambda *t, starts=starts: _column_block(spec, scale_dtype, starts, *t), inputs)
        W1, q1, err, grids = out
        Wt[:, i1:i2] = W1
        qt[:, i1:i2] = q1
        for (j, s), z in zip(grids[0], grids[1] or [None] * len(grids[0]), strict=True):
            scale[:, :, (i1 + j) // gs] = s
            if zero is not None:
                zero[:, :, (i1 + j) // gs] = z
        Wt[:, i2:] -= torch.bmm(U[:, i1:i2, i2:].transpose(1, 2), err)
    return qt.transpose(1, 2).contiguous(), scale, zero, ~all_finite(Wt)


def _column_block(spec: Scheme, scale_dtype, starts: tuple[int, ...], W1, U1, s_static=None, z_static=None):
    """One block of GPTQ columns, in place on ``W1 [B, w, O]`` (transposed), ``U1 [B, w, w]``. Grids are fitted at
    the block offsets ``starts`` (dynamic) or read from ``s_static/z_static [B, w, O]``.
    -> (W1, codes [B, w, O], errors [B, w, O], ([(offset, scale [B, O])], [zero [B, O]] or None))."""
    B, width, n_out = W1.shape
    gs, column = spec.group_size, Scheme(spec.bits, 1, spec.symmetric)
    q1 = torch.empty(B, width, n_out, dtype=torch.int8, device=W1.device)
    err = torch.empty(B, width, n_out, dtype=W1.dtype, device=W1.device)
    scales, zeros = [], None if spec.symmetric else []
    s = z = None
    for j in range(width):
        if s_static is not None:
            s, z = s_static[:, j, :, None], None if z_static is None else z_static[:, j, :, None]
        elif j in starts:  # a group starts: its columns have every earlier update (see _blocks)
            s, z = fit_grid(W1[:, j : j + gs].transpose(1, 2), spec, scale_dtype)
            scales.append((j, s[..., 0]))
            if zeros is not None:
                zeros.append(z[..., 0])
        w_col = W1[:, j, :, None]  # [B, O, 1]
        q_col = quantize(w_col, s, z, column)
        e = (w_col - dequantize(q_col, s, z, 1).float())[..., 0] / U1[:, j, j, None]  # [B, O]
        W1[:, j:] -= U1[:, j, j:, None] * e[:, None, :]
        err[:, j] = e
        q1[:, j] = q_col[..., 0]
    return W1, q1, err, (scales, zeros)


class _BlockRunner:
    """Runs ``fn(*inputs)`` eagerly, or on CUDA through one captured graph per ``key`` (inputs copied into static
    buffers, the graph replayed). Outputs of a replay live in the graph's buffers until the next replay."""

    def __init__(self, use_graphs: bool):
        self.use_graphs = use_graphs
        self.graphs: dict = {}

    def run(self, key, fn, inputs: list[torch.Tensor]):
        if not self.use_graphs:
            return fn(*inputs)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(fn, inputs)
            except RuntimeError:  # capture unsupported here: the eager loop computes the same thing
                self.use_graphs = False
                return fn(*inputs)
        graph, static, out = self.graphs[key]
        for buf, t in zip(static, inputs, strict=True):
            buf.copy_(t)
        graph.replay()
        return out

    @staticmethod
    def _capture(fn, inputs):
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on copies (the block updates its input in place)
            fn(*[t.clone() for t in static])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        return graph, static, out
