"""Host read of one decoder layer and its upload to the GPU: the read-ahead's two halves, old path vs new.

On a model built by ``engine.py`` / ``profile_stage.py`` under ``--workdir`` (e.g. ``--build-only``), for each saved
layer twice (the files then sit in the page cache, as in a tiled run):
  safe_open+pin   ``read_tensors`` (safetensors' mmap) then ``copy_into`` torch's pinned allocator
  direct Nt       ``direct_read.read_into`` with N threads into one ``Staging`` buffer (cudaHostRegister'd)
  direct pageable the same into ordinary memory (the read alone, no pinning)
and the upload of the staged layer (``.to('cuda', non_blocking=True)`` then a sync). Prints GB/s per row.
Usage (GPU): python benchmarks/layer_read.py --workdir /tmp/quant-device --shape deepseek-v3 --layers 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from quant.io.direct_read import read_into
from quant.io.staging import copy_into
from quant.layerwise import LayerReader
from quant.models import ModelSource
from quant.parallel.world import World


def meminfo() -> str:
    rows = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return ", ".join(f"{k} {int(rows[k].split()[0]) / 2**20:.1f} GB" for k in ("MemAvailable", "Cached"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/quant-device")
    ap.add_argument("--shape", default="deepseek-v3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", default="1,4,8,16")
    a = ap.parse_args()
    src = ModelSource(Path(a.workdir) / f"model-{a.shape}-{a.layers}")
    reader = LayerReader(src, World(), torch.device("cuda"))
    print(f"host memory: {meminfo()}; read-ahead budget {reader.pin_budget / 1e9:.1f} GB", flush=True)
    rows: list[tuple[str, int, float, float]] = []

    def timed(name: str, idx: int, fn, *args) -> dict:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        n_bytes = sum(t.numel() * t.element_size() for t in out.values())
        rows.append((name, idx, n_bytes / 1e9, s))
        print(f"{name:18s} layer {idx}: {n_bytes / 1e9:6.2f} GB in {s:6.2f} s = {n_bytes / 1e9 / s:6.2f} GB/s",
              flush=True)
        return out

    def upload(tensors: dict) -> dict:
        return {k: v.to("cuda", non_blocking=True) for k, v in tensors.items()}

    def torch_pinned(n_bytes: int) -> torch.Tensor:  # the read-ahead before eed93b5: torch's pinned allocator
        return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)

    def pageable(n_bytes: int) -> torch.Tensor:
        return torch.empty(n_bytes, dtype=torch.uint8)

    for rep in range(2):
        for idx in range(src.n_layers):
            keys = reader.shares(idx)[0]
            old = timed("safe_open+pin", idx, lambda k: copy_into(src.read_tensors(k), torch_pinned), keys)
            timed("upload (old)", idx, upload, old)
            old = None
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # torch's pinned block back to the host
            for n in map(int, a.threads.split(",")):
                new = timed(f"direct {n}t", idx, read_into, src.path, src.weight_map, keys,
                            reader.staging.into(0), n)
                timed("upload (staged)", idx, upload, new)
                reader.staging.uploaded(0)
                new = None
            timed("direct pageable 8t", idx, read_into, src.path, src.weight_map, keys, pageable, 8)
            torch.cuda.empty_cache()
        print(f"host memory after pass {rep}: {meminfo()}", flush=True)
    print("path                  GB/s (mean of the second pass)")
    for name in dict.fromkeys(r[0] for r in rows):
        last = [r for r in rows[len(rows) // 2:] if r[0] == name]
        print(f"{name:20s} {sum(r[2] for r in last) / sum(r[3] for r in last):6.2f}")


if __name__ == "__main__":
    main()
