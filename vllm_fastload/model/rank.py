"""Load one rank's weights into a model: learn its writes, plan its reads, read, replay.

1. Probe: run the model's own ``load_weights`` on placeholders to learn, for this rank, which
   region of which checkpoint tensor goes where (see ``probe``).
2. Plan: whole tensors and narrows are read straight into the parameters, other writes from
   slabs replayed afterwards, tensors no write takes are not read (see ``reads``).
3. Read: one aggregated pass in layer order through the core reader, firing layer events; at
   TP>1 on object stores the ranks share row reads (see ``exchange``).
If the probe cannot describe the model's loading, every tensor is read in full and handed to
``model.load_weights`` for real, the way the engines' default loaders do it.

Engine-independent: it needs the model's ``load_weights`` (or the engine's wrapper of it) and, for
the row exchange, the collectives of the tensor-parallel group. The vLLM and SGLang loaders
(``vllm_plugin.loader``, ``sglang_plugin.loader``) wrap it; tests drive it directly with the
engines' own layers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from vllm_fastload import (
    CheckpointError,
    ConfigFacts,
    Countdown,
    FastCheckpoint,
    FastloadConfig,
    LayerGroup,
    LoadReport,
    LoadStats,
    Plan,
    ReadHooks,
    TensorInfo,
    TensorRequest,
    policy,
)
from vllm_fastload.model import coverage, exchange
from vllm_fastload.model.probe import LoadWeights, Placement, ProbeResult, own_load_weights, probe_model
from vllm_fastload.model.reads import RankReads, plan_reads
from vllm_fastload.tensors import dtype_of, shape_of

# The core's logger: the adapters show its lines in their engine's log.
logger = logging.getLogger("vllm_fastload")


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
              listener: ParameterListener | None = None, load_weights: LoadWeights | None = None,
              rank_cpus: tuple[int, ...] | None = None, group_takes_all: bool = True,
              replicas: exchange.Collectives | None = None) -> LoadReport:
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
    ``rank_cpus``: the CPUs the engine bound this rank to, where it did (``ConfigFacts.rank_cpus``).
    ``group_takes_all``: the ranks of ``collectives`` (this rank alone without it) together take
    every element of each checkpoint tensor they use, so that a tensor they leave part of is a
    checkpoint that does not match the model (``model.coverage``); False where the engine splits
    tensors beyond the group by design (experts spread over data-parallel ranks).
    ``replicas``: the collectives of the ranks that hold what this rank holds, its experts aside
    (the data-parallel group of an MoE at data parallelism > 1; every rank of it must call this):
    what they need alike they read once among them (``dp_exchange``, ``exchange.agree_replicas``).
    """
    decisions = policy.DecisionLog()  # this load's decisions, each logged once
    sharing = _Sharing(collectives, decisions)
    alike = _ReplicaSharing(replicas, decisions)
    load = _Load(model, rank, world, listener, load_weights or own_load_weights(model), sharing, group_takes_all,
                 alike)
    try:
        with FastCheckpoint(path, device, config, show_progress=show_progress,
                            facts=ConfigFacts(rank_cpus=rank_cpus)) as ckpt:
            return load.run(ckpt)
    except BaseException:
        sharing.give_up()  # a rank that fails before agreeing still takes part (no-op after)
        alike.give_up()
        raise


