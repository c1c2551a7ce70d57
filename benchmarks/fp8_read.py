"""Where an FP8 release's layer read goes, on one GPU: a DeepSeek-V3 layer (random weights, quant.models.synthetic)
and its FP8 release with 128 x 128 block scales; twice each, the bf16 read and the FP8 read as the read-ahead reads (into a
page-locked staging buffer, FP8 dequantized on the GPU), then the FP8 read's phases one by one: the stored bytes
read into the source's page-locked buffer, their upload, the block dequantization, the copy into the staging
buffer. Needs a CUDA GPU and ~40 GB free in --workdir.

  python benchmarks/fp8_read.py --workdir /tmp/q8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from quant.io.staging import Staging, pin_budget
from quant.models import ModelSource, resolve_model
from quant.models.fp8 import write_fp8_release
from quant.models.source import read_safetensors
from quant.models.synthetic import build_model


def timed(name: str, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(name, round(time.perf_counter() - t0, 2), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/q8")
    a = ap.parse_args()
    model, release = Path(a.workdir) / "m", Path(a.workdir) / "f"
    build_model("deepseek-v3", 1, model, 0)
    write_fp8_release(ModelSource(model), release, device="cuda")
    src = resolve_model(str(release))
    keys = sorted(src.layer_keys(0))
    bf16, staging, bf16_staging = ModelSource(model), Staging(pin_budget(1)), Staging(pin_budget(1))
    for i in range(2):
        timed(f"bf16 read {i}", lambda: bf16.read_tensors(keys, "cpu", into=bf16_staging.into(0)))
    for i in range(2):
        timed(f"fp8 read {i}", lambda: src.read_tensors(keys, "cpu", into=staging.into(0)))
    raw = timed("raw read", lambda: read_safetensors(src.path, src.raw_map, src.stored_names(keys), "cpu",
                                                     into=src.stored_staging.into(0)))
    work = torch.device("cuda", 0)
    up = timed("upload", lambda: {k: v.to(work, non_blocking=True) for k, v in raw.items()})
    dense = timed("dequant", lambda: src.dequantize(up, keys))
    out = src.dense_views(raw, keys, staging.into(0))
    timed("d2h", lambda: [out[k].copy_(t, non_blocking=True) for k, t in dense.items()])
    print("chunks", len(src.chunks(raw, keys)), "keys", len(keys))


if __name__ == "__main__":
    main()
