"""Calibration manifests -> a fixed token tensor with recorded sample ids.

A manifest (``calibration/*.yaml``) names weighted sources: local text / JSONL / parquet files, or a hub dataset
(used on clusters; needs network). Each source is tokenized into one stream (documents joined by EOS) and cut
into ``seq_len`` windows; ``n_samples`` windows are drawn, split across sources by weight, with a seeded
generator. Every sample's id (``source:window``) is recorded, so a run says exactly what it calibrated on.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from quant import strict_yaml
from quant.errors import CalibrationError

log = logging.getLogger(__name__)
MIN_READ_BYTES = 1 << 20  # every bundled source is read whole
BYTES_PER_TOKEN = 16  # text read per token needed: 3-5 bytes make a token in prose and code
TOKENIZE_CHARS = 1 << 20


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    name: str
    kind: Literal["text", "jsonl", "parquet", "hub"] = "text"
    path: str | None = None
    field: str = "text"
    dataset: str | None = None
    config: str | None = None
    split: str = "train"
    max_documents: int | None = Field(None, ge=1)
    weight: float = Field(1.0, gt=0.0)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    name: str
    description: str = ""
    sources: tuple[Source, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _weights(self) -> Manifest:
        if not math.isfinite(sum(s.weight for s in self.sources)):
            raise ValueError("the sources' weights add up to more than a float holds; give them smaller values (only "
                             "their ratios matter, e.g. 0.4, 0.2, 0.4)")
        return self


@dataclass(frozen=True)
class CalibrationSet:
    """``tokens [N, S]`` int64; ``sample_ids[i]`` names the window; ``domains[i]`` its source."""

    tokens: torch.Tensor
    sample_ids: tuple[str, ...]
    domains: tuple[str, ...]
    seed: int
    manifest: str


def resolve_dataset_path(dataset: str, base: Path | None = None) -> Path:
    """A manifest path as given, else relative to the repository's ``calibration/`` folder's parent."""
    p = Path(dataset)
    candidates = [p] + ([base / p] if base else []) + [Path(__file__).resolve().parents[1] / p]
    for c in candidates:
        if c.is_file():
            return c
    raise CalibrationError(f"calibration manifest not found: {dataset}")


def load_manifest(path: Path) -> Manifest:
    """A manifest file, read with the strict YAML loader (``strict_yaml``) and validated."""
    text = strict_yaml.decode(path.read_bytes(), f"calibration manifest {path}", CalibrationError)
    data = strict_yaml.load(text, f"calibration manifest {path}", CalibrationError)
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "manifest"
        msg = first["msg"].removeprefix("Value error, ")
        raise CalibrationError(f"invalid calibration manifest {path}: {where}: {msg}") from None


def read_budget_bytes(n_tokens: int) -> int:
    """Bytes of text read from one source that is to give ``n_tokens`` tokens: ``BYTES_PER_TOKEN`` per token, at
    least ``MIN_READ_BYTES``. A source is a window pool, not a corpus: a 300 MB text tokenized whole took the
    tokenizer past the host's memory (it aborted the process)."""
    return max(MIN_READ_BYTES, n_tokens * BYTES_PER_TOKEN)


def _text(path: Path, name: str, max_bytes: int) -> str:
    """The file's first ``max_bytes`` as text, cut after its last newline (or whitespace) when it is longer."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1 if size > max_bytes else size)
    if len(data) > max_bytes:
        data = data[:max_bytes]
        cut = max(data.rfind(b"\n"), data.rfind(b" "))
        data = data[: cut + 1] if cut > 0 else data
        log.warning("calibration source %s: %s is %.0f MB; read its first %.0f MB (enough for the windows it gives)",
                    name, path, size / 1e6, len(data) / 1e6)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if size > max_bytes and e.start >= len(data) - 3 and e.reason == "unexpected end of data":
            return data[: e.start].decode("utf-8")  # the cut split a character
        raise CalibrationError(f"calibration source '{name}': {path} is not UTF-8 text (invalid byte at offset "
                               f"{e.start})") from None


def _jsonl(path: Path, field: str, name: str, max_bytes: int) -> list[str]:
    docs = []
    text = _text(path, name, max_bytes)
    lines = text.splitlines()
    if len(text.encode()) < path.stat().st_size and lines:  # read in part: the last line may be cut
        lines = lines[:-1]
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CalibrationError(f"calibration source '{name}': {path} line {i} is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise CalibrationError(f"calibration source '{name}': {path} line {i} has no string field '{field}'")
        docs.append(row[field])
    return docs


def _hub(src: Source, max_bytes: int) -> list[str]:
    from datasets import load_dataset

    try:
        ds = load_dataset(src.dataset, src.config, split=src.split, streaming=True)
        return _until(max_bytes, (row[src.field] for _, row in zip(range(src.max_documents or 10_000), ds,
                                                                        strict=False)))
    except Exception as e:  # noqa: BLE001 - offline, unknown dataset, missing field: one user-facing problem
        reason = (str(e).strip().splitlines() or [""])[0]
        raise CalibrationError(f"calibration source '{src.name}': hub dataset '{src.dataset}' could not be read "
                               f"({type(e).__name__}: {reason}); hub sources need network access (HF_HUB_OFFLINE "
                               "unset) — offline, use a local text/jsonl/parquet source") from None


def _until(max_bytes: int, docs) -> list[str]:
    """Documents from ``docs`` while fewer than ``max_bytes`` (counted as characters) are held."""
    out, held = [], 0
    for doc in docs:
        if held >= max_bytes:
            break
        out.append(doc)
        held += len(doc)
    return out


def _parquet(path: Path, src: Source, max_bytes: int) -> list[str]:
    import pyarrow.parquet as pq

    def rows():
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[src.field]):
            yield from (str(x) for x in batch.column(0).to_pylist())

    try:
        return _until(max_bytes, rows())
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file or a missing column
        raise CalibrationError(f"calibration source '{src.name}': cannot read column '{src.field}' of {path} "
                               f"({(str(e).strip().splitlines() or [''])[0]})") from None


def _documents(src: Source, base: Path, max_bytes: int) -> list[str]:
    """The source's documents, at most about ``max_bytes`` of them (``read_budget_bytes``)."""
    if src.kind == "hub":
        return _hub(src, max_bytes)
    if src.path is None:
        raise CalibrationError(f"calibration source '{src.name}' ({src.kind}) needs a path")
    path = (base / src.path) if not Path(src.path).is_absolute() else Path(src.path)
    if not path.is_file():
        raise CalibrationError(f"calibration source '{src.name}': file not found: {path}")
    if src.kind == "text":
        docs = [_text(path, src.name, max_bytes)]
    elif src.kind == "jsonl":
        docs = _jsonl(path, src.field, src.name, max_bytes)
    else:
        docs = _parquet(path, src, max_bytes)
    return docs[: src.max_documents] if src.max_documents else docs


