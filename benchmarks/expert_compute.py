"""quant's experts forward (``quant.models.expert_compute``) on one MoE layer of a real shape, as the layer-damage pass
runs it: bf16 experts beside fp32 activations, widened a few experts at a time, clean or at a scheme (round-to-nearest
as they are widened); forward alone and forward + input gradient; the error column is each output's relative distance
from the clean one (at a scheme: that scheme's output error). Random weights and routing (seeded).

    python benchmarks/expert_compute.py --shape deepseek-v3 --tokens 16384     # one H200: ~1 minute
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quant.algos.grid import quantize_weight
from quant.models.expert_compute import install
from quant.models.experts import ExpertsView
from quant.models.synthetic import SHAPES
from quant.scheme import Scheme


def _timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (and the probe of the kernels)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3", choices=[k for k, v in SHAPES.items() if "moe_intermediate_size" in v])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the batch (the pass's 8 x 2048)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = SHAPES[a.shape]
    E = cfg.get("n_routed_experts") or cfg["num_experts"]
    k, D, I = cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.nn.Parameter((torch.randn(E, 2 * I, D, device=dev, generator=gen) * D**-0.5).bfloat16(), False)
    down = torch.nn.Parameter((torch.randn(E, D, I, device=dev, generator=gen) * I**-0.5).bfloat16(), False)
    view = ExpertsView(torch.nn.Module(), gate_up, down, torch.nn.functional.silu, lambda fn: None)
    x = torch.randn(a.tokens, D, device=dev, generator=gen)
    idx = torch.rand(a.tokens, E, device=dev, generator=gen).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(a.tokens, k, device=dev, generator=gen), dim=1)
    spec = Scheme(4, 128)
    rtn = lambda t: quantize_weight(t, spec, t.dtype).dequantize()  # noqa: E731
    rows, ref = {}, None
    for mode in ("widened", "at w4g128"):
        compute = install(view, torch.float32)
        compute.transform = rtn if mode.startswith("at") else None
        with torch.no_grad():
            fwd_s, y = _timed(lambda: view.module(x, idx, w), a.repeats)

        def with_grad():
            xg = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(view.module(xg, idx, w), xg, torch.ones(a.tokens, D, device=dev) / D)
            return g

        bwd_s, g = _timed(with_grad, a.repeats) if compute.transform is None else (float("nan"), None)
        compute.remove()
        if mode == "widened":
            ref = (y, g)
        err = (y - ref[0]).norm().item() / ref[0].norm().item()
        gerr = (g - ref[1]).norm().item() / ref[1].norm().item() if g is not None else float("nan")
        rows[mode] = {"forward_s": round(fwd_s, 4), "forward_backward_s": round(bwd_s, 4),
                      "rel_err_vs_widened": err, "grad_rel_err_vs_widened": gerr,
                      "peak_gb": round(torch.cuda.max_memory_allocated(dev) / 1e9, 1)}
        torch.cuda.reset_peak_memory_stats(dev)
        print(json.dumps({"mode": mode, **rows[mode]}), flush=True)
    print(f"\n{a.shape} experts ({E} x [{2 * I}, {D}] + [{D}, {I}], bf16), {a.tokens} tokens x top-{k}, fp32 activations")
    print(f"{'mode':12} {'forward s':>10} {'fwd+grad s':>11} {'rel err':>9} {'grad err':>9} {'peak GB':>8}")
    for mode, r in rows.items():
        print(f"{mode:12} {r['forward_s']:10.4f} {r['forward_backward_s']:11.4f} {r['rel_err_vs_widened']:9.1e} "
              f"{r['grad_rel_err_vs_widened']:9.1e} {r['peak_gb']:8.1f}")


if __name__ == "__main__":
    main()
