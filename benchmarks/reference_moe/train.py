"""Train the reference MoE (``builtin:reference-moe``): a small Qwen3-MoE trained from scratch on one GPU.

Reads the corpus that ``build_corpus.py`` wrote (``.refmoe/corpus``), trains a transformers ``Qwen3MoeConfig``
model with bf16 autocast, AdamW (warmup + cosine), the router load-balancing loss, periodic validation, and
stops at whichever comes first: ``--epochs`` passes over the train split or ``--minutes`` of wall time (the
cosine schedule follows whichever is further along, so it always ends at the minimum learning rate). Then it
saves the checkpoint in bf16 safetensors (``--shard-size`` shards) with the tokenizer and a generation config,
reloads it from disk and evaluates THAT (test perplexity, next-line exact match on held-out Python, routing
profile), and writes ``training_log.json``. ``--pack DIR`` also writes the folder as one tar split into parts
(for a size-limited transfer) plus ``SHA256SUMS``.

    python benchmarks/reference_moe/train.py --out runs/reference-moe --minutes 7             # GPU
    python benchmarks/reference_moe/train.py --tiny --out /tmp/refmoe-tiny --minutes 1         # CPU smoke test

Dimension legend: B batch, T tokens per window, V vocabulary, L layers, E experts, k experts per token,
D hidden, I expert intermediate.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path

import evaluate_reference as ev  # the sibling script (run as a script, this folder is on sys.path)
import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
PRESETS = {
    # 31.0M parameters (62.0 MB in bf16): experts 8 x 32 x 3 x 256 x 128 = 25.2M, embedding + lm_head
    # 2 x 8192 x 256 = 4.2M, attention 8 x 196,608 = 1.6M; active per token 6.9M (README has the arithmetic).
    "reference": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
                      intermediate_size=512, norm_topk_prob=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                 norm_topk_prob=True),
}


# ----------------------------------------------------------------------------------------------- model


def build_model(tokenizer, preset: str, aux_coef: float, seed: int, max_position: int):
    """A freshly initialized Qwen3-MoE in fp32 (normal(0.02); residual-branch outputs scaled by 1/sqrt(2L))."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    eos = tokenizer.eos_token_id
    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), max_position_embeddings=max_position, tie_word_embeddings=False,
                         router_aux_loss_coef=aux_coef, output_router_logits=False, rms_norm_eps=1e-6,
                         initializer_range=0.02, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                         **PRESETS[preset])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    std, resid_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():  # explicit, seeded init of everything that is not a norm
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                s = resid_std if name.endswith(("o_proj.weight", "experts.down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
    return model


def param_counts(model) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.model.embed_tokens.weight.numel()
    active = total - embed - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "experts": experts, "embedding": embed, "lm_head": model.lm_head.weight.numel(),
            "active_per_token_excl_embedding": active, "bf16_bytes": 2 * total}


def train_flops_per_token(model, seq_len: int) -> float:
    """6 x active matmul parameters + causal attention scores (fwd+bwd), per trained token."""
    cfg = model.config
    n = param_counts(model)["active_per_token_excl_embedding"]
    attn = 6 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * cfg.head_dim  # QK^T and AV, causal half
    return 6 * n + attn


# ----------------------------------------------------------------------------------------------- experts


def grouped_mm_autocast_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts, with weights cast to the autocast dtype.

    torch's grouped-GEMM fast path needs bf16 operands; ``grouped_mm`` is not autocast-aware, so fp32 master
    weights would silently take the slow per-expert fallback (a host sync + a loop). Gradients flow through the
    cast to the fp32 parameters.
    """
    from transformers.integrations.moe import grouped_mm_experts_forward

    device_type = hidden_states.device.type
    if not torch.is_autocast_enabled(device_type):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    dtype = torch.get_autocast_dtype(device_type)
    view = _CastExperts(self, dtype)
    return grouped_mm_experts_forward(view, hidden_states.to(dtype), top_k_index, top_k_weights.to(dtype))


class _CastExperts:
    """The attributes grouped_mm_experts_forward reads, with the weights in ``dtype``."""

    def __init__(self, experts, dtype):
        self.num_experts, self.has_gate, self.has_bias = experts.num_experts, experts.has_gate, experts.has_bias
        self.is_transposed, self.act_fn = experts.is_transposed, experts.act_fn
        self.gate_up_proj = experts.gate_up_proj.to(dtype)
        self.down_proj = experts.down_proj.to(dtype)
        self._apply_gate = experts._apply_gate


def _register_experts_impl() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("grouped_mm_autocast", grouped_mm_autocast_forward)


def choose_experts_impl(model, device: torch.device, requested: str) -> dict:
    """Set the experts implementation; ``auto`` = grouped_mm_autocast if it matches eager on a test batch."""
    _register_experts_impl()
    if requested != "auto":
        model.set_experts_implementation(requested)
        return {"implementation": requested, "self_test": None}
    x = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for impl in ("eager", "grouped_mm_autocast"):
        try:
            model.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True)
            with ev.autocast_for(device):
                loss = F.cross_entropy(model(input_ids=x[:, :-1]).logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            g = model.model.layers[0].mlp.experts.gate_up_proj.grad
            results[impl] = (loss.item(), g.norm().item() if g is not None else float("nan"))
        except Exception as e:  # a missing kernel on this torch / GPU: fall back to eager
            results[impl] = repr(e)[:300]
    model.zero_grad(set_to_none=True)
    fast = results.get("grouped_mm_autocast")
    ok = isinstance(fast, tuple) and all(math.isfinite(v) for v in fast) and isinstance(results["eager"], tuple) \
        and abs(fast[0] - results["eager"][0]) < 2e-2 and abs(fast[1] / results["eager"][1] - 1) < 5e-2
    impl = "grouped_mm_autocast" if ok else "eager"
    model.set_experts_implementation(impl)
    return {"implementation": impl, "self_test": {k: v for k, v in results.items()}}


# ----------------------------------------------------------------------------------------------- data


class EpochSampler:
    """Batches [B, T+1] of the train stream: each epoch a fresh random offset and a permutation of the
    non-overlapping windows, so every token is seen once per epoch. ``fraction`` < 1 keeps a fixed random
    subset of the windows (for small-data experiments)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, fraction: float = 1.0):
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        n = (len(tokens) - 1 - seq_len) // seq_len
        self.keep = np.sort(self.rng.permutation(n)[:max(batch_size, int(n * fraction))])
        self.epoch, self.queue = 0, np.empty(0, dtype=np.int64)

    @property
    def tokens_per_epoch(self) -> int:
        return len(self.keep) * self.seq_len

    def next_batch(self) -> torch.Tensor:
        if len(self.queue) < self.batch_size:
            offset = int(self.rng.integers(0, self.seq_len))
            starts = offset + self.keep[self.rng.permutation(len(self.keep))] * self.seq_len
            self.queue = np.concatenate([self.queue, starts])
            self.epoch += 1
        starts, self.queue = self.queue[:self.batch_size], self.queue[self.batch_size:]
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx]


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from peak to ``min_lr_ratio * peak`` over ``progress``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def make_optimizer(model, args, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **extra)


