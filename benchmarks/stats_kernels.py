"""Where the statistics pass spends its time (GPU), and candidate kernels for per-expert Hessians.

One decoder layer with Qwen3-30B-A3B shapes (random weights), ``--batches`` batches of 8 × 2048 tokens:
  1. the layer forward alone, with the attention-input statistics, with the expert statistics;
  2. the expert gate/up + down Hessian accumulation on one batch's routed tokens, scaled to a layer pass:
     quant's load buckets vs padding every expert to the busiest one, under the layer's own (near-uniform)
     routing and under a Zipf-skewed routing like a trained model's, each checked against fp64 on 3 experts;
  3. a CUDA kernel profile of 4 batches with all statistics on.
Usage (GPU): python benchmarks/stats_kernels.py --batches 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quant.models.experts import fused_view
from quant.parallel.relay import Relay
from quant.parallel.world import World
from quant.quantize.hessians import ExpertStats, linear_stats


def timed(fn, reps: int = 1) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def build_layer():
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                               num_hidden_layers=1, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"  # what a model built by from_config gets on a Hopper GPU
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = Qwen3MoeDecoderLayer(cfg, 0).to(torch.bfloat16)
        rope = Qwen3MoeRotaryEmbedding(cfg)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
            for n, p in layer.named_parameters():
                if "norm" in n:
                    p.fill_(1.0)
    return layer.eval(), rope, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    args = ap.parse_args()
    layer, rope, cfg = build_layer()
    B, S, D = args.batch, args.seqlen, 2048
    torch.manual_seed(1)
    xs = [torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    pos = torch.arange(S, device="cuda")[None].expand(B, S)
    pe = rope(xs[0], pos)

    def forward_all():
        with torch.no_grad():
            for i in range(args.batches):
                layer(xs[i % 4], position_embeddings=pe, position_ids=pos)

    rows = {}
    forward_all()
    rows["forward"] = timed(forward_all)
    attn = {n: m for n, m in layer.self_attn.named_modules() if isinstance(m, torch.nn.Linear)}
    st = linear_stats(attn, Relay(World()))
    rows["forward + attention stats (q/k/v share one sum)"] = timed(forward_all)
    for s_ in st.values():
        s_.remove()
    view = fused_view(layer.mlp.experts)
    es = ExpertStats(view, gate_weighted=False, all_experts=False, relay=Relay(World()))
    rows["forward + expert stats"] = timed(forward_all)
    es.remove()
    del es, st
    torch.cuda.empty_cache()

    # capture one batch's routed (x, idx, w), then also a skewed routing of the same tokens
    cap = {}
    h = view.on_route(lambda x, i, w: cap.update(x=x, idx=i, w=w))
    with torch.no_grad():
        layer(xs[0], position_embeddings=pe, position_ids=pos)
    h.remove()
    x, idx_u, w_u = cap["x"], cap["idx"], cap["w"]
    E, I = view.n_experts, view.intermediate
    gu = view.gate_up.data
    zipf = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32) ** 0.8
    g = torch.Generator(device="cuda").manual_seed(0)
    idx_s = torch.multinomial(zipf.expand(x.shape[0], E), idx_u.shape[1], generator=g)
    from quant.quantize.routing import expert_intermediate, load_buckets, with_zero_row

    def ref(idx, e: int):
        rows_e = (idx == e).any(dim=1)
        xe = x[rows_e].double()
        a = expert_intermediate(x[rows_e][None], gu[e : e + 1], view.act)[0].double()
        return xe.T @ xe, a.T @ a

    def padded_to_busiest(acc_gu, acc_dn, idx, w):
        """The previous scheme: one [E, C_max, D] block per batch (bf16 in, fp32 out)."""
        _, (g,) = load_buckets(idx, w, E, max_elems=1 << 62, max_waste=float("inf"))
        xg = g.gather(with_zero_row(x))
        torch.baddbmm(acc_gu, xg.transpose(1, 2), xg, out_dtype=torch.float32, out=acc_gu)
        a = expert_intermediate(xg, gu, view.act)
        torch.baddbmm(acc_dn, a.transpose(1, 2), a, out_dtype=torch.float32, out=acc_dn)

    def expert_stats(acc_gu, acc_dn, idx, w):
        es = ExpertStats.__new__(ExpertStats)
        es.view, es.gate_weighted, es.all_experts, es.need_down = view, False, False, True
        es.first, es.count = 0, E
        es.sum_gu, es.sum_down = acc_gu, acc_dn
        es.abs_gu = torch.zeros(E, D, device="cuda")
        es.abs_down = torch.zeros(E, I, device="cuda")
        es.weight_sum = torch.zeros(E, dtype=torch.float64, device="cuda")
        es.counts = torch.zeros(E, dtype=torch.long, device="cuda")
        es._hook(x, idx, w)

    for routing, idx, w in (("uniform", idx_u, w_u), ("zipf 0.8", idx_s, w_u)):
        load = torch.bincount(idx.reshape(-1), minlength=E).float()
        check = [int(load.argmax()), int(load.argmin()), 17]
        refs = {e: ref(idx, e) for e in check}
        for name, fn in (("padded to the busiest expert", padded_to_busiest), ("ExpertStats (load buckets)", expert_stats)):
            acc_gu = torch.zeros(E, D, D, device="cuda")
            acc_dn = torch.zeros(E, I, I, device="cuda")
            fn(acc_gu, acc_dn, idx, w)
            err = max(max(((acc_gu[e].double() - refs[e][0]).norm() / refs[e][0].norm()).item(),
                          ((acc_dn[e].double() - refs[e][1]).norm() / refs[e][1].norm()).item()) for e in check)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = timed(lambda fn=fn, idx=idx, w=w, a=acc_gu, d=acc_dn: fn(a.zero_(), d.zero_(), idx, w), reps=3)
            extra = (torch.cuda.max_memory_allocated() - base) / 1e9
            rows[f"experts, {routing} (max/mean {float(load.max() / load.mean()):.1f}): {name}"] = t * args.batches
            print(json.dumps({"routing": routing, "variant": name, "s_per_layer_pass": round(t * args.batches, 3),
                              "temp_gb": round(extra, 2), "max_rel_err_vs_fp64": err}), flush=True)

    from torch.profiler import ProfilerActivity, profile

    es = ExpertStats(view, gate_weighted=False, all_experts=False, relay=Relay(World()))
    st = linear_stats(attn, Relay(World()))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            for i in range(4):
                layer(xs[i], position_embeddings=pe, position_ids=pos)
        torch.cuda.synchronize()
    es.remove()
    for s_ in st.values():
        s_.remove()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(f"\n{'what (' + str(args.batches) + ' batches of ' + str(B) + ' x ' + str(S) + ' tokens)':<78} {'s':>7}")
    for k, v in rows.items():
        print(f"{k:<78} {v:>7.3f}")


if __name__ == "__main__":
    main()
