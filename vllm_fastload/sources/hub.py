"""Hugging Face Hub ids (``org/name``), resolved from the local cache alone.

An engine started with a Hub id downloads its weights in the process that loads them, long after
start-up began; until then the id names nothing on this node. Where an earlier start or a
pre-pull left the snapshot in the Hugging Face cache, that snapshot is what the download step
will hand the loader (unless the Hub moved the revision on since), so early reads can start on
it right away. Nothing here touches the network: ``huggingface_hub`` is asked with
``local_files_only``, and it resolves a branch or tag through the cache's ``refs/``.
"""

from __future__ import annotations

import os
import re

#: The weight files the loaders download (the index, where the repository has one, names the shards).
PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class NotCachedError(LookupError):
    """The Hub id's snapshot for the requested revision is not (completely) in the local cache."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id rather than a local path (which it is not)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not os.path.exists(name)


def cached_snapshot(repo_id: str, *, revision: str | None = None,
                    cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: the default branch) in the
    Hugging Face cache at ``cache_dir`` (default: ``HF_HUB_CACHE``), without a network request.

    Raises ``NotCachedError`` saying why where the cache cannot answer (no such repository or
    revision cached, a snapshot the cache's own listing shows incomplete, no ``huggingface_hub``).
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise NotCachedError(f"huggingface_hub is not installed ({exc})") from None
    try:
        cache = None if cache_dir is None else os.fspath(cache_dir)
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=PATTERNS,
                                 local_files_only=True)
    except Exception as exc:  # huggingface_hub's errors differ between releases; each one means "not here"
        where = cache_dir or "the default cache (HF_HUB_CACHE)"
        raise NotCachedError(f"no complete snapshot of {repo_id} at revision {revision or 'main'} in {where} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
