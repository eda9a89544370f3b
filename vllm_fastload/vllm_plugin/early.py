"""Early reads: start reading the checkpoint while vLLM starts, not when a worker asks for it.

A vLLM start spends tens of seconds (imports, processes, distributed set-up, the model's
construction) before any worker calls ``load_weights``; meanwhile the disk sits idle. The process
that builds vLLM's config knows the checkpoint long before that, but not the model, so not the
per-rank plan: it asks the kernel to read every file of a local checkpoint into the page cache (the
node's ranks share it), in a process of its own and on CPU time nothing else wants, where the checkpoint
fits in half of the memory available (``early_reads``: by default on local filesystems).
``load_weights`` then finds the pages cached and copies them out. The reads stop when the first
rank's load begins (it reads what is missing itself), and the files stay mapped in the reading
process until every rank of this node has loaded (each leaves marks, see ``load_begins`` and
``load_ends``) or ``HOLD_S`` has passed, so that a host reclaiming idle page cache does not take
them first; then the reading process unmaps them and ends (it also ends with the process that
started it). A failure here is logged, never raised.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger("vllm.fastload")

#: The share of the memory available at start-up that early reads may fill with page cache.
MEMORY_SHARE = 0.5
#: Set in the environment of the process that started early reads, so that the processes it
#: starts (vLLM's engine core and workers, which verify the config again) do not read twice.
STARTED_ENV = "_FASTLOAD_EARLY_READS"
#: Also inherited: the directory in which each rank's load leaves its marks as it begins and ends.
MARKS_ENV = "_FASTLOAD_EARLY_READS_MARKS"
#: The longest the files stay mapped after they were read, if not every rank leaves its mark
#: (a start that failed, ranks on other nodes).
HOLD_S = 600.0


def start(vllm_config: Any) -> None:
    """Read the checkpoint of ``vllm_config`` into the page cache, once per path in a process tree."""
    from vllm_fastload.sources.hub import NotCachedError

    try:
        _start(vllm_config)
    except NotCachedError as exc:
        logger.info("fastload: no early reads: %s; vLLM downloads it and fastload reads it at load time", exc)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        logger.info("fastload: no early reads (%s: %s)", type(exc).__name__, exc)


def _start(vllm_config: Any) -> None:
    from vllm_fastload.sources.readahead import LoadMarks, available_memory, read_ahead

    model_config = vllm_config.model_config
    path = getattr(model_config, "model_weights", "") or model_config.model
    if os.environ.get(STARTED_ENV) == path or _is_rank():
        return
    ranks = _local_ranks(vllm_config)
    if not ranks:
        return  # no rank loads on this node (an API server without engines of its own)
    # Decided once per model in a process tree, whatever the outcome: the processes vLLM starts from
    # here verify the config again, by then perhaps while the load is under way or over.
    os.environ[STARTED_ENV] = path
    load_config = vllm_config.load_config
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    files = files_to_read(path, extra, revision=getattr(model_config, "revision", None),
                          download_dir=getattr(load_config, "download_dir", None))
    if not files:
        return
    marks = LoadMarks(ranks)  # removed when the reads end, or at this process's exit
    os.environ[MARKS_ENV] = marks.directory
    reads = None
    try:
        reads = read_ahead(files, limit=int(available_memory() * MEMORY_SHARE), hold=marks, hold_s=HOLD_S)
    finally:
        if reads is None:
            marks.remove()
            os.environ.pop(MARKS_ENV, None)
    if reads is not None:
        source = "" if os.path.isdir(path) else f" of {path} (its cached snapshot {_snapshot_of(files[0])})"
        logger.info("fastload: early reads: %d checkpoint files (%.2f GB)%s into the page cache while vLLM starts",
                    len(files), sum(os.path.getsize(f) for f in files) / 1e9, source)


def files_to_read(path: str, extra: dict[str, Any], *, revision: str | None = None,
                  download_dir: str | None = None) -> list[str]:
    """The checkpoint files to read early for a model at ``path`` loaded with fastload's ``extra``
    config (the environment's ``FASTLOAD_*`` under it); none where early reads are off, and with
    'auto' none on a network filesystem.

    A Hugging Face id (``org/name``) is its snapshot at ``revision`` in the local cache (or
    ``download_dir``), resolved without the network as vLLM's download step will resolve it;
    ``NotCachedError`` where the cache lacks it. Where the Hub has a newer revision, vLLM's config
    step has already fetched its ``config.json`` and moved the cache's ref to it, so its snapshot
    lacks the weights: no early reads, and the load reads that revision once vLLM has downloaded
    it. Early reads only warm the page cache; the load reads whatever the download step hands it."""
    from vllm_fastload.checkpoint import Checkpoint
    from vllm_fastload.config import FastloadConfig
    from vllm_fastload.errors import MissingFileError
    from vllm_fastload.sources import fstype, hub, is_remote

    if is_remote(path):
        return []  # an object store: nothing on this node's disks to read ahead
    if not os.path.isdir(path) and not hub.is_repo_id(path):
        return []
    mode = FastloadConfig.from_env(**extra).early_reads
    if mode == "never":
        return []
    if os.path.isdir(path):
        ckpt = Checkpoint.discover(path)
    else:
        snapshot = hub.cached_snapshot(path, revision=revision, cache_dir=download_dir)
        try:
            ckpt = Checkpoint.discover(snapshot)
        except MissingFileError as exc:  # e.g. vLLM fetched a newer revision's config.json, not its weights yet
            raise hub.NotCachedError(f"the cached snapshot of {path} at revision {revision or 'main'} lacks "
                                     f"weight files ({exc.reason})") from None
    files = sorted(ckpt.files)
    ckpt.close()
    if mode == "auto" and not all(_local(fstype.filesystem_type(f)) for f in files):
        return []
    return files


def _snapshot_of(file: str) -> str:
    """The commit a file of a Hugging Face cache snapshot belongs to (``snapshots/<commit>/...``), shortened."""
    parts = file.split(os.sep)[:-1]
    if "snapshots" not in parts:
        return os.path.dirname(file)
    return parts[len(parts) - parts[::-1].index("snapshots")][:12]


def _local(filesystem: str) -> bool:
    """Whether ``auto`` reads early on this filesystem type: not on network filesystems, nor on
    FUSE mounts (most of them fetch from a network or an object store)."""
    from vllm_fastload.sources import fstype

    return not fstype.is_network(filesystem) and not filesystem.startswith("fuse")


def load_begins() -> None:
    """Called by the loader as this rank's load begins: early reads stop reading (the load reads
    the rest itself) and hold what they read."""
    _mark(ended=False)


def load_ends() -> None:
    """Called by the loader when this rank's load ends (done or failed): the early reads it was
    started for need not stay mapped for it any longer."""
    _mark(ended=True)


def _mark(*, ended: bool) -> None:
    directory = os.environ.get(MARKS_ENV)
    if directory:
        from vllm_fastload.sources.readahead import mark_load

        mark_load(directory, ended=ended)


def _is_rank() -> bool:
    """Whether this process already is a rank of a distributed group (``vllm-fastload verify``'s
    rank processes build each config right before loading it): its load is next, there is no
    start-up to overlap with, and no other process would leave the marks the hold waits for."""
    torch = sys.modules.get("torch")
    distributed = getattr(torch, "distributed", None)
    return bool(distributed is not None and distributed.is_available() and distributed.is_initialized())


def _local_ranks(vllm_config: Any) -> int:
    """How many ranks load on this node (each leaves its marks): the node's share of the
    tensor- and pipeline-parallel group, for each data-parallel engine the node runs."""
    parallel = vllm_config.parallel_config
    ranks = getattr(parallel, "local_world_size", None)
    if ranks is None:  # vLLM before 0.32
        ranks = max(int(parallel.world_size) // max(int(getattr(parallel, "nnodes", 1) or 1), 1), 1)
    engines = getattr(parallel, "data_parallel_size_local", 1)
    return int(ranks) * int(1 if engines is None else engines)
