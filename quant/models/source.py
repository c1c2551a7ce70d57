"""A model on disk: config, safetensors index, family, canonical module inventory and fingerprint.

Nothing here loads weights; shapes come from safetensors headers, so a 600 GB model is inspected in seconds.
Pickle checkpoints (``*.bin``, ``*.pt``) are refused: weights are read from safetensors only. A folder is checked
when it is opened: config.json a JSON object with a model type and layer count, the index readable, every shard
it names inside the folder and present with a readable header holding the tensors the index puts there; problems
are ModelErrors. Whether the tensors are the ones config.json implies is ``models.expected``'s check, which
``resolve_model`` runs on every folder it opens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quant.errors import ModelError
from quant.io.direct_read import read_into
from quant.io.storage import file_sha256
from quant.models.families import FAMILIES, FamilySpec, family_for, layer_key_prefix
from quant.models.names import expert_of, layer_of, module_kind

log = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt",
                   "tokenizer_config.json")
TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog. 0123456789"


@dataclass(frozen=True)
class ModuleInfo:
    """One quantizable 2-D weight. ``disk_prefix`` is its on-disk name without ``.weight``."""

    name: str
    disk_prefix: str
    kind: str
    layer: int | None
    expert: int | None
    out_features: int
    in_features: int

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


@contextmanager
def open_safetensors(path: Path, device: str = "cpu") -> Iterator:
    """``safe_open`` whose failures (truncated file, damaged header, missing tensor) are ModelErrors naming the file."""
    try:
        with safe_open(str(path), "pt", device=device) as f:
            yield f
    except FileNotFoundError:
        raise ModelError(f"{path.parent} lacks {path.name}, which its index names; re-download the model") from None
    except (SafetensorError, OSError) as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ModelError(f"{path} is not a readable safetensors file ({reason}); it is truncated or damaged: "
                         "re-download or re-save it") from None


def error_reason(e: BaseException) -> str:
    """A library exception's message as one short clause: its first two non-empty lines (transformers' config
    validation puts the field on the first and the problem on the second)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()][:2]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def read_json_object(path: Path, what: str, error: type[Exception] = ModelError) -> dict:
    """A JSON file holding an object, or ``error`` naming the file."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise error(f"{path} is not valid JSON ({str(e).splitlines()[0]}); {what}") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, not an object; {what}")
    return data


def check_shard_names(root: Path, names, what: str) -> None:
    """Every shard a model folder names lies inside it: a plain relative name (no absolute path, no ``..``) whose
    file, symlinks followed, is in the folder, or for a hub cache snapshot (``snapshots/<revision>/``) in its
    repository's ``blobs/``. Else an index (or a symlink) could make quant read, quantize and ship another
    folder's weights."""
    real_root = root.resolve()
    blobs = real_root.parent.parent / "blobs" if real_root.parent.name == "snapshots" else None
    for name in sorted(set(names)):
        rel = Path(name)
        bad = rel.is_absolute() or ".." in rel.parts or not rel.parts or "\x00" in name
        if not bad and (root / rel).exists():
            target = (root / rel).resolve()
            bad = not (target.is_relative_to(real_root) or (blobs is not None and target.is_relative_to(blobs)))
        if bad:
            raise ModelError(f"{what} names {name!r}, which is not a file inside {root}: a model's shards must lie "
                             "in its folder (no absolute paths, no '..', no symlinks out of it)")


