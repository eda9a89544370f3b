"""Whether and what to read early, from what the engine's start says, and the start of it.

The process that parses the engine's arguments knows the checkpoint long before any rank loads,
but not the model, so not the per-rank plan: it reads every file of a local checkpoint into the
page cache (the node's ranks share it), in a process of its own (``early.process``) and on CPU time
nothing else wants, where the checkpoint fits in half of the memory free under the lowest memory
limit (``policy.early_reads_memory``: the machine's, and every cgroup's over the process)
(``early_reads``: by default on local filesystems). Where one model spans several nodes, each node
reads only its share: the byte ranges its ranks hold (``early.node_share``), from the layout the
adapter reads off the engine's configuration. The rank's load then finds the pages cached and copies
them out. The reads stop when the first rank's load begins (it reads what is missing itself), and
the files stay mapped in the reading process until every rank of this node has loaded (each leaves
marks, ``early.marks``) or ``policy.EARLY_READS_HOLD_S`` has passed. A failure here is logged, never
raised; a checkpoint file found cut short or unreadable is an error line naming it, at once.

Engine-independent: each adapter calls ``start`` where its engine has its configuration (vLLM:
``vllm_plugin.early``; SGLang: ``sglang_plugin``) and loads each rank within ``marks.loading()``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllm_fastload import machine, policy
from vllm_fastload.early.marks import MARKS_ENV, LoadMarks
from vllm_fastload.early.node_share import NodeLayout, NodeShare
from vllm_fastload.errors import CheckpointError, HeaderError, TruncatedFileError
from vllm_fastload.frozen import FrozenMap

logger = logging.getLogger("vllm_fastload")

#: Set in the environment of the process that started early reads, so that the processes it
#: starts (the engine's workers, which may verify the config again) do not read twice.
STARTED_ENV = "_FASTLOAD_EARLY_READS"


@dataclass(frozen=True)
class EarlyStart:
    """What early reads need to know of an engine's start, read from its configuration."""

    #: The model: a directory, a Hugging Face id, or an object URI (never read early).
    path: str
    #: fastload's options as the engine received them (``--model-loader-extra-config``).
    extra: Mapping[str, Any]
    #: The ranks that will load it on this node.
    local_ranks: int
    #: The engine's revision and download directory, for a Hugging Face id (see ``files_to_read``).
    revision: str | None = None
    download_dir: str | None = None
    #: The nodes one model spans, and what this node's ranks hold where that is several (None:
    #: one node, or a layout the adapter could not read).
    nodes: int = 1
    layout: NodeLayout | None = None
    #: Whether the engine's start-up leaves idle CPU time for the reads (SGLang's keeps every core
    #: busy until the load): where not, the reading process leaves idle priority once it has waited
    #: ``policy.EARLY_READS_STARVED_S`` for a CPU, if the start's processes kept the CPUs busy
    #: (``policy.starved_reads``, ``early.child``).
    idle_cpu: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", FrozenMap(self.extra))


#: What finding the checkpoint's files may raise about one file's own bytes (cut short, a header
#: that is not safetensors): a rank whose load reads that file will stop with the same error, so it
#: is an error line at once, not one among the reasons for reading nothing early. Not raised: which
#: files the load reads is the model's to say (vLLM's ``allow_patterns_overrides`` may leave a
#: damaged file of the directory unread), and the model is not known yet.
UNREADABLE: tuple[type[CheckpointError], ...] = (HeaderError, TruncatedFileError)


def start(engine: str, settings: Callable[[], EarlyStart]) -> None:
    """Read the checkpoint of the start that ``settings()`` describes into the page cache, once per
    path in a process tree (``engine`` names the engine in the log lines). Best effort: a failure,
    reading the engine's configuration included, is logged, never raised; a checkpoint file that
    cannot be read (``UNREADABLE``) as an error naming it."""
    from vllm_fastload.sources.hub import NotCachedError  # (huggingface_hub only where asked)

    try:
        _start(settings(), engine)
    except NotCachedError as exc:
        logger.info("fastload: no early reads: %s; %s downloads it and fastload reads it at load time", exc, engine)
    except UNREADABLE as exc:
        logger.error("fastload: early reads: a checkpoint file cannot be read (%s: %s); nothing is read early, "
                     "and a rank whose load reads that file will stop with this error", type(exc).__name__, exc)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        logger.info("fastload: no early reads (%s: %s)", type(exc).__name__, exc)


