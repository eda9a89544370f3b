"""The tuning decisions (``vllm_fastload.policy``) as tables of facts to outcomes.

The tables were first recorded from the readers as they decided before the decisions moved into
the policy (every combination of the facts below), so they pin the behaviour, not a new one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from vllm_fastload import policy
from vllm_fastload.policy import ChunkRead, EarlyReads, Filesystem, MapChunk, ReplicaSharing, RowSharing

ANY = object()


def _matches(row: tuple, facts: tuple) -> bool:
    return all(want is ANY or (facts[i] in want if isinstance(want, (set, frozenset)) else facts[i] == want)
               for i, want in enumerate(row))


@dataclass
class Facts:
    """Facts that record which of them a decision asked for (each is a probe in the reader)."""

    remote: bool = False
    cached: bool = False
    holes: bool = False
    direct_ok: bool = False
    cached_share: float | None = None
    asked: set[str] = field(default_factory=set)

    def __getattribute__(self, name: str):
        if name in ("cached", "holes", "direct_ok", "cached_share"):
            object.__getattribute__(self, "asked").add(name)
        return object.__getattribute__(self, name)


#: (remote, direct_io, cached, holes, direct_ok, (copiers, threads)) -> how the chunk is read;
#: the first matching row decides.
CHUNK_READS = [
    ((True, ANY, ANY, ANY, ANY, ANY), ChunkRead.REMOTE),
    ((False, "always", ANY, ANY, False, ANY), ChunkRead.BUFFERED),
    ((False, "always", ANY, ANY, True, ANY), ChunkRead.DIRECT),
    ((False, ANY, True, True, ANY, ANY), ChunkRead.HOLES),
    ((False, ANY, True, False, ANY, {(2, 4)}), ChunkRead.CACHED_PREFAULTED),
    ((False, ANY, True, False, ANY, ANY), ChunkRead.CACHED),
    ((False, "never", False, ANY, ANY, ANY), ChunkRead.BUFFERED),
    ((False, "auto", False, ANY, False, ANY), ChunkRead.BUFFERED),
    ((False, "auto", False, ANY, True, ANY), ChunkRead.DIRECT),
]


@pytest.mark.parametrize("remote,direct_io,cached,holes,direct_ok,layout", list(itertools.product(
    [False, True], ["auto", "always", "never"], [False, True], [False, True], [False, True],
    [(1, 1), (1, 4), (2, 4), (4, 4)])))
def test_chunk_read_table(remote, direct_io, cached, holes, direct_ok, layout) -> None:
    facts = Facts(remote, cached, holes, direct_ok)
    key = (remote, direct_io, cached, holes, direct_ok, layout)
    want = next(out for row, out in CHUNK_READS if _matches(row, key))
    copiers, threads = layout
    assert policy.chunk_read(facts, direct_io=direct_io, copiers=copiers, threads=threads) is want
    # Probes are asked for only where they decide something.
    if remote or direct_io == "always":
        assert "cached" not in facts.asked and "holes" not in facts.asked
    if not (direct_io != "always" and cached) or remote:
        assert "holes" not in facts.asked
    if remote or direct_io == "never" or (direct_io != "always" and cached):
        assert "direct_ok" not in facts.asked


#: (map_cached, remote, direct_io, cached, cached_share) -> whether a chunk is mapped.
MAP_CHUNKS = [
    ((False, ANY, ANY, ANY, ANY), MapChunk.READ),
    ((True, True, ANY, ANY, ANY), MapChunk.READ),
    ((True, False, "always", ANY, ANY), MapChunk.READ),
    ((True, False, ANY, True, ANY), MapChunk.MAP),
    ((True, False, "never", False, ANY), MapChunk.MAP_ADVISED),
    ((True, False, "auto", False, {None, 0.2}), MapChunk.READ),
    ((True, False, "auto", False, {0.5, 0.9}), MapChunk.MAP_ADVISED),
]


@pytest.mark.parametrize("map_cached,remote,direct_io,cached,share", list(itertools.product(
    [False, True], [False, True], ["auto", "always", "never"], [False, True], [None, 0.2, 0.5, 0.9])))
def test_map_chunk_table(map_cached, remote, direct_io, cached, share) -> None:
    facts = Facts(cached=cached, cached_share=share)
    want = next(out for row, out in MAP_CHUNKS if _matches(row, (map_cached, remote, direct_io, cached, share)))
    assert policy.map_chunk(facts, map_cached=map_cached, remote=remote, direct_io=direct_io) is want
    if not map_cached or remote or direct_io == "always":
        assert not facts.asked  # no probe for a chunk that is read anyway
    if cached or direct_io == "never":
        assert "cached_share" not in facts.asked


@pytest.mark.parametrize("setting,device,remote,gds,want", [
    ("auto", "cpu", False, True, "host"),
    ("host", "cpu", True, True, "host"),
    ("auto", "cuda", False, True, "kvikio"),
    ("auto", "cuda", False, False, "cuda"),
    ("auto", "cuda", True, True, "cuda"),
    ("cuda", "cuda", False, True, "cuda"),
    ("kvikio", "cuda", False, False, "kvikio"),
    ("cuda", "cpu", False, True, ValueError),
    ("kvikio", "cpu", False, True, ValueError),
    ("host", "cuda", False, True, ValueError),
    ("kvikio", "cuda", True, True, ValueError),
    ("auto", "mps", False, True, ValueError),
])
def test_backend_table(setting, device, remote, gds, want) -> None:
    asked: list[bool] = []

    def gds_live() -> bool:
        asked.append(True)
        return gds

    if want is ValueError:
        with pytest.raises(ValueError):
            policy.backend(setting, device, remote=remote, gds_live=gds_live)
        return
    assert policy.backend(setting, device, remote=remote, gds_live=gds_live) == want
    assert bool(asked) == (setting == "auto" and device == "cuda" and not remote)  # kvikio imported only then


@pytest.mark.parametrize("cpus,want", [(1, 4), (2, 4), (4, 4), (8, 8), (16, 16), (64, 16)])
def test_default_threads(cpus: int, want: int) -> None:
    assert policy.default_threads(cpus) == want


@pytest.mark.parametrize("threads,cpus,want", [(4, 1, 1), (4, 2, 2), (4, 8, 4), (16, 16, 16)])
def test_copier_count(threads: int, cpus: int, want: int) -> None:
    assert policy.copier_count(threads, cpus) == want


@pytest.mark.parametrize("direct_io,budget,threads,read_size,want", [
    ("never", 1 << 30, 4, 8 << 20, 0),
    ("auto", 1 << 30, 4, 8 << 20, (8 << 20) + 8192),
    ("always", 1 << 30, 4, 8 << 20, (8 << 20) + 8192),
    ("auto", 16 << 20, 4, 8 << 20, 1 << 20),          # a quarter of the budget over four threads
    ("auto", 65536, 4, 4096, 0),                      # not a page beside the slack: no O_DIRECT
])
def test_bounce_size(direct_io, budget, threads, read_size, want) -> None:
    assert policy.bounce_size(direct_io=direct_io, memory_budget=budget, threads=threads, read_size=read_size,
                              max_alignment=4096) == want


@pytest.mark.parametrize("budget,read_size,threads,want", [
    (1 << 30, 8 << 20, 8, (16 << 20, 8)),
    (1 << 30, 32 << 20, 16, (32 << 20, 8)),
    (16 << 20, 8 << 20, 8, (4 << 20, 1)),
    (8192, 4096, 4, (4096, 1)),
])
def test_staging_slots(budget, read_size, threads, want) -> None:
    assert policy.staging_slots(memory_budget=budget, read_size=read_size, threads=threads) == want
    slot, _ = want
    assert policy.staging_in_flight(threads=threads, slot_size=slot) == 2 * threads * slot


@pytest.mark.parametrize("planned,gap,count,cached,want", [
    (True, 100, 10, False, True),
    (True, 100, 1, False, False),                     # one row: nothing to read through
    (True, (1 << 20) + 1, 10, False, False),          # too large a gap for the scratch
    (False, 4095, 10, False, True),                   # under a page: the disk reads it anyway
    (False, 4096, 10, False, False),
    (False, 32 << 10, 10, True, True),                # from the page cache: cheaper than a call per row
    (False, (32 << 10) + 1, 10, True, False),
])
def test_read_through_gaps(planned, gap, count, cached, want) -> None:
    assert policy.read_through_gaps(planned=planned, gap=gap, count=count, cached=cached, page=4096) is want


@pytest.mark.parametrize("configured,remote,want", [(123, True, 123), (0, False, 0), (None, True, 1 << 20),
                                                     (None, False, 4096)])
def test_strided_min_skip(configured, remote, want) -> None:
    assert policy.strided_min_skip(configured=configured, remote=remote, coalesce_gap=1 << 20,
                                   backend="cuda") == want


def test_filesystem_defaults() -> None:
    assert policy.filesystem_defaults(network=False, set_fields=set()) == {}
    assert policy.filesystem_defaults(network=True, set_fields=set()) == policy.NETWORK_DEFAULTS
    assert policy.filesystem_defaults(network=True, set_fields={"strided_min_skip"}) == {
        "stall_timeout_s": policy.NETWORK_STALL_TIMEOUT_S}
    assert policy.filesystem_defaults(network=True, set_fields={"strided_min_skip", "stall_timeout_s"}) == {}


#: (planned, mode, remote) -> the offer; the first matching row decides. ``auto`` shares on object
#: stores only: on files each rank reading its own columns was faster, cold and warm.
ROW_SHARING = [
    ((False, ANY, ANY), RowSharing.OFF),
    ((True, "never", ANY), RowSharing.OFF),
    ((True, "always", ANY), RowSharing.GROUP),
    ((True, "auto", True), RowSharing.GROUP),
    ((True, "auto", False), RowSharing.FILES),
]


@pytest.mark.parametrize("planned,mode,remote", list(itertools.product(
    [True, False], ["auto", "always", "never"], [False, True])))
def test_row_sharing_table(planned, mode, remote) -> None:
    want = next(out for row, out in ROW_SHARING if _matches(row, (planned, mode, remote)))
    got = policy.row_sharing(mode=mode, planned=planned, remote=remote)
    assert got is want
    assert got.offered == (want is RowSharing.GROUP)


#: (planned, mode, remote, network) -> the replicas' offer; the first matching row decides. ``auto``
#: shares where every rank fetches from the same shared storage (an object store, a network filesystem).
REPLICA_SHARING = [
    ((False, ANY, ANY, ANY), ReplicaSharing.OFF),
    ((True, "never", ANY, ANY), ReplicaSharing.OFF),
    ((True, "always", ANY, ANY), ReplicaSharing.GROUP),
    ((True, "auto", True, ANY), ReplicaSharing.GROUP),
    ((True, "auto", ANY, True), ReplicaSharing.GROUP),
    ((True, "auto", False, False), ReplicaSharing.LOCAL),
]


@pytest.mark.parametrize("planned,mode,remote,network", list(itertools.product(
    [True, False], ["auto", "always", "never"], [False, True], [False, True])))
def test_replica_sharing_table(planned, mode, remote, network) -> None:
    want = next(out for row, out in REPLICA_SHARING if _matches(row, (planned, mode, remote, network)))
    got = policy.replica_sharing(mode=mode, planned=planned, remote=remote, network=network)
    assert got is want
    assert got.offered == (want is ReplicaSharing.GROUP)


@pytest.mark.parametrize("direct_io,world,want", [
    ("auto", 1, "auto"), ("auto", 2, "never"), ("auto", 8, "never"), ("always", 1, "always"),
    ("always", 2, "always"), ("never", 1, "never"), ("never", 2, "never"),
])
def test_whole_reads_direct_io(direct_io, world, want) -> None:
    assert policy.whole_reads_direct_io(direct_io, world=world) == want


@pytest.mark.parametrize("cpus,want", [(1, False), (2, True), (16, True)])
def test_prefault_whole_reads(cpus: int, want: bool) -> None:
    assert policy.prefault_whole_reads(cpus) is want


@pytest.mark.parametrize("fs,want", [
    (Filesystem("ext4", network=False), True), (Filesystem("xfs", network=False), True),
    (Filesystem("tmpfs", network=False), True), (Filesystem("nfs4", network=True), False),
    (Filesystem("fuse.sshfs", network=True), False), (Filesystem("fuse.s3fs", network=False), False),
])
def test_reads_early_by_default(fs: Filesystem, want: bool) -> None:
    assert policy.reads_early_by_default(fs) is want


class EarlyFacts:
    """``policy.EarlyFacts`` that record which of the costly ones a decision asked for, and how
    many filesystems it looked at."""

    def __init__(self, kind: str, mode: str, filesystems: list[Filesystem]) -> None:
        self.remote, self.directory, self.hub_id = kind == "remote", kind == "directory", kind == "hub"
        self._mode, self._filesystems = mode, filesystems
        self.asked: list[str] = []

    @property
    def mode(self) -> str:
        self.asked.append("mode")
        return self._mode

    @property
    def filesystems(self):
        for fs in self._filesystems:
            self.asked.append("filesystem")
            yield fs


LOCAL, NFS = Filesystem("ext4", network=False), Filesystem("nfs4", network=True)
FUSE, TMPFS = Filesystem("fuse.sshfs", network=True), Filesystem("tmpfs", network=False)
#: (kind of path, mode, filesystems of its two files) -> the decision; the first matching row
#: decides. Recorded from ``model.early.files_to_read`` before the decision moved here (a path
#: that is "neither": a file, or nothing there).
EARLY_READS = [
    (("remote", ANY, ANY), EarlyReads.REMOTE),
    (("neither", ANY, ANY), EarlyReads.NOT_A_CHECKPOINT),
    ((ANY, "never", ANY), EarlyReads.OFF),
    ((ANY, "auto", {"nfs", "fuse"}), EarlyReads.NETWORK),
    ((ANY, ANY, ANY), EarlyReads.READ),
]
FILESYSTEMS = {"local": [LOCAL, LOCAL], "nfs": [LOCAL, NFS], "fuse": [FUSE, LOCAL], "tmpfs": [TMPFS, LOCAL]}


@pytest.mark.parametrize("kind,mode,fs", list(itertools.product(
    ["remote", "directory", "hub", "neither"], ["auto", "always", "never"], FILESYSTEMS)))
def test_early_reads_table(kind: str, mode: str, fs: str) -> None:
    facts = EarlyFacts(kind, mode, FILESYSTEMS[fs])
    want = next(out for row, out in EARLY_READS if _matches(row, (kind, mode, fs)))
    assert policy.early_reads(facts) is want
    # The setting is read (and checked) only for a checkpoint there is; its files' filesystems
    # only by 'auto', and no further than the first that rules early reads out.
    checkpoint = kind in ("directory", "hub")
    looked = {"local": 2, "tmpfs": 2, "nfs": 2, "fuse": 1}[fs] if checkpoint and mode == "auto" else 0
    assert facts.asked == (["mode"] if checkpoint else []) + ["filesystem"] * looked


def test_each_outcome_is_logged_once_with_its_facts(caplog) -> None:
    log = policy.DecisionLog()
    with caplog.at_level("DEBUG", logger="vllm_fastload"):
        log.note("host reader chunk", ChunkRead.DIRECT, cached=False, direct_ok=True)
        log.note("host reader chunk", ChunkRead.DIRECT, cached=False, direct_ok=True)
        log.note("host reader chunk", ChunkRead.CACHED, cached=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["fastload: host reader chunk: direct (cached=False, direct_ok=True)",
                     "fastload: host reader chunk: cached (cached=True)"]


@pytest.mark.parametrize("backend,want", [("host", 0), ("cuda", 4096), ("kvikio", 4096)])
def test_reader_strided_min_skip(backend, want) -> None:
    assert policy.reader_strided_min_skip(backend) == want
    assert policy.strided_min_skip(configured=None, remote=False, coalesce_gap=1 << 20, backend=backend) == want


@pytest.mark.parametrize("span,needed,want", [(100, 100, True), (200, 100, True), (201, 100, False), (0, 0, True)])
def test_advise_whole_span(span, needed, want) -> None:
    assert policy.advise_whole_span(span=span, needed=needed) is want


@pytest.mark.parametrize("span,want", [(64 * 4096, False), (64 * 4096 + 1, True), (4096, False)])
def test_sample_for_holes(span, want) -> None:
    assert policy.sample_for_holes(span=span, page=4096) is want



@pytest.mark.parametrize("quota,before,now,want", [
    (None, 1.0, 2.0, 0.0),  # no quota: idle priority alone keeps the reads off the engine's CPU time
    ("/g", 1.0, 2.0, policy.EARLY_READS_QUOTA_PAUSE_S),  # held back since the last look: pause
    ("/g", 2.0, 2.0, 0.0),  # not held back: read on
    ("/g", None, 2.0, 0.0), ("/g", 1.0, None, 0.0),  # the group does not say: read on
])
def test_early_reads_pause_only_while_their_quota_holds_the_group_back(quota, before, now, want) -> None:
    described = SimpleNamespace(directory=quota, describe=lambda: f"CPU quota at {quota}")
    pacing = policy.early_reads_pacing(None if quota is None else described)
    assert pacing.group == quota
    assert pacing.quota == ("" if quota is None else "CPU quota at /g")
    assert policy.early_reads_pause(pacing, before, now) == want


@pytest.mark.parametrize("busy,start,reads,want", [
    (2.0, 1.8, 0.1, policy.StarvedReads.BATCH),  # the start's processes took the CPUs (SGLang's start-up)
    (2.0, 0.7, 0.1, policy.StarvedReads.IDLE),  # other work took twice what the start did (a busy node)
    (2.0, 0.95, 0.1, policy.StarvedReads.BATCH),  # a tie goes to the start: the reads' own time is neither's
    (2.0, 0.0, 2.0, policy.StarvedReads.BATCH),  # only the reads ran: nothing else to yield to
])
def test_starved_reads_leave_idle_priority_only_where_the_start_kept_the_cpus_busy(busy, start, reads, want) -> None:
    assert policy.starved_reads(SimpleNamespace(busy_s=10.0, start_s=5.0),
                                SimpleNamespace(busy_s=10.0 + busy, start_s=5.0 + start), reads) is want


@pytest.mark.parametrize("before,now", [(None, SimpleNamespace(busy_s=1, start_s=0)),
                                        (SimpleNamespace(busy_s=1, start_s=0), None)])
def test_starved_reads_leave_idle_priority_where_the_kernel_does_not_say(before, now) -> None:
    assert policy.starved_reads(before, now, 0.0) is policy.StarvedReads.BATCH
    assert policy.cpu_split(before, now, 0.0) is None


def test_the_cpu_split_leaves_the_reads_own_time_out() -> None:
    before, now = SimpleNamespace(busy_s=10.0, start_s=5.0), SimpleNamespace(busy_s=12.0, start_s=5.75)
    split = policy.cpu_split(before, now, 0.25)
    assert split == policy.CpuSplit(start_s=0.75, other_s=1.0)


@pytest.mark.parametrize(("reader_ahead", "remote", "expected"), [
    (0, False, 0),                                        # local files: the reader's threads are the limit
    (64 << 20, False, 64 << 20),                          # a staged reader's slots
    (0, True, policy.OBJECT_READS_AHEAD),                 # objects: the link kept busy between chunks
    (1 << 30, True, 1 << 30),                             # never fewer than the reader asks for
])
def test_direct_reads_ahead(reader_ahead: int, remote: bool, expected: int) -> None:
    assert policy.direct_reads_ahead(reader_ahead=reader_ahead, remote=remote) == expected
