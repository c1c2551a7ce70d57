"""The studies' held-out next-line samples: from the held-out Python file's own modules, reproducible by seed, no
file giving more than a quarter, contexts cut at the end of the previous line; their batch marks exactly the line."""

from __future__ import annotations

from quant.models import resolve_model
from studies.heldout import heldout_code_docs, nextline_batch, nextline_samples


def test_nextline_samples_and_their_batch(quant_cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:reference-moe").path)
    docs = heldout_code_docs()
    assert {d["path"] for d in docs} >= {"glob.py", "string.py"} and all(d["domain"] == "code" for d in docs)
    samples = nextline_samples(tok, docs, 12, seed=0, max_context=64, max_line_tokens=48)
    assert samples == nextline_samples(tok, docs, 12, seed=0, max_context=64, max_line_tokens=48)
    per_file = [sum(s["path"] == d["path"] for s in samples) for d in docs]
    assert max(per_file) == 3 and len(samples) == sum(per_file)  # at most 12 // 4 from a file
    for s in samples:
        lines = next(d for d in docs if d["path"] == s["path"])["text"].split("\n")
        assert s["target"] == lines[s["line"] - 1].rstrip() and s["target"].strip()
        assert len(s["context_ids"]) <= 64
        assert tok.decode(s["context_ids"]).endswith(lines[s["line"] - 2][-10:])
    ids, mask, span, ends_line = nextline_batch(tok, samples[:3])
    for r, s in enumerate(samples[:3]):
        line = tok("\n" + s["target"], add_special_tokens=False)["input_ids"]
        assert ids[r, span[r]].tolist() == line and int(mask[r].sum()) == len(s["context_ids"]) + len(line)
    assert ends_line[tok.eos_token_id] and ends_line.shape == (len(tok),)
