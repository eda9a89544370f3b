"""The reading process: a bare interpreter (``python -I -S``, started by ``early.process``) that
brings checkpoint files into the page cache and holds them until the loads are done.

It runs standard library code only, imported through the package's empty root: this module,
``early.marks``, ``machine`` and ``policy``. It starts in milliseconds, and nothing it imports can
race the starting process's imports or start threads.

At idle CPU priority (Linux ``SCHED_IDLE``): reading early must not slow the start-up it overlaps
with, which on a machine with few cores is CPU-bound. Where the start-up leaves no idle CPU time at
all (SGLang's, whose processes keep every core busy until the load), idle priority starves the
reads and they have not finished when the load begins; with ``starved_s`` the process leaves idle
priority once it has waited that long for a CPU and reads on as a batch job (``SCHED_BATCH``: a
fair share, never preempting the start-up's processes as it wakes). Reading costs little CPU (the
kernel fills the pages; the process touches each once), so that share is small. Only where the
start's own processes kept the CPUs busy while it waited: where other work on the node did, a
share for the reads would come out of the start's too, with no idle time ahead to repay it, and
the process stays at idle priority (``policy.starved_reads``). Under a CPU quota
(a container's CPU limit) idle priority is not enough: the reads spend the quota the engine's
processes share, however idle the CPUs are; so with ``pacing`` the process pauses between chunks
whenever the quota has held its group back since it last looked (``policy.early_reads_pause``).

Each file is mapped and populated ``policy.EARLY_READS_CHUNK`` bytes at a time, or
``policy.EARLY_READS_STARVED_CHUNK`` while it may yet leave idle priority (it looks between two
chunks, and a large one populated while starved takes seconds to come back)
(``madvise(MADV_POPULATE_READ)``: the kernel reads the pages in, nothing is copied into the
process), and each page is touched once (see ``_Mapping``); ``posix_fadvise(WILLNEED)`` alone reads
only a few percent of a large file. Reading stops as soon as a load begins (it reads the rest
itself). The mappings stay until the loads have ended (``marks.LoadMarks``; or ``hold_s`` runs out,
memory runs low, or the starting process ends), because the kernel's proactive reclaim of idle
page cache takes only pages that no process maps: unmapped, part of a checkpoint could be
reclaimed before the workers ask for it. Mapped pages are still page cache,
which memory pressure can reclaim (after unmapped page cache); they show in the reading process's
RSS while held. Where the kernel lacks ``MADV_POPULATE_READ`` (before Linux 5.14) each chunk is
read through one small reused buffer instead, and nothing is held. A file that cannot be read is
skipped: the loader reads it at load time and reports what is wrong.

A file is read whole, or only some byte ranges of it (a node's share on a start over several
nodes), exactly, widened only to whole pages (see ``_Mapping``).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vllm_fastload import machine, policy
from vllm_fastload.early.marks import LoadMarks

MADV_POPULATE_READ = 22  # Linux 5.14
PR_SET_PDEATHSIG = 1


def main() -> None:
    """Serve the request the starting process writes on standard input."""
    _serve(json.loads(sys.stdin.read()))


def _serve(request: dict[str, Any]) -> None:
    """The reading process: read, report, hold, report, end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C ends the process that started it, then this one
    parent = request["parent"]
    if request.get("main_thread"):
        _end_with(parent)
    starved = _Starved(request.get("starved_s"), parent)  # (its first look before idle priority can starve it)
    _run_when_idle()
    start = time.perf_counter()
    paced = _Paced(policy.EarlyReadsPacing(*request["pacing"]) if request.get("pacing") else None)
    paths = request["paths"]
    hold = None if request["marks"] is None else LoadMarks(request["marks"][1], directory=request["marks"][0])
    held: list[_Mapping] = []
    why = "every load it was read for has ended"

    def orphaned() -> bool:
        return bool(os.getppid() != parent)

    try:
        def load_began() -> bool:
            return orphaned() or (hold is not None and hold.started())

        def stop() -> bool:
            starved.check()  # (between two chunks: where it may leave idle priority, or pause)
            paced.wait(load_began)
            return load_began()

        spans = request.get("spans") or {}
        held, read, files, stopped = _read_in(paths, hold=hold is not None, stop=stop, spans=spans,
                                              chunk=lambda: policy.early_reads_chunk(looking=starved.looking))
        _report_reads(request, time.perf_counter() - start, read, files, stopped)
        if paced.paused_s:
            _report("fastload: early reads: paused %.1f s in all while the %s held the start back",
                    paced.paused_s, paced.pacing.quota if paced.pacing else "CPU quota")
        _run_normally()  # only sleeps and lists a directory from now on: let it notice the marks on time
        deadline = time.monotonic() + request["hold_s"]
        while hold is not None and held and not hold.all_done():
            if time.monotonic() >= deadline:
                why = f"not every load it was read for ended within {request['hold_s']:.0f} s"
                break
            if _memory_low(request["low_memory"]):
                why = "memory ran low"
                break
            if orphaned():
                why = "the process that started it ended"
                break
            time.sleep(policy.EARLY_READS_POLL_S)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        why = f"{type(exc).__name__}: {exc}"
    finally:
        for mapping in held:
            mapping.close()
        if hold is not None:
            _report("fastload: early reads: files released after %.2f s, %d of %d loads done (%s)",
                    time.perf_counter() - start, hold.done(), hold.expected, why)
            hold.remove()


