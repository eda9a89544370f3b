"""``vllm-fastload bench --model org/name``: a Hugging Face Hub id beside the same checkpoint given as
a directory (its cached snapshot), so a table shows what starting vLLM by id costs or saves.

With ``--stand-in-hub`` (machines without the Hub) the id is served by the tests' stand-in Hub
(``tests/hub.py``) on loopback from a private cache under ``.fastload/hf-cache``, where the 1.67 GB
``bench-llama`` checkpoint is laid out under that id on first use; the runs are online
(``HF_HUB_OFFLINE=0``, ``HF_ENDPOINT`` at the stand-in), as for most users. The stand-in is a test
helper and not in the wheel, so that option runs from a source checkout only. Without it the id
must be in the user's own cache, and the runs ask the real Hub as vLLM would.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType

from vllm_fastload.sources.hub import NotCachedError, cached_snapshot
from vllm_fastload.tools.checkpoints import write_checkpoint

#: The private cache the stand-in serves from.
STAND_IN_CACHE = Path(".fastload/hf-cache")


@dataclass(frozen=True)
class HubCheckpoint:
    """A Hub id, its cached snapshot (the directory rows read it) and the environment of every start."""

    repo_id: str
    snapshot: str
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
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
        offline = os.environ.get("HF_HUB_OFFLINE", "0")
        yield HubCheckpoint(repo_id, snapshot, MappingProxyType({"HF_HUB_OFFLINE": offline}))
        return
    helper = stand_in_hub()
    try:
        snapshot = cached_snapshot(repo_id, cache_dir=STAND_IN_CACHE)
    except NotCachedError:
        base = write_checkpoint(".fastload/bench-llama", "bench-llama", files=4)
        snapshot = str(helper.write_cache(STAND_IN_CACHE, repo_id, helper.Revision.of_directory(base)))
    with helper.StandInHub(repo_id, [helper.Revision.of_directory(snapshot)]) as hub:
        yield HubCheckpoint(repo_id, snapshot, MappingProxyType(hub.env(STAND_IN_CACHE.resolve())),
                            f"a stand-in Hub on loopback ({hub.url}; the real Hub cannot be reached here)")


#: The source checkout this package would run from: the folder above it.
CHECKOUT = Path(__file__).resolve().parents[2]
#: Where that checkout keeps the stand-in Hub.
STAND_IN_HUB = CHECKOUT / "tests" / "hub.py"


def stand_in_hub() -> ModuleType:
    """The stand-in Hub of the source checkout this package runs from (``tests/hub.py``, loaded by
    its path: another ``tests`` package may be importable); the command ends, saying why, where
    there is none (an installed wheel)."""
    if not (STAND_IN_HUB.is_file() and (CHECKOUT / "pyproject.toml").is_file()):
        raise SystemExit(f"--stand-in-hub needs a source checkout of vllm-fastload (its tests/hub.py; there is none "
                         f"at {STAND_IN_HUB}): without it, measure a Hub id that is in your own Hugging Face cache")
    name = "vllm_fastload_stand_in_hub"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, STAND_IN_HUB)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]
