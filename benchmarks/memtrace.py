"""Where quantize's memory goes, on CPUs: a giant shape scaled down, traced with quant.diag.memtrace.LiveBytes per rank.

Every width of the shape (hidden, expert and dense intermediate, MLA ranks) and the head counts are divided by
``--scale`` k (head dims, expert count and top-k are kept), so are the calibration samples and the batch (the
sequence is kept), and the budgets (``hessian_budget_gb``, ``solve_budget_gb``) by k²: Hessians, weights, solve
working sets, activations and per-batch attention all shrink by k², so the expert chunks, sub-batches, passes
and rank shares are the full shape's, and the traced live bytes times k² stand for the full run's GPU
allocations. Attention runs through a query-blocked SDPA that holds what GPU flash attention holds (no
[S, S] scores; CPU's SDPA would materialize them), and the GPU's block sizes (statistics blocks, Hessian
temporaries) are used, scaled; kernel workspaces are not seen. Each rank prints its peak,
the allocation sites alive at it and the peak of each phase, all ×k².

  python benchmarks/memtrace.py --shape deepseek-v3 --scale 8 --algo gptq --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from quant.calibration import random_calibration as calibration
from quant.models.synthetic import SHAPES

_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
           "num_attention_heads", "num_key_value_heads")


def scaled_shape(shape: str, k: int) -> dict:
    kw = dict(SHAPES[shape])
    for key in _WIDTHS:
        if key in kw:
            kw[key] = max(1, kw[key] // k)
    return kw


def blocked_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, block=128):
    """``F.scaled_dot_product_attention`` by blocks of queries: memory like GPU flash attention's."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S, out = k.shape[-2], []
    for i in range(0, q.shape[-2], block):
        s = (q[..., i : i + block, :] @ k.transpose(-1, -2)).float() * scale
        if is_causal:
            rows = torch.arange(i, min(i + block, q.shape[-2]), device=q.device)[:, None]
            s = s.masked_fill(torch.arange(S, device=q.device)[None] > rows, float("-inf"))
        elif attn_mask is not None:
            m = attn_mask[..., i : i + block, :]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        out.append(torch.softmax(s, dim=-1).to(v.dtype) @ v)
    return torch.cat(out, dim=-2)


