"""``quant publish``: upload a run's validated checkpoint to the Hugging Face hub.

Refused unless the run finished its eval stage with every gate passing and the checkpoint still matches the
SHA-256 manifest written at export (so what is uploaded is exactly what was evaluated). The hub client is
injectable (``api``) so tests upload to a local fake.
"""

from __future__ import annotations

import json
from pathlib import Path

from quant.errors import CheckpointError, PublishError, RunDirError
from quant.export.writer import verify_manifest


def publish_run(run_dir: Path, repo_id: str, *, private: bool = False, api=None) -> str:
    run_dir = Path(run_dir)
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise RunDirError(f"{run_dir} is not a quant run directory (no manifest.json)")
    m = json.loads(manifest_path.read_text())
    ev = m.get("stages", {}).get("eval", {})
    if ev.get("status") != "done":
        raise RunDirError(f"{run_dir}: the eval stage has not finished; run `quant run` first")
    if ev.get("passed") is not True:
        raise RunDirError(f"{run_dir}: quality gates failed ({'; '.join(ev.get('failed_gates', []))}); not publishing")
    ckpt = run_dir / "checkpoint"
    bad = verify_manifest(ckpt)
    if bad:
        raise CheckpointError(f"{ckpt} changed since export ({bad[0]}…); re-run `quant export` and `quant eval`")
    if "/" not in repo_id:
        raise RunDirError(f"--repo-id must look like ORG/NAME, got '{repo_id}'")
    if api is None:
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise PublishError("publishing needs huggingface_hub: pip install 'moe-quant[publish]'") from None
        api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(ckpt), commit_message=f"quant: {m['identity']['recipe']}")
    except Exception as e:  # noqa: BLE001 - network, auth, offline mode: one user-facing problem
        reason = (str(e).strip().splitlines() or [""])[0]
        raise PublishError(f"could not upload {ckpt} to hub repo '{repo_id}' ({type(e).__name__}: {reason}); check "
                           "the network, HF_TOKEN / `hf auth login`, and that HF_HUB_OFFLINE is unset") from None
    return f"https://huggingface.co/{repo_id}"
