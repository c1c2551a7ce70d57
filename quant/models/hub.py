"""Whether the Hugging Face hub can be reached, answered in seconds.

huggingface_hub retries a failed connection five times with backoff (25-30 s, a warning per retry) before it falls
back to its local cache; quant asks once, with a short connect, and then either calls the hub or reads the local
cache only (``local_files_only``), so a hub id without network is one line at once, or the cached copy.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0


def unreachable_reason(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the hub endpoint accepts a TCP connection within ``timeout_s`` (or huggingface_hub is in offline
    mode, where it reads the cache itself without retries), else why not. The name lookup runs in a thread, so
    a resolver that never answers costs ``timeout_s`` too."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    answer: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"{host}:{port}: {e.strerror or e}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else f"{host}:{port}: no answer within {timeout_s:g} s"


def cache_only_error(repo_id: str, reason: str) -> str:
    return (f"model '{repo_id}' is not a local folder, the hub cannot be reached ({reason}) and the local hub cache "
            f"does not hold it: download it where there is network (hf download {repo_id}), or point model.path at "
            "a local folder")