def _report_reads(request: dict[str, Any], seconds: float, read: int, files: int, stopped: bool) -> None:
    paths = request["paths"]
    if stopped:
        _report("fastload: early reads: stopped after %.2f s, when the load began; %.2f of %.2f GB read early",
                seconds, read / 1e9, request["total"] / 1e9)
    elif request.get("spans"):
        _report("fastload: early reads: %d of %d files in the page cache after %.2f s (%.2f GB: the ranges "
                "of them this node's ranks read)", files, len(paths), seconds, read / 1e9)
    else:
        _report("fastload: early reads: %d of %d files in the page cache after %.2f s", files, len(paths), seconds)


def _end_with(parent: int) -> None:
    """Have the kernel end this process when the one that started it ends, however it ends
    (``PR_SET_PDEATHSIG``): a read of a disk that stopped answering can block this process for
    good, and then it never looks for its parent again. Only where the main thread started it:
    the kernel counts the starting thread's end as the parent's."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the polling below still notices a parent that is gone
    if os.getppid() != parent:  # it ended before the kernel was asked
        os._exit(0)


def _report(message: str, *args: Any) -> None:
    """A line for the starting process's log (nothing if it is gone). Unbuffered: nothing is left
    to flush, and fail, at exit."""
    try:
        os.write(sys.stdout.fileno(), (json.dumps([message, args]) + "\n").encode())
    except OSError:
        pass


def _run_when_idle() -> None:
    """Run this process only on CPU time nothing else wants (Linux ``SCHED_IDLE``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class _Starved:
    """Once the process has waited ``limit_s`` seconds for a CPU (the run-queue wait the kernel counts
    in ``/proc/self/schedstat``), leaves idle priority for ``SCHED_BATCH`` where the start's own
    processes (``start`` and its descendants) are what kept the CPUs busy meanwhile, and stays
    where other work did (``policy.starved_reads``); never without a limit."""

    def __init__(self, limit_s: float | None, start: int) -> None:
        self._limit_s, self._starter, self._done = limit_s, start, limit_s is None
        self._began = time.perf_counter()
        self._before = None if self._done else machine.cpu_time(start, leave_out=os.getpid())
        self._own = _own_cpu_s()
        self._waited = _cpu_wait_s()  # (its start, at normal priority, waited too: not starved)

    @property
    def looking(self) -> bool:
        """Whether it may yet leave idle priority."""
        return not self._done

    def check(self) -> None:
        if self._done:
            return
        waited = _cpu_wait_s()
        if waited is None or self._waited is None:
            return
        waited -= self._waited
        if waited < (self._limit_s or 0.0):
            return
        self._done = True
        try:  # first, for the look at the CPU time: at idle priority it would starve as the reads do
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except (AttributeError, OSError):
            return
        now = machine.cpu_time(self._starter, leave_out=os.getpid())
        own = _own_cpu_s() - self._own
        decision, split = policy.starved_reads(self._before, now, own), policy.cpu_split(self._before, now, own)
        spent = "" if split is None else (f" (meanwhile the start's processes ran {split.start_s:.1f} CPU s, "
                                          f"other work {split.other_s:.1f})")
        if decision is policy.StarvedReads.IDLE:
            _run_when_idle()
        _report("fastload: early reads: no idle CPU time for them (%.1f s waiting for a CPU in %.1f s); %s%s",
                waited, time.perf_counter() - self._began, decision.value, spent)


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class _Paced:
    """Pauses the reads between two chunks while the CPU quota over them holds their group back,
    until a pause passes without it or a load begins (``policy.early_reads_pause``); never without
    a quota."""

    def __init__(self, pacing: policy.EarlyReadsPacing | None) -> None:
        self.pacing = pacing
        self._last = machine.throttled_s(pacing.group) if pacing and pacing.group else None
        self.paused_s = 0.0

    def wait(self, load_began: Callable[[], bool]) -> None:
        pacing = self.pacing
        if pacing is None or pacing.group is None:
            return
        while True:
            now = machine.throttled_s(pacing.group)
            pause, self._last = policy.early_reads_pause(pacing, self._last, now), now
            if not pause or load_began():
                return
            time.sleep(pause)
            self.paused_s += pause


def _cpu_wait_s() -> float | None:
    """Seconds this process has waited on a run queue (runnable, not running); None where the kernel
    does not say."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _run_normally() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # without the privilege to (RLIMIT_NICE): it notices marks when idle time allows


def _memory_low(share: float) -> bool:
    """Whether less than ``share`` of some memory limit (the machine's memory, a cgroup's limit)
    is free under it."""
    return any(limit.free < share * limit.limit for limit in machine.memory_limits())


def _read_in(paths: list[str], *, hold: bool = False, stop: Callable[[], bool] | None = None,
             spans: dict[str, Sequence[Sequence[int]]] | None = None,
             chunk: Callable[[], int] | None = None) -> tuple[list[_Mapping], int, int, bool]:
    """Read ``paths`` into the page cache, a chunk at a time, until ``stop()`` says to stop: the
    mappings of the files when ``hold`` (else none), the bytes read, the files read whole (or
    every span of), and whether it stopped. ``spans``: for the files named, only these
    ``[start, end)`` ranges (see ``_pieces``); ``chunk()``: the size of the next chunk
    (``policy.EARLY_READS_CHUNK`` without it).

    Stopping matters once a load has begun: it reads what it needs itself, in its own order, and
    reading the same bytes here would only make the two share the disk."""
    reader = _FileReader(chunk or (lambda: policy.EARLY_READS_CHUNK))
    held: list[_Mapping] = []
    read = files = 0
    stopped = False
    for path in paths:
        if stop is not None and (stopped or stop()):
            stopped = True
            break
        mapping, nbytes, whole, stopped = reader.read(path, (spans or {}).get(path), stop)
        read, files = read + nbytes, files + whole
        if mapping is not None and hold:
            held.append(mapping)
        elif mapping is not None:
            mapping.close()
    return held, read, files, stopped


class _FileReader:
    """Reads one file after another, chunk by chunk: mapped and populated; through a buffer first
    where only ranges of it are read (see ``_Mapping``); through the buffer alone once the kernel
    turns out not to populate mappings (nothing is held then)."""

    def __init__(self, chunk: Callable[[], int]) -> None:
        self._buffer: bytearray | None = None  # made on first use
        self._unmappable = False
        self._chunk_size = chunk

    def read(self, path: str, spans: Sequence[Sequence[int]] | None,
             stop: Callable[[], bool] | None) -> tuple[_Mapping | None, int, bool, bool]:
        """The file's mapping (None: none made), the bytes read, whether it was read to its end,
        and whether ``stop()`` stopped it. A file that cannot be read is left where it failed: the
        loader reads it at load time and says what is wrong with it."""
        mapping, read = None, 0
        try:
            with open(path, "rb", buffering=0) as f:
                fd, exact = f.fileno(), spans is not None
                size = os.fstat(fd).st_size
                if exact:  # reads read no further than asked (no read-ahead): see ``_Mapping``
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                if size and not self._unmappable:
                    mapping = _Mapping(fd, size, exact=exact)
                pieces = _pieces(size, spans, self._chunk_size)
                piece, n = next(pieces, None), 0
                while piece is not None:
                    if stop is not None and n and stop():
                        return mapping, read, False, True
                    following = next(pieces, None)
                    if exact and following is not None:  # the disk reads the next piece while this one is copied
                        os.posix_fadvise(fd, *following, os.POSIX_FADV_WILLNEED)
                    mapping = self._chunk(fd, mapping, *piece, exact)
                    read, piece, n = read + piece[1], following, n + 1
        except (OSError, ValueError):  # ValueError: mmap of a file that shrank since its size was read
            return mapping, read, False, False
        return mapping, read, True, False

    def _chunk(self, fd: int, mapping: _Mapping | None, offset: int, length: int, exact: bool) -> _Mapping | None:
        """Read one chunk; the mapping to go on with (None once the kernel cannot populate one)."""
        through = exact or mapping is None  # exact: read first, then mapped
        if through:
            self._read_through(fd, offset, length)
        if mapping is not None and not mapping.populate(offset, length):
            mapping.close()
            self._unmappable = True
            if not through:
                self._read_through(fd, offset, length)
            return None
        return mapping

    def _read_through(self, fd: int, offset: int, length: int) -> None:
        self._buffer = self._buffer or bytearray(8 << 20)
        _read_through(fd, offset, length, self._buffer)


def _pieces(size: int, spans: Sequence[Sequence[int]] | None, chunk: Callable[[], int]) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of the chunks to read of a file of ``size`` bytes: all of it, or each
    span widened to whole pages (``madvise`` takes page-aligned ranges; the kernel reads whole
    pages anyway) and clipped to the file, in chunks of at most ``chunk()`` bytes (asked for each)."""
    page = mmap.PAGESIZE
    sections = [(0, size)] if spans is None else [
        (start // page * page, min(size, -(-end // page) * page)) for start, end in spans]
    done = 0  # sections are sorted and disjoint, but widening may make neighbours overlap
    for start, end in sections:
        offset = max(start, done)
        while offset < end:
            length = min(chunk(), end - offset)
            yield offset, length
            offset += length
        done = max(done, end)


class _Mapping:
    """A read-only shared mapping of a whole file. (Python's ``mmap.madvise`` keeps the GIL while
    the kernel reads: harmless in the reading process, which has one thread.)

    ``exact``: only some ranges of the file are read. A fault in a mapping reads around the page
    it needs, as far as the device's read-ahead window (often several MiB), which would read what
    other nodes' ranks hold; so such a mapping is marked random (no read-around), and the caller
    reads each chunk through a buffer first (``_read_through`` on a descriptor advised random: it
    reads exactly what is asked, in requests as large as the device takes), leaving the mapping
    only cached pages to map and touch.
    """

    def __init__(self, fd: int, size: int, *, exact: bool = False) -> None:
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        if exact:
            self._map.madvise(mmap.MADV_RANDOM)

    def populate(self, offset: int, length: int) -> bool:
        """Read a chunk into the page cache and touch each of its pages once; False where the
        kernel cannot populate a mapping (before Linux 5.14).

        The touch (one byte read per page) is for hosts that back a VM's memory lazily: there the
        first CPU access to a page the disk filled costs a fault in the hypervisor, which makes a
        later copy out of the page cache several times slower; touched here, that cost is paid
        while vLLM starts instead of in the load."""
        try:
            self._map.madvise(MADV_POPULATE_READ, offset, length)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        with memoryview(self._map) as view, view[offset:offset + length:mmap.PAGESIZE] as pages:
            pages.tobytes()
        return True

    def close(self) -> None:
        self._map.close()


def _read_through(fd: int, offset: int, length: int, buffer: bytearray) -> None:
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - offset)]], offset)
        if n <= 0:
            return
        offset += n
