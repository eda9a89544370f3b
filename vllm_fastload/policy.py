"""Tuning decisions, kept apart from the mechanisms that carry them out.

Every choice fastload makes from what it knows (the device, the source, the filesystem, how much
of a chunk the page cache holds, the CPUs, the config) is a pure function here, returning a typed
decision; the readers, the executor and the sources gather the facts, ask, and do what they are
told. Each threshold is a named constant with one line on what it trades. The runs behind the
numbers are in docs/benchmarks.md, next to the commands that repeat them.

Nothing here touches a file, a device or a thread: a decision can be tested as a table of facts
to outcomes (tests/core/test_policy.py), and ``DecisionLog`` shows an operator, at debug level,
what was decided from which facts.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

logger = logging.getLogger("vllm_fastload")

#: A setting that fastload may decide (``auto``) or the user forces on or off.
Mode = Literal["auto", "always", "never"]
#: The reader backends.
Backend = Literal["host", "cuda", "kvikio"]
#: What the ``backend`` setting accepts.
BackendSetting = Literal["auto", "host", "cuda", "kvikio"]

# -- thresholds ------------------------------------------------------------------------------

#: Fewest reader threads by default: enough I/O depth for a disk on a machine with few CPUs,
#: where one thread per CPU would leave the disk idle between reads.
MIN_THREADS = 4
#: Most reader threads by default: more threads fault fresh memory in at once and contend.
MAX_THREADS = 16
#: Chunks in flight ahead of the one being delivered: each needs a buffer of fresh memory, and this
#: many already keep every thread busy (each chunk is split into ``read_size`` pieces).
CHUNKS_IN_FLIGHT = 3
#: Buffers the executor holds at once: the chunks in flight, the one being delivered, and the one
#: before it (handed back one chunk late, see ``executor.PlanExecutor.run``). The buffer pool
#: rounds to its large granule only where this many fit in the budget.
BUFFERS_IN_USE = CHUNKS_IN_FLIGHT + 2
#: Bytes of reads from an object store into the caller's own tensors queued beyond
#: ``CHUNKS_IN_FLIGHT``: they need no buffer, and the store's link stays busy while the caller
#: works between chunks (a replicas' exchange, a layer's post-processing). Bounded because a
#: failed load waits for the requests already under way.
OBJECT_READS_AHEAD = 256 << 20
#: A page: below it the disk transfers the bytes between a slice's rows anyway.
PAGE_BYTES = 4096
#: ``strided_min_skip`` of the readers that land every byte they read where the caller's bytes go
#: (the staged readers): one extra read call costs about as much as reading a page, so a slice
#: whose rows skip less than that is read as its enclosing rows.
STAGED_STRIDED_MIN_SKIP = PAGE_BYTES
#: Destination ranges smaller than this are not faulted in ahead of a read: not worth the two
#: system calls (a residency probe and ``madvise``).
MIN_POPULATE_BYTES = 256 << 10
#: Pages sampled per range to estimate its share in the page cache: one probe on the loading
#: thread per chunk, or per tensor of a rank's load.
PAGE_SAMPLES = 16
#: Pages sampled per file for a whole checkpoint's share in the page cache (the rank's log line):
#: a file is far larger than a chunk, and asked about once per load.
FILE_PAGE_SAMPLES = 4 * PAGE_SAMPLES
#: Pages sampled per chunk that a cheap probe found cached, to tell a wholly cached chunk from one
#: with holes: enough to find a reclaimed stretch, few enough for one probe per chunk on the
#: loading thread. A chunk of no more pages than this is not sampled.
HOLE_SAMPLES = 64
#: Read advice covers a chunk's whole span, first byte to last, where that is at most this many
#: times the bytes it needs: one call instead of one per range, for few pages it does not need.
ADVISE_SPAN_FACTOR = 2
#: A chunk with at least this share of its pages cached is mapped (``map_cached``) with the
#: missing pages advised, rather than read again whole with O_DIRECT (which re-fetches the
#: cached pages from disk).
MOSTLY_CACHED = 0.5
#: The share of the memory budget the host reader's per-thread O_DIRECT buffers may take (1/4).
BOUNCE_BUDGET_DIVISOR = 4
#: The share of the memory budget the pinned staging slots may take (1/4); the rest holds chunks.
STAGING_BUDGET_DIVISOR = 4
#: Smallest pinned staging slot: each slot is a task with a fixed cost besides its read, so
#: smaller slots spend more of the thread's time on scheduling than on reading.
MIN_SLOT = 16 << 20
#: Queued work for the staged readers, in slots per thread: two keep a thread busy while its
#: previous slot's copy to the device finishes.
SLOTS_AHEAD_PER_THREAD = 2
#: From the page cache (no mapping), gaps between a slice's rows up to this size are read
#: through into a scratch buffer: a call per row costs more than copying that many bytes.
CACHED_GAP = 32 << 10
#: Gaps larger than this are never read through (the scratch buffer would grow without bound).
MAX_GAP = 1 << 20
#: On a network filesystem a slice along a later dim is never read row by row: each row is a
#: round trip, while the enclosing rows are a few large requests (``strided_min_skip``).
NETWORK_STRIDED_MIN_SKIP = 1 << 62
#: Seconds a read of a local disk may make no progress before the load fails (``stall_timeout_s``):
#: a healthy disk answers in well under a second, and a failing one retries a request for about
#: a minute (the SCSI layer's 30 s timeout, retried) before it reports an error itself.
LOCAL_STALL_TIMEOUT_S = 120.0
#: The same on a network filesystem: an NFS or Lustre server that fails over or restarts leaves
#: its clients' reads waiting for minutes and then answers them.
NETWORK_STALL_TIMEOUT_S = 600.0
#: Defaults a network filesystem gets for the fields the user left unset.
NETWORK_DEFAULTS: dict[str, object] = {"strided_min_skip": NETWORK_STRIDED_MIN_SKIP,
                                       "stall_timeout_s": NETWORK_STALL_TIMEOUT_S}
#: The share of the memory available at start-up that early reads may fill with page cache: more
#: would evict what the engine's start-up itself needs, for pages the load then reads anyway.
EARLY_READS_MEMORY_SHARE = 0.5
#: Byte ranges of a node's share of a checkpoint at most this far apart are read early as one: a
#: sequential read brings in about this much ahead anyway (the kernel's default read-ahead), and
#: every separate range is another call, on a network filesystem another request.
EARLY_READS_GAP = 128 << 10

#: Seconds early reads may wait for a CPU at idle priority before they read on as a batch job, for
#: an engine whose start-up keeps every core busy until the load (SGLang's; ``starved_reads`` says
#: whether the start-up is what keeps them busy): long enough to tell a start-up with no idle time
#: from a busy moment, short against its seconds before the load.
EARLY_READS_STARVED_S = 1.0

#: Seconds early reads pause once the CPU quota over them has held its group back since they last
#: looked (two of the kernel's default 100 ms CFS periods), and again for as long as it goes on doing
#: so: idle CPU priority keeps them off CPUs the engine wants, but not off the quota they share with
#: it, and each CPU second they spend at the quota is one the engine's start-up waits.
EARLY_READS_QUOTA_PAUSE_S = 0.2

#: Early reads let go of the files they hold when less than this share of a memory limit (the
#: machine's, a cgroup's) is free under it: the page cache they pin is then better left to what
#: the engine needs.
EARLY_READS_LOW_MEMORY = 0.1
#: Bytes early reads populate at a time: between two looks for a load that has begun (which stops
#: them), so a load waits at most this long for the disk they share.
EARLY_READS_CHUNK = 16 << 20
#: Bytes early reads populate at a time while they may yet leave idle priority
#: (``EARLY_READS_STARVED_S``): they look for their wait between two chunks, and a starved chunk
#: of ``EARLY_READS_CHUNK`` could take seconds to come back to look.
EARLY_READS_STARVED_CHUNK = 1 << 20
#: Seconds between two looks of the reading process for the loads' marks (and for memory running
#: low) while it holds the files: a load's end is noticed this late at most.
EARLY_READS_POLL_S = 0.2
#: The longest early reads hold the files mapped after reading them, where not every rank leaves
#: its mark (a start that failed, ranks that do not inherit the environment, such as Ray's).
EARLY_READS_HOLD_S = 600.0
#: Row slices share pages at their boundaries; those pages are owned in blocks of this many bytes
#: (``readers.row_pages``): large enough that advice stays a few long ranges, small enough that
#: each rank owns blocks in proportion to its slice.
SHARED_PAGE_BLOCK = 64 << 10


# -- decisions -------------------------------------------------------------------------------


class ChunkRead(str, enum.Enum):
    """How the host reader reads one chunk."""

    #: An object in a store: ranged requests to the source, destinations faulted in meanwhile.
    REMOTE = "remote"
    #: Cached: copies out of the page cache on the copier threads (one per CPU).
    CACHED = "cached"
    #: Cached, and several CPUs but fewer than threads: copies on the copiers while the other
    #: threads fault the destinations in ahead of them.
    CACHED_PREFAULTED = "cached, destinations faulted in ahead"
    #: Mostly cached with pages missing: buffered reads on every thread (each miss waits on the
    #: disk, so the misses are waited for in parallel), the range advised first.
    HOLES = "cached with holes"
    #: Not cached and no O_DIRECT (refused by the filesystem, or ``direct_io`` never): buffered
    #: reads on every thread with read-ahead advice.
    BUFFERED = "buffered"
    #: Not cached: O_DIRECT into per-thread buffers on every thread; row slices through the page
    #: cache with advice for exactly their pages.
    DIRECT = "direct"


class ChunkFacts(Protocol):
    """What the host reader can learn of a chunk; each may cost a probe, so a decision asks only
    for those it needs (an implementation probes on first access)."""

    @property
    def remote(self) -> bool:
        """The file is an object in a store (no descriptor)."""

    @property
    def cached(self) -> bool:
        """A cheap probe (first, middle and last page) finds the chunk in the page cache."""

    @property
    def holes(self) -> bool:
        """A sample of the chunk's pages finds some missing (asked only of a cached chunk)."""

    @property
    def direct_ok(self) -> bool:
        """The file can be read with O_DIRECT here (asked only of a chunk that is not cached)."""