def _read_index(path: Path) -> dict[str, str]:
    """Map every tensor key to its safetensors file name."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "re-download the model").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index} has no weight_map of tensor name -> file; re-download the model")
        check_shard_names(path, weight_map.values(), str(index))
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ModelError(f"{path} lacks {missing[0]}" + (f" and {len(missing) - 1} more shard(s)" if len(missing) > 1
                             else "") + ", which model.safetensors.index.json names; re-download the model")
        return dict(weight_map)
    single = path / "model.safetensors"
    if single.is_file():
        check_shard_names(path, [single.name], str(path))
        with open_safetensors(single) as f:
            return {k: single.name for k in f.keys()}
    pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise ModelError(
            f"{path} holds pickle weights ({pickles[0]}); quant reads safetensors only — convert with "
            "`transformers` (model.save_pretrained(dir, safe_serialization=True)) first"
        )
    raise ModelError(f"{path} has no model.safetensors or model.safetensors.index.json")


class ModelSource:
    """A local model folder (builtin models are materialized to one first).

    ``trust_remote_code``: let transformers run the folder's own Python (``auto_map`` in config.json) for the config
    and the model skeleton; required for a ``model_type`` transformers does not define. ``family``: which family
    (``FAMILIES``) such a remote ``model_type`` follows in its checkpoint names and routing; a ``model_type``
    transformers defines already names its family.
    """

    left_out: list[str] = []  # noqa: RUF012 - never mutated: keys of multi-token-prediction layers (prediction_layers)
    stored_quantized = False  # weights stored quantized and read dequantized (an FP8 release: quant.models.fp8)

    def __init__(self, path: Path, display_name: str | None = None, trust_remote_code: bool = False,
                 family: str | None = None):
        self.path = Path(path)
        self.display_name = display_name or str(path)
        self.trust_remote_code = trust_remote_code
        if not self.path.exists():
            raise ModelError(f"model path does not exist: {self.path}")
        if not (self.path / "config.json").is_file():
            raise ModelError(f"{self.path} is not a model folder (no config.json)")
        self.config_dict = read_json_object(self.path / "config.json", "it must be the model's configuration")
        model_type = self.config_dict.get("model_type", "?")
        if not isinstance(model_type, str):
            raise ModelError(f"{self.path / 'config.json'}: model_type must be a string, got {model_type!r}")
        self.family: FamilySpec = self._family(model_type, family)
        check_layer_count_type(self.config_dict, str(self.path / "config.json"))
        self.weight_map = _read_index(self.path)
        self._dtypes: dict[str, str] = {}
        self._headers = self._read_headers()
        self.left_out = prediction_layers(self.config_dict, self._headers, str(self.path))
        for key in self.left_out + never_read(self._headers):
            del self.weight_map[key], self._headers[key], self._dtypes[key]

    def _family(self, model_type: str, declared: str | None) -> FamilySpec:
        from transformers import CONFIG_MAPPING

        native = family_for(model_type)
        remote = model_type not in CONFIG_MAPPING and "auto_map" in self.config_dict
        if declared is not None and declared not in FAMILIES:
            raise ModelError(f"model.family '{declared}' is not one of {', '.join(FAMILIES)}")
        if native is not None and declared is not None and native.name != declared:
            raise ModelError(f"{self.path} is model_type '{model_type}' (family {native.name}); model.family "
                             f"'{declared}' contradicts it — leave model.family unset")
        family = native or (FAMILIES[declared] if declared is not None and remote else None)
        if remote and not self.trust_remote_code:
            raise ModelError(
                f"{self.path} (model_type '{model_type}') is defined by its own Python code (config.json auto_map); "
                "set model.trust_remote_code: true to run it"
            )
        if family is None:
            kind = "a dense model" if not _looks_moe(self.config_dict) else "an MoE family quant does not support"
            hint = ("; if its checkpoint names and routing follow one of these, set model.family to it"
                    if remote and _looks_moe(self.config_dict) else "")
            raise ModelError(
                f"{self.path} is {kind} (model_type '{model_type}'); quant quantizes Mixture-of-Experts models: "
                f"{', '.join(FAMILIES)}{hint}"
            )
        return family

    @cached_property
    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - config.json's values reach arbitrary transformers code: bad input
            raise ModelError(f"transformers cannot read {self.path / 'config.json'}: {error_reason(e)}") from None

    def hf_config(self):
        """transformers' config object (``config``), or None where none can be made without the model's own code
        from the hub (``models.headers``)."""
        return self.config

    def tokenizer(self):
        """The model's own tokenizer (its Python too, with ``trust_remote_code``); one that turns text into no
        tokens (transformers builds an empty one for a folder without tokenizer files) is a ModelError."""
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except (ValueError, TypeError, KeyError, OSError) as e:
            reason = (str(e).strip().splitlines() or [""])[0]
            raise ModelError(f"cannot load the tokenizer of {self.path}: {reason}") from None
        if not tok(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
            found = [f for f in TOKENIZER_FILES if (self.path / f).is_file()]
            what = (f"its tokenizer files ({', '.join(found)}) hold no vocabulary" if found else
                    f"the folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
            raise ModelError(f"the tokenizer of {self.path} turns text into no tokens: {what}; copy the tokenizer "
                             "files from the model's release into the folder")
        return tok

    def tokenizer_digest(self) -> str:
        """sha256 over the tokenizer files present (names and bytes): what ``tokenizer()`` reads, which the
        fingerprint (weights and config) leaves out."""
        h = hashlib.sha256()
        for name in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES):
            if (self.path / name).is_file():
                h.update(name.encode() + b"\0" + file_sha256(self.path / name).encode())
        return h.hexdigest()[:16]

    def token_rows(self) -> int:
        """How many token ids the model has rows for: its embedding's rows, at most config.json's vocab_size."""
        rows = self.shapes().get("model.embed_tokens.weight", (None,))[0]
        vocab = self.config_dict.get("vocab_size")
        sizes = [n for n in (rows, vocab) if isinstance(n, int) and not isinstance(n, bool)]
        return min(sizes) if sizes else 0

    def check_token_ids(self, tokens: torch.Tensor, what: str) -> None:
        """A ModelError when ``tokens`` hold an id the model has no row for (a tokenizer of another model, or with
        tokens added after the embedding was sized), instead of an index error deep in a forward."""
        rows = self.token_rows()
        top = int(tokens.max()) if tokens.numel() else -1
        if rows and top >= rows:
            n = int((tokens >= rows).sum())
            raise ModelError(f"the tokenizer of {self.path} gives token id {top} ({n} token(s) of {what} at or above "
                             f"{rows}), but the model has {rows} token embeddings (config.json vocab_size "
                             f"{self.config_dict.get('vocab_size')}); use the tokenizer files that belong to this model")

    def read_tensors(self, keys: list[str], device="cpu", into: Callable[[int], torch.Tensor | None] | None = None
                     ) -> dict:
        """Named tensors from the safetensors shards on ``device``, or into ``into``'s buffer (``read_safetensors``)."""
        return read_safetensors(self.path, self.weight_map, keys, device, into)

    def _read_headers(self) -> dict[str, tuple[int, ...]]:
        """Shape (and, into ``_dtypes``, dtype) of every tensor from the shard headers, checking each header and that
        it holds what the index says."""
        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.weight_map.values())):
            with open_safetensors(self.path / file) as f:
                for key in f.keys():
                    header = f.get_slice(key)
                    out[key] = tuple(header.get_shape())
                    self._dtypes[key] = header.get_dtype()
        absent = sorted(k for k, f in self.weight_map.items() if k not in out)
        if absent:
            raise ModelError(f"{self.path}: {absent[0]} is not in {self.weight_map[absent[0]]}, where the index puts "
                             "it; re-download the model")
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor, from safetensors headers."""
        return dict(self._headers)

    def dtypes(self) -> dict[str, str]:
        """Dtype of every tensor as safetensors names it (``BF16``, ``F32``), from safetensors headers."""
        return dict(self._dtypes)

    @cached_property
    def modules(self) -> dict[str, ModuleInfo]:
        """Every quantizable 2-D weight by canonical name, in checkpoint order (layers ascending)."""
        found: dict[str, ModuleInfo] = {}
        for key, shape in self.shapes().items():
            if len(shape) != 2 or not key.endswith(".weight"):
                if len(shape) == 3 and ".experts." in key:
                    raise ModelError(f"{self.path}: fused on-disk expert tensor {key} is not supported yet")
                continue
            name = self.family.canonical(key)
            if name is None:
                continue
            found[name] = ModuleInfo(
                name, key.removesuffix(".weight"), module_kind(name), layer_of(name), expert_of(name), shape[0], shape[1]
            )
        if not any(m.kind == "expert" for m in found.values()):
            raise ModelError(f"{self.path} has no routed-expert weights; is it a dense model?")
        return dict(sorted(found.items(), key=lambda kv: _order(kv[1])))

    @property
    def n_layers(self) -> int:
        return int(self.config_dict["num_hidden_layers"])

    def layer_keys(self, layer: int) -> list[str]:
        """On-disk tensor names of decoder layer ``layer``, in the weight map's order."""
        prefix = layer_key_prefix(layer)
        return [k for k in self.weight_map if k.startswith(prefix)]

    def moe_layers(self) -> list[int]:
        return sorted({m.layer for m in self.modules.values() if m.kind == "expert"})

    def n_experts(self, layer: int) -> int:
        return 1 + max(m.expert for m in self.modules.values() if m.kind == "expert" and m.layer == layer)

    @property
    def top_k(self) -> int:
        cfg = self.config_dict
        return int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 1)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over config.json, the model's own Python when ``trust_remote_code`` (it defines the forward) and
        the full SHA-256 of every shard.

        Exact: damage anywhere in a shard changes it. Each shard is read whole once and its digest cached by stat
        (``storage.file_sha256``: device, inode, size, mtime, ctime), shards in parallel; afterwards a fingerprint
        costs a stat per shard, and a copied folder keeps its fingerprint (content, not location).
        """
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for code in remote_code_files(self.path) if self.trust_remote_code else []:  # it defines the forward
            h.update(code.name.encode() + code.read_bytes())
        files = sorted(set(self.weight_map.values()))
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:  # hashlib releases the GIL
            digests = list(pool.map(lambda f: file_sha256(self.path / f), files))
        for file, digest in zip(files, digests, strict=True):
            h.update(f"{file}:{digest}".encode())
        return h.hexdigest()[:16]


# buffers old transformers versions saved beside the weights (rotary inverse frequencies); transformers computes
# them and never reads them from a checkpoint, so neither does quant, nor does it ship them
_NEVER_READ = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def never_read(keys) -> list[str]:
    """Stored tensors that are not weights of the model (``_NEVER_READ``): left out when a folder is opened."""
    return [k for k in keys if _NEVER_READ.search(k)]


def check_layer_count_type(config: dict, where: str) -> None:
    layers = config.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ModelError(f"{where}: num_hidden_layers must be a positive integer, got {layers!r}")


def layer_of_key(key: str) -> int | None:
    """The decoder layer an on-disk tensor name belongs to (``model.layers.<i>.…``), None for other tensors."""
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else None


def prediction_layers(config: dict, keys, where: str) -> list[str]:
    """Keys of decoder layers past ``num_hidden_layers`` that config.json declares as multi-token-prediction layers
    (``num_nextn_predict_layers``: DeepSeek-V3/R1 store layer 61, GLM-4.5 layer 92). quant leaves them out of the
    model, as transformers does when it loads one: they are not part of the forward, and the quantized checkpoint
    does not carry them (serving it with MTP speculative decoding needs a draft model). Tensors of other layers
    past the config's count are a ModelError: the config does not describe these weights."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return []
    extra: dict[int, list[str]] = {}
    for key in keys:
        layer = layer_of_key(key) if key.startswith("model.layers.") else None
        if layer is not None and layer >= n and key.count(".") > 2:
            extra.setdefault(layer, []).append(key)
    if not extra:
        return []
    declared = config.get("num_nextn_predict_layers")
    declared = declared if isinstance(declared, int) and not isinstance(declared, bool) else 0
    stray = sorted(i for i in extra if i >= n + declared)
    if stray:
        raise ModelError(f"{where}: the weights hold decoder layer {stray[0]} ({extra[stray[0]][0]}) but config.json "
                         f"has num_hidden_layers {n}" + (f" and num_nextn_predict_layers {declared}" if declared else "")
                         + ": the config does not describe these weights; re-download the model")
    log.info("%s: multi-token-prediction layer(s) %s (num_nextn_predict_layers %d) left out: not part of the "
             "forward, not in the quantized checkpoint", where, ", ".join(map(str, sorted(extra))), declared)
    return sorted(k for ks in extra.values() for k in ks)


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """``(rows, cols)`` of the scale blocks when config.json declares FP8 weights with block scales (DeepSeek-V3/R1,
    Kimi-K2, Qwen3 FP8 releases: ``quant_method: fp8``, ``weight_block_size``), else None."""
    q = config.get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) and q.get("quant_method") == "fp8" else None
    if isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block):
        return block[0], block[1]
    return None


