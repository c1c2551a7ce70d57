"""``quant publish``: upload a run's validated checkpoint to the Hugging Face hub.

Refused unless the run finished its eval stage with every gate passing, the checkpoint is the one that eval
read (the export digest eval recorded), it carries its model card, and every file still matches the SHA-256
manifest (written at export, the card added by the card stage): what is uploaded is exactly what was
evaluated and described. Published means servable: the folder uploaded is the first export format some runtime on
its card serves (the GPTQ folder of a per-expert plan for GPTQModel, say), or ``--format``'s; a run whose
checkpoints no runtime serves is refused with what to run instead. The hub client is injectable (``api``) so tests upload to a local fake.
"""

from __future__ import annotations

import json
from pathlib import Path

from quant.errors import CheckpointError, MissingDependency, PublishError, RunDirError
from quant.export.writer import CARD, checkpoint_digest, read_manifest, verify_manifest
from quant.io.rundir import MANIFEST, manifest_problem, refuse_links

RERUN = "re-run the `quant run` command that made this run directory (it redoes export and eval as needed)"


def _run_manifest(run_dir: Path) -> dict:
    manifest_path = run_dir / MANIFEST
    if not manifest_path.is_file():
        raise RunDirError(f"{run_dir} is not a quant run directory (no {MANIFEST})")
    refuse_links(run_dir)  # the rule every command applies: an upload follows no link out of the run directory
    try:
        m = json.loads(manifest_path.read_bytes())
    except OSError as e:
        raise RunDirError(f"{manifest_path} is unreadable ({e.strerror or e}); {RERUN}") from None
    except ValueError:  # not JSON, or not UTF-8 text
        raise RunDirError(f"{manifest_path} is not JSON; {RERUN}") from None
    problem = manifest_problem(m) or (None if isinstance(m.get("stages"), dict) else "it records no stages")
    if problem is not None:
        raise RunDirError(f"{manifest_path} is not a quant run manifest ({problem}); {RERUN}")
    return m


SERVABLE = ("run recipes/mixed_vllm.yaml (one scheme per MoE layer: vLLM and SGLang), set plan.target_runtime: "
            "vllm-quant (quant's vLLM plugin serves per-expert bits), or add gptq to export.formats (GPTQModel)")


def servable_folder(run_dir: Path, stages: dict, fmt: str | None = None) -> tuple[str, list[str]]:
    """The checkpoint folder to publish and the runtimes that serve it: ``fmt``'s folder, or the first folder (in
    export order) that some runtime on its card serves. A checkpoint nothing serves is not published."""
    served = stages.get("export", {}).get("served_by")
    if not isinstance(served, dict) or not served:
        raise RunDirError(f"{run_dir}: the export stage records no serving runtimes (made by an older quant); {RERUN}")
    if fmt is not None:
        folder = "checkpoint" if fmt == (stages["export"].get("formats") or [None])[0] else f"checkpoint-{fmt}"
        if folder not in served:
            raise RunDirError(f"{run_dir} has no {fmt} checkpoint (exported: {', '.join(served)})")
        if not served[folder]:
            raise PublishError(f"no runtime serves {run_dir / folder}; {SERVABLE}")
        return folder, served[folder]
    for folder, runtimes in served.items():
        if runtimes:
            return folder, runtimes
    raise PublishError(f"no runtime serves the checkpoints of {run_dir} ({', '.join(served)}); {SERVABLE}")


def check_publishable(run_dir: Path, fmt: str | None = None) -> Path:
    """The run's checkpoint folder to publish, after every check above; raises a QuantError naming the first
    failure."""
    m = _run_manifest(run_dir)
    stages = m["stages"]
    ev = stages.get("eval", {})
    if ev.get("status") != "done":
        raise RunDirError(f"{run_dir}: the eval stage has not finished; run `quant run` first")
    if ev.get("passed") is not True:
        raise RunDirError(f"{run_dir}: quality gates failed ({'; '.join(ev.get('failed_gates', []))}); not publishing")
    folder, _ = servable_folder(run_dir, stages, fmt)
    export = stages.get("export", {})
    evaluated = (ev.get("upstream") or {}).get("export", {}) or {}
    for name in dict.fromkeys(("checkpoint", folder)):  # the evaluated checkpoint, and the one to upload
        ckpt = run_dir / name
        bad = verify_manifest(ckpt) if ckpt.is_dir() else [f"{name}/"]
        if bad:
            raise CheckpointError(f"{ckpt} changed since export ({bad[0]}{'…' if len(bad) > 1 else ''}); {RERUN}")
        exported = export.get("outputs", {}).get(name)
        # the export the eval stage read wrote both folders: its digest of checkpoint/ is still the export's
        if export.get("status") != "done" or checkpoint_digest(ckpt) != exported \
                or evaluated.get("checkpoint") != export.get("outputs", {}).get("checkpoint"):
            raise CheckpointError(f"{ckpt} is not the checkpoint the eval stage evaluated; {RERUN}")
        if CARD not in read_manifest(ckpt)["files"]:
            raise CheckpointError(f"{ckpt} has no model card ({CARD}, written by the card stage); {RERUN}")
    return run_dir / folder


def hub_api():
    """The hub client (``huggingface_hub.HfApi``); MissingDependency naming the pip command when it is not
    installed, raised before any check reads the checkpoint."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise MissingDependency("publishing needs huggingface_hub, which is not installed: "
                           "pip install 'moe-quant[publish]'") from None
    return HfApi()


def publish_run(run_dir: Path, repo_id: str, *, private: bool = False, api=None, fmt: str | None = None) -> str:
    run_dir = Path(run_dir)
    api = hub_api() if api is None else api
    ckpt = check_publishable(run_dir, fmt)
    if "/" not in repo_id:
        raise RunDirError(f"--repo-id must look like ORG/NAME, got '{repo_id}'")
    m = _run_manifest(run_dir)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(ckpt), commit_message=f"quant: {m.get('identity', {}).get('recipe')}")
    except Exception as e:  # noqa: BLE001 - network, auth, offline mode: one user-facing problem
        reason = (str(e).strip().splitlines() or [""])[0]
        raise PublishError(f"could not upload {ckpt} to hub repo '{repo_id}' ({type(e).__name__}: {reason}); check "
                           "the network, HF_TOKEN / `hf auth login`, and that HF_HUB_OFFLINE is unset") from None
    return f"https://huggingface.co/{repo_id}"
