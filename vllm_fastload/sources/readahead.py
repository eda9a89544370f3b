"""Early reads: bring local checkpoint files into the page cache, in the background, while the
engine is still starting, and keep them there until the loads that need them are done.

Each file is mapped and populated 16 MiB at a time (``madvise(MADV_POPULATE_READ)``: the kernel
reads the pages in, nothing is copied into the process), and each page is touched once (see
``_Mapping``); ``posix_fadvise(WILLNEED)`` alone reads only a few percent of a large file. Reading
runs on idle CPU time and stops as soon as a load begins (it reads the rest itself). The mappings
stay until the loads have ended (``LoadMarks``; or ``hold_s`` runs out, or memory runs low),
because hosts that reclaim idle page cache on their own (DAMON's ``pageout`` scheme on cloud VMs)
take only pages that no process maps: read and dropped, a checkpoint was partly gone before the
workers asked for it. Mapped pages are still page cache, which memory pressure can reclaim (after
unmapped page cache); they show in this process's RSS while held. Where the kernel lacks
``MADV_POPULATE_READ`` (before Linux 5.14) each chunk is read through one small reused buffer
instead, and nothing is held. A file that cannot be read is skipped: the loader reads it at load
time and reports what is wrong. The caller bounds it by memory: the files are read only if they
fit in a share of the memory available now (``available_memory``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from vllm_fastload.libc import MAP_FAILED, releasing_gil

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
    every load it expects has ended (looked for every ``POLL_S``), ``hold_s`` seconds have passed
    since the reads ended, or memory runs low; then it unmaps them, removes the marks and ends."""
    total = sum(os.path.getsize(p) for p in paths)
    if total > limit:
        logger.info("fastload: no early reads: the checkpoint (%.2f GB) exceeds the share of available memory "
                    "early reads may fill (%.2f GB); it is read at load time", total / 1e9, limit / 1e9)
        return None
    thread = threading.Thread(target=_advise, args=(list(paths), total, hold, hold_s), name="fastload-early-reads",
                              daemon=True)
    thread.start()
    return thread


#: Bytes populated at a time (between two looks for a load that has begun).
CHUNK = 16 << 20
MADV_POPULATE_READ = 22  # Linux 5.14
MADV_DONTFORK = 10
#: Seconds between two looks for the loads' marks.
POLL_S = 0.2
#: Held files are let go early when less than this share of the machine's memory is available.
LOW_MEMORY = 0.1


def _advise(paths: list[str], total: int, hold: LoadMarks | None, hold_s: float) -> None:
    _run_when_idle()
    start = time.perf_counter()
    held: list[_Mapping] = []
    why = "every load it was read for has ended"
    try:
        held, read, files, stopped = _read_in(paths, hold=hold is not None, stop=hold.started if hold else None)
        _run_normally()  # what is left (looking for marks) must not hold the GIL on a starved thread
        if stopped:
            logger.info("fastload: early reads: stopped after %.2f s, when the load began; %.2f of %.2f GB "
                        "read early", time.perf_counter() - start, read / 1e9, total / 1e9)
        else:
            logger.info("fastload: early reads: %d of %d files in the page cache after %.2f s", files, len(paths),
                        time.perf_counter() - start)
        deadline = time.monotonic() + hold_s
        while held and not hold.all_done():
            if time.monotonic() >= deadline:
                why = f"not every load it was read for ended within {hold_s:.0f} s"
                break
            if _memory_low():
                why = "memory ran low"
                break
            time.sleep(POLL_S)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        why = f"{type(exc).__name__}: {exc}"
    finally:
        for mapping in held:
            mapping.close()
        if hold is not None:
            logger.info("fastload: early reads: files released after %.2f s, %d of %d loads done (%s)",
                        time.perf_counter() - start, hold.done(), hold.expected, why)
            hold.remove()


def _run_when_idle() -> None:
    """Run this thread only on CPU time nothing else wants (Linux ``SCHED_IDLE``): reading early
    must not slow the start-up it overlaps with, which on a machine with few cores is CPU-bound.
    The reads themselves release the GIL (see ``_Mapping``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _run_normally() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # without the privilege to: it only sleeps and lists a directory from now on


def _memory_low() -> bool:
    return available_memory() < LOW_MEMORY * _meminfo("MemTotal")


def _read_in(paths: list[str], *, hold: bool = False,
             stop: Callable[[], bool] | None = None) -> tuple[list[_Mapping], int, int, bool]:
    """Read ``paths`` into the page cache, a chunk at a time, until ``stop()`` says to stop: the
    mappings of the files when ``hold`` (else none), the bytes read, the files read whole, and
    whether it stopped.

    Stopping matters once a load has begun: it reads what it needs itself, in its own order, and
    reading the same bytes here would only make the two share the disk."""
    held: list[_Mapping] = []
    buffer: bytearray | None = None  # set once the kernel cannot populate mappings
    read = files = 0
    stopped = False
    for path in paths:
        if stop is not None and (stopped or stop()):
            stopped = True
            break
        mapping = None
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size and buffer is None:
                    mapping = _Mapping(f.fileno(), size)
                for offset in range(0, size, CHUNK):
                    if stop is not None and offset and stop():
                        stopped = True
                        break
                    length = min(CHUNK, size - offset)
                    if mapping is not None and not mapping.populate(offset, length):
                        mapping.close()
                        mapping, buffer = None, bytearray(8 << 20)
                    if mapping is None:
                        _read_through(f.fileno(), offset, length, buffer)
                    read += length
                else:
                    files += 1
        except OSError:
            pass  # the loader reads this file at load time and says what is wrong with it
        if mapping is not None and hold:
            held.append(mapping)
        elif mapping is not None:
            mapping.close()
    return held, read, files, stopped


class _Mapping:
    """A read-only shared mapping of a whole file, made and advised through libc: Python's
    ``mmap.madvise`` keeps the GIL while the kernel reads, which would stop the process's other
    threads for as long as the disk takes. Not inherited by a child the process forks (vLLM's
    engine core on GPUs), which would keep the files mapped for as long as it runs."""

    def __init__(self, fd: int, size: int) -> None:
        libc = releasing_gil()
        if libc is None:
            raise OSError(errno.ENOSYS, "the C library cannot be loaded")
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.address: int | None = address
        self.size = size
        self._libc = libc
        libc.madvise(address, size, MADV_DONTFORK)

    def populate(self, offset: int, length: int) -> bool:
        """Read a chunk into the page cache and touch each of its pages once; False where the
        kernel cannot populate a mapping (before Linux 5.14).

        The touch (one byte read per page; ~0.01 s per 400 MB where it costs nothing more) is for
        hosts that back a VM's memory lazily: there the first CPU access to a page the disk filled
        costs a fault in the hypervisor, which made a later copy out of the page cache 3-12x slower
        (0.5-2 GB/s instead of 6 GB/s on this project's VM); touched here, that cost is paid while
        vLLM starts instead of in the load. numpy's reduction releases the GIL too."""
        assert self.address is not None
        if self._libc.madvise(self.address + offset, length, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:
                return False
            raise OSError(err, os.strerror(err))
        pages = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(self.address + offset))
        int(pages[::mmap.PAGESIZE].max())
        return True

    def close(self) -> None:
        if self.address is not None:
            self._libc.munmap(self.address, self.size)
            self.address = None


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
