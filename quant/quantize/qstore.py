"""The quantize stage's artifact: integer codes, scales and zero points per module, one safetensors file a layer.

Keys are canonical names: ``layers.3.experts.17.up.q`` (codes ``[out, in]``), ``.scale`` (``[out, G]``, model
dtype), ``.zero`` (int8, asymmetric only). The file's metadata holds each module's bits / group size. Codes of up
to 4 bits (with an even ``in``) are stored two a byte, ``uint8 [out, in / 2]``: ``code - qmin`` in the low nibble
for even columns, the high nibble for odd ones (half the disk and write time of a W4 layer: 5.6 instead of
11.3 GB per DeepSeek-V3 layer); wider codes, and files of earlier versions, hold one int8 code a byte. Readers
return int8 ``[out, in]`` either way. Files are written to a temporary name and renamed, so a file that exists is
complete; beside each, ``<file>.sha256`` records the SHA-256 of what was written, so a stored layer is reused (a
resumed quantize) only while its bytes are still those (``stored_layer_problem``).
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant.algos.grid import QuantizedWeight
from quant.io.rundir import atomic_write_text
from quant.io.storage import file_sha256
from quant.scheme import Scheme


def layer_file(root: Path, layer: int | None) -> Path:
    return root / ("layer_head.safetensors" if layer is None else f"layer_{layer:05d}.safetensors")


def digest_file(path: Path) -> Path:
    """Where the SHA-256 of layer file ``path`` is recorded when it is written."""
    return path.with_name(path.name + ".sha256")


def stored_layer_problem(path: Path) -> str | None:
    """Why layer file ``path`` must not be reused, or None when its bytes are the ones recorded at writing (digests
    cached by stat: an unchanged file is not re-read, a changed one always is)."""
    if not path.is_file():
        return "missing"
    try:
        recorded = digest_file(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return "without a recorded digest (written by a killed process or an older quant)"
    try:
        if file_sha256(path) != recorded:
            return "damaged (its SHA-256 differs from the one recorded when it was written)"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


def remove_layer(path: Path) -> None:
    """Delete a stored layer file and its recorded digest."""
    path.unlink(missing_ok=True)
    digest_file(path).unlink(missing_ok=True)


PARAM_PREFIX = "__param__."


def packs(spec: Scheme, n_in: int) -> bool:
    """Whether the store keeps this module's codes two a byte."""
    return spec.bits <= 4 and n_in % 2 == 0


def pack_codes(q: torch.Tensor, spec: Scheme) -> torch.Tensor:
    """int8 codes ``[..., in]`` (``in`` even) -> ``uint8 [..., in / 2]``, on ``q``'s device."""
    u = (q - spec.qmin).view(torch.uint8)  # codes of <= 4 bits: -qmin <= 8, no int8 overflow
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_codes(p: torch.Tensor, spec: Scheme) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int8 ``[..., 2 * p.shape[-1]]``."""
    u = torch.stack((p & 15, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    return u.view(torch.int8) + spec.qmin


def packed_words(qw: QuantizedWeight) -> torch.Tensor | None:
    """Codes as :func:`read_layer` ``(packed=True)`` may return them, at 4 bits and ``in`` a multiple of 8: the
    store's bytes read as int32 words ``[out, in / 8]``, eight ``code - qmin`` nibbles a word, the first in the lowest
    bits (compressed-tensors' ``weight_packed``, GPTQ's ``qweight`` transposed). None for any other codes."""
    q = qw.q
    if q.dtype == torch.uint8 and qw.spec.bits == 4 and q.shape[1] % 4 == 0:
        return q.contiguous().view(torch.int32)
    return None


def codes_numel(qw: QuantizedWeight) -> int:
    """Number of codes (weights) of ``qw``, whether its codes are packed two a byte or not."""
    return qw.q.numel() * (2 if qw.q.dtype == torch.uint8 else 1)


def with_codes(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with int8 codes ``[out, in]``, unpacking codes the store kept two a byte."""
    return QuantizedWeight(unpack_codes(qw.q, qw.spec), qw.scale, qw.zero, qw.spec) if qw.q.dtype == torch.uint8 else qw


