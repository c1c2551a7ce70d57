"""Checkpoint writing shared by every format: sharded safetensors, index, copied side files, SHA-256 manifest,
atomic directory replacement, on one rank or many.

A checkpoint directory is built under a temporary name beside its destination (``.<name>.tmp-<writer pid>``) and
renamed into place only when complete, so a directory with the final name is always a finished checkpoint. Under
torchrun every rank writes its share of the shard files (``shards.py``) into that one temporary directory and
hashes them; the writer (rank 0) alone creates it, waits for every rank, writes the index, config, side files and
manifest (with the ranks' digests) and renames it. A failure on any rank ends every rank and the writer deletes
the temporary; one left by a killed job carries the writer's pid and is removed when the run directory is next
claimed (``storage.remove_stale``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from quant.errors import CheckpointError
from quant.export.shards import Shard, index, plan_shards, plan_tensors, shard_owners, write_shard
from quant.io.rundir import atomic_write_text, environment_error
from quant.io.storage import file_sha256, file_stamp, remember_sha256
from quant.models import ModelSource
from quant.models.source import remote_code_files
from quant.parallel.world import World
from quant.plan.bitplan import BitPlan

log = logging.getLogger(__name__)

MANIFEST = "quant_manifest.json"
CARD = "README.md"  # the model card: written after evaluation by the card stage alone, which adds it to the manifest
# lm-eval's own results (task configs, versions, n-shot, sample counts) of the base and the quantized model, copied
# beside the card by the card stage when eval ran lm-eval tasks, so the published checkpoint carries what its card cites
LM_EVAL_FILES = {"base": "lm_eval_results_base.json", "quantized": "lm_eval_results_quantized.json"}
AFTER_EVAL = (CARD, *LM_EVAL_FILES.values())  # written after eval: not part of the checkpoint's identity
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "LICENSE", "LICENSE.txt")


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation and license files, and the model's own Python that config.json's ``auto_map`` names
    (a remote-code model's checkpoint needs it to load)."""
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    for code in remote_code_files(src):
        shutil.copy2(code, dst / code.name)


def write_manifest(directory: Path, extra: dict | None = None, digests: dict[str, str] | None = None) -> None:
    """SHA-256 of every file in the checkpoint (except the manifest itself); ``digests``: those already known
    (relative name -> SHA-256, computed by the rank that wrote the file)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    known = digests or {}
    data = dict(extra or {})
    data["files"] = {(rel := str(p.relative_to(directory))): known.get(rel) or file_sha256(p) for p in files}
    (directory / MANIFEST).write_text(json.dumps(data, indent=1))


def read_manifest(directory: Path) -> dict | None:
    """The checkpoint's manifest, or None when it is missing or unreadable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def add_to_manifest(directory: Path, name: str) -> None:
    """Record (or update) the SHA-256 of one file written after export (``AFTER_EVAL``, by the card stage)."""
    data = read_manifest(directory)
    if data is None:
        raise CheckpointError(f"{directory} has no readable {MANIFEST}; re-run the export")
    data["files"] = dict(sorted({**data["files"], name: file_sha256(directory / name)}.items()))
    atomic_write_text(directory / MANIFEST, json.dumps(data, indent=1))


def remove_from_checkpoint(directory: Path, name: str) -> None:
    """Delete one file written after export and its manifest entry (lm-eval's results once no task is run)."""
    (directory / name).unlink(missing_ok=True)
    data = read_manifest(directory)
    if data is not None and name in data["files"]:
        data["files"] = {k: v for k, v in data["files"].items() if k != name}
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
    """Identity of a finished, intact checkpoint: a hash of its manifest's file digests, the files the card stage
    writes after eval excluded (``AFTER_EVAL``). None when the manifest is missing or any other file differs from it."""
    data = read_manifest(directory)
    if data is None or [f for f in verify_manifest(directory) if f not in AFTER_EVAL]:
        return None
    files = {k: v for k, v in data["files"].items() if k not in AFTER_EVAL}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def temp_directory(final: Path) -> Path:
    """A new, empty ``.<final>.tmp-<pid>`` beside ``final`` (the pid is the writer's: see ``storage.remove_stale``)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def replace_directory(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing (and then deleting) any old ``final``."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def write_checkpoint(source: ModelSource, plan: BitPlan, qdir: Path, out: Path, max_shard_bytes: int,
                     module_tensors: Callable, config_files: dict[str, dict], manifest: dict,
                     world: World) -> Path:
    """Write every tensor of ``source`` to a new checkpoint at ``out`` (atomically), each rank of ``world`` its share
    of the shard files: quantized modules as ``module_tensors(stored) -> {suffix: tensor}`` (``stored`` as
    ``qstore.read_layer(packed=True)`` returns it: W4 codes may come two a byte), kept tensors from the
    quantize stage when it changed them (AWQ folds) else from the source. ``config_files``: JSON files to write
    (config.json, ...). The files are the same, byte for byte, at any world size."""
    shards = plan_shards(plan_tensors(source, plan, qdir, module_tensors), max_shard_bytes)
    owners = shard_owners(shards, world.size)
    tmp = Path(world.on_writer(lambda: str(temp_directory(out))))
    try:
        mine = [s for s, r in zip(shards, owners, strict=True) if r == world.rank]
        written = world.on_every_rank(lambda: _write_shards(mine, source, qdir, module_tensors, tmp, world))
        world.on_writer(lambda: _finish(tmp, out, shards, written, source, config_files, manifest))
    except BaseException:
        if world.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_shards(shards: list[Shard], source: ModelSource, qdir: Path, module_tensors: Callable, tmp: Path,
                  world: World) -> dict[str, tuple[str, tuple[int, int]]]:
    """This rank's shard files: file -> (SHA-256, (size, mtime) when hashed). Under torchrun a full disk or an
    unwritable path becomes one line naming this rank (one process: the pipeline names it)."""
    t0, out = time.perf_counter(), {}
    try:
        for shard in shards:
            path = write_shard(shard, source, qdir, module_tensors, tmp)
            out[shard.file] = (file_sha256(path), file_stamp(path))
    except OSError as e:
        plain = environment_error(e, tmp, lambda: sum(s.nbytes for s in shards)) if world.distributed else None
        if plain is None:
            raise
        raise type(plain)(f"rank {world.rank} of {world.size}: {plain}") from None
    log.debug("rank %d wrote %d shard files (%.1f MB) in %.1f s", world.rank, len(shards),
              sum(s.nbytes for s in shards) / 1e6, time.perf_counter() - t0)
    return out


def _finish(tmp: Path, out: Path, shards: list[Shard], written: list[dict], source: ModelSource,
            config_files: dict[str, dict], manifest: dict) -> None:
    """The writer's part once every shard is on disk: index, config and side files, manifest, rename."""
    digests = {}
    for rank, part in enumerate(written):
        for file, (digest, stamp) in part.items():
            if rank > 0:  # the writer's own digest cache may not have seen another node's files
                remember_sha256(tmp / file, digest, stamp)
            digests[file] = digest
    if (idx := index(shards)) is not None:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2))
    for fname, data in config_files.items():
        (tmp / fname).write_text(json.dumps(data, indent=2))
    copy_side_files(source.path, tmp)
    write_manifest(tmp, manifest, digests)
    replace_directory(tmp, out)
    if len(written) > 1:
        log.info("%s: %d shard files written by %d ranks (%s)", out.name, len(shards), len(written),
                 ", ".join(f"rank {r}: {len(part)}" for r, part in enumerate(written)))
