"""Early reads: bring local checkpoint files into the page cache, in the background, while the
engine is still starting, and keep them there until the loads that need them are done.

Each file is mapped and populated 16 MiB at a time (``madvise(MADV_POPULATE_READ)``: the kernel
reads the pages in, nothing is copied into the process), and each page is touched once (see
``_populate``); ``posix_fadvise(WILLNEED)`` alone reads only a few percent of a large file. Reading
stops as soon as a load begins (it reads the rest itself). The mappings stay until the loads have
ended (``LoadMarks``; or ``hold_s`` runs out), because hosts that reclaim idle page cache on their
own (DAMON's ``pageout`` scheme on cloud VMs) take only pages that no process maps: read and
dropped, a checkpoint was partly gone before the workers asked for it. Mapped pages are still page
cache (the kernel reclaims them under memory pressure like any other); they show in this process's
RSS while held. Where the kernel lacks ``MADV_POPULATE_READ`` (before Linux 5.14) each chunk is
read through one small reused buffer instead, and nothing is held. A file that cannot be read is
skipped: the loader reads it at load time and reports what is wrong. The caller bounds it by
memory: the files are read only if they fit in a share of the memory available now
(``available_memory``).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger("vllm_fastload")


def available_memory() -> int:
    """Bytes this process could fill with page cache without evicting what others use: the
    kernel's ``MemAvailable``, lowered to the cgroup's headroom where a memory limit is set
    (page cache counts against a container's limit)."""
    available = _meminfo("MemAvailable")
    limit, used = _cgroup("memory.max"), _cgroup("memory.current")
    if limit is not None and used is not None:
        available = min(available, max(limit - used, 0))
    return available


def read_ahead(paths: Sequence[str], *, limit: int, hold: LoadMarks | None = None,
               hold_s: float = 0.0) -> threading.Thread | None:
    """Start reading ``paths`` into the page cache on a daemon thread, if together they fit in
    ``limit`` bytes; None (and nothing done) otherwise.

    With ``hold``, the thread stops reading when a load begins, and keeps the files mapped until
    every load it expects has ended (looked for every ``POLL_S``) or ``hold_s`` seconds have
    passed since the reads ended; then it unmaps them, removes the marks and ends."""
    total = sum(os.path.getsize(p) for p in paths)
    if total > limit:
        logger.info("fastload: no early reads: the checkpoint (%.2f GB) exceeds the share of available memory "
                    "early reads may fill (%.2f GB); it is read at load time", total / 1e9, limit / 1e9)
        return None
    thread = threading.Thread(target=_advise, args=(list(paths), hold, hold_s), name="fastload-early-reads",
                              daemon=True)
    thread.start()
    return thread


#: Bytes populated at a time (between two looks for a load that has begun).
CHUNK = 16 << 20
#: ``MADV_POPULATE_READ`` (Linux 5.14); Python's ``mmap`` names it from 3.12 on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: Seconds between two looks for the loads' marks.
POLL_S = 0.2


def _advise(paths: list[str], hold: LoadMarks | None, hold_s: float) -> None:
    _run_when_idle()
    start = time.perf_counter()
    held: list[mmap.mmap] = []
    try:
        held, read, stopped = _read_in(paths, hold=hold is not None, stop=hold.started if hold else None)
        if stopped:
            logger.info("fastload: early reads: stopped after %.2f s, when the load began; %.2f of %.2f GB "
                        "read early", time.perf_counter() - start, read / 1e9,
                        sum(os.path.getsize(p) for p in paths) / 1e9)
        else:
            logger.info("fastload: early reads: %d files in the page cache after %.2f s", len(paths),
                        time.perf_counter() - start)
        deadline = time.monotonic() + hold_s
        while held and time.monotonic() < deadline and not hold.all_done():
            time.sleep(POLL_S)
    finally:
        for view in held:
            view.close()
        if held:
            logger.info("fastload: early reads: files unmapped after %.2f s, %d of %d loads done",
                        time.perf_counter() - start, hold.done(), hold.expected)
        if hold is not None:
            hold.remove()


def _run_when_idle() -> None:
    """Run this thread only on CPU time nothing else wants (Linux ``SCHED_IDLE``): reading early
    must not slow the start-up it overlaps with, which on a machine with few cores is CPU-bound."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _read_in(paths: list[str], *, hold: bool = False,
             stop: Callable[[], bool] | None = None) -> tuple[list[mmap.mmap], int, bool]:
    """Read ``paths`` into the page cache, a chunk at a time, until ``stop()`` says to stop: the
    mappings of the files when ``hold`` (else none), the bytes read, and whether it stopped.

    Stopping matters once a load has begun: it reads what it needs itself, in its own order, and
    reading the same bytes here would only make the two share the disk."""
    held: list[mmap.mmap] = []
    buffer: bytearray | None = None
    read = 0
    stopped = False
    for path in paths:
        if stop is not None and (stopped or stop()):
            stopped = True
            break
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if not size:
                    continue
                view = None if buffer is not None else mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
                for offset in range(0, size, CHUNK):
                    if stop is not None and offset and stop():
                        stopped = True
                        break
                    length = min(CHUNK, size - offset)
                    if view is not None and not _populate(view, offset, length):
                        view.close()
                        view, buffer = None, bytearray(8 << 20)
                    if view is None:
                        _read_through(f.fileno(), offset, length, buffer)
                    read += length
                if view is not None and hold:
                    held.append(view)
                elif view is not None:
                    view.close()
        except (OSError, ValueError):
            continue
    return held, read, stopped


def _populate(view: mmap.mmap, offset: int, length: int) -> bool:
    """Read a chunk of a mapped file into the page cache, and touch each of its pages once; False
    where the kernel cannot populate a mapping.

    The touch (one byte read per page, ~0.01 s per 400 MB where it costs nothing more) is for
    hosts that back a VM's memory lazily: there the first CPU access to a page the disk filled
    costs a fault in the hypervisor, which made a later copy out of the page cache 3-12x slower
    (0.5-2 GB/s instead of 6 GB/s on this project's VM); touched here, that cost is paid while
    vLLM starts instead of in the load."""
    try:
        view.madvise(MADV_POPULATE_READ, offset, length)
    except OSError:
        return False
    pages = np.frombuffer(view, dtype=np.uint8, count=length, offset=offset)
    int(pages[::mmap.PAGESIZE].max())
    del pages  # the mapping cannot be closed while a view of it is alive
    return True


def _read_through(fd: int, offset: int, length: int, buffer: bytearray) -> None:
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - offset)]], offset)
        if n <= 0:
            return
        offset += n


class LoadMarks:
    """How the process that reads early learns when the loads it reads for begin and end: a
    directory in which each loading process leaves a mark as its load begins and one as it ends
    (the loads run in other processes, which inherit the directory's path)."""

    def __init__(self, expected: int) -> None:
        self.expected = max(expected, 1)
        self.directory = tempfile.mkdtemp(prefix="fastload-loads-")

    def _count(self, kind: str) -> int:
        try:
            return sum(name.startswith(kind) for name in os.listdir(self.directory))
        except OSError:
            return 0

    def started(self) -> bool:
        """Whether a load has begun (True once the directory is gone)."""
        return self._count("begun-") > 0 or not os.path.isdir(self.directory)

    def done(self) -> int:
        """How many loads have ended."""
        return self._count("ended-")

    def all_done(self) -> bool:
        """Whether ``expected`` loads have ended (True once the directory is gone)."""
        return self.done() >= self.expected or not os.path.isdir(self.directory)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def mark_load(directory: str, *, ended: bool) -> None:
    """Leave this process's mark, its load begun or ended, in a ``LoadMarks`` directory (nothing
    if it is gone)."""
    try:
        with open(os.path.join(directory, f"{'ended' if ended else 'begun'}-{os.getpid()}"), "w"):
            pass
    except OSError:
        pass


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    return 0


def _cgroup(name: str) -> int | None:
    try:
        with open(f"/sys/fs/cgroup/{name}") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
