"""GPTQ solve pieces on one expert sub-batch of real layer shapes (GPU), checked against each other.

For each expert projection of the shape (gate/up: ``[2I, D]``, down: ``[D, I]``), on one sub-batch sized as
``quantize`` sizes it (``--solve-budget-gb``), with random bf16 weights and Hessians of correlated activations:
  - U: the old factorization (Cholesky, inverse from it, second Cholesky) against ``cholesky.upper_inverse_factor``
    (one Cholesky of the reversed Hessian, GEMM-based triangular inverse) for several block sizes;
  - the whole solve (act-order W4 g128 symmetric, as quant's default) with the fused Triton kernel and with the
    CUDA-graph torch loop: seconds, the Hessian-weighted error of both and the share of equal codes;
  - ``--tune``: the fused column loop alone for several (rows per program, warps) settings;
then the solve time of a whole layer's experts extrapolated from the sub-batch (sub-batches x seconds).
Usage (GPU): python benchmarks/solve_kernels.py --shape deepseek-v3 --tune
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from quant.algos import gptq_triton
from quant.algos.cholesky import upper_inverse_factor
from quant.algos.gptq import dampen, gptq, reversed_hessian
from quant.algos.grid import fit_grid
from quant.scheme import Scheme

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128), "deepseek-v3": (7168, 2048, 256)}  # D, I, experts


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def timed(fn, reps: int = 3) -> tuple[float, object]:
    """Median seconds of ``reps`` calls after one warm-up, and the last result."""
    out = fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def problem(B: int, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights ``[B, O, I]`` and fp32 Hessians ``[B, I, I]`` of correlated activations with uneven channels."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(B, n_out, n_in, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    H = torch.empty(B, n_in, n_in, device="cuda")
    for b in range(B):
        x = torch.randn(2 * n_in, n_in, device="cuda", generator=g)
        x = (x + 0.3 * x.roll(1, dims=1)) * (torch.rand(n_in, device="cuda", generator=g) * 2 + 0.1)
        H[b] = x.T @ x / x.shape[0]
    return w, H


def old_factor(H: torch.Tensor) -> torch.Tensor:
    damp = 0.01 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)
    L = torch.linalg.cholesky(H + damp[:, None, None] * torch.eye(H.shape[-1], device=H.device))
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def bench_projection(name: str, n_out: int, n_in: int, n_experts: int, budget_gb: float, tune: bool) -> dict:
    B = max(1, int(budget_gb * 1e9) // (4 * (2 * n_out * n_in + 3 * n_in * n_in)))
    n_sub = math.ceil(n_experts / B)
    w, H = problem(B, n_out, n_in, seed=n_in)
    row = {"proj": name, "shape": [B, n_out, n_in], "sub_batches": n_sub}
    row["u_old_s"], U_old = timed(lambda: old_factor(H), reps=1)
    Hr = H.flip(-2, -1).contiguous()
    torch.diagonal(Hr, dim1=-2, dim2=-1).add_(0.01 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1, keepdim=True))
    for base in (256, 512, 1024):
        t, (U, ok) = timed(lambda base=base, Hr=Hr: upper_inverse_factor(Hr, base=base), reps=1)
        row[f"u_new_s_base{base}"] = t
        row[f"u_rel_diff_base{base}"] = ((U - U_old).norm() / U_old.norm()).item()
    spec = Scheme(4, 128, True)
    runs = {}
    for kernel in ("triton", "torch"):
        t, res = timed(lambda kernel=kernel: gptq(w, H, spec, torch.bfloat16, act_order=True, kernel=kernel,
                                                  with_loss=False), reps=2 if kernel == "triton" else 1)
        row[f"solve_{kernel}_s"] = t
        runs[kernel] = gptq(w, H, spec, torch.bfloat16, act_order=True, kernel=kernel)
        row[f"loss_{kernel}"] = runs[kernel].loss.sum().item()
        del res
    del Hr, U, U_old
    row["codes_equal"] = (runs["triton"].weight.q == runs["torch"].weight.q).float().mean().item()
    row["loss_rel_diff"] = abs(row["loss_triton"] - row["loss_torch"]) / row["loss_torch"]
    row["layer_solve_triton_s"] = n_sub * row["solve_triton_s"]
    if tune:
        row["tune"] = tune_columns(w, H, spec)
    say(**row)
    return row


def tune_columns(w: torch.Tensor, H: torch.Tensor, spec: Scheme) -> dict:
    """The fused column loop alone (act-order static grids) for several tile settings."""
    B, n_out, n_in = w.shape
    W = w.float()
    perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
    grids = fit_grid(W, spec, torch.bfloat16)
    W = W.gather(-1, perm[:, None, :].expand(B, n_out, n_in))
    Hr = reversed_hessian(H, perm, torch.zeros(B, n_in, dtype=torch.bool, device=H.device))
    dampen(Hr, 0.01)
    U, _ = upper_inverse_factor(Hr)
    out = {}
    default = (gptq_triton.ROWS_PER_PROGRAM, gptq_triton.NUM_WARPS)
    for rows, warps in ((32, 1), (32, 2), (64, 4), (128, 4)):
        gptq_triton.ROWS_PER_PROGRAM, gptq_triton.NUM_WARPS = rows, warps
        t, _ = timed(lambda: gptq_triton.quantize_columns(W, U, spec, torch.bfloat16, 128, grids, perm), reps=2)
        out[f"{rows}x{warps}"] = round(t, 4)
    gptq_triton.ROWS_PER_PROGRAM, gptq_triton.NUM_WARPS = default
    return out


def profile_solve(n_out: int, n_in: int, n_experts: int, budget_gb: float) -> None:
    """A kernel profile of one sub-batch's solve (fused kernel): where the seconds go."""
    from torch.profiler import ProfilerActivity, profile

    B = max(1, int(budget_gb * 1e9) // (4 * (2 * n_out * n_in + 3 * n_in * n_in)))
    w, H = problem(B, n_out, n_in, seed=n_in)
    spec = Scheme(4, 128, True)
    solve = lambda: gptq(w, H, spec, torch.bfloat16, act_order=True, with_loss=False)  # noqa: E731
    t, _ = timed(solve, reps=3)
    say(profile_shape=[B, n_out, n_in], solve_s=t)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        solve()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    ap.add_argument("--solve-budget-gb", type=float, default=3.0)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only a kernel profile of one gate/up sub-batch")
    a = ap.parse_args()
    D, I, E = SHAPES[a.shape]
    say(shape=a.shape, gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
    if a.profile:
        return profile_solve(2 * I, D, E, a.solve_budget_gb)
    rows = [bench_projection(n, o, i, E, a.solve_budget_gb, a.tune) for n, o, i in (("gate_up", 2 * I, D), ("down", D, I))]
    print(f"\n{'proj':8} {'B':>3} {'subs':>5} {'U old':>7} {'U new':>7} {'triton':>7} {'torch':>7} {'equal':>6} "
          f"{'dloss':>8} {'layer s':>8}")
    for r in rows:
        print(f"{r['proj']:8} {r['shape'][0]:3d} {r['sub_batches']:5d} {r['u_old_s']:7.3f} {r['u_new_s_base512']:7.3f} "
              f"{r['solve_triton_s']:7.3f} {r['solve_torch_s']:7.3f} {r['codes_equal']:6.4f} {r['loss_rel_diff']:8.2e} "
              f"{r['layer_solve_triton_s']:8.2f}")
    print(f"experts' solve per layer (fused kernel, extrapolated): {sum(r['layer_solve_triton_s'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
