"""The builtin tiny models' tokenizer: a byte-level BPE trained once on the bundled calibration text.

The trained file ships as ``assets/tiny-bpe.json`` so builtin models are identical on every machine;
``train_tiny_tokenizer`` is how it was made (``python -m quant.models.tokenizer OUT.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSET = Path(__file__).parent / "assets" / "tiny-bpe.json"
EOS = "<|endoftext|>"
VOCAB_SIZE = 1024


def train_tiny_tokenizer(files: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer) with one special token, ``EOS``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def load_tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ASSET))


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2] / "calibration" / "data"
    sources = sorted(root.glob("*.txt"))
    train_tiny_tokenizer(sources).save(sys.argv[1] if len(sys.argv) > 1 else str(ASSET))
