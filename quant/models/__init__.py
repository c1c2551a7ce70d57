"""Model knowledge lives only here: families, on-disk names, builtin models, layer materialization."""

from __future__ import annotations

from pathlib import Path

from quant.errors import ModelError
from quant.models.builtin import BUILTINS, DEFAULT_BUILTIN, builtin_path
from quant.models.source import ModelSource, ModuleInfo

__all__ = ["BUILTINS", "DEFAULT_BUILTIN", "ModuleInfo", "ModelSource", "resolve_model"]


def resolve_model(spec: str) -> ModelSource:
    """``builtin:NAME`` or a local folder -> ModelSource. Hub ids are resolved to the local HF cache only."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        return ModelSource(builtin_path(name), display_name=spec)
    path = Path(spec).expanduser()
    if path.exists():
        return ModelSource(path, display_name=spec)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return ModelSource(_hub_snapshot(spec), display_name=spec)
    raise ModelError(f"model path does not exist: {spec} (use a folder, a hub id, or builtin:NAME)")


def _hub_snapshot(repo_id: str) -> Path:
    """Download (or find in the local cache) a hub model's safetensors and config; used on clusters."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelError(f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