def build(shape: str, k: int, layers: int, path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    kw = scaled_shape(shape, k)
    cfg = AutoConfig.for_model(kw.pop("model_type"), num_hidden_layers=layers, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            if ex is not None and hasattr(ex, "gate_up_proj"):
                ex.gate_up_proj.normal_(0, cfg.initializer_range)
                ex.down_proj.normal_(0, cfg.initializer_range)
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                            unk_token="[UNK]", pad_token="[UNK]").save_pretrained(path)


def _phases(tracer) -> None:
    """Wrap the engine's steps so each runs inside a tracer phase."""
    import quant.quantize.awq_layer as sm
    from quant.layerwise import Layerwise
    from quant.quantize.layer_job import LayerJob

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def wrapped(*a, **kw):
            with tracer.phase(label):
                return fn(*a, **kw)

        setattr(owner, name, wrapped)

    wrap(Layerwise, "run", "statistics pass")
    wrap(Layerwise, "forward", "propagate")
    wrap(LayerJob, "run_experts", "solve experts")
    wrap(LayerJob, "run_linears", "solve linears")
    wrap(LayerJob, "share", "exchange codes")
    wrap(sm, "_experts_down", "AWQ down search")
    wrap(sm._GateUpSearch, "add", "AWQ gate/up trials")
    wrap(sm._GateUpSearch, "finish", "AWQ gate/up quantize")


def worker(rank: int, a: argparse.Namespace, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(a.ranks), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // a.ranks))
    from quant.diag.memtrace import LiveBytes
    from quant.layerwise import Layerwise
    from quant.models import ModelSource
    from quant.parallel.world import close_world, exit_process, init_world
    from quant.plan.bitplan import plan_bits
    from quant.profile.profile import profile_routing
    from quant.quantize.driver import quantize_model
    from quant.recipe import PlanSpec, QuantizeSpec

    torch.nn.functional.scaled_dot_product_attention = blocked_sdpa
    import quant.quantize.hessians
    import quant.quantize.routing

    k2 = a.scale**2  # the GPU's block and temporary sizes, scaled like everything else
    quant.quantize.routing.chunk_budget = lambda device: (1 << 28) // k2
    quant.quantize.hessians.chunk_budget = quant.quantize.routing.chunk_budget
    quant.quantize.hessians._add_gram.__defaults__ = ((1 << 30) // k2,)
    world = init_world("cpu")
    src = ModelSource(Path(model_dir))
    samples, batch = max(1, a.samples // a.scale), max(1, a.batch // a.scale)
    calib = calibration(samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", "cpu", batch, world=world))
    group = max(16, 128 // a.scale)
    spec = PlanSpec(policy="uniform", low_bits=4, high_bits=4, group_size=group, symmetric=a.algo != "awq",
                    protect={"attention": 4, "shared_experts": 4, "dense_mlp": 4})
    plan = plan_bits(prof, src.modules, spec, src.n_layers)
    qspec = QuantizeSpec(algorithm=a.algo, device="cpu", batch_size=batch,
                         hessian_budget_gb=a.hessian_budget_gb / k2, solve_budget_gb=a.solve_budget_gb / k2)
    if a.background_writer:
        import quant.quantize.driver as qz

        qz.LayerWriter = lambda background, cls=qz.LayerWriter: cls(True)
    tracer = LiveBytes(step=max(1, int(a.step_gb * 1e9 / k2)))
    _phases(tracer)
    lw = Layerwise(src, "bfloat16", "cpu", batch, world=world)
    lw.reader.shared = a.shared_read and world.distributed  # NCCL's read path: a share per rank, then broadcasts
    with tracer:
        quantize_model(src, calib, plan.quantized_schemes(), a.algo, qspec, lw, Path(out) / f"q{a.ranks}")
    mine = {"rank": rank, "peak": tracer.peak.table(top=a.top, scale=k2),
            "phases": {p: round(b * k2 / 1e9, 2) for p, b in tracer.phase_peaks.items()}}
    got = world.all_gather_object(mine)
    if world.is_writer:
        Path(out, "trace.json").write_text(json.dumps(got))
    close_world(world)
    exit_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32, help="the full shape's; divided by --scale")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="the full shape's; divided by --scale")
    ap.add_argument("--algo", default="gptq", choices=["rtn", "gptq", "awq"])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--hessian-budget-gb", type=float, default=16.0, help="the full shape's; divided by k²")
    ap.add_argument("--solve-budget-gb", type=float, default=3.0, help="the full shape's; divided by k²")
    ap.add_argument("--step-gb", type=float, default=0.25, help="site snapshot resolution, full-shape GB")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--shared-read", action="store_true", help="ranks read a share of each layer and broadcast it "
                    "(what they do under NCCL; gloo runs otherwise read the whole layer each)")
    ap.add_argument("--background-writer", action="store_true", help="layer files written by a thread as on a GPU "
                    "(the codes stay alive until the thread has packed them)")
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="quant-memtrace-"))
    model_dir = work / f"model-{a.shape}-k{a.scale}-{a.layers}"
    if not (model_dir / "config.json").is_file():
        build(a.shape, a.scale, a.layers, model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(dir=work))
    mp.start_processes(worker, args=(a, port, str(model_dir), str(run_dir)), nprocs=a.ranks, start_method="spawn")
    print(f"{a.shape} / {a.scale} ({max(1, a.samples // a.scale)} x {a.seqlen} tokens), {a.algo}, {a.ranks} rank(s); "
          f"live bytes x {a.scale**2}, GB")
    for r in json.loads((run_dir / "trace.json").read_text()):
        print(f"rank {r['rank']}: {r['peak']}")
        print("  phase peaks: " + ", ".join(f"{p} {b}" for p, b in r["phases"].items()))


if __name__ == "__main__":
    main()