# ----------------------------------------------------------------------------------------------- training


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e * P_e`` for each layer, averaged over layers (as
    Megatron-style trainers do); transformers' ``aux_loss`` instead pools all layers' counts and probabilities
    first. Balanced value: ``top_k``. router_logits: one [N, E] tensor per layer."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        top = probs.topk(top_k, dim=-1).indices.flatten()
        counts = torch.zeros(num_experts, device=logits.device).scatter_add_(
            0, top, torch.ones(top.numel(), device=logits.device))
        losses.append(num_experts * (counts / logits.shape[0] * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def train_step(model, batch: torch.Tensor, device: torch.device, aux_coef: float, aux_mode: str):
    """One forward/backward; returns (ce, aux) as device tensors (no host sync)."""
    batch = batch.to(device, non_blocking=True)
    with ev.autocast_for(device):
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    if aux_mode == "per_layer":
        cfg = model.config
        aux = per_layer_balance_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    else:
        aux = out.aux_loss
    (ce + aux_coef * aux).backward()
    return ce.detach(), aux.detach()


def train(model, sampler: EpochSampler, val_tokens: np.ndarray, args, device: torch.device) -> dict:
    """The loop; stops at the token budget (``--epochs``), ``--minutes`` or ``--max-steps``."""
    opt = make_optimizer(model, args, device)
    token_budget = int(args.epochs * sampler.tokens_per_epoch)
    tokens_per_step = args.batch_size * args.seq_len
    meter = _Meter(device, sampler.tokens_per_epoch, tokens_per_step)
    val_curve: list[dict] = []
    best = {"loss": float("inf"), "step": -1, "state": None}
    step = tokens = 0
    model.train()
    while True:
        progress = max(tokens / token_budget, meter.elapsed() / (args.minutes * 60))
        if progress >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        ce, aux = train_step(model, sampler.next_batch(), device, args.aux_coef, args.aux_mode)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + tokens_per_step
        meter.add(ce, aux)
        if step % args.log_every == 0:
            meter.log(step, tokens, lr)
        if step % args.eval_every == 0:
            with meter.pause():
                _validate(model, val_tokens, args, device, step, tokens, meter, val_curve, best)
    train_s = meter.elapsed()
    _validate(model, val_tokens, args, device, step, tokens, meter, val_curve, best)
    selected = "final"
    if best["step"] != step and best["loss"] < val_curve[-1]["val_loss"] - args.keep_best_margin:
        model.load_state_dict(best["state"])
        selected = f"best (step {best['step']})"
        print(f"restored the best validation state from step {best['step']} "
              f"({best['loss']:.4f} < final {val_curve[-1]['val_loss']:.4f})")
    stopped_by = ("max_steps" if args.max_steps and step >= args.max_steps
                  else "epochs" if tokens >= token_budget else "minutes")
    return {"steps": step, "tokens_seen": tokens, "epochs_seen": tokens / sampler.tokens_per_epoch,
            "train_seconds": train_s, "periodic_eval_seconds": meter.paused_s, "tokens_per_step": tokens_per_step,
            "token_budget": token_budget, "stopped_by": stopped_by, "selected_checkpoint": selected,
            "best_val": {"loss": best["loss"], "step": best["step"]}, "loss_curve": meter.records,
            "val_curve": val_curve}


class _Meter:
    """Running train-loss sums on the device (read every ``log_every`` steps) and a tokens/s that leaves out
    the periodic evaluations."""

    def __init__(self, device, tokens_per_epoch: int, tokens_per_step: int):
        self.device, self.tokens_per_epoch, self.tokens_per_step = device, tokens_per_epoch, tokens_per_step
        self.t0 = self.t_last = time.time()
        self.paused_s, self.n = 0.0, 0
        self.ce = self.aux = torch.zeros((), device=device)
        self.records: list[dict] = []

    def elapsed(self) -> float:
        return time.time() - self.t0

    def add(self, ce, aux) -> None:
        self.ce, self.aux, self.n = self.ce + ce, self.aux + aux, self.n + 1

    def log(self, step: int, tokens: int, lr: float) -> None:
        now = time.time()
        rec = {"step": step, "tokens": tokens, "epoch": tokens / self.tokens_per_epoch, "lr": lr,
               "train_loss": (self.ce / self.n).item(), "aux_loss": (self.aux / self.n).item(),
               "elapsed_s": now - self.t0, "tokens_per_s": self.n * self.tokens_per_step / (now - self.t_last)}
        self.records.append(rec)
        print(f"step {step:5d} ep {rec['epoch']:5.2f} loss {rec['train_loss']:.3f} aux {rec['aux_loss']:.3f} "
              f"lr {lr:.2e} {rec['tokens_per_s'] / 1e3:7.1f}k tok/s {rec['elapsed_s']:6.0f}s", flush=True)
        self.ce = self.aux = torch.zeros((), device=self.device)
        self.n, self.t_last = 0, time.time()

    @contextlib.contextmanager
    def pause(self):
        t = time.time()
        yield
        self.paused_s += time.time() - t
        self.t_last += time.time() - t


def _validate(model, val_tokens, args, device, step, tokens, meter, val_curve, best) -> None:
    """Validation loss into ``val_curve``; a copy of the state when it is the best so far."""
    if val_curve and val_curve[-1]["step"] == step:
        return
    r = ev.eval_loss(model, val_tokens, args.seq_len, args.eval_batch_size, device)
    val_curve.append({"step": step, "tokens": tokens, "val_loss": r["loss"], "elapsed_s": meter.elapsed()})
    print(f"  val loss {r['loss']:.4f} (ppl {r['perplexity']:.1f}) at step {step}", flush=True)
    if r["loss"] < best["loss"]:
        best.update(loss=r["loss"], step=step,
                    state={k: v.detach().clone() for k, v in model.state_dict().items()})


# ----------------------------------------------------------------------------------------------- saving


def save_checkpoint(model, tokenizer, out: Path, shard_size: str) -> None:
    """bf16 safetensors shards + config + generation config + tokenizer, loadable by from_pretrained."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                               do_sample=False, max_new_tokens=64)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size=shard_size)
    tokenizer.save_pretrained(out)


def pack(folder: Path, dest: Path, part_bytes: int) -> list[str]:
    """``folder`` as one uncompressed tar cut into parts of at most ``part_bytes``, plus SHA256SUMS."""
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / "reference-moe.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(folder.rglob("*")):
            info = tar.gettarinfo(p, arcname=f"reference-moe/{p.relative_to(folder).as_posix()}")
            info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
            info.mode = 0o644 if p.is_file() else 0o755
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = tar_path.read_bytes()
    tar_path.unlink()
    names = []
    for i in range(0, len(data), part_bytes):
        name = f"reference-moe.tar.{i // part_bytes:02d}"
        (dest / name).write_bytes(data[i:i + part_bytes])
        names.append(name)
    sums = [f"{hashlib.sha256(data).hexdigest()}  reference-moe.tar"]
    sums += [f"{hashlib.sha256((dest / n).read_bytes()).hexdigest()}  {n}" for n in names]
    (dest / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return names


def environment(device: torch.device) -> dict:
    import tokenizers
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__,
           "device": str(device), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   gpu_capability=list(torch.cuda.get_device_capability(device)))
    return env


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO / ".refmoe" / "corpus")
    ap.add_argument("--out", type=Path, required=True, help="run folder; the checkpoint goes to OUT/model")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    ap.add_argument("--epochs", type=float, default=8.0, help="token budget in passes over the train split")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model for CPU smoke tests")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss coefficient")
    ap.add_argument("--aux-mode", default="pooled", choices=["pooled", "per_layer"],
                    help="pooled: transformers' aux_loss (all layers pooled); per_layer: balance each layer")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batch-size", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--keep-best-margin", type=float, default=0.01, help="restore the best val state if the "
                    "final val loss is worse by more than this (nats)")
    ap.add_argument("--train-fraction", type=float, default=1.0, help="use a random subset of train windows")
    ap.add_argument("--nextline-samples", type=int, default=200)
    ap.add_argument("--experts-impl", default="auto", choices=["auto", "grouped_mm_autocast", "grouped_mm", "eager"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", default="15MB")
    ap.add_argument("--pack", type=Path, help="also write OUT/model as tar parts + SHA256SUMS into this folder")
    ap.add_argument("--part-mib", type=int, default=15)
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq_len, args.batch_size = min(args.seq_len, 128), min(args.batch_size, 8)
        args.warmup_steps, args.eval_every = min(args.warmup_steps, 20), min(args.eval_every, 50)
        args.nextline_samples = min(args.nextline_samples, 40)
    return args


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    t_start = time.time()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # fp32 leftovers (outside autocast) may use TF32
    seed_everything(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.corpus / "tokenizer")
    corpus_meta = json.loads((args.corpus / "corpus.json").read_text())
    train_tokens, val_tokens = ev.load_tokens(args.corpus, "train"), ev.load_tokens(args.corpus, "val")
    model = build_model(tokenizer, "tiny" if args.tiny else "reference", args.aux_coef, args.seed,
                        max_position=1024).to(device)
    counts = param_counts(model)
    experts = choose_experts_impl(model, device, args.experts_impl)
    seed_everything(args.seed)
    sampler = EpochSampler(train_tokens, args.seq_len, args.batch_size, args.seed, args.train_fraction)
    print(f"device {device} | params {counts['total'] / 1e6:.2f}M total, {counts['experts'] / 1e6:.2f}M experts, "
          f"{counts['active_per_token_excl_embedding'] / 1e6:.2f}M active/token | experts {experts['implementation']}"
          f" | train {sampler.tokens_per_epoch:,} tokens/epoch, {args.epochs} epochs or {args.minutes} min",
          flush=True)
    setup_s = time.time() - t_start
    result = train(model, sampler, val_tokens, args, device)
    flops = train_flops_per_token(model, args.seq_len) * result["tokens_seen"]
    result.update(setup_seconds=setup_s, train_flops=flops,
                  achieved_tflops=flops / result["train_seconds"] / 1e12, peak_memory_bytes=peak_memory_bytes(device))
    print(f"trained {result['steps']} steps, {result['tokens_seen']:,} tokens ({result['epochs_seen']:.2f} epochs) "
          f"in {result['train_seconds']:.0f}s ({result['achieved_tflops']:.3g} model TFLOP/s), stopped by "
          f"{result['stopped_by']}; peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB", flush=True)
    model_dir = args.out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    save_checkpoint(model, tokenizer, model_dir, args.shard_size)
    del model
    # Evaluate what ships: the bf16 folder, loaded back through the public loader.
    shipped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    shipped_tok = AutoTokenizer.from_pretrained(model_dir)
    final = ev.full_evaluation(shipped, shipped_tok, args.corpus, device, args.seq_len, args.nextline_samples,
                               args.seed)
    ev.print_summary(final)
    log = {"schema_version": 1, "argv": sys.argv[1:], "args": {k: str(v) for k, v in vars(args).items()},
           "model_config": shipped.config.to_dict(), "params": counts, "experts_implementation": experts,
           "corpus": {k: corpus_meta[k] for k in ("tokens", "documents_per_split", "by_domain", "params")},
           "corpus_files": corpus_meta["files"], "environment": environment(device), **result,
           "final_eval": final, "wall_seconds": time.time() - t_start}
    (model_dir / "training_log.json").write_text(json.dumps(log, indent=1))
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    if args.pack:
        parts = pack(model_dir, args.pack, args.part_mib * 2**20)
        shutil.copy(args.out / "training_log.json", args.pack / "training_log.json")
        print(f"packed {model_dir} into {len(parts)} parts in {args.pack}")
    print(f"done in {time.time() - t_start:.0f}s; checkpoint {model_dir} "
          f"({sum(p.stat().st_size for p in model_dir.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
