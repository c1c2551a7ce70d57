"""Evaluation of the reference MoE: held-out perplexity, next-line exact match on held-out Python, routing profile.

``train.py`` imports these functions for its periodic and final evaluation; run as a script it evaluates a saved
checkpoint folder (CPU is enough: a few minutes on 2 cores). The held-out lines of the next-line metric are picked
by ``studies.heldout.nextline_samples`` (the studies score the same lines), so quant must be importable
(installed, or ``PYTHONPATH=.`` from the repository root):

    python benchmarks/reference_moe/evaluate_reference.py --model runs/reference-moe/model \
        --corpus .refmoe/corpus --out eval.json

Dimension legend: B batch, T tokens per window, V vocabulary, L layers, E experts, k experts per token.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import StoppingCriteria, StoppingCriteriaList

from studies.heldout import nextline_samples  # the held-out lines the studies score too

REPO = Path(__file__).resolve().parents[2]
REPO_HELDOUT_TEXTS = ("calibration/data/heldout-apache-artistic-bsd.txt", "calibration/data/heldout-python-code.txt")


# ----------------------------------------------------------------------------------------------- data


def load_tokens(corpus: Path, split: str) -> np.ndarray:
    """The uint16 token stream of a split (train / val / test)."""
    return np.fromfile(corpus / f"{split}.bin", dtype=np.uint16)


def load_docs(corpus: Path, split: str) -> list[dict]:
    """Held-out documents (val / test) as {path, domain, text}."""
    with open(corpus / f"{split}.jsonl") as f:
        return [json.loads(line) for line in f]


def encode_docs(tokenizer, docs: list[dict]) -> np.ndarray:
    """Token stream of documents, each followed by EOS (as build_corpus.py writes them)."""
    ids: list[int] = []
    for d in docs:
        ids += tokenizer(d["text"], add_special_tokens=False, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
    return np.asarray(ids, dtype=np.int64)


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] (consecutive windows share one boundary token)."""
    n = (len(tokens) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens is shorter than one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def autocast_for(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA; nothing on CPU (fp32 or bf16 weights run as they are)."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ----------------------------------------------------------------------------------------------- metrics


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, seq_len: int, batch_size: int, device: torch.device,
              max_windows: int | None = None) -> dict:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``tokens``."""
    was_training = model.training
    model.eval()
    w = windows(tokens, seq_len)[:max_windows]
    total, count = 0.0, 0
    for i in range(0, len(w), batch_size):
        batch = w[i:i + batch_size].to(device)
        with autocast_for(device):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [B, T, V]
        nll = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}


def unigram_baseline(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) of ``eval_tokens`` under the add-one-smoothed unigram distribution of the train split."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_tokens.astype(np.int64)].mean())


def text_perplexities(model, tokenizer, seq_len: int, device: torch.device) -> dict:
    """Perplexity of the repo's own held-out evaluation texts (what ``quant eval`` measures), per file."""
    out = {}
    for rel in REPO_HELDOUT_TEXTS:
        path = REPO / rel
        if path.is_file():
            ids = tokenizer(path.read_text(), add_special_tokens=False, verbose=False)["input_ids"]
            out[rel] = eval_loss(model, np.asarray(ids, dtype=np.int64), seq_len, 16, device)
    return out


# ----------------------------------------------------------------------------------------------- next line


def _predicted_line(generated: str) -> str | None:
    """The line the model wrote after the context: text between the first and second newline (or EOS)."""
    if not generated.startswith("\n"):
        return None  # it continued the previous line instead of ending it
    rest = generated[1:]
    if "\n" not in rest and "<|endoftext|>" not in rest:
        return None  # ran out of tokens before finishing the line
    return rest.split("<|endoftext|>")[0].split("\n")[0].rstrip()


def newline_counts(tokenizer) -> torch.Tensor:
    """[V] number of newlines in each token's text."""
    return torch.tensor([tokenizer.decode([i]).count("\n") for i in range(len(tokenizer))])


class _SecondNewline(StoppingCriteria):
    """Stopping criterion: a row is done once its generated tokens hold two newlines (the next line is complete)."""

    def __init__(self, counts: torch.Tensor, prompt_len: int):
        self.counts, self.prompt_len = counts, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return self.counts[input_ids[:, self.prompt_len:]].sum(dim=-1) >= 2


@torch.no_grad()
def nextline_exact_match(model, tokenizer, samples: list[dict], device: torch.device, batch_size: int = 50,
                         max_new_tokens: int = 64) -> dict:
    """Greedy-generate after each context (left-padded batches); exact = same line incl. indentation."""
    model.eval()
    pad = tokenizer.pad_token_id
    counts = newline_counts(tokenizer).to(device)
    results = []
    order = sorted(range(len(samples)), key=lambda j: len(samples[j]["context_ids"]))
    for s in range(0, len(order), batch_size):
        chunk = [samples[j] for j in order[s:s + batch_size]]
        width = max(len(c["context_ids"]) for c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, c in enumerate(chunk):
            ids[r, width - len(c["context_ids"]):] = torch.tensor(c["context_ids"])
            mask[r, width - len(c["context_ids"]):] = 1
        stop = StoppingCriteriaList([_SecondNewline(counts, width)])
        with autocast_for(device):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad, stopping_criteria=stop)
        for r, c in enumerate(chunk):
            gen = tokenizer.decode(out[r, width:].tolist(), skip_special_tokens=False)
            pred = _predicted_line(gen)
            results.append({"path": c["path"], "line": c["line"], "target": c["target"], "predicted": pred,
                            "exact": pred == c["target"],
                            "exact_stripped": pred is not None and pred.strip() == c["target"].strip()})
    n = max(len(results), 1)
    return {"n": len(results), "exact_match": sum(r["exact"] for r in results) / n,
            "exact_match_stripped": sum(r["exact_stripped"] for r in results) / n,
            "examples": sorted(results, key=lambda r: (r["path"], r["line"]))}


# ----------------------------------------------------------------------------------------------- routing


@torch.no_grad()
def routing_profile(model, tokens: np.ndarray, seq_len: int, device: torch.device, max_windows: int = 64) -> dict:
    """Per-layer share of routed (token, top-k slot) assignments per expert, and how uneven it is."""
    model.eval()
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    counts = torch.zeros(cfg.num_hidden_layers, E, dtype=torch.float64)
    w = windows(tokens, seq_len)[:max_windows]
    for i in range(0, len(w), 16):
        with autocast_for(device):
            out = model(input_ids=w[i:i + 16, :-1].to(device), output_router_logits=True, use_cache=False)
        for layer, logits in enumerate(out.router_logits):  # [B*T, E]
            top = logits.float().topk(k, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(top, minlength=E).double().cpu()
    return summarize_routing(counts, k)


def summarize_routing(counts: torch.Tensor, k: int) -> dict:
    """counts [L, E] -> shares and unevenness statistics (uniform = 1/E each)."""
    L, E = counts.shape
    shares = counts / counts.sum(dim=1, keepdim=True)
    top_n = max(1, math.ceil(0.2 * E))
    per_layer = []
    for layer in range(L):
        s = shares[layer]
        nz = s[s > 0]
        srt = s.sort().values
        gini = float(((2 * torch.arange(1, E + 1, dtype=torch.float64) - E - 1) * srt).sum() / (E * srt.sum()))
        per_layer.append({
            "layer": layer,
            "max_over_uniform": float(s.max() * E), "min_over_uniform": float(s.min() * E),
            "cv": float(s.std() / s.mean()),
            "normalized_entropy": float(-(nz * nz.log()).sum() / math.log(E)),
            f"top{top_n}_share": float(srt[-top_n:].sum()), "gini": gini,
            "hottest": [int(e) for e in s.argsort(descending=True)[:3]],
            "unused_experts": int((s == 0).sum()),
        })
    return {"experts": E, "top_k": k, "tokens_per_layer": int(counts[0].sum() / k),
            "uniform_top20pct_share": top_n / E, "per_layer": per_layer,
            "shares": [[round(float(x), 5) for x in row] for row in shares]}


@torch.no_grad()
def sample_generations(model, tokenizer, prompts: list[str], device: torch.device, max_new_tokens: int = 48) -> list:
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]], device=device)
        with autocast_for(device):
            gen = model.generate(input_ids=ids, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": p, "completion": tokenizer.decode(gen[0, ids.shape[1]:].tolist())})
    return out


PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
           "THE SOFTWARE IS PROVIDED", "The `fs.readFile()` method"]


