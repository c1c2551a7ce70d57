"""Model knowledge lives only here: families, canonical and on-disk names, builtin models, layer materialization."""

from __future__ import annotations

from pathlib import Path

from quant.errors import ModelError
from quant.models.builtin import BUILTINS, DEFAULT_BUILTIN, builtin_path
from quant.models.source import ModelSource, ModuleInfo, fp8_block_size, read_json_object, refuse_quantized

__all__ = ["BUILTINS", "DEFAULT_BUILTIN", "ModuleInfo", "ModelSource", "resolve_model"]


def resolve_model(spec: str, trust_remote_code: bool = False, family: str | None = None,
                  processes_per_node: int = 1) -> ModelSource:
    """``builtin:NAME`` or a local folder -> ModelSource. Hub ids are resolved to the local HF cache only.
    ``trust_remote_code`` (the recipe's ``model.trust_remote_code``) lets the folder's own Python run; ``family``
    (``model.family``) names the family a remote ``model_type`` follows. ``processes_per_node``: the job's
    processes on this host (a release read through a dequantizer stages its stored bytes in page-locked memory,
    a share of the host's)."""
    kw = dict(display_name=spec, trust_remote_code=trust_remote_code, family=family)
    if spec.startswith("builtin:"):
        path = builtin_path(spec.split(":", 1)[1])
    elif (path := Path(spec).expanduser()).exists():
        pass
    elif spec.count("/") == 1 and not spec.startswith((".", "/")):
        path = _hub_snapshot(spec, trust_remote_code)
    else:
        raise ModelError(f"model path does not exist: {spec} (use a folder, a hub id, or builtin:NAME)")
    config = path / "config.json"
    if config.is_file():  # else ModelSource says what is wrong with the folder
        config = read_json_object(config, "it must be the model's configuration")
        refuse_quantized(config, f"model {spec}")
        if fp8_block_size(config) is not None:
            from quant.models.fp8 import Fp8BlockSource

            return checked(Fp8BlockSource(path, processes_per_node=processes_per_node, **kw))
    return checked(ModelSource(path, **kw))


def checked(source: ModelSource) -> ModelSource:
    """``source`` once its tensors are those its config.json implies (``models.expected``)."""
    from quant.models.expected import check_model

    check_model(source)
    return source


def _hub_snapshot(repo_id: str, with_code: bool) -> Path:
    """Download (or find in the local cache) a hub model's safetensors and config (and its ``*.py`` remote code
    when ``with_code``); used on clusters. When the hub cannot be reached, the local cache alone, at once."""
    from quant.models.hub import cache_only_error, unreachable_reason

    offline = unreachable_reason()
    kw = {"local_files_only": True} if offline else {}
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        config = read_json_object(Path(hf_hub_download(repo_id, "config.json", **kw)), "it must be a JSON object")
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelError(cache_only_error(repo_id, offline) if offline else
                         f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
    refuse_quantized(config, f"model {repo_id}")  # before downloading its weights (700 GB for DeepSeek-V3's FP8)
    try:
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.py"] if with_code else [])
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kw))
    except Exception as e:  # noqa: BLE001
        raise ModelError(cache_only_error(repo_id, offline) if offline else
                         f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