def chunk_read(facts: ChunkFacts, *, direct_io: Mode, copiers: int, threads: int) -> ChunkRead:
    """How to read a chunk, from what is known of it.

    Reads that wait on the disk want many threads (I/O depth); copies out of the page cache are
    CPU work and want no more threads than CPUs.

    Args:
        facts: the chunk's facts, probed as they are asked for.
        direct_io: the ``direct_io`` setting.
        copiers: threads that copy out of the page cache (``copier_count``).
        threads: the reader's threads.

    Returns:
        The way to read it.

    Example:
        >>> from types import SimpleNamespace as F
        >>> chunk_read(F(remote=False, cached=False, direct_ok=True), direct_io="auto", copiers=2, threads=4)
        <ChunkRead.DIRECT: 'direct'>
    """
    if facts.remote:
        return ChunkRead.REMOTE
    if direct_io != "always" and facts.cached:
        if facts.holes:
            return ChunkRead.HOLES
        return ChunkRead.CACHED_PREFAULTED if 1 < copiers < threads else ChunkRead.CACHED
    if direct_io == "never" or not facts.direct_ok:
        return ChunkRead.BUFFERED
    return ChunkRead.DIRECT


class MapFacts(Protocol):
    """What the host reader can learn of a chunk it might hand out as mapped views."""

    @property
    def cached(self) -> bool:
        """A cheap probe finds the chunk in the page cache."""

    @property
    def cached_share(self) -> float | None:
        """The share of a sample of its pages in the page cache (None: cannot be told)."""


