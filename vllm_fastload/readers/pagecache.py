"""Whether a file's pages are in the page cache, asked without reading them.

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
    if not _may_ask_mincore(fd):
        return None
    found = _mincore(fd, [start + (end - 1 - start) * i // (samples - 1) for i in range(samples)])
    return None if found is None else sum(found) / samples


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