def tokenize(tokenizer, text: str, max_chars: int = TOKENIZE_CHARS) -> torch.Tensor:
    """Token ids of ``text`` (int64), a piece of at most ``max_chars`` characters at a time, cut after a newline
    where one is near: the tokenizer's memory grows with its input (3.6 GB for 20 MB at once)."""
    if len(text) <= max_chars:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    pieces, start = [], 0
    while start < len(text):
        end = min(start + max_chars, len(text))
        if end < len(text):
            newline = text.rfind("\n", start + max_chars // 2, end)
            end = newline + 1 if newline >= 0 else end
        pieces.append(torch.tensor(tokenizer(text[start:end], add_special_tokens=False)["input_ids"], dtype=torch.long))
        start = end
    return torch.cat(pieces)


def _allocate(n: int, weights: list[float]) -> list[int]:
    """Split n samples by weight with the largest-remainder rule (sums to n exactly)."""
    total = sum(weights)
    raw = [n * (w / total) for w in weights]  # w / total first: n * w may overflow
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _windows(stream: torch.Tensor, seq_len: int, need: int, gen: torch.Generator, name: str) -> list[tuple[int, torch.Tensor]]:
    """``need`` windows (start offset, tokens): non-overlapping when the stream is long enough."""
    n_full = stream.numel() // seq_len
    if n_full >= need:
        starts = (torch.randperm(n_full, generator=gen)[:need] * seq_len).tolist()
    else:
        if stream.numel() < seq_len:
            raise CalibrationError(f"calibration source '{name}' has {stream.numel()} tokens, fewer than seq_len {seq_len}")
        log.warning("source %s: %d tokens give %d windows of %d, %d needed; windows will overlap",
                    name, stream.numel(), n_full, seq_len, need)
        starts = torch.randint(0, stream.numel() - seq_len + 1, (need,), generator=gen).tolist()
    return [(s, stream[s : s + seq_len]) for s in sorted(starts)]


def build_calibration(dataset: str, tokenizer, n_samples: int, seq_len: int, seed: int) -> CalibrationSet:
    """Tokenize the manifest's sources and draw ``n_samples`` windows of ``seq_len`` tokens (seeded)."""
    path = resolve_dataset_path(dataset)
    manifest = load_manifest(path)
    gen = torch.Generator().manual_seed(seed)
    rows, ids, domains = [], [], []
    counts = _allocate(n_samples, [s.weight for s in manifest.sources])
    eos = tokenizer.eos_token or ""
    for src, need in zip(manifest.sources, counts, strict=True):
        if need == 0:
            continue
        text = eos.join(_documents(src, path.parent, read_budget_bytes(need * seq_len)))
        stream = tokenize(tokenizer, text)
        for start, window in _windows(stream, seq_len, need, gen, src.name):
            rows.append(window)
            ids.append(f"{src.name}:{start}")
            domains.append(src.name)
    return CalibrationSet(torch.stack(rows), tuple(ids), tuple(domains), seed, str(dataset))


def random_calibration(n: int, seqlen: int, vocab: int, seed: int) -> CalibrationSet:
    """``n`` seeded random token rows of ``seqlen`` (ids below ``vocab``) as a calibration set."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seqlen), generator=g)
    return CalibrationSet(tokens, tuple(f"random:{i}" for i in range(n)), ("random",) * n, seed, "random")
