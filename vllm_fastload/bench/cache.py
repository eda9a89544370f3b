"""What the page cache holds of a checkpoint, one control for every benchmark: drop the files (a
cold start), read them in (a warm one), and measure how much of them is there.

Cold and warm rows compare only if "cold" and "warm" mean the same in every benchmark; and a
cold row that was partly warm must say so, hence the measure beside the two actions.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Cold", "evict", "make_cold", "read_files", "resident", "warm"]

#: ``drop_caches`` levels: 1 the page cache, 3 also dentries and inodes.
_PAGE_CACHE, _EVERYTHING = "1", "3"
_FADVISE = "posix_fadvise(DONTNEED) of the checkpoint's files"


def evict(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (clean pages only; needs no privileges)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Sequence[str], *, unless_cached: bool = False) -> None:
    """Read the files into the page cache. ``unless_cached``: not where 99% of them already is
    (after a loader that read with ``O_DIRECT``, which leaves the cache as it was)."""
    if unless_cached and (resident(paths) or 0.0) >= 0.99:
        return
    read_files(paths, threads=4, block=4 << 20)


@dataclass(frozen=True)
class Cold:
    """How a cold start was made, and how cold it came out."""

    #: What was done, as the benchmarks print it.
    how: str
    #: The share of the checkpoint still in the page cache afterwards (None: the kernel would not say).
    resident: float | None
    #: Whether the machine's caches were dropped (``/proc/sys/vm/drop_caches``).
    dropped: bool = False


def make_cold(paths: Sequence[str], *, drop: str = "never") -> Cold:
    """Evict ``paths``. ``drop`` says when to drop the machine's caches too (root only; it disturbs
    everything else running, so only a machine lent to the benchmark alone may):

    - ``never``: the checkpoint's own pages only (a shared machine);
    - ``leftover``: the page cache, where eviction left more than 1% of the checkpoint behind (a
      page cache larger than ``DONTNEED`` will empty);
    - ``always``: everything cached, dentries and inodes too, as a machine's first start finds it
      (eviction instead where the kernel refuses).
    """
    if drop == "always":
        refused = _drop_caches(_EVERYTHING)
        if refused is None:
            return Cold(f"sync; echo {_EVERYTHING} > /proc/sys/vm/drop_caches", resident(paths), dropped=True)
        evict(paths)
        return Cold(f"{_FADVISE} (drop_caches refused: {refused})", resident(paths))
    evict(paths)
    left = resident(paths)
    if drop == "leftover" and left is not None and left > 0.01 and _drop_caches(_PAGE_CACHE) is None:
        return Cold(f"{_FADVISE}, then sync; echo {_PAGE_CACHE} > /proc/sys/vm/drop_caches", resident(paths),
                    dropped=True)
    return Cold(_FADVISE, left)


def _drop_caches(level: str) -> str | None:
    """Sync and drop the machine's caches; None, or why the kernel refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(level)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


# -- how much is cached --------------------------------------------------------------------------
_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_mincore.restype = ctypes.c_int


def resident(paths: Sequence[str]) -> float | None:
    """The share of the files' pages in the page cache, every page counted (``mincore`` over a
    private mapping of each file). None where the kernel would not answer truthfully: for a file
    this process neither owns nor may write it answers as if every page were cached."""
    cached = pages = 0
    for path in paths:
        with open(path, "rb") as f:
            if not _truthful(f.fileno()):
                return None
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                continue
            region = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            anchor = ctypes.c_char.from_buffer(region)
            address = ctypes.addressof(anchor)
            del anchor  # the mapping stays open; only the export must end before close()
            n = -(-size // mmap.PAGESIZE)
            vec = np.zeros(n, dtype=np.uint8)
            if _mincore(address, size, vec.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            cached += int(np.count_nonzero(vec & 1))
            pages += n
        finally:
            region.close()
    return cached / pages if pages else 0.0


def _truthful(fd: int) -> bool:
    try:
        return os.geteuid() == 0 or os.fstat(fd).st_uid == os.geteuid() or os.access(f"/proc/self/fd/{fd}",
                                                                                        os.W_OK)
    except OSError:
        return False


# -- reading -------------------------------------------------------------------------------------
def read_files(paths: Sequence[str], threads: int, block: int, *, direct: bool = False) -> int:
    """Read the files whole on ``threads`` threads, ``block`` bytes a read into reused page-aligned
    buffers (``direct``: with ``O_DIRECT``, past the page cache); the bytes read."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    jobs: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
    for path in paths:
        size = os.path.getsize(path)
        for offset in range(0, size, block):
            jobs.put((path, offset, min(block, size - offset)))
    fds = {path: os.open(path, flags) for path in set(paths)}
    done = [0] * threads
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        try:
            while not errors:
                try:
                    path, offset, length = jobs.get_nowait()
                except queue.Empty:
                    return
                done[i] += _read_range(fds[path], view, offset, length, direct)
        except BaseException as exc:
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    try:
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    return sum(done)


def _read_range(fd: int, view: memoryview, offset: int, length: int, direct: bool) -> int:
    got = 0
    while length > 0:
        want = -(-length // 4096) * 4096 if direct else length  # O_DIRECT: whole pages
        n = os.preadv(fd, [view[:min(want, len(view))]], offset)
        if n <= 0:
            break
        got += min(n, length)
        offset += n
        length -= n
    return got
