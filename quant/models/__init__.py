"""Model knowledge lives only here: families, on-disk names, builtin models, layer materialization."""

from __future__ import annotations

from pathlib import Path

from quant.errors import ModelError
from quant.models.builtin import BUILTINS, DEFAULT_BUILTIN, builtin_path
from quant.models.source import ModelSource, ModuleInfo

__all__ = ["BUILTINS", "DEFAULT_BUILTIN", "ModuleInfo", "ModelSource", "resolve_model"]


def resolve_model(spec: str, trust_remote_code: bool = False, family: str | None = None) -> ModelSource:
    """``builtin:NAME`` or a local folder -> ModelSource. Hub ids are resolved to the local HF cache only.
    ``trust_remote_code`` (the recipe's ``model.trust_remote_code``) lets the folder's own Python run; ``family``
    (``model.family``) names the family a remote ``model_type`` follows."""
    kw = dict(display_name=spec, trust_remote_code=trust_remote_code, family=family)
    if spec.startswith("builtin:"):
        return ModelSource(builtin_path(spec.split(":", 1)[1]), **kw)
    path = Path(spec).expanduser()
    if path.exists():
        return ModelSource(path, **kw)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return ModelSource(_hub_snapshot(spec, trust_remote_code), **kw)
    raise ModelError(f"model path does not exist: {spec} (use a folder, a hub id, or builtin:NAME)")


def _hub_snapshot(repo_id: str, with_code: bool) -> Path:
    """Download (or find in the local cache) a hub model's safetensors and config (and its ``*.py`` remote code
    when ``with_code``); used on clusters."""
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.py"] if with_code else [])
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelError(f"model '{repo_id}' is not a local folder and could not be fetched from the hub: {e}") from None
