"""Whether a file's pages are in the page cache, asked without reading them; and advice that
brings the pages a read will need in ahead of it.

The reader decides per chunk between copying out of the page cache and reading the disk with
O_DIRECT. The obvious probe, a one-byte ``preadv2(RWF_NOWAIT)``, has a side effect: on a miss
the kernel still starts read-ahead around the byte, so probing one chunk could fill the cache
for the next and make it look cached. ``mincore`` on a one-page mapping of the file asks the
page cache without any I/O. Linux answers it truthfully only to the file's owner or a process
that may write the file; for anyone else it would report every page missing, so those probe
with ``RWF_NOWAIT`` instead.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

from vllm_fastload import policy
from vllm_fastload.libc import MAP_FAILED, keeping_gil
from vllm_fastload.plan import ByteRange, Rows
from vllm_fastload.readers import row_pages
from vllm_fastload.readers.base import Call, RowsCall

#: What the probes and the advice take: read calls, or the ranges of a chunk that may be mapped
#: instead of read.
Probed = Call | ByteRange

PAGE = mmap.PAGESIZE
_PROBE = bytearray(1)


def is_cached(fd: int, offsets: Sequence[int]) -> bool:
    """Whether the pages holding these byte offsets of the open file are all in the page cache."""
    if _may_ask_mincore(fd):
        answer = _mincore(fd, offsets)
        if answer is not None:
            return all(answer)
    return _nowait(fd, offsets)


def cached_share(fd: int, start: int, end: int, samples: int = policy.PAGE_SAMPLES) -> float | None:
    """The share of ``samples`` pages spread evenly over bytes ``[start, end)`` that are in the page
    cache, through one mapping; None where ``mincore`` cannot be asked truthfully (see above).
    A sample, not every page: the probe runs on the loading thread, once per chunk."""
    if end <= start:
        return 1.0
    return share_cached(fd, spread(start, end - start, samples))


def spread(offset: int, length: int, samples: int) -> list[int]:
    """``samples`` offsets spread evenly over ``length`` bytes from ``offset``, first and last included."""
    return [offset + (length - 1) * i // max(samples - 1, 1) for i in range(samples)]


def share_cached(fd: int, offsets: Sequence[int]) -> float | None:
    """The share of the pages holding ``offsets`` that are in the page cache (1.0: no offsets);
    None where ``mincore`` cannot be asked truthfully."""
    if not offsets:
        return 1.0
    if not _may_ask_mincore(fd):
        return None
    found = _mincore(fd, offsets)
    return None if found is None else sum(found) / len(offsets)


def _may_ask_mincore(fd: int) -> bool:
    try:
        if os.geteuid() == 0 or os.fstat(fd).st_uid == os.geteuid():
            return True
        return os.access(f"/proc/self/fd/{fd}", os.W_OK)
    except OSError:
        return False


def _mincore(fd: int, offsets: Sequence[int]) -> list[bool] | None:
    """Per offset, whether its page is cached: ``mincore`` over one shared mapping of the pages
    holding the offsets; None if the file cannot be mapped. The calls keep the GIL (each takes
    microseconds): giving it up and taking it back behind busy reader threads can cost the
    loading thread milliseconds per call."""
    if not offsets:
        return []
    libc = keeping_gil()
    if libc is None:
        return None
    lo = min(offsets) - min(offsets) % PAGE
    length = max(offsets) - lo + 1
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if address is None or address == MAP_FAILED:
        return None
    try:
        vec = ctypes.c_ubyte(0)
        found = []
        for offset in offsets:
            page = address + (offset - lo) - (offset - lo) % PAGE
            if libc.mincore(page, PAGE, ctypes.byref(vec)) != 0:
                return None
            found.append(bool(vec.value & 1))
        return found
    finally:
        libc.munmap(address, length)


def _nowait(fd: int, offsets: Sequence[int]) -> bool:
    """A one-byte read at each offset that must not wait for the disk."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return False
    try:
        return all(os.preadv(fd, [_PROBE], offset, nowait) == 1 for offset in offsets)
    except OSError:  # BlockingIOError: not cached; anything else: treat as not cached
        return False


# -- a chunk's read calls ----------------------------------------------------------------------

def _ranges(calls: Sequence[Probed]) -> list[ByteRange]:
    return [ByteRange(c.rows.offset, c.rows.span) if isinstance(c, RowsCall) else ByteRange(c.offset, c.length)
            for c in calls]


def span(ranges: Sequence[ByteRange]) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` from the first range's start to the last one's end."""
    return min(offset for offset, _ in ranges), max(offset + length for offset, length in ranges)


def cached_calls(fd: int, calls: Sequence[Probed]) -> bool:
    """Whether the chunk is (as far as a cheap probe can tell) in the page cache: its first,
    middle and last byte can be read without waiting."""
    if not calls:
        return True
    lo, hi = span(_ranges(calls))
    return hi <= lo or is_cached(fd, (lo, (lo + hi) // 2, hi - 1))


def has_holes(fd: int, calls: Sequence[Probed]) -> bool:
    """Whether pages of a chunk that probed as cached are missing from the page cache (as a host
    that reclaims idle page cache leaves a checkpoint read into it earlier)."""
    if not calls:
        return False
    lo, hi = span(_ranges(calls))
    if not policy.sample_for_holes(span=hi - lo, page=PAGE):
        return False
    share = cached_share(fd, lo, hi, samples=policy.HOLE_SAMPLES)
    return share is not None and share < 1.0


def advise(fd: int, calls: Sequence[Probed]) -> None:
    """Tell the kernel to start reading these ranges now (``POSIX_FADV_WILLNEED``), for files
    read through the page cache.

    The executor submits chunks ahead of the threads reaching them, so on a cold cache the
    disk works on later chunks while threads copy earlier ones: I/O depth without more
    threads (more threads cost warm-cache speed on few cores).
    """
    if not calls or not hasattr(os, "posix_fadvise"):
        return
    ranges = _ranges(calls)
    lo, hi = span(ranges)
    needed = sum(length for _, length in ranges)
    spans = [ByteRange(lo, hi - lo)] if policy.advise_whole_span(span=hi - lo, needed=needed) else ranges
    for offset, length in spans:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            break  # advice only


def advise_rows(fd: int, rows: Rows, ahead: bool = False) -> None:
    """``WILLNEED`` for the pages that hold the segments (runs of touching pages merged), so the
    disk reads those pages and neither the gaps' whole pages nor read-ahead past the slice.

    ``ahead`` (advice given when the chunk is submitted): only the pages this rank owns, so that
    ranks reading other parts of the same rows split the shared pages' disk reads (see
    ``row_pages``); right before the read, the advice for all its pages fetches what is left."""
    if not hasattr(os, "posix_fadvise"):
        return
    for offset, length in (row_pages.owned_spans(rows) if ahead else row_pages.touched_spans(rows)):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # advice only