@dataclass
class _Load:
    """One rank's load: what ``load_rank`` was given, and the steps it takes."""

    model: nn.Module
    rank: int
    world: int
    listener: ParameterListener | None
    load_weights: LoadWeights
    sharing: _Sharing
    group_takes_all: bool
    replicas: _ReplicaSharing
    phases: dict[str, float] = field(default_factory=dict)

    def run(self, ckpt: FastCheckpoint) -> LoadReport:
        start = time.perf_counter()
        cached = ckpt.cached_share()
        infos = dict(ckpt.tensors)
        self.sharing.decide(ckpt)
        self.replicas.decide(ckpt)
        tensors = {name: (shape_of(info), dtype_of(info)) for name, info in infos.items()}
        probe = (probe_model(self.model, tensors, self.load_weights) if ckpt.config.plan_per_rank else
                 ProbeResult(unsupported=("plan_per_rank is false in the fastload config",)))
        self.phases["probe"] = time.perf_counter() - start
        if probe.unsupported:
            outcome = self.read_whole(ckpt, probe.unsupported[0], len(infos))
        else:
            outcome = self.read_planned(ckpt, probe, infos)
        return LoadReport(rank=self.rank, world=self.world, planned=not probe.unsupported,
                          fallback_reason=probe.unsupported[0] if probe.unsupported else None,
                          loaded=outcome.loaded, bytes_read=outcome.stats.bytes_read,
                          bytes_kept=outcome.kept, bytes_total=ckpt.total_bytes,
                          backend=ckpt.backend, seconds=time.perf_counter() - start, summary=outcome.summary,
                          paths=outcome.paths, phases=self.phases, cached=cached, own_cached=outcome.own_cached,
                          never_written=() if probe.unsupported else tuple(probe.never_written()),
                          cpus=ckpt.config.cpus)

    def read_whole(self, ckpt: FastCheckpoint, why: str, tensors: int) -> _Outcome:
        """Every tensor read in full and handed to the model's ``load_weights`` (after agreeing to
        share nothing), the page cache shared with the other ranks where they read alike."""
        reading = time.perf_counter()
        self.sharing.agree(None)
        self.replicas.agree(None)
        logger.warning("fastload: reading every tensor in full through load_weights on rank %d: %s", self.rank, why)
        loaded, stats = _load_through_model(self.model, ckpt, self.load_weights, self.world)
        self.phases["read"] = time.perf_counter() - reading
        return _Outcome(loaded, None, "all tensors read whole through load_weights", {"load_weights": tensors}, stats)

    def read_planned(self, ckpt: FastCheckpoint, probe: ProbeResult, infos: dict[str, TensorInfo]) -> _Outcome:
        """This rank's bytes read into the parameters by its plan, the rest replayed."""
        _check_fully_written(probe, ckpt.source)
        if self.world == 1 and self.group_takes_all:
            _check_fully_used(probe, infos)
        grouped = self.sharing.collectives is not None and self.group_takes_all
        uses = coverage.uses(probe.placements, infos) if grouped else None
        planning = time.perf_counter()
        reads = plan_reads(probe, infos, ckpt.strided_min_skip)
        own_cached = ckpt.cached_share([*reads.targets, *reads.slabs])
        reading = time.perf_counter()
        readiness = _Readiness(probe.placements, self.listener) if self.listener is not None else None
        hooks = _RankHooks(reads, readiness)
        summary, exchanged, stats = _load_planned(ckpt, reads, (self.sharing, self.replicas), hooks, uses)
        post = readiness.seconds if readiness is not None else 0.0
        self.phases.update(plan=reading - planning, check=hooks.check_seconds,
                           read=time.perf_counter() - reading - hooks.check_seconds - post,
                           replay=hooks.replay_seconds)
        if readiness is not None:
            self.phases["post"] = post
        return _Outcome(probe.loaded_params, reads.kept_bytes, summary,
                        {**reads.paths(hooks.strategies), "exchange": exchanged}, stats, own_cached)


@dataclass(frozen=True)
class _Outcome:
    """What reading did, for the rank's report."""

    loaded: frozenset[str] | None
    kept: int | None
    summary: str
    paths: Mapping[str, int]
    stats: LoadStats
    #: The share of the bytes the plan reads in the page cache as the reads began (planned path).
    own_cached: float | None = None


