"""Distributed benchmark (GPUs): profile + GPTQ quantize on 1 GPU and on N GPUs of one node, in one command.

Builds (once) the random-weight model of ``benchmarks/engine.py`` (Qwen3-30B-A3B or DeepSeek-V3 layer shapes), then
for each world size starts ``torchrun --standalone --nproc-per-node N`` on this script in worker mode: every rank
runs ``profile_routing`` and ``quantize_model`` through ``quant.parallel.world`` (NCCL) on the same seeded calibration tokens,
W4 g128 symmetric GPTQ on attention and experts (as engine.py); rank 0 writes timings and every rank's peak GPU
memory. Afterwards the stored codes of every world size are compared byte for byte with the 1-GPU run's, and
(``--error-samples``) both checkpoints get engine.py's layer-output error. ``--llmcompressor N`` then runs
llm-compressor 0.14's distributed oneshot (``torchrun --nproc-per-node N``: data-parallel calibration, each rank
its slice of the same tokens; weight-parallel GPTQ W4A16, the model loaded with compressed-tensors'
``load_offloaded_model``, as its docs start it) on the same model folder, and prints quant's speed-up at N GPUs.
``--memory-trace``: what each rank held at its peak, by the quant line that allocated it (CUDA allocator history);
``--torch-profile``: each rank's top operators by self time over quantize (torch.profiler).
Prints JSON lines, then a table.

  python benchmarks/distributed.py --shape qwen3-30b-a3b --layers 2 --samples 256 --seqlen 2048 --ranks 1,2 \\
      --llmcompressor 2
  python benchmarks/distributed.py --shape deepseek-v3 --layers 1 --samples 32 --seqlen 2048 --ranks 1,2 \\
      --error-samples 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quant.calibration import random_calibration as calibration
from quant.eval.layer_error import checkpoint_layer_errors
from quant.models import ModelSource
from quant.models.synthetic import SHAPES, build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _plan(src, prof, algo: str = "gptq"):
    """engine.py's plan: W4 g128 everywhere, symmetric for GPTQ, asymmetric for AWQ (llm-compressor's schemes)."""
    from quant.plan.bitplan import plan_bits
    from quant.recipe import PlanSpec

    spec = PlanSpec(policy="uniform", low_bits=4, high_bits=4, group_size=128, symmetric=algo != "awq",
                    protect={"attention": 4, "shared_experts": 4, "dense_mlp": 4})
    return plan_bits(prof, src.modules, spec, src.n_layers)


def llmc_worker(a: argparse.Namespace) -> None:
    """One rank of llm-compressor's distributed oneshot on ``--model-dir`` with this rank's slice of the tokens."""
    import torch.distributed as dist
    from compressed_tensors.offload import init_dist, load_offloaded_model
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    init_dist()
    rank, size = dist.get_rank(), dist.get_world_size()
    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype="auto", device_map="auto_offload")
    ids = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0).tokens
    per = a.samples // size
    ids = ids[rank * per : (rank + 1) * per]
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=a.seqlen, num_calibration_samples=per,
            pipeline="sequential")
    torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    model.save_pretrained(a.qdir, save_compressed=True)  # every rank, as llm-compressor's DDP examples do
    peaks = [None] * size
    dist.all_gather_object(peaks, round(torch.cuda.max_memory_allocated() / 1e9, 2))
    if rank == 0:
        n_layers = json.loads((Path(a.model_dir) / "config.json").read_text())["num_hidden_layers"]
        Path(a.result).write_text(json.dumps({"ranks": size, "quantize_s": seconds, "s_per_layer": seconds / n_layers,
                                              "peak_gpu_gb_per_rank": peaks}))


@contextlib.contextmanager
def _torch_profile(on: bool):
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield prof


def worker(a: argparse.Namespace) -> None:
    """One rank: profile and quantize under the world torchrun set up; rank 0 writes the results file."""
    from quant.diag.memtrace import CudaTrace
    from quant.layerwise import Layerwise
    from quant.parallel.world import close_world, exit_process, init_world
    from quant.profile.profile import profile_routing
    from quant.quantize.driver import quantize_model
    from quant.recipe import QuantizeSpec

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    world = init_world(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    src = ModelSource(Path(a.model_dir))
    calib = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
    out = {"ranks": world.size}
    sync()
    world.barrier()
    t0 = time.perf_counter()
    prof = profile_routing(src, calib, Layerwise(src, "bfloat16", dev, a.batch, world=world))
    sync()
    out["profile_s"] = time.perf_counter() - t0
    plan = _plan(src, prof, a.algo)
    qdir = Path(a.qdir)
    if world.is_writer:
        shutil.rmtree(qdir, ignore_errors=True)
        plan.save(Path(str(qdir) + ".plan.json"))
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    world.barrier()
    t0 = time.perf_counter()
    with CudaTrace() if a.memory_trace else contextlib.nullcontext() as trace, _torch_profile(a.torch_profile) as prof:
        qspec = QuantizeSpec(algorithm=a.algo, device=dev, batch_size=a.batch, statistics=a.statistics)
        reports = quantize_model(src, calib, plan.quantized_schemes(), a.algo, qspec,
                                 Layerwise(src, "bfloat16", dev, a.batch, world=world), qdir)
    sync()
    world.barrier()
    out["quantize_s"] = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else float("nan")
    out["peak_gpu_gb_per_rank"] = world.all_gather_object(round(peak, 2))
    if prof is not None:  # where each rank's time went (the profiler's overhead included)
        # by device time (what the GPU did), then by host time (launch- and sync-bound loops show up here)
        avg = prof.key_averages()
        tables = [avg.table(sort_by=sort, row_limit=25, max_name_column_width=60)
                  for sort in (["self_cuda_time_total"] if dev == "cuda" else []) + ["self_cpu_time_total"]]
        # per phase (quantize's timed blocks): wall on the host vs kernel time on the device inside the range
        phases = [e for e in avg if e.key.startswith("quant.")]
        tables.append("phase                      calls   host ms   device ms\n" + "\n".join(
            f"{e.key:26} {e.count:5d} {e.cpu_time_total / 1e3:9.1f} {getattr(e, 'device_time_total', 0) / 1e3:11.1f}"
            for e in sorted(phases, key=lambda e: e.key)))
        out["torch_profile"] = world.all_gather_object("\n".join(tables))
    if a.memory_trace:  # what was live at each rank's peak, by the quant line that allocated it
        out["memory_trace"] = world.all_gather_object(trace.peak.table(top=15) if trace and trace.peak else "")
    n = len(reports)
    out.update(layers=n, s_per_layer=out["quantize_s"] / n,
               layer_seconds=[round(r.seconds, 2) for r in reports],
               load_s_per_layer=sum(r.load_seconds for r in reports) / n,
               rank_solve_seconds=[r.rank_solve_seconds for r in reports],
               stats_s_per_layer=sum(r.stats_seconds for r in reports) / n,
               solve_s_per_layer=sum(r.solve_seconds for r in reports) / n,
               forward_s_per_layer=sum(r.forward_seconds for r in reports) / n,
               worst_rel_error=max(r.worst_rel_error for r in reports))
    if world.is_writer:
        Path(a.result).write_text(json.dumps(out))
    close_world(world)
    exit_process(0)


def launch(a: argparse.Namespace, n: int, model_dir: Path, work: Path, statistics: str = "auto") -> dict:
    tag = f"{n}" if statistics == "auto" else f"{n}-{statistics}"
    result, qdir = work / f"result-{tag}.json", work / f"q-{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           "--worker", "--shape", a.shape, "--samples", str(a.samples), "--seqlen", str(a.seqlen), "--batch",
           str(a.batch), "--model-dir", str(model_dir), "--qdir", str(qdir), "--result", str(result),
           "--statistics", statistics, "--algo", a.algo] + (
               ["--memory-trace"] if a.memory_trace else []) + (["--torch-profile"] if a.torch_profile else [])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))} if torch.cuda.is_available() \
        else dict(os.environ)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    out["qdir"] = str(qdir)
    return out


def launch_llmcompressor(a: argparse.Namespace, n: int, model_dir: Path, work: Path) -> dict:
    result = work / f"llmc-{n}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           "--llmc-worker", "--shape", a.shape, "--samples", str(a.samples), "--seqlen", str(a.seqlen),
           "--model-dir", str(model_dir), "--result", str(result), "--qdir", str(work / f"llmc-ckpt-{n}")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}
    p = subprocess.run(cmd, env=env)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}"}
    out = json.loads(result.read_text())
    if a.error_samples:  # engine.py's layer-output error of the checkpoint it saved
        calib = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
        errs = checkpoint_layer_errors(ModelSource(model_dir), work / f"llmc-ckpt-{n}", work,
                                       calib.tokens[: a.error_samples], a.batch, DEVICE)
        out["mean_rel_layer_error"] = sum(errs) / len(errs)
    return out


def same_codes(a: Path, b: Path) -> tuple[int, int]:
    """(identical layer files, layer files) between two stores."""
    files = sorted(p.name for p in a.glob("layer_*.safetensors"))
    return sum((a / f).read_bytes() == (b / f).read_bytes() for f in files), len(files)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--error-samples", type=int, default=16)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--memory-trace", action="store_true", help="each rank's live blocks at its peak (CUDA)")
    ap.add_argument("--torch-profile", action="store_true", help="each rank's top ops by self time (torch.profiler)")
    ap.add_argument("--llmcompressor", type=int, default=0, help="N: llm-compressor's distributed oneshot on N GPUs")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--llmc-worker", action="store_true")
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--qdir", default="")
    ap.add_argument("--algo", default="gptq", choices=["gptq", "awq"])
    ap.add_argument("--statistics", default="auto", help="quantize.statistics; a comma list (auto,ordered,reduce) "
                    "runs each rank count > 1 once per mode")
    ap.add_argument("--result", default="")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.llmc_worker:
        return llmc_worker(a)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="quant-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"model-{a.shape}-{a.layers}"
    t0 = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        build_model(a.shape, a.layers, model_dir, seed=0)
    say(step="build", s=round(time.perf_counter() - t0, 1), gpus=torch.cuda.device_count())
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        for mode in a.statistics.split(",") if n > 1 else ["auto"]:
            r = launch(a, n, model_dir, work, mode)
            r["statistics"] = mode
            say(**r)
            rows.append(r)
    base = Path(rows[0]["qdir"])
    for r in rows:
        r["identical_layer_files"] = same_codes(base, Path(r["qdir"]))
    if a.error_samples:
        from quant.export.compressed_tensors import write_compressed_tensors
        from quant.parallel.world import World

        src = ModelSource(model_dir)
        calib = calibration(a.samples, a.seqlen, SHAPES[a.shape]["vocab_size"], seed=0)
        for r in rows:
            from quant.plan.bitplan import BitPlan

            plan = BitPlan.load(Path(r["qdir"] + ".plan.json"))
            ckpt = write_compressed_tensors(src, plan, Path(r["qdir"]), work / f"ckpt-{Path(r['qdir']).name}", 20 << 30,
                                            World())
            errs = checkpoint_layer_errors(src, ckpt, work, calib.tokens[: a.error_samples], a.batch, DEVICE)
            r["mean_rel_layer_error"] = sum(errs) / len(errs)
            say(ranks=r["ranks"], statistics=r["statistics"], rel_layer_error=errs)
    print(f"\n{'GPUs':>4} {'stats mode':>10} {'s/layer':>8} {'stats':>7} {'solve':>7} {'fwd':>7} {'profile s':>9} {'peak GB/rank':>16} "
          f"{'same codes':>10} {'rel err':>8}")
    for r in rows:
        same = "{}/{}".format(*r["identical_layer_files"])
        print(f"{r['ranks']:>4} {r['statistics']:>10} {r['s_per_layer']:8.2f} {r['stats_s_per_layer']:7.2f} {r['solve_s_per_layer']:7.2f} "
              f"{r['forward_s_per_layer']:7.2f} {r['profile_s']:9.2f} {str(r['peak_gpu_gb_per_rank']):>16} "
              f"{same:>10} {r.get('mean_rel_layer_error', float('nan')):8.4f}")
    for r in rows:
        for rank, table in enumerate(r.get("torch_profile", [])):
            print(f"{r['ranks']} GPU(s), rank {rank}, torch.profiler over quantize:\n{table}")
        for rank, table in enumerate(r.get("memory_trace", [])):
            print(f"{r['ranks']} GPU(s), rank {rank}, live at the peak (GB):\n{table}")
    if a.llmcompressor:
        llmc = launch_llmcompressor(a, a.llmcompressor, model_dir, work)
        say(llmcompressor=llmc)
        mine = next((r for r in rows if r["ranks"] == a.llmcompressor), None)
        if "error" not in llmc:
            print(f"llm-compressor distributed oneshot, {a.llmcompressor} GPUs: {llmc['s_per_layer']:.2f} s/layer, peak "
                  f"GB per rank {llmc['peak_gpu_gb_per_rank']}, rel err {llmc.get('mean_rel_layer_error', float('nan')):.4f}" + (
                      f"; quant {llmc['s_per_layer'] / mine['s_per_layer']:.1f}x faster per layer" if mine else ""))
    for r in rows[1:]:
        print(f"{r['ranks']} GPUs ({r['statistics']} statistics) vs 1: {rows[0]['s_per_layer'] / r['s_per_layer']:.2f}x "
              "per layer (quantize), "
              f"{rows[0]['profile_s'] / r['profile_s']:.2f}x profile")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