class MapChunk(str, enum.Enum):
    """Whether a chunk is handed out as views of a private mapping of the file."""

    #: Read into a buffer.
    READ = "read"
    #: Mapped as it is (cached).
    MAP = "map"
    #: Mapped, with its missing pages advised to the kernel first.
    MAP_ADVISED = "map, missing pages advised"


def map_chunk(facts: MapFacts, *, map_cached: bool, remote: bool, direct_io: Mode) -> MapChunk:
    """Whether to map a chunk instead of reading it: cached chunks, mostly cached ones (where
    O_DIRECT would fetch the whole chunk again), and with ``direct_io`` never every chunk.

    Example:
        >>> from types import SimpleNamespace as F
        >>> map_chunk(F(cached=False, cached_share=0.9), map_cached=True, remote=False, direct_io="auto")
        <MapChunk.MAP_ADVISED: 'map, missing pages advised'>
    """
    if not map_cached or remote or direct_io == "always":
        return MapChunk.READ
    if facts.cached:
        return MapChunk.MAP
    if direct_io != "never":
        share = facts.cached_share
        if share is None or share < MOSTLY_CACHED:
            return MapChunk.READ  # read with O_DIRECT
    return MapChunk.MAP_ADVISED


def default_threads(cpus: int) -> int:
    """Reader threads when the config names none: one per usable CPU, within
    ``[MIN_THREADS, MAX_THREADS]``."""
    return max(MIN_THREADS, min(MAX_THREADS, cpus))


