"""``vllm-fastload bench --model org/name``: a Hugging Face Hub id beside the same checkpoint given as
a directory (its cached snapshot), so a table shows what starting vLLM by id costs or saves.

With ``--stand-in-hub`` (machines without the Hub) the id is served by ``tools.hub.StandInHub`` on
loopback from a private cache under ``.fastload/hf-cache``, where the 1.67 GB ``bench-llama``
checkpoint is laid out under that id on first use; the runs are online (``HF_HUB_OFFLINE=0``,
``HF_ENDPOINT`` at the stand-in), as for most users. Without it the id must be in the user's own
cache, and the runs ask the real Hub as vLLM would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fastload.sources.hub import NotCachedError, cached_snapshot
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.hub import Revision, StandInHub, write_cache

#: The private cache the stand-in serves from.
STAND_IN_CACHE = Path(".fastload/hf-cache")


@dataclass(frozen=True)
class HubCheckpoint:
    """A Hub id, its cached snapshot (the directory rows read it) and the environment of every start."""

    repo_id: str
    snapshot: str
    env: dict[str, str] = field(default_factory=dict)
    served_by: str = "the Hugging Face Hub"


@contextmanager
def hub_checkpoint(repo_id: str, *, stand_in: bool) -> Iterator[HubCheckpoint]:
    """The id's snapshot, with the stand-in Hub running for as long as the context lasts (``stand_in``)."""
    if not stand_in:
        try:
            snapshot = cached_snapshot(repo_id)
        except NotCachedError as exc:
            raise SystemExit(f"--model {repo_id}: {exc}; download it first (huggingface-cli download {repo_id}), "
                             "or measure a private copy with --stand-in-hub") from None
        yield HubCheckpoint(repo_id, snapshot, {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")})
        return
    try:
        snapshot = cached_snapshot(repo_id, cache_dir=STAND_IN_CACHE)
    except NotCachedError:
        base = write_checkpoint(".fastload/bench-llama", "bench-llama", files=4)
        snapshot = str(write_cache(STAND_IN_CACHE, repo_id, Revision.of_directory(base)))
    with StandInHub(repo_id, [Revision.of_directory(snapshot)]) as hub:
        yield HubCheckpoint(repo_id, snapshot, hub.env(STAND_IN_CACHE.resolve()),
                            f"a stand-in Hub on loopback ({hub.url}; the real Hub cannot be reached here)")
