"""Checkpoint writing shared by every format: sharded safetensors, index, copied side files, SHA-256 manifest,
atomic directory replacement.

A checkpoint directory is built under a temporary name beside its destination and renamed into place only
when complete, so a directory with the final name is always a finished checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.errors import CheckpointError, NumericalError
from quant.models import ModelSource
from quant.models.source import remote_code_files
from quant.plan import BitPlan
from quant.qstore import layer_file, read_layer, read_params
from quant.rundir import atomic_write_text
from quant.storage import file_sha256

MANIFEST = "quant_manifest.json"
CARD = "README.md"  # the model card, written after evaluation (report stage), then added to the manifest
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "LICENSE", "LICENSE.txt")


class ShardWriter:
    """Collects tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_bytes``."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; a floating-point tensor with NaN or infinite values is refused (NumericalError)."""
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NumericalError(f"{name} holds NaN or infinite values; a checkpoint must not ship them (is the "
                                 "source model damaged?)")
        n = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous().cpu()
        self.pending_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        i = len(self.shards)
        save_file(self.pending, str(self.out / f".shard-{i:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """Flush, give shards their final names and write the index (single file: model.safetensors)."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.out / ".shard-00000.safetensors", self.out / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / f".shard-{i:05d}.safetensors", self.out / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation and license files, and the model's own Python that config.json's ``auto_map`` names
    (a remote-code model's checkpoint needs it to load)."""
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    for code in remote_code_files(src):
        shutil.copy2(code, dst / code.name)


def write_manifest(directory: Path, extra: dict | None = None) -> None:
    """SHA-256 of every file in the checkpoint (except the manifest itself)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    data = dict(extra or {})
    data["files"] = {str(p.relative_to(directory)): file_sha256(p) for p in files}
    (directory / MANIFEST).write_text(json.dumps(data, indent=1))


def read_manifest(directory: Path) -> dict | None:
    """The checkpoint's manifest, or None when it is missing or unreadable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def add_to_manifest(directory: Path, name: str) -> None:
    """Record (or update) the SHA-256 of one file written after export (the model card)."""
    data = read_manifest(directory)
    if data is None:
        raise CheckpointError(f"{directory} has no readable {MANIFEST}; re-run the export")
    data["files"] = dict(sorted({**data["files"], name: file_sha256(directory / name)}.items()))
    atomic_write_text(directory / MANIFEST, json.dumps(data, indent=1))


def verify_manifest(directory: Path) -> list[str]:
    """Files whose SHA-256 differs from the manifest, or that are missing / unlisted (the manifest itself when it
    is missing or unreadable). Digests are cached by stat (``storage.file_sha256``): an unchanged checkpoint is
    not re-read, a changed file always is."""
    data = read_manifest(directory)
    if data is None:
        return [MANIFEST]
    listed = data["files"]
    present = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST}
    bad = [f for f in listed if f not in present or file_sha256(directory / f) != listed[f]]
    return bad + sorted(present - set(listed))


def checkpoint_digest(directory: Path) -> str | None:
    """Identity of a finished, intact checkpoint: a hash of its manifest's file digests, model card excluded (it
    is added later by the report stage). None when the manifest is missing or any other file differs from it."""
    data = read_manifest(directory)
    if data is None or [f for f in verify_manifest(directory) if f != CARD]:
        return None
    files = {k: v for k, v in data["files"].items() if k != CARD}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``final`` (old content removed), else it is deleted."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _layer_of_key(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else None


class _LayerCache:
    """The quantize stage's stored modules and changed kept parameters (on-disk names) of one layer at a time."""

    def __init__(self, source: ModelSource, qdir: Path):
        self.source, self.qdir, self.layer = source, qdir, object()
        self.modules: dict = {}
        self.params: dict[str, torch.Tensor] = {}

    def load(self, layer: int | None) -> None:
        if layer == self.layer:
            return
        path = layer_file(self.qdir, layer)
        self.layer = layer
        self.modules = read_layer(path) if path.is_file() else {}
        raw = read_params(path) if path.is_file() else {}
        self.params = {self.source.family.disk_key(layer, k): v for k, v in raw.items()}


def write_checkpoint(source: ModelSource, plan: BitPlan, qdir: Path, out: Path, max_shard_bytes: int,
                     module_tensors: Callable, config_files: dict[str, dict], manifest: dict) -> Path:
    """Stream every tensor of ``source`` to a new checkpoint at ``out`` (atomically): quantized modules as
    ``module_tensors(stored) -> {suffix: tensor}``, kept tensors from the quantize stage when it changed them
    (AWQ folds) else from the source. ``config_files``: JSON files to write (config.json, ...)."""
    by_prefix = {m.disk_prefix: n for n, m in source.modules.items()}
    quantized = plan.quantized()
    cache = _LayerCache(source, qdir)
    with atomic_directory(out) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for key in sorted(source.weight_map, key=lambda k: (_layer_of_key(k) is None, _layer_of_key(k) or 0, k)):
            cache.load(_layer_of_key(key))
            prefix = key.removesuffix(".weight")
            name = by_prefix.get(prefix) if key.endswith(".weight") else None
            if name is not None and name in quantized:
                for suffix, tensor in module_tensors(cache.modules[name]).items():
                    writer.add(f"{prefix}.{suffix}", tensor)
            elif key in cache.params:
                writer.add(key, cache.params[key].to(source.read_tensors([key])[key].dtype))
            else:
                writer.add(key, source.read_tensors([key])[key])
        writer.close()
        for fname, data in config_files.items():
            (tmp / fname).write_text(json.dumps(data, indent=2))
        copy_side_files(source.path, tmp)
        write_manifest(tmp, manifest)
    return out
