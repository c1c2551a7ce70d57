"""Model knowledge lives only here: families, on-disk names, builtin models, layer materialization."""

from __future__ import annotations

from pathlib import Path

from quant.errors import ModelError
from quant.models.builtin import BUILTINS, DEFAULT_BUILTIN, builtin_path
from quant.models.source import ModelSource, ModuleInfo, read_json_object, refuse_quantized

__all__ = ["BUILTINS", "DEFAULT_BUILTIN", "ModuleInfo", "ModelSource", "resolve_model"]


def resolve_model(spec: str, trust_remote_code: bool = False, family: str | None = None) -> ModelSource:
    """``builtin:NAME`` or a local folder -> ModelSource. Hub ids are resolved to the local HF cache only.
    ``trust_remote_code`` (the recipe's ``model.trust_remote_code``) lets the folder's own Python run; ``family``
    (``model.family``) names the family a remote ``model_type`` follows."""
    kw = dict(display_name=spec, trust_remote_code=trust_remote_code, family=family)
    if spec.startswith("builtin:"):
        source = ModelSource(builtin_path(spec.split(":", 1)[1]), **kw)
    elif (path := Path(spec).expanduser()).exists():
        source = ModelSource(path, **kw)
    elif spec.count("/") == 1 and not spec.startswith((".", "/")):
        source = ModelSource(_hub_snapshot(spec, trust_remote_code), **kw)
    else:
        raise ModelError(f"model path does not exist: {spec} (use a folder, a hub id, or builtin:NAME)")
    refuse_quantized(source.config_dict, f"model {spec}")
    return source


def _hub_snapshot(repo_id: str, with_code: bool) -> Path:
    """Download (or find in the local cache) a hub model's safetensors and config (and its ``*.py`` remote code
    when ``with_code``); used on clusters."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        config = read_json_object(Path(hf_hub_download(repo_id, "config.json")), "it must be a JSON object")
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelError(f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
    refuse_quantized(config, f"model {repo_id}")  # before downloading its weights (700 GB for DeepSeek-V3's FP8)
    try:
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.py"] if with_code else [])
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