def copier_count(threads: int, cpus: int) -> int:
    """Threads that copy out of the page cache: one per CPU the reader runs on, at most ``threads``."""
    return min(threads, cpus)


def bounce_size(*, direct_io: Mode, memory_budget: int, threads: int, read_size: int, max_alignment: int) -> int:
    """Each host reader thread's O_DIRECT buffer: a read piece plus slack for aligning both ends,
    within ``1/BOUNCE_BUDGET_DIVISOR`` of the memory budget; 0 (no O_DIRECT) if not even one
    page beside the slack fits, or where ``direct_io`` is never."""
    if direct_io == "never":
        return 0
    slack = 2 * max_alignment
    share = memory_budget // BOUNCE_BUDGET_DIVISOR // threads // 4096 * 4096
    size = min(read_size + slack, share)
    return size if size >= slack + 4096 else 0


def staging_slots(*, memory_budget: int, read_size: int, threads: int) -> tuple[int, int]:
    """``(slot size, slots)`` of the pinned staging: ``1/STAGING_BUDGET_DIVISOR`` of the budget, at
    least one page per slot; slots smaller than ``MIN_SLOT`` or ``read_size`` and fewer than
    threads where the budget is tight."""
    share = memory_budget // STAGING_BUDGET_DIVISOR
    wanted = max(read_size, MIN_SLOT)
    slot_size = max(4096, min(wanted, share) // 4096 * 4096)
    return slot_size, max(1, min(threads, share // slot_size))


def direct_reads_ahead(*, reader_ahead: int, remote: bool) -> int:
    """Bytes of reads into the caller's own tensors queued beyond ``CHUNKS_IN_FLIGHT``: what the
    reader asks for (``Reader.direct_in_flight``), and from an object store at least
    ``OBJECT_READS_AHEAD`` (its own request limit paces them)."""
    return max(reader_ahead, OBJECT_READS_AHEAD) if remote else reader_ahead


def staging_in_flight(*, threads: int, slot_size: int) -> int:
    """Bytes of reads into the caller's own tensors worth queueing beyond ``CHUNKS_IN_FLIGHT``
    for a staged reader: ``SLOTS_AHEAD_PER_THREAD`` slots per thread."""
    return SLOTS_AHEAD_PER_THREAD * threads * slot_size


def read_through_gaps(*, planned: bool, gap: int, count: int, cached: bool, page: int) -> bool:
    """Whether a slice's rows are read with their gaps in one ``preadv`` per batch of rows (the
    gaps into a scratch buffer) rather than with a call per row: where the plan says so, or the
    gaps are under a page (the disk transfers those pages anyway), or under ``CACHED_GAP`` from the
    page cache; never for gaps over ``MAX_GAP``, nor for a single row."""
    through = planned or gap <= (CACHED_GAP if cached else page - 1)
    return through and count > 1 and gap <= MAX_GAP


def reader_strided_min_skip(backend: Backend) -> int:
    """The ``strided_min_skip`` a backend's plans use by default (local files).

    ``host``: 0, its plans are exact. It moves a slice's rows without landing the bytes between
    them anywhere the caller sees (copied out of a mapping where cached, else read through gaps
    under a page into a scratch buffer), so reading the enclosing rows would only add bytes to copy
    and hold. The staged readers: ``STAGED_STRIDED_MIN_SKIP``.
    """
    return 0 if backend == "host" else STAGED_STRIDED_MIN_SKIP


def strided_min_skip(*, configured: int | None, remote: bool, coalesce_gap: int, backend: Backend) -> int:
    """The ``strided_min_skip`` a plan uses: configured, else for objects the store's
    ``coalesce_gap`` (a request costs about as much as that many bytes), else the backend's
    (``reader_strided_min_skip``)."""
    if configured is not None:
        return configured
    return coalesce_gap if remote else reader_strided_min_skip(backend)


def advise_whole_span(*, span: int, needed: int) -> bool:
    """Whether read advice for a chunk's ranges covers its whole span at once (``ADVISE_SPAN_FACTOR``)
    rather than each range on its own."""
    return span <= ADVISE_SPAN_FACTOR * needed


def bring_in_mapped(*, wholly_cached: bool) -> bool:
    """Whether a mapped range's pages are brought in (``MADV_POPULATE_READ``, on the reader's
    threads) before anything copies out of it: where pages must come from the disk, so that a
    failing disk or a file cut short is an error naming the file and not ``SIGBUS`` in the copy. A
    range wholly in the page cache (``HOLE_SAMPLES`` pages sampled) has no read that could fail or
    stall, and mapping its pages ahead would only add to the copy."""
    return not wholly_cached


def sample_for_holes(*, span: int, page: int) -> bool:
    """Whether a chunk the cheap probe found cached is sampled for holes: only one larger than
    ``HOLE_SAMPLES`` pages (a smaller one is as good as probed already)."""
    return span > HOLE_SAMPLES * page


def filesystem_defaults(*, network: bool, set_fields: Collection[str]) -> dict[str, object]:
    """Config fields to change for a checkpoint on this kind of filesystem: on a network
    filesystem ``NETWORK_DEFAULTS`` for the fields the user left unset; else none."""
    if not network:
        return {}
    return {k: v for k, v in NETWORK_DEFAULTS.items() if k not in set_fields}


def backend(setting: BackendSetting, device: str, *, remote: bool, gds_live: Callable[[], bool]) -> Backend:
    """The reader backend for a device.

    ``auto``: host memory -> host; a GPU -> kvikio only where GPUDirect Storage is live (without
    it kvikio reads through POSIX calls as the cuda backend does, without overlapping disk and
    PCIe), else cuda; objects always through cuda's pinned staging (kvikio reads local paths only).

    Args:
        setting: the ``backend`` setting.
        device: where the tensors go, as torch names it (``"cpu"``, ``"cuda:0"``).
        remote: the checkpoint is in an object store.
        gds_live: asked only where the answer matters (it imports kvikio).

    Returns:
        The backend.

    Raises:
        ValueError: the setting cannot read into this device or this source.
    """
    device_type = device.split(":")[0]
    if device_type == "cpu":
        if setting not in ("auto", "host"):
            raise ValueError(f"backend {setting!r} needs a CUDA device; device is {device}")
        return "host"
    if device_type != "cuda":
        raise ValueError(f"unsupported device {device}; fastload reads into 'cpu' or 'cuda' memory")
    if setting == "host":
        raise ValueError("backend 'host' reads into host memory; use device='cpu' or backend 'cuda'")
    if setting == "kvikio" and remote:
        raise ValueError("backend 'kvikio' reads local files only; an object store checkpoint is read with "
                         "backend 'cuda' (or 'auto')")
    if setting != "auto":
        return setting
    if remote:
        return "cuda"
    return "kvikio" if gds_live() else "cuda"


# -- loading a model's rank (``model.rank``, ``early``) ------------------------------------------


class RowSharing(str, enum.Enum):
    """Whether a rank offers its tensor-parallel group to share row reads (``row_exchange``): each
    rank then reads a block of whole rows and sends the others their columns, instead of every
    rank reading its columns of every row."""

    #: Not offered: ``never``, or no per-rank plan (every tensor is read whole).
    OFF = "not offered"
    #: Not offered, ``auto`` on files (a local disk, a network filesystem): each rank reading its
    #: own columns, cold or warm, was faster than reading blocks of rows and swapping columns
    #: (docs/benchmarks.md, "The row exchange on a local disk").
    FILES = "not offered: files, where each rank reads its own columns"
    #: Offered to every rank of the group: ``always``, or an object store, where a row-parallel
    #: slice costs a request per row and a block of rows a few.
    GROUP = "offered to the whole group"

    @property
    def offered(self) -> bool:
        return self is RowSharing.GROUP


def row_sharing(*, mode: Mode, planned: bool, remote: bool) -> RowSharing:
    """Whether this rank offers to share row reads with its tensor-parallel group.

    Args:
        mode: the ``row_exchange`` setting.
        planned: the rank reads from a per-rank plan (``plan_per_rank``, and the probe could
            describe the model's loading); without one every tensor is read whole.
        remote: the checkpoint is in an object store.

    Returns:
        The offer.
    """
    if not planned or mode == "never":
        return RowSharing.OFF
    if mode == "always" or remote:
        return RowSharing.GROUP
    return RowSharing.FILES


class ReplicaSharing(str, enum.Enum):
    """Whether a rank offers the ranks that hold what it holds (its data-parallel group) to read
    what they hold alike once among them (``dp_exchange``): each reads a block of the rows and
    sends it to the others, instead of every rank reading all of it."""

    #: Not offered: ``never``, or no per-rank plan (every tensor is read whole).
    OFF = "not offered"
    #: Not offered, ``auto`` on a local disk: there one page cache, or a disk that each node
    #: reads at its own rate, serves every rank of the node; the exchange would add its sends.
    LOCAL = "not offered: local files, where each rank reads them itself"
    #: Offered: ``always``, an object store or a network filesystem, where every rank's read is a
    #: fetch from the same shared storage.
    GROUP = "offered to the group"

    @property
    def offered(self) -> bool:
        return self is ReplicaSharing.GROUP


def replica_sharing(*, mode: Mode, planned: bool, remote: bool, network: bool) -> ReplicaSharing:
    """Whether this rank offers to read what its data-parallel group holds alike once among them.

    Args:
        mode: the ``dp_exchange`` setting.
        planned: the rank reads from a per-rank plan.
        remote: the checkpoint is in an object store.
        network: its files are on a network filesystem.

    Returns:
        The offer.
    """
    if not planned or mode == "never":
        return ReplicaSharing.OFF
    if mode == "always" or remote or network:
        return ReplicaSharing.GROUP
    return ReplicaSharing.LOCAL


def whole_reads_direct_io(direct_io: Mode, *, world: int) -> Mode:
    """The ``direct_io`` for reading every tensor whole on every rank (no per-rank plan): at TP>1
    'auto' reads through the page cache, so that where the ranks share a machine one rank's disk
    read serves them all (with O_DIRECT each rank would read the whole checkpoint from the disk)."""
    return "never" if world > 1 and direct_io == "auto" else direct_io


def prefault_whole_reads(cpus: int) -> bool:
    """Whether fresh parameter pages are faulted in on another thread ahead of a model's
    ``load_weights`` copying every tensor into them: with one CPU that thread would only take
    turns with the copies."""
    return cpus > 1


@dataclass(frozen=True)
class Filesystem:
    """A checkpoint file's filesystem, as ``early_reads`` needs to know it."""

    #: The type the kernel names it by (``/proc/self/mountinfo``): "ext4", "nfs4", "fuse.sshfs"...
    type: str
    #: Reads on it cross a network (``machine.is_network``).
    network: bool


def reads_early_by_default(fs: Filesystem) -> bool:
    """Whether ``early_reads`` 'auto' reads ahead on ``fs``: not on network filesystems, nor on FUSE
    mounts (most fetch from a network or an object store), where the client's own work (sshfs
    decrypting, for one) shares the CPUs with the engine's start-up and the start is not sooner."""
    return not fs.network and not fs.type.startswith("fuse")


class EarlyReads(str, enum.Enum):
    """Whether a checkpoint is read into the page cache while the engine starts."""

    READ = "read"
    #: An object store: nothing on this node's disks to read early.
    REMOTE = "not read: an object store"
    #: Neither a directory nor a Hugging Face id (a single file, or a path that is not there).
    NOT_A_CHECKPOINT = "not read: neither a directory nor a Hugging Face id"
    OFF = "not read: early_reads is never"
    #: 'auto', and a file on a filesystem ``reads_early_by_default`` refuses.
    NETWORK = "not read: a file on a network or FUSE filesystem"


class EarlyFacts(Protocol):
    """What ``early_reads`` may ask; ``mode`` and ``filesystems`` cost work (parsing the config,
    finding the checkpoint's files) and are asked only where they decide something."""

    @property
    def remote(self) -> bool:
        """The model is an object-store URI."""

    @property
    def directory(self) -> bool:
        """The model is a local directory."""

    @property
    def hub_id(self) -> bool:
        """The model is a Hugging Face id (``org/name``)."""

    @property
    def mode(self) -> Mode:
        """The ``early_reads`` setting."""

    @property
    def filesystems(self) -> Iterable[Filesystem]:
        """The filesystems of the checkpoint's files, one per file, found as they are iterated."""


def early_reads(facts: EarlyFacts) -> EarlyReads:
    """Whether to read the checkpoint into the page cache while the engine starts (``early_reads``:
    by default where every file is on a filesystem ``reads_early_by_default`` accepts).

    Example:
        >>> from types import SimpleNamespace as F
        >>> early_reads(F(remote=False, directory=True, hub_id=False, mode="auto",
        ...               filesystems=[Filesystem("nfs4", network=True)]))
        <EarlyReads.NETWORK: 'not read: a file on a network or FUSE filesystem'>
    """
    if facts.remote:
        return EarlyReads.REMOTE
    if not facts.directory and not facts.hub_id:
        return EarlyReads.NOT_A_CHECKPOINT
    mode = facts.mode
    if mode == "never":
        return EarlyReads.OFF
    if mode == "auto" and not all(reads_early_by_default(fs) for fs in facts.filesystems):
        return EarlyReads.NETWORK
    return EarlyReads.READ


class Headroom(Protocol):
    """A memory limit as ``early_reads_memory`` sees it (``machine.MemoryLimit``)."""

    @property
    def free(self) -> int:
        """Bytes that may still be filled under it."""


#: The kind of limit a decision was made from.
H = TypeVar("H", bound=Headroom)


@dataclass(frozen=True)
class EarlyReadsMemory(Generic[H]):
    """Whether a checkpoint fits the memory early reads may fill, and under which limit."""

    #: The checkpoint fits in ``allowed``.
    fits: bool
    #: The limit with the least free under it: the one that decided.
    limit: H
    #: Bytes early reads may fill: ``EARLY_READS_MEMORY_SHARE`` of what is free under ``limit``.
    allowed: int


def early_reads_memory(size: int, limits: Iterable[H]) -> EarlyReadsMemory[H]:
    """Whether ``size`` bytes of checkpoint fit in the page cache early reads may fill: a share
    (``EARLY_READS_MEMORY_SHARE``) of the least free under any of ``limits`` (the machine's
    available memory, every cgroup memory limit over the process), since page cache counts against
    each of them.

    Example:
        >>> from types import SimpleNamespace as L
        >>> early_reads_memory(3 << 30, [L(free=20 << 30), L(free=5 << 30)]).fits
        False
    """
    lowest = min(limits, key=lambda limit: limit.free)
    allowed = int(lowest.free * EARLY_READS_MEMORY_SHARE)
    return EarlyReadsMemory(size <= allowed, lowest, allowed)


class Quota(Protocol):
    """A CPU quota as ``early_reads_pacing`` sees it (``machine.CpuQuota``)."""

    @property
    def directory(self) -> str:
        """The cgroup whose ``cpu.stat`` counts the time the quota held it back."""

    def describe(self) -> str:
        """The quota in words, for the reads' log line."""


@dataclass(frozen=True)
class EarlyReadsPacing:
    """Whether early reads pause while a CPU quota over them holds their group back."""

    #: The cgroup directory they watch (its ``cpu.stat``); None: no quota over them, nothing to pace.
    group: str | None
    #: Seconds of one pause (``EARLY_READS_QUOTA_PAUSE_S``).
    pause_s: float = 0.0
    #: The quota in words (``machine.CpuQuota.describe``), for the line that says how long they paused.
    quota: str = ""


def early_reads_pacing(quota: Quota | None) -> EarlyReadsPacing:
    """Early reads under a CPU quota (``machine.cpu_quota``, the lowest over the process: the
    group the engine's processes share it in) pause whenever it has held the group back since
    they last looked (``early_reads_pause``); with no quota, idle CPU priority alone keeps them off
    the engine's CPU time."""
    if quota is None:
        return EarlyReadsPacing(None)
    return EarlyReadsPacing(quota.directory, EARLY_READS_QUOTA_PAUSE_S, quota.describe())


def early_reads_pause(pacing: EarlyReadsPacing, throttled_before_s: float | None,
                      throttled_now_s: float | None) -> float:
    """Seconds to pause before reading on: ``pacing.pause_s`` where the quota held the group back
    between two looks at its throttled time, else none (nor where the group does not say).

    Example:
        >>> paced = EarlyReadsPacing("/sys/fs/cgroup/cpu/job", 0.2)
        >>> early_reads_pause(paced, 1.5, 1.6), early_reads_pause(paced, 1.6, 1.6)
        (0.2, 0.0)
    """
    if throttled_before_s is None or throttled_now_s is None:
        return 0.0
    return pacing.pause_s if throttled_now_s > throttled_before_s else 0.0


def early_reads_chunk(*, looking: bool) -> int:
    """Bytes early reads populate before they next look at their CPU wait and for a load:
    ``EARLY_READS_STARVED_CHUNK`` while ``looking`` (they may yet leave idle priority), else
    ``EARLY_READS_CHUNK``."""
    return EARLY_READS_STARVED_CHUNK if looking else EARLY_READS_CHUNK


class StarvedReads(str, enum.Enum):
    """What early reads that have waited ``EARLY_READS_STARVED_S`` for a CPU do next."""

    #: The start's own processes keep the CPUs busy (SGLang's start-up): a fair share for the reads
    #: is a small cost to it, repaid at the load.
    BATCH = "reading on as a batch job: the start's own processes keep the CPUs busy"
    #: Other work keeps the CPUs busy: a fair share for the reads would come out of the start's
    #: share too, for no idle time to repay it; the load reads what they have not.
    IDLE = "reading on at idle priority only: other work keeps the CPUs busy"


class Spent(Protocol):
    """CPU time as ``starved_reads`` sees it (``machine.CpuTime``)."""

    @property
    def busy_s(self) -> float:
        """Seconds the CPUs have run anything."""

    @property
    def start_s(self) -> float:
        """Seconds the start's processes have run."""


@dataclass(frozen=True)
class CpuSplit:
    """CPU time between two looks, by whom: what ``starved_reads`` decides on and logs."""

    #: Seconds the start's processes ran.
    start_s: float
    #: Seconds everything else ran on the same CPUs (the reads themselves left out).
    other_s: float


def cpu_split(before: Spent | None, now: Spent | None, reads_s: float) -> CpuSplit | None:
    """The CPU time between two looks, the start's against everything else's (``reads_s``: the
    reads' own, counted as neither); None where either look has nothing."""
    if before is None or now is None:
        return None
    start = now.start_s - before.start_s
    return CpuSplit(start, now.busy_s - before.busy_s - start - reads_s)


def starved_reads(before: Spent | None, now: Spent | None, reads_s: float) -> StarvedReads:
    """``BATCH`` where the start's processes ran at least as long as everything else on its CPUs
    between two looks (``reads_s``: the reads' own time, counted as neither), else ``IDLE``; and
    ``BATCH`` where the kernel does not say.

    Example:
        >>> from types import SimpleNamespace as T
        >>> starved_reads(T(busy_s=0, start_s=0), T(busy_s=2.0, start_s=0.7), 0.1).name
        'IDLE'
        >>> starved_reads(T(busy_s=0, start_s=0), T(busy_s=2.0, start_s=1.8), 0.1).name
        'BATCH'
    """
    split = cpu_split(before, now, reads_s)
    return StarvedReads.BATCH if split is None or split.start_s >= split.other_s else StarvedReads.IDLE


class EarlyScope(str, enum.Enum):
    """What of the checkpoint a node reads early."""

    #: One node: its ranks hold the whole model between them (and share its page cache).
    EVERY_FILE = "every file: the ranks on this node hold the whole model between them"
    #: Several nodes, and the engine's layout of this node's ranks could not be read.
    UNKNOWN_LAYOUT = "every file: the start spans several nodes, but what this node's ranks hold is unknown"
    #: Several nodes: the layers, experts, slices, embeddings and head this node's ranks hold.
    NODE = "this node's share: what its ranks hold"


def early_scope(*, nodes: int, layout_known: bool) -> EarlyScope:
    """What a node reads early, where one model spans ``nodes`` nodes: with one, every file; with
    several, the node's share (``early.node_share``) where the layout of its ranks is known, else
    every file (more than its ranks read, never less)."""
    if nodes <= 1:
        return EarlyScope.EVERY_FILE
    return EarlyScope.NODE if layout_known else EarlyScope.UNKNOWN_LAYOUT


class DecisionLog:
    """Logs each decision at debug level the first time it comes out a given way, with the facts
    it was made from: one line per outcome per load, so an operator can see why fastload did
    what it did without a line per chunk."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def note(self, topic: str, outcome: object, **facts: object) -> None:
        """Log ``outcome`` of ``topic`` (once per distinct outcome) with ``facts``."""
        key = (topic, str(outcome))
        if key in self._seen:
            return
        self._seen.add(key)
        if logger.isEnabledFor(logging.DEBUG):
            shown = getattr(outcome, "value", outcome)
            logger.debug("fastload: %s: %s (%s)", topic, shown, ", ".join(f"{k}={v}" for k, v in facts.items()))