def fp8_dense_dtype(config: dict) -> torch.dtype:
    """The dtype an FP8 release's weights are read as: config.json's ``torch_dtype`` (or ``dtype``) when it names a
    16- or 32-bit float, else bf16 (DeepSeek-V3's)."""
    name = config.get("torch_dtype") or config.get("dtype")
    return getattr(torch, name) if name in ("bfloat16", "float16", "float32") else torch.bfloat16


def refuse_quantized(config: dict, where: str) -> None:
    """A model whose config carries a ``quantization_config`` quant cannot read as weights (GPTQ, AWQ,
    compressed-tensors, bitsandbytes, FP8 without block scales) is one clear ModelError: reading packed tensors as
    weights would fail later on names it does not know, or give garbage. FP8 with block scales is read dequantized
    (``quant.models.fp8``)."""
    qcfg = config.get("quantization_config")
    if qcfg is not None and not isinstance(qcfg, dict):
        raise ModelError(f"{where}: config.json's quantization_config is a JSON {type(qcfg).__name__}, not an "
                         "object; an unquantized model has none (remove it)")
    if qcfg is None or fp8_block_size(config) is not None:
        return
    method = qcfg.get("quant_method", "unknown")
    raise ModelError(f"{where} is already quantized (quantization_config.quant_method '{method}'); quant needs the "
                     "model's unquantized weights (bf16, fp16 or fp32) or an FP8 release with block scales: point "
                     "model.path at that release")


