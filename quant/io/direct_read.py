"""Safetensors tensors read straight into one caller-owned buffer by parallel ``pread`` calls.

``safe_open`` hands each tensor over as a fresh CPU tensor (mmap page faults, then a copy); a GPU upload from there
needs yet another copy into page-locked memory. Read-ahead of a DeepSeek-V3 layer (23 GB) that way ran at about
3 GB/s on the H200 machine, slower than the profile's forward, so the GPU waited for the disk. Here the byte ranges
come from the shard headers (8-byte length, JSON table of name -> dtype, shape, data offsets), tensors that lie
next to each other in a shard become one read, reads are cut into chunks and issued from a thread pool (``pread``
releases the GIL), straight into the buffer ``into(n_bytes)`` returns (page-locked, from ``layerwise``). The
tensors returned are views of that buffer.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quant.errors import ModelError
from quant.io.staging import aligned_offsets, views_at

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
# safetensors dtype name -> torch dtype; a shard holding another (e.g. packed 4-bit types) is read by safe_open
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}  # torch dtype -> safetensors dtype name
READ_CHUNK_BYTES = 64 << 20  # one pread: large enough for the disk's sequential speed, small enough to spread


def header_table(path: Path) -> tuple[int, dict]:
    """(offset of the data section, the header's JSON table) of safetensors file ``path``."""
    if not path.is_file():
        raise ModelError(f"{path.parent} lacks {path.name}, which its index names; re-download the model")
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 30:
            raise ModelError(f"{path}: safetensors header of {n} bytes is not plausible; is the file corrupt?")
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(table, dict):
        raise ModelError(f"{path}: malformed safetensors header; is the file corrupt?")
    return 8 + n, table


def _entries(root: Path, weight_map: dict[str, str], keys: list[str]) -> list[tuple] | None:
    """(file, absolute begin, n_bytes, key, dtype, shape) of ``keys``, in file order; None when one has a dtype
    outside ``TORCH_DTYPES``."""
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(weight_map[key], []).append(key)
    out = []
    for file, file_keys in sorted(by_file.items()):
        start, table = header_table(root / file)
        for key in file_keys:
            try:
                info = table[key]
                if info["dtype"] not in TORCH_DTYPES:
                    return None
                dtype, shape = TORCH_DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ModelError(f"{root / file}: no readable entry for {key} in its header; re-download the "
                                 "model") from None
            n_bytes = dtype.itemsize * torch.Size(shape).numel()
            if end - begin != n_bytes or begin < 0:
                raise ModelError(f"{root / file}: {key}'s data offsets span {end - begin} bytes, its shape "
                                 f"{list(shape)} needs {n_bytes}; the file is damaged: re-download or re-save it")
            out.append((file, start + begin, n_bytes, key, dtype, shape))
    return sorted(out, key=lambda e: (e[0], e[1]))


def _runs(entries: list[tuple], offsets: list[int]) -> list[tuple[str, int, int, int]]:
    """(file, file offset, buffer offset, n_bytes) reads: neighbours in file and buffer merged, cut into chunks."""
    merged: list[list] = []
    for (file, pos, n, *_), off in zip(entries, offsets, strict=True):
        last = merged[-1] if merged else None
        if last and last[0] == file and last[1] + last[3] == pos and last[2] + last[3] == off:
            last[3] += n
        elif n:
            merged.append([file, pos, off, n])
    return [(file, pos + c, off + c, min(READ_CHUNK_BYTES, n - c))
            for file, pos, off, n in merged for c in range(0, n, READ_CHUNK_BYTES)]


def read_into(root: Path, weight_map: dict[str, str], keys: list[str], into: Callable[[int], torch.Tensor | None],
              threads: int) -> dict[str, torch.Tensor] | None:
    """``keys`` read into ``into(n_bytes)`` (a CPU ``uint8`` tensor, or None to decline: then None is returned),
    as views of it, by ``threads`` parallel preads; None as well when a tensor's dtype is not in ``TORCH_DTYPES``
    (the caller reads with safe_open). A shard shorter than its header says is a ModelError."""
    entries = _entries(root, weight_map, keys)
    if entries is None:
        return None
    offsets, total = aligned_offsets([e[2] for e in entries])
    buf = into(total)
    if buf is None:
        return None
    assert buf.dtype == torch.uint8 and buf.device.type == "cpu" and buf.numel() >= total
    dest = buf.numpy()
    fds = {file: os.open(root / file, os.O_RDONLY) for file in {e[0] for e in entries}}

    def read(run: tuple[str, int, int, int]) -> None:
        file, pos, off, n = run
        view, done = memoryview(dest[off : off + n]), 0
        while done < n:
            got = os.preadv(fds[file], [view[done:]], pos + done)
            if got == 0:
                raise ModelError(f"{root / file} ends before {key_at(file, pos + done)}'s data; it is truncated "
                                 "or damaged: re-download or re-save it")
            done += got

    def key_at(file: str, pos: int) -> str:
        return next((e[3] for e in entries if e[0] == file and e[1] <= pos < e[1] + e[2]), "a tensor")

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="quant-read") as pool:
            list(pool.map(read, _runs(entries, offsets)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return views_at(buf, {e[3]: (e[5], e[4]) for e in entries}, offsets)