class _RankHooks(ReadHooks):
    """A planned rank's read: its plan checked, its slabs replayed, its row exchanges (``swaps``, set
    once the groups agreed) fed and swapped per layer, its listener told which parameters are
    complete; the time the checks and replays take is counted."""

    def __init__(self, reads: RankReads, readiness: _Readiness | None) -> None:
        self.reads, self.readiness = reads, readiness
        #: The row exchanges the groups agreed on (the tensor-parallel group's, the replicas').
        self.swaps: list[exchange.RowExchange] = []
        #: The read strategies of the checked plan (``Plan.strategy_counts``).
        self.strategies: dict[str, int] = {}
        self.check_seconds = self.replay_seconds = 0.0

    def check(self, plan: Plan) -> None:
        start = time.perf_counter()
        try:
            self.strategies = plan.strategy_counts()
            self.reads.check(plan)
        finally:
            self.check_seconds += time.perf_counter() - start
        if self.readiness is not None:
            self.readiness.planned(plan)

    def on_tensor(self, request: TensorRequest, tensor: torch.Tensor) -> None:
        if any(swap.take(request, tensor) for swap in self.swaps):
            return
        start = time.perf_counter()
        self.reads.replay(request.result_key, tensor)
        self.replay_seconds += time.perf_counter() - start

    def on_layer_end(self, group: LayerGroup) -> None:
        for swap in self.swaps:  # in the same order on every rank
            swap.layer_done(group)  # completes the layer's exchanged rows
        if self.readiness is not None:
            self.readiness.group_done(group)


def _load_planned(ckpt: FastCheckpoint, reads: RankReads, sharings: tuple[_Sharing, _ReplicaSharing],
                  hooks: _RankHooks, uses: Mapping[str, coverage.Use] | None) -> tuple[str, int, LoadStats]:
    """Check that the group takes each tensor whole (``uses``: this rank's part, None: not
    checked), agree on the row exchanges (the tensor-parallel group's, then the replicas' on what
    is left), read and replay; the summary, how many tensors the exchanges delivered, and what
    the read did."""
    # No huge-page advice on the parameters: in an engine's worker whose memory is bound to a NUMA
    # node it made the load several times slower, though it speeds filling fresh memory in a plain
    # process (docs/benchmarks.md, Measurements behind the code). (The host reader does fault in
    # parameter pages it is about to overwrite, see readers.memory: that changes no policy.)
    sharing, alike = sharings
    targets, slabs = reads.targets, list(reads.slabs)
    swap = sharing.agree(targets, uses)
    if sharing.uses is not None:  # every rank has the same uses, so every rank raises alike
        coverage.check_taken_whole(sharing.uses, ckpt.tensors, reads.writes,
                                   f"{len(sharing.uses)} ranks of the tensor-parallel group")
    hooks.swaps = [swap] if swap is not None else []
    try:  # from here a failure tells the ranks of each exchange agreed on (``abort``)
        if swap is not None:
            targets = {req: dest for req, dest in targets.items() if not swap.owns(req)}
        replica_swap = alike.agree(targets)
        if replica_swap is not None:
            hooks.swaps.append(replica_swap)
        direct: dict[TensorRequest, torch.Tensor] = {}
        for agreed in hooks.swaps:
            targets = {req: dest for req, dest in targets.items() if not agreed.owns(req)}
            slabs += agreed.row_requests()
            direct.update(agreed.direct_targets())
        stats = ckpt.read_into({**targets, **direct}, extra=slabs, hooks=hooks)
    except BaseException as exc:
        for agreed in hooks.swaps:
            try:
                agreed.abort(exc)  # the other ranks stop at their next swap instead of waiting for this one
            except Exception as again:
                logger.warning("fastload: could not tell the other ranks that this one stopped: %s", again)
        raise
    summary = reads.summary(len(ckpt.tensors))
    for agreed in hooks.swaps:
        agreed.finish()
        st = agreed.stats
        what = (f"sliced tensors read as whole rows shared with the other {agreed.world - 1} rank(s)"
                if agreed is swap else f"tensors held alike read once among the {agreed.world} ranks of the "
                                       f"{agreed.group}")
        summary += f"; {st.tensors} {what} ({st.bytes_sent / 1e6:.3f} MB sent in {st.layers} exchanges, " \
                   f"{st.seconds:.2f} s)"
    return summary, sum(agreed.stats.tensors for agreed in hooks.swaps), stats