def _start(start: EarlyStart, engine: str) -> None:
    from vllm_fastload.early.process import start_reading

    path, local_ranks = start.path, start.local_ranks
    if os.environ.get(STARTED_ENV) == path or _is_rank() or local_ranks < 1:
        return  # decided already, a rank itself, or no rank loads on this node (a front end without engines)
    # Decided once per model in a process tree, whatever the outcome: the processes the engine starts
    # from here may verify its configuration again, by then perhaps while the load is under way.
    os.environ[STARTED_ENV] = path
    files = files_to_read(path, start.extra, revision=start.revision, download_dir=start.download_dir)
    if not files:
        return
    total = sum(os.path.getsize(f) for f in files)
    scope = policy.early_scope(nodes=start.nodes, layout_known=start.layout is not None)
    policy.DecisionLog().note("early reads scope", scope, nodes=start.nodes)
    layout = _with_replicas(start.layout, start.extra, files) if start.layout else None
    share = node_share_of(files, layout) if scope is policy.EarlyScope.NODE and layout else None
    wanted = total if share is None else share.read
    memory = policy.early_reads_memory(wanted, machine.memory_limits())
    policy.DecisionLog().note("early reads memory", memory.fits, size=wanted, allowed=memory.allowed,
                              limit=memory.limit)
    if not memory.fits:
        logger.info("fastload: no early reads: %s (%.2f GB) exceeds the %.2f GB early reads may fill "
                    "(%.0f%% of the free memory under the lowest limit: %s); it is read at load time",
                    "the checkpoint" if share is None else "this node's share of the checkpoint", wanted / 1e9,
                    memory.allowed / 1e9, 100 * policy.EARLY_READS_MEMORY_SHARE, memory.limit.describe())
        return
    quota = machine.cpu_quota()
    pacing = policy.early_reads_pacing(quota)
    policy.DecisionLog().note("early reads pacing", pacing.group is not None,
                              quota=None if quota is None else quota.describe())
    LoadMarks.remove_stale()  # a start killed before it could remove its own
    marks = LoadMarks(local_ranks)  # removed when the reads end, or at this process's exit
    os.environ[MARKS_ENV] = marks.directory
    reads = None
    try:
        reads = start_reading(files if share is None else share.ranges, limit=memory.allowed, hold=marks,
                              hold_s=policy.EARLY_READS_HOLD_S,
                              starved_s=None if start.idle_cpu else policy.EARLY_READS_STARVED_S,
                              pacing=pacing)
    finally:
        if reads is None:
            marks.remove()
            os.environ.pop(MARKS_ENV, None)
    if reads is None:
        return
    source = "" if os.path.isdir(path) else f" of {path} (its cached snapshot {_snapshot_of(files[0])})"
    limit = f"the lowest memory limit: {memory.limit.describe()}"
    if quota is not None:
        limit += f"; pausing whenever the {quota.describe()} holds the start back"
    if share is None:
        every = "" if scope is policy.EarlyScope.EVERY_FILE else f"; {scope.value}"
        logger.info("fastload: early reads: %d checkpoint files (%.2f GB)%s into the page cache while %s starts%s "
                    "(%s)", len(files), total / 1e9, source, engine, every, limit)
        return
    assert layout is not None
    logger.info("fastload: early reads: %d checkpoint files (%.2f of %.2f GB: %.3f of the checkpoint, %.3f of its "
                "layers; %s)%s into the page cache while %s starts (%s)", len(files), share.read / 1e9, total / 1e9,
                share.read / max(total, 1), share.layer_share, layout.describe(), source, engine, limit)


def _with_replicas(layout: NodeLayout, extra: Mapping[str, Any], files: list[str]) -> NodeLayout:
    """``layout``, its data-parallel ranks reading what they hold alike in blocks where the
    loads will (``policy.replica_sharing`` on these files, as ``model.rank`` decides it)."""
    from vllm_fastload.config import FastloadConfig

    if max((r.dp_size for r in layout.ranks), default=1) < 2:
        return layout
    config = FastloadConfig.for_engine(extra)
    network = any(machine.is_network(machine.filesystem_type(f)) for f in files)
    offer = policy.replica_sharing(mode=config.dp_exchange, planned=config.plan_per_rank, remote=False,
                                   network=network)
    return replace(layout, alike_in_blocks=offer.offered)