# ----------------------------------------------------------------------------------------------- all of it


def full_evaluation(model, tokenizer, corpus: Path, device: torch.device, seq_len: int, nextline_n: int,
                    seed: int) -> dict:
    """Every final metric on the test split (+ val loss, unigram baselines, the repo's held-out texts)."""
    t0 = time.time()
    train = load_tokens(corpus, "train")
    test, val = load_tokens(corpus, "test"), load_tokens(corpus, "val")
    docs = load_docs(corpus, "test")
    V = model.config.vocab_size
    res = {"val": eval_loss(model, val, seq_len, 16, device), "test": eval_loss(model, test, seq_len, 16, device),
           "unigram_baseline_loss": {"val": unigram_baseline(train, val, V), "test": unigram_baseline(train, test, V)}}
    for domain in ("code", "prose"):
        stream = encode_docs(tokenizer, [d for d in docs if d["domain"] == domain])
        res[f"test_{domain}"] = eval_loss(model, stream, seq_len, 16, device)
        res[f"test_{domain}"]["unigram_baseline_loss"] = unigram_baseline(train, stream, V)
    res["repo_heldout_texts_seq256"] = text_perplexities(model, tokenizer, 256, device)
    samples = nextline_samples(tokenizer, docs, nextline_n, seed, max_context=256, max_line_tokens=48)
    res["nextline"] = nextline_exact_match(model, tokenizer, samples, device)
    res["routing_test"] = routing_profile(model, test, seq_len, device)
    for domain in ("code", "prose"):
        stream = encode_docs(tokenizer, [d for d in docs if d["domain"] == domain])
        prof = routing_profile(model, stream, seq_len, device, max_windows=32)
        res[f"routing_test_{domain}_shares"] = prof["shares"]
    res["samples"] = sample_generations(model, tokenizer, PROMPTS, device)
    res["seconds"] = time.time() - t0
    return res


