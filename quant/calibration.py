"""Calibration manifests -> a fixed token tensor with recorded sample ids.

A manifest (``calibration/*.yaml``) names weighted sources: local text / JSONL / parquet files, or a hub dataset
(used on clusters; needs network). Each source is tokenized into one stream (documents joined by EOS) and cut
into ``seq_len`` windows; ``n_samples`` windows are drawn, split across sources by weight, with a seeded
generator. Every sample's id (``source:window``) is recorded, so a run says exactly what it calibrated on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quant.errors import CalibrationError

log = logging.getLogger(__name__)


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
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
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    sources: tuple[Source, ...]


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
    try:
        return Manifest.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValidationError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else None
        detail = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(e).splitlines()[0]
        raise CalibrationError(f"invalid calibration manifest {path}: {detail}") from None


def _documents(src: Source, base: Path) -> list[str]:
    if src.kind == "hub":
        from datasets import load_dataset

        ds = load_dataset(src.dataset, src.config, split=src.split, streaming=True)
        return [row[src.field] for _, row in zip(range(src.max_documents or 10_000), ds, strict=False)]
    if src.path is None:
        raise CalibrationError(f"calibration source '{src.name}' ({src.kind}) needs a path")
    path = (base / src.path) if not Path(src.path).is_absolute() else Path(src.path)
    if not path.is_file():
        raise CalibrationError(f"calibration source '{src.name}': file not found: {path}")
    if src.kind == "text":
        docs = [path.read_text(encoding="utf-8")]
    elif src.kind == "jsonl":
        docs = [json.loads(line)[src.field] for line in path.read_text().splitlines() if line.strip()]
    else:
        import pyarrow.parquet as pq

        docs = [str(x) for x in pq.read_table(path, columns=[src.field]).column(src.field).to_pylist()]
    return docs[: src.max_documents] if src.max_documents else docs


def _allocate(n: int, weights: list[float]) -> list[int]:
    """Split n samples by weight with the largest-remainder rule (sums to n exactly)."""
    total = sum(weights)
    raw = [n * w / total for w in weights]
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
        text = eos.join(_documents(src, path.parent))
        stream = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        for start, window in _windows(stream, seq_len, need, gen, src.name):
            rows.append(window)
            ids.append(f"{src.name}:{start}")
            domains.append(src.name)
    return CalibrationSet(torch.stack(rows), tuple(ids), tuple(domains), seed, str(dataset))
