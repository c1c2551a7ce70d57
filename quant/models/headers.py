"""A model known by its config and tensor shapes only: what ``quant estimate`` reads before any job runs.

Local folders (and builtins): ``config.json`` and the safetensors headers, parsed directly (8-byte length, then a
JSON table of name -> dtype, shape, offsets), so no weight is read and a header-only file serves as well. Hub ids:
``config.json`` alone through ``hf_hub_download`` and every shard's header through huggingface_hub's
``get_safetensors_metadata`` (HTTP range requests): nothing else is downloaded, so a 671 B model is sized in
seconds on a login node. When the hub cannot be reached (``models.hub``), a copy in the local hub cache is read as a
folder, or the id is one error at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quant.errors import ModelError
from quant.io.direct_read import DTYPE_NAMES, TORCH_DTYPES, header_table
from quant.models.expected import check_model
from quant.models.source import (
    ModelSource,
    check_layer_count_type,
    check_shard_names,
    error_reason,
    fp8_block_size,
    fp8_dense_dtype,
    never_read,
    prediction_layers,
    read_json_object,
    refuse_quantized,
)

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header (the data section is never touched)."""
    _, header = header_table(path)
    try:
        return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    except (AttributeError, KeyError, TypeError):
        raise ModelError(f"{path}: malformed safetensors header; is the file corrupt?") from None


class HeaderSource(ModelSource):
    """A ModelSource whose tensors are a shape table: module inventory, family and shapes, never weights."""

    def __init__(self, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]], display_name: str,
                 trust_remote_code: bool = False, family: str | None = None, path: Path | None = None,
                 stored_quantized: bool = False):
        self.stored_quantized = stored_quantized
        self.path = path or Path(display_name)
        self.display_name = display_name
        self.trust_remote_code = trust_remote_code
        self.config_dict = config
        model_type = config.get("model_type", "?")
        if not isinstance(model_type, str):
            raise ModelError(f"{display_name}: config.json's model_type must be a string, got {model_type!r}")
        self.family = self._family(model_type, family)
        check_layer_count_type(config, f"{display_name}: config.json")
        self.left_out = prediction_layers(config, tensors, display_name)
        left_out = set(self.left_out + never_read(tensors))
        self.tensors = {k: v for k, v in tensors.items() if k not in left_out}
        self.weight_map = {k: "(header)" for k in self.tensors}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: shape for k, (_, shape) in self.tensors.items()}

    def dtypes(self) -> dict[str, str]:
        return {k: dtype for k, (dtype, _) in self.tensors.items()}

    def hf_config(self):
        """From the folder's config.json when there is one, else from the hub's config.json for a model_type
        transformers defines (None for remote code: its Python is not fetched for an estimate)."""
        if (self.path / "config.json").is_file():
            return self.config
        from transformers import CONFIG_MAPPING

        model_type = self.config_dict.get("model_type")
        if model_type not in CONFIG_MAPPING:
            return None
        try:
            return CONFIG_MAPPING[model_type].from_dict(dict(self.config_dict))
        except Exception as e:  # noqa: BLE001 - config.json's values reach arbitrary transformers code: bad input
            raise ModelError(f"transformers cannot read the config.json of {self.display_name}: {error_reason(e)}"
                             ) from None

    def read_tensors(self, keys, device="cpu", into=None):
        raise ModelError(f"{self.display_name}: only tensor shapes are known here (quant estimate), not weights")


def _local(path: Path) -> tuple[dict, dict]:
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model folder (no config.json)")
    index = path / "model.safetensors.index.json"
    weight_map = read_json_object(index, "re-download the model").get("weight_map") if index.is_file() else None
    if index.is_file() and not isinstance(weight_map, dict):
        raise ModelError(f"{index} has no weight_map of tensor name -> file; re-download the model")
    files = sorted(set(map(str, weight_map.values()))) if weight_map else sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} has no safetensors files (quant reads safetensors only)")
    check_shard_names(path, files, str(index) if weight_map else str(path))
    tensors: dict = {}
    for name in files:
        tensors.update(read_safetensors_header(path / name))
    return read_json_object(path / "config.json", "it must be the model's configuration"), tensors


def _hub(repo_id: str, hub) -> tuple[dict, dict, Path | None]:
    """(config, tensors, None) from the hub's metadata; when the hub cannot be reached, a copy in the local hub
    cache is read as a folder (its path third), at once."""
    from quant.models.hub import cache_only_error, unreachable_reason

    offline = unreachable_reason()
    if offline:
        try:
            path = Path(hub.snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"], local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached, in whatever way huggingface_hub says it
            raise ModelError(cache_only_error(repo_id, offline)) from None
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ModelError(cache_only_error(repo_id, offline))
        return *_local(path), path
    try:
        config = read_json_object(Path(hub.hf_hub_download(repo_id, "config.json")), "it must be the model's "
                                  "configuration")
        meta = hub.get_safetensors_metadata(repo_id)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelError(f"model '{repo_id}' is not a local folder and its config/safetensors headers could not be "
                         f"read from the hub: {e}") from None
    tensors = {name: (info.dtype, tuple(info.shape)) for f in meta.files_metadata.values()
               for name, info in f.tensors.items()}
    return config, tensors, None


def load_headers(spec: str, trust_remote_code: bool = False, family: str | None = None, hub=None) -> HeaderSource:
    """``builtin:NAME``, a local folder or a hub id -> HeaderSource (config and shapes only). ``hub``: the module
    providing ``hf_hub_download`` and ``get_safetensors_metadata`` (default: huggingface_hub)."""
    from quant.models.builtin import builtin_path

    if spec.startswith("builtin:"):
        path = builtin_path(spec.split(":", 1)[1])
        config, tensors = _local(path)
    elif (path := Path(spec).expanduser()).exists():
        config, tensors = _local(path)
    elif spec.count("/") == 1 and not spec.startswith((".", "/")):
        if hub is None:
            import huggingface_hub as hub
        config, tensors, path = _hub(spec, hub)
    else:
        raise ModelError(f"model path does not exist: {spec} (use a folder, a hub id, or builtin:NAME)")
    refuse_quantized(config, f"model {spec}")
    scales = set()
    if fp8_block_size(config) is not None:  # read dequantized (quant.models.fp8): the weights as the dense model's
        scales = {k for k in tensors if k.endswith("_scale_inv") and k.removesuffix("_scale_inv") in tensors}
        dense = DTYPE_NAMES[fp8_dense_dtype(config)]
        tensors = {k: (dense if k + "_scale_inv" in scales else dtype, shape) for k, (dtype, shape) in tensors.items()
                   if k not in scales}
    source = HeaderSource(config, tensors, spec, trust_remote_code, family, path, stored_quantized=bool(scales))
    check_model(source)
    return source


@dataclass(frozen=True)
class Dims:
    """Model facts a memory forecast needs, from config.json."""

    hidden: int
    n_layers: int
    heads: int
    qk_head_dim: int
    v_head_dim: int
    top_k: int
    vocab: int


def dims(config: dict) -> Dims:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if "qk_nope_head_dim" in config:  # MLA (DeepSeek-V3): queries/keys carry a rope part, values do not
        qk, v = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"]), int(config["v_head_dim"])
    else:
        qk = v = int(config.get("head_dim") or hidden // heads)
    top_k = int(config.get("num_experts_per_tok") or config.get("moe_topk") or 1)
    return Dims(hidden, int(config["num_hidden_layers"]), heads, qk, v, top_k, int(config["vocab_size"]))