def print_summary(res: dict) -> None:
    t = res["test"]
    print(f"test loss {t['loss']:.3f} (ppl {t['perplexity']:.1f}, unigram baseline "
          f"{res['unigram_baseline_loss']['test']:.3f}); code {res['test_code']['loss']:.3f}, "
          f"prose {res['test_prose']['loss']:.3f}; val loss {res['val']['loss']:.3f}")
    for rel, r in res["repo_heldout_texts_seq256"].items():
        print(f"  {rel}: ppl {r['perplexity']:.2f} over {r['tokens']} tokens")
    nl = res["nextline"]
    print(f"next-line exact match {nl['exact_match']:.3f} (ignoring indentation {nl['exact_match_stripped']:.3f}) "
          f"over {nl['n']} held-out Python lines")
    for lay in res["routing_test"]["per_layer"]:
        print(f"  layer {lay['layer']}: hottest expert {lay['max_over_uniform']:.2f}x uniform, coldest "
              f"{lay['min_over_uniform']:.2f}x, top-20% experts take {lay[next(k for k in lay if k.startswith('top'))]:.2f}"
              f", cv {lay['cv']:.2f}")
    for s in res["samples"][:2]:
        print(f"  sample: {s['prompt']!r} -> {s['completion'][:120]!r}")


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description="Evaluate a saved reference-MoE checkpoint folder.")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=REPO / ".refmoe" / "corpus")
    ap.add_argument("--seq-len", type=int, help="default: the training run's (training_log.json), else 512")
    ap.add_argument("--nextline-samples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    if args.seq_len is None:
        log = args.model / "training_log.json"
        args.seq_len = int(json.loads(log.read_text())["args"]["seq_len"]) if log.is_file() else 512
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device)
    res = full_evaluation(model, tok, args.corpus, device, args.seq_len, args.nextline_samples, args.seed)
    print_summary(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
