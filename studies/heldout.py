"""What the studies (STUDY.md) measure on held-out text: the pipeline's eval proxies of a quantized model in memory
against bf16, and next-line exact match on held-out Python.

A quantized model here is the base transformers model with the quantize stage's stored dequantized weights put in
(``apply_quantized``), so a study scores many plans without exporting each. The proxies are the pipeline's own
(``quant.eval.stream.ProxySums``); next-line exact match asks whether greedy decoding reproduces a held-out line
of code after its file's preceding text (``nextline_samples`` picks the lines, ``nextline_batch`` lays them out,
``nextline_greedy_match`` scores them from one teacher-forced forward).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from quant.calibration import resolve_dataset_path
from quant.eval.evaluate import final_hidden
from quant.eval.stream import ProxySums
from quant.models import ModelSource
from quant.models.layers import decoder_layers
from quant.quantize.qstore import layer_file, load_into_layer

HELDOUT_CODE = "calibration/data/heldout-python-code.txt"  # calibration/heldout.yaml's Python source


def load_model(path: Path):
    """The transformers model of a folder, in float32, for evaluation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def apply_quantized(model, source: ModelSource, qdir: Path) -> None:
    """Put the stored dequantized weights (and AWQ-changed kept tensors) of ``qdir`` into a float model of ``source``."""
    for layer, module in enumerate(decoder_layers(model)):
        load_into_layer(source, module, layer, layer_file(qdir, layer))


def heldout_code_docs() -> list[dict]:
    """The held-out Python file of calibration/heldout.yaml, split back into its modules (``{path, domain, text}``)."""
    text = resolve_dataset_path(HELDOUT_CODE).read_text()
    parts = [p for p in text.split("# ---- ") if p.strip()]
    return [{"path": p.split(" ", 1)[0], "domain": "code", "text": "# ---- " + p} for p in parts]


def nextline_samples(tokenizer, docs: list[dict], n: int, seed: int, max_context: int,
                     max_line_tokens: int) -> list[dict]:
    """Pick ``n`` (file, line) pairs from held-out Python files.

    The context is the file up to the END of the previous line (no trailing newline: cutting after the newline
    would split BPE's newline+indent tokens and put the model off-distribution), left-truncated to
    ``max_context`` tokens. Both the previous and the target line must be non-blank, the previous one without
    trailing whitespace. No file gives more than a quarter of the samples.
    """
    rng = random.Random(seed)
    per_file = []
    for d in docs:
        if d["domain"] != "code" or not d["path"].endswith(".py"):
            continue
        lines = d["text"].split("\n")
        cands = [i for i in range(1, len(lines))
                 if lines[i].strip() and lines[i - 1].strip() and lines[i - 1] == lines[i - 1].rstrip()]
        rng.shuffle(cands)
        per_file.append((d, lines, cands[:max(1, n // 4)]))
    pool = [(d, lines, i) for d, lines, cands in per_file for i in cands]
    rng.shuffle(pool)
    samples = []
    for d, lines, i in pool:
        target = lines[i].rstrip()
        if len(tokenizer("\n" + target + "\n", add_special_tokens=False)["input_ids"]) > max_line_tokens:
            continue
        ctx = tokenizer("\n".join(lines[:i]), add_special_tokens=False, verbose=False)["input_ids"][-max_context:]
        samples.append({"path": d["path"], "line": i + 1, "context_ids": ctx, "target": target})
        if len(samples) == n:
            break
    return samples


def nextline_batch(tok, samples: list[dict]) -> tuple[torch.Tensor, ...]:
    """Left-padded ``context + "\\n" + line`` ids, attention mask, mask of the line's tokens, and [V] whether a
    token ends the line (its text starts with a newline, or it is EOS)."""
    rows = [(smp["context_ids"], tok("\n" + smp["target"], add_special_tokens=False)["input_ids"]) for smp in samples]
    width = max(len(c) + len(t) for c, t in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    span = torch.zeros_like(ids, dtype=torch.bool)
    for r, (c, t) in enumerate(rows):
        seq = c + t
        ids[r, width - len(seq):] = torch.tensor(seq)
        mask[r, width - len(seq):] = 1
        span[r, width - len(t):] = True
    ends_line = torch.tensor([tok.decode([i]).startswith("\n") for i in range(len(tok))])
    ends_line[tok.eos_token_id] = True
    return ids, mask, span, ends_line


@torch.no_grad()
def nextline_greedy_match(model, batch: tuple[torch.Tensor, ...]) -> float:
    """Share of held-out lines that greedy decoding reproduces exactly, from one teacher-forced forward: every
    token of ``"\\n" + line`` after the context is the model's argmax given the true prefix, and the argmax after
    the line's last token starts a new line (a token beginning with a newline, or EOS)."""
    ids, mask, span, ends_line = batch
    pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    ok = ((pred[:, :-1] == ids[:, 1:]) | ~span[:, 1:]).all(dim=1)
    return (ok & ends_line[pred[:, -1]]).float().mean().item()


def reference(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    """The model's final-norm hidden states on the held-out tokens and its lm_head (what the proxies compare)."""
    return final_hidden(model, tokens, 16, "cpu"), model.get_output_embeddings()


def proxies(model, tokens: torch.Tensor, base: tuple[torch.Tensor, torch.nn.Module]) -> dict:
    """The pipeline's own eval proxies (``ProxySums``) of ``model`` against the bf16 ``reference``:
    ``{ppl, kl, top1}``."""
    sums = ProxySums("cpu")
    sums.score(*base, *reference(model, tokens), tokens, "cpu")
    p = sums.metrics()
    return {"ppl": p["perplexity"]["quantized"], "kl": p["kl"]["quantized"], "top1": p["top1_agreement"]["quantized"]}


def metrics(model, tokens: torch.Tensor, base: tuple[torch.Tensor, torch.nn.Module], lines) -> dict:
    """The proxies against bf16, plus next-line exact match (``nextline_em``) on ``lines`` (``nextline_batch``)."""
    return proxies(model, tokens, base) | {"nextline_em": nextline_greedy_match(model, lines)}
