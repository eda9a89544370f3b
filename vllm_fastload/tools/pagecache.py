"""A checkpoint's files in the page cache: drop them (a cold start without root) and say how much is there."""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_fastload.readers.pagecache import cached_share


def evict(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (clean pages only; needs no privileges)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def share_cached(paths: Sequence[str], samples: int = 256) -> float | None:
    """The share of the files' bytes in the page cache (sampled pages, weighted by size); None where
    the kernel does not say (``mincore`` refused)."""
    total = cached = 0.0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            share = cached_share(fd, 0, size, samples=samples) if size else 1.0
        finally:
            os.close(fd)
        if share is None:
            return None
        total += size
        cached += share * size
    return cached / total if total else 1.0