def stored_tensors(weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """The store's tensors of 2-D modules (``q [out, in]``), on their devices (codes packed where :func:`packs`)."""
    tensors = {}
    for name, qw in weights.items():
        assert qw.q.ndim == 2, f"{name}: store one module per entry, got {tuple(qw.q.shape)}"
        packable = qw.q.dtype == torch.int8 and packs(qw.spec, qw.q.shape[1])  # uint8: packed already
        tensors[f"{name}.q"] = pack_codes(qw.q, qw.spec) if packable else qw.q.contiguous()
        tensors[f"{name}.scale"] = qw.scale.contiguous()
        if qw.zero is not None:
            tensors[f"{name}.zero"] = qw.zero.contiguous()
    return tensors


def write_layer(path: Path, weights: dict[str, QuantizedWeight], params: dict[str, torch.Tensor] | None = None,
                report: dict | None = None, tensors: dict[str, torch.Tensor] | None = None,
                specs: dict[str, Scheme] | None = None) -> None:
    """Write 2-D quantized modules (``q [out, in]``) atomically, plus ``params``: kept tensors the algorithm
    changed (AWQ folds 1/s into norms and routers), by the layer's in-memory parameter name, and ``report``: the
    layer's quantization report (errors, fallbacks, times), so a resumed run reports what was measured.
    ``tensors`` and ``specs``: ``stored_tensors(weights)`` already made (on the host, e.g. packed on a GPU) and the
    modules' specs, in place of ``weights``."""
    tensors = {k: v.cpu() for k, v in (stored_tensors(weights) if tensors is None else tensors).items()}
    tensors |= {PARAM_PREFIX + k: v.detach().contiguous().cpu() for k, v in (params or {}).items()}
    specs = {name: qw.spec for name, qw in weights.items()} if specs is None else specs
    meta = {name: [spec.bits, spec.group_size, spec.symmetric] for name, spec in specs.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # one metadata key: safetensors keeps metadata in a hash map, so several keys come out in varying order and the
    # same layer would not always be the same bytes
    save_file(tensors, str(tmp), metadata={"quant": json.dumps({"modules": meta, "report": report or {}})})
    digest_file(path).unlink(missing_ok=True)  # never an old digest beside a new file
    os.replace(tmp, path)
    atomic_write_text(digest_file(path), file_sha256(path) + "\n")  # read back from the page cache, then cached


def read_layer(path: Path, device: str | torch.device = "cpu", names=None,
               packed: bool = False) -> dict[str, QuantizedWeight]:
    """Inverse of ``write_layer``: 2-D QuantizedWeights (``q [out, in]``, ``scale [out, G]``); only ``names``
    (a collection of module names) when given. ``packed``: codes stored two a byte stay so (``uint8 [out, in / 2]``,
    :func:`pack_codes`' layout) for a reader that takes them as they are (the compressed-tensors writer)."""
    out = {}
    with safe_open(str(path), "pt", device=str(device)) as f:
        meta = _header(f)["modules"]
        for name, (bits, group, sym) in meta.items():
            if names is not None and name not in names:
                continue
            zero = f.get_tensor(f"{name}.zero") if not sym else None
            spec = Scheme(bits, group, sym)
            q = f.get_tensor(f"{name}.q")
            out[name] = QuantizedWeight(unpack_codes(q, spec) if q.dtype == torch.uint8 and not packed else q,
                                        f.get_tensor(f"{name}.scale"), zero, spec)
    return out


def read_layout(path: Path) -> dict[str, tuple[Scheme, tuple]]:
    """Per stored module, from the file's header alone (no tensor is read): its spec and the ``(shape, dtype)`` of
    its codes (as :func:`read_layer` returns them: int8 ``[out, in]``, also when stored packed), scale and zero point
    (None when symmetric), dtypes as safetensors names them (``I8``, ``BF16``)."""
    out = {}
    with safe_open(str(path), "pt") as f:
        for name, (bits, group, sym) in _header(f)["modules"].items():
            parts = []
            for part in ("q", "scale", "zero"):
                if part == "zero" and sym:
                    parts.append(None)
                    continue
                s = f.get_slice(f"{name}.{part}")
                shape, dtype = tuple(s.get_shape()), s.get_dtype()
                if part == "q" and dtype == "U8":  # packed: report the codes readers return
                    shape, dtype = (shape[0], 2 * shape[1]), "I8"
                parts.append((shape, dtype))
            out[name] = (Scheme(bits, group, sym), tuple(parts))
    return out


def read_report(path: Path) -> dict:
    """The layer report stored by ``write_layer`` (empty for a file written without one)."""
    with safe_open(str(path), "pt") as f:
        return _header(f)["report"]


def _header(f) -> dict:
    """``{"modules": ..., "report": ...}`` of an open layer file (also from files of the two-key layout)."""
    m = f.metadata() or {}
    if "quant" in m:
        return json.loads(m["quant"])
    return {"modules": json.loads(m["modules"]), "report": json.loads(m.get("report") or "{}")}


def dequantize_2d(qw: QuantizedWeight) -> torch.Tensor:
    """``[out, in]`` dequantized weight of a stored module (in the scale's dtype; codes packed or not)."""
    qw = with_codes(qw)
    return QuantizedWeight(qw.q[None], qw.scale[None], None if qw.zero is None else qw.zero[None],
                           qw.spec).dequantize()[0]


def read_params(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The changed kept parameters stored with a layer (in-memory names), possibly empty."""
    with safe_open(str(path), "pt", device=str(device)) as f:
        return {k[len(PARAM_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(PARAM_PREFIX)}


def load_into_layer(source, layer, idx: int, path: Path, device: str | torch.device = "cpu"):
    """Write a stored layer's dequantized weights and changed kept parameters into decoder layer ``idx`` (a
    materialized layer, or ``model.model.layers[idx]`` of a full transformers model). Returns (stored, params)."""
    from quant.models.layers import layer_weights

    stored, params = read_layer(path, device), read_params(path, device)
    weights = layer_weights(source, layer, idx)
    for name, qw in stored.items():
        weights[name].copy_(dequantize_2d(qw))
    state = dict(layer.named_parameters())
    for name, t in params.items():
        state[name].data.copy_(t)
    return stored, params


class LayerWriter:
    """Layer files written by a background thread while the next layer computes (``background``: on a GPU), else at
    once; one file in flight, ``wait`` re-raises a failed write. The thread packs the codes and copies them to host
    memory on its own CUDA stream (after the compute stream has produced them), holding them on the GPU until the
    copy is done (not through the disk write), so neither the copy nor the disk write sits on the compute path."""

    def __init__(self, background: bool):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="quant-write") if background else None
        self.pending: Future | None = None

    def submit(self, path: Path, results: dict[str, QuantizedWeight], params: dict[str, torch.Tensor],
               report: dict | None = None) -> None:
        self.wait()
        if self.pool is None:
            write_layer(path, results, params, report)
            return
        ready = torch.cuda.Event() if torch.cuda.is_available() else None
        if ready is not None:
            ready.record()
        self.pending = self.pool.submit(self._copy_and_write, path, dict(results), dict(params), ready, report)

    @staticmethod
    def _copy_and_write(path: Path, results: dict[str, QuantizedWeight], params: dict[str, torch.Tensor],
                        ready, report: dict | None = None) -> None:
        stream = torch.cuda.Stream() if ready is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_event(ready)
            host = {}  # packed where the codes are, one module at a time (the packed layer is not held on the GPU)
            for name in results:
                host |= {k: v.cpu() for k, v in stored_tensors({name: results[name]}).items()}
            host_params = {k: v.cpu() for k, v in params.items()}
        specs = {name: qw.spec for name, qw in results.items()}
        results.clear()  # the codes on the GPU (7 GB for a DeepSeek-V3 layer) go before the disk write, not after it
        params.clear()
        write_layer(path, {}, host_params, report, tensors=host, specs=specs)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