def _load_through_model(model: nn.Module, ckpt: FastCheckpoint, load_weights: LoadWeights,
                        world: int) -> tuple[frozenset[str] | None, LoadStats]:
    """Every tensor read whole and handed to the model's ``load_weights`` (read alike by the
    ``world`` ranks, see ``FastCheckpoint.iter_tensors``); a failure in it names the tensor."""
    current: list[str] = []
    stream = ckpt.iter_tensors(shared_by=world)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            current[:] = [name]
            yield name, tensor

    try:
        # The model copies each tensor into its parameter: fresh parameter pages may be faulted
        # in ahead of it, as the per-rank path does before reading into them.
        with ckpt.prefault(p.data for p in model.parameters()):
            loaded = load_weights(weights())
    except CheckpointError:
        raise
    except Exception as exc:
        name = current[0] if current else None
        file = ckpt.info(name).file if name else ckpt.source
        raise CheckpointError(f"the model's load_weights could not load this checkpoint tensor: "
                              f"{type(exc).__name__}: {exc}", file=file, tensor=name) from exc
    return (frozenset(loaded) if loaded is not None else None), stream.stats


class _Readiness:
    """Which parameters are complete as the read passes each layer group: a parameter is complete
    once every planned read of every checkpoint tensor that writes it has been delivered (replays
    and exchanged rows included)."""

    def __init__(self, placements: Mapping[str, Sequence[Placement]], listener: ParameterListener) -> None:
        self.listener = listener
        #: checkpoint tensor -> the parameters it writes
        self.writes = {name: sorted({p.parameter for p in ps}) for name, ps in placements.items()}
        self.countdown: Countdown[str, str] | None = None
        self.seconds = 0.0

    def planned(self, plan: Plan) -> None:
        """Each parameter waits for every planned read of each tensor that writes it (a tensor no
        read is planned for keeps its parameters waiting: they are never complete)."""
        reads = {name: 0 for name in self.writes}
        for t in plan.tensors:
            reads[t.info.name] = reads.get(t.info.name, 0) + 1
        self.countdown = Countdown((param, name) for name, params in self.writes.items() for param in params
                                   for _ in range(max(reads[name], 1)))
        self.listener.expect({param for params in self.writes.values() for param in params})

    def group_done(self, group: LayerGroup) -> None:
        start = time.perf_counter()
        assert self.countdown is not None, "group_done before planned"
        ready = [param for t in group.tensors for param in self.countdown.arrive(t.info.name)]
        if ready:
            self.listener.ready(group.key.layer, ready)
        self.seconds += time.perf_counter() - start