def node_share_of(files: list[str], layout: NodeLayout) -> NodeShare:
    """The ranges of the checkpoint ``files`` that ``layout``'s node reads early (``node_share``),
    from the files' headers."""
    from vllm_fastload.checkpoint import Checkpoint
    from vllm_fastload.early.node_share import node_share

    ckpt = Checkpoint.discover(files)
    try:
        headers = {name: sf.header.data_offset for name, sf in ckpt.files.items()}
        return node_share(ckpt.tensors, headers, layout, gap=policy.EARLY_READS_GAP)
    finally:
        ckpt.close()


def files_to_read(path: str, extra: Mapping[str, Any], *, revision: str | None = None,
                  download_dir: str | None = None) -> list[str]:
    """The checkpoint files to read early for a model at ``path`` loaded with fastload's ``extra``
    config (the environment's ``FASTLOAD_*`` under it); none where ``policy.early_reads`` says not to.

    A Hugging Face id (``org/name``) is its snapshot at ``revision`` in the local cache (or
    ``download_dir``), resolved without the network as the engine's download step will resolve it;
    ``NotCachedError`` where the cache lacks it. Where the Hub has a newer revision, vLLM's config
    step has already fetched its ``config.json`` and moved the cache's ref to it, so its snapshot
    lacks the weights: no early reads, and the load reads that revision once it is downloaded.
    Early reads only warm the page cache; the load reads whatever the download step hands it."""
    facts = _EarlyFacts(path, extra, revision, download_dir)
    decision = policy.early_reads(facts)
    policy.DecisionLog().note("early reads", decision, path=path, **facts.known())
    return facts.files if decision is policy.EarlyReads.READ else []


class _EarlyFacts:
    """What ``policy.early_reads`` may ask of a model path; the setting is parsed, and the
    checkpoint's files found, only when asked."""

    def __init__(self, path: str, extra: Mapping[str, Any], revision: str | None, download_dir: str | None) -> None:
        from vllm_fastload.sources import hub, is_remote

        self._path, self._extra, self._revision, self._download_dir = path, extra, revision, download_dir
        self.remote = is_remote(path)
        self.directory = not self.remote and os.path.isdir(path)
        self.hub_id = not self.remote and not self.directory and hub.is_repo_id(path)
        self._known: dict[str, object] = {}

    @property
    def mode(self) -> policy.Mode:
        from vllm_fastload.config import FastloadConfig

        mode = FastloadConfig.for_engine(self._extra).early_reads
        self._known["mode"] = mode
        return mode

    @property
    def filesystems(self) -> Iterator[policy.Filesystem]:
        for file in self.files:
            kind = machine.filesystem_type(file)
            self._known["filesystem"] = kind
            yield policy.Filesystem(kind, network=machine.is_network(kind))

    @functools.cached_property
    def files(self) -> list[str]:
        """The checkpoint's files, sorted."""
        from vllm_fastload.checkpoint import Checkpoint
        from vllm_fastload.errors import MissingFileError
        from vllm_fastload.sources import hub

        if self.directory:
            ckpt = Checkpoint.discover(self._path)
        else:
            snapshot = hub.cached_snapshot(self._path, revision=self._revision, cache_dir=self._download_dir)
            try:
                ckpt = Checkpoint.discover(snapshot)
            except MissingFileError as exc:  # e.g. vLLM fetched a newer revision's config.json, not its weights yet
                raise hub.NotCachedError(f"the cached snapshot of {self._path} at revision "
                                         f"{self._revision or 'main'} lacks weight files ({exc.reason})") from None
        files = sorted(ckpt.files)
        ckpt.close()
        return files

    def known(self) -> dict[str, object]:
        """What was learnt (for the decision's log line)."""
        return {"remote": self.remote, "directory": self.directory, "hub_id": self.hub_id, **self._known}


def _snapshot_of(file: str) -> str:
    """The commit a file of a Hugging Face cache snapshot belongs to (``snapshots/<commit>/...``), shortened."""
    parts = file.split(os.sep)[:-1]
    if "snapshots" not in parts:
        return os.path.dirname(file)
    return parts[len(parts) - parts[::-1].index("snapshots")][:12]


def _is_rank() -> bool:
    """Whether this process already is a rank of a distributed group (``vllm-fastload verify``'s
    rank processes build each config right before loading it): its load is next, there is no
    start-up to overlap with, and no other process would leave the marks the hold waits for."""
    torch = sys.modules.get("torch")
    distributed = getattr(torch, "distributed", None)
    return bool(distributed is not None and distributed.is_available() and distributed.is_initialized())