def read_safetensors(root: Path, weight_map: dict[str, str], keys: list[str], device="cpu",
                     into: Callable[[int], torch.Tensor | None] | None = None) -> dict:
    """``keys`` from the shards of ``root`` that ``weight_map`` (key -> file) names, one open per shard, on
    ``device``. ``into``: ``n_bytes`` -> a CPU ``uint8`` buffer (or None to decline) that the tensors are read into,
    by parallel preads, as its views (``direct_read``; ``device`` is then ignored; a dtype the direct reader does
    not know falls back to safe_open too)."""
    if into is not None:
        tensors = read_into(root, weight_map, keys, into, threads=min(8, os.cpu_count() or 1))
        if tensors is not None:
            return tensors
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(weight_map[key], []).append(key)
    out = {}
    for file, file_keys in by_file.items():
        with open_safetensors(root / file, str(device)) as f:
            for key in file_keys:
                out[key] = f.get_tensor(key)
    return out


def remote_code_files(path: Path) -> list[Path]:
    """``*.py`` files in ``path`` that config.json's or tokenizer_config.json's ``auto_map`` names (entries like
    ``modeling_x.Cls``; ``repo--module.Cls`` entries pointing at another repository are not local and skipped)."""
    names: set[str] = set()
    for cfg in ("config.json", "tokenizer_config.json"):
        f = path / cfg
        auto_map = read_json_object(f, "it must be a JSON object").get("auto_map", {}) if f.is_file() else {}
        for ref in auto_map.values() if isinstance(auto_map, dict) else []:
            for r in ref if isinstance(ref, list) else [ref]:
                if isinstance(r, str) and "--" not in r and "." in r:
                    names.add(r.rsplit(".", 1)[0] + ".py")
    return sorted(path / n for n in names if (path / n).is_file())


def _order(m: ModuleInfo) -> tuple:
    return (-1 if m.name == "embed" else (10**9 if m.layer is None else m.layer), m.expert or -1, m.name)


def _looks_moe(cfg: dict) -> bool:
    return any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"))