class _Sharing:
    """Whether this rank shares row reads with its tensor-parallel group (``row_exchange``,
    decided by ``policy.row_sharing``).

    Every rank of the group agrees exactly once per load, whatever its config says, also one
    that fails or falls back before reading (it agrees to nothing): so no rank is left waiting in
    the agreement, and ranks whose settings or filesystems differ simply do not share.
    """

    def __init__(self, collectives: exchange.Collectives | None, decisions: policy.DecisionLog | None = None) -> None:
        self.collectives = collectives if collectives is not None and collectives.world > 1 else None
        self.pending = self.collectives is not None
        self.decisions = decisions if decisions is not None else policy.DecisionLog()
        self.ckpt: FastCheckpoint | None = None
        self.infos: Mapping[str, TensorInfo] = {}
        #: Every rank's ``coverage.Use`` per tensor, once agreed (None: not every rank sent them).
        self.uses: list[Mapping[str, coverage.Use]] | None = None

    def decide(self, ckpt: FastCheckpoint) -> None:
        """What this rank will offer, once the checkpoint is open."""
        self.ckpt, self.infos = ckpt, ckpt.tensors

    def offer(self, targets: Mapping[TensorRequest, torch.Tensor | None] | None) -> bool:
        """Whether this rank offers to share the row reads of ``targets``."""
        if self.ckpt is None:
            return False
        config, remote = self.ckpt.config, self.ckpt.is_remote
        decision = policy.row_sharing(mode=config.row_exchange, remote=remote,
                                      planned=config.plan_per_rank and targets is not None)
        self.decisions.note("row exchange", decision, setting=config.row_exchange, remote=remote)
        return decision.offered

    def agree(self, targets: Mapping[TensorRequest, torch.Tensor] | None,
              uses: Mapping[str, coverage.Use] | None = None) -> exchange.RowExchange | None:
        """Agree with the group (once; after that, None) on the row reads to share, offering
        ``targets``' where ``offer`` says so, and gather every rank's ``uses`` (``self.uses``)."""
        if not self.pending or self.collectives is None:
            return None
        try:
            offered = self.offer(targets)
        except Exception as exc:  # a default's guess must not fail the load; the reads will tell
            logger.warning("fastload: not sharing row reads with the other ranks: %s", exc)
            offered = False
        except BaseException:
            self.pending = False
            self._gather(None, None)  # the others must not wait for this rank
            raise
        self.pending = False
        return self._gather(targets if offered else None, uses)

    def _gather(self, targets: Mapping[TensorRequest, torch.Tensor] | None,
                uses: Mapping[str, coverage.Use] | None) -> exchange.RowExchange | None:
        """The group's two rounds, taken by every rank in this order whatever happens in the first."""
        assert self.collectives is not None
        try:
            swap = exchange.agree(self.collectives, targets, self.infos)
        except BaseException:
            self.collectives.all_gather_object(None)
            raise
        everyone = self.collectives.all_gather_object(uses)
        self.uses = None if any(u is None for u in everyone) else everyone
        return swap

    def give_up(self) -> None:
        """Agree to nothing if not agreed yet; a failure here (a peer already gone) is logged, so
        that the error that stopped this rank is the one raised."""
        try:
            self.agree(None)
        except Exception as exc:
            logger.warning("fastload: could not tell the other ranks that this one stopped: %s", exc)


class _ReplicaSharing(_Sharing):
    """Whether this rank reads what it holds alike with the ranks of ``collectives`` (the
    data-parallel group: ``dp_exchange``, decided by ``policy.replica_sharing``) once among them.
    Agreed exactly once per load by every rank of that group, as ``_Sharing`` is."""

    def offer(self, targets: Mapping[TensorRequest, torch.Tensor | None] | None) -> bool:
        if self.ckpt is None:
            return False
        config, remote, network = self.ckpt.config, self.ckpt.is_remote, self.ckpt.network
        decision = policy.replica_sharing(mode=config.dp_exchange, remote=remote, network=network,
                                          planned=config.plan_per_rank and targets is not None)
        self.decisions.note("replica exchange", decision, setting=config.dp_exchange, remote=remote, network=network)
        return decision.offered

    def _gather(self, targets: Mapping[TensorRequest, torch.Tensor] | None,
                uses: Mapping[str, coverage.Use] | None) -> exchange.RowExchange | None:
        assert self.collectives is not None
        return exchange.agree_replicas(self.collectives, targets, self.infos)


def _check_fully_written(probe: ProbeResult, path: str) -> None:
    """Stricter than the engines' name-level checks: a stacked parameter (qkv, gate_up) must get every shard."""
    partial = probe.partly_written()
    if partial:
        param, sources = next(iter(partial.items()))
        raise CheckpointError(
            f"parameter {param} is only partly provided by the checkpoint (it receives {', '.join(sources)}; "
            f"{len(partial)} parameters are incomplete: {', '.join(list(partial)[:5])}); a tensor is missing",
            file=path)


def _check_fully_used(probe: ProbeResult, infos: Mapping[str, TensorInfo]) -> None:
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


def model_device(model: nn.Module) -> torch.device:
    """Where the model's (materialised) parameters live."""
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")
