"""Early reads: bring local checkpoint files into the page cache, in the background, while the
engine is still starting.

Each file is mapped 64 MiB at a time and the mapping populated (``madvise(MADV_POPULATE_READ)``:
the kernel reads the pages in, nothing is copied into the process), then unmapped, so the
process keeps nothing; ``posix_fadvise(WILLNEED)`` alone reads only a few percent of a large
file. Where the kernel lacks ``MADV_POPULATE_READ`` (before Linux 5.14) the chunk is read into
one small reused buffer instead. A file that cannot be read is skipped: the loader reads it at
load time and reports what is wrong. The caller bounds it by memory: the files are read only if
they fit in a share of the memory available now (``available_memory``).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

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


def read_ahead(paths: Sequence[str], *, limit: int) -> threading.Thread | None:
    """Start reading ``paths`` into the page cache on a daemon thread, if together they fit in
    ``limit`` bytes; None (and nothing done) otherwise."""
    total = sum(os.path.getsize(p) for p in paths)
    if total > limit:
        logger.info("fastload: no early reads: the checkpoint (%.2f GB) exceeds the share of available memory "
                    "early reads may fill (%.2f GB); it is read at load time", total / 1e9, limit / 1e9)
        return None
    thread = threading.Thread(target=_advise, args=(list(paths),), name="fastload-early-reads", daemon=True)
    thread.start()
    return thread


#: Bytes mapped and populated at a time.
CHUNK = 64 << 20
#: ``MADV_POPULATE_READ`` (Linux 5.14); Python's ``mmap`` names it from 3.12 on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _advise(paths: list[str]) -> None:
    start = time.perf_counter()
    _read_in(paths)
    logger.info("fastload: early reads: %d files in the page cache after %.2f s", len(paths),
                time.perf_counter() - start)


def _read_in(paths: list[str]) -> None:
    buffer: bytearray | None = None
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                for offset in range(0, size, CHUNK):
                    length = min(CHUNK, size - offset)
                    if buffer is None and not _populate(f.fileno(), offset, length):
                        buffer = bytearray(8 << 20)
                    if buffer is not None:
                        _read_through(f.fileno(), offset, length, buffer)
        except OSError:
            continue


def _populate(fd: int, offset: int, length: int) -> bool:
    """Read a chunk into the page cache through a mapping; False where the kernel cannot."""
    with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=offset) as view:
        try:
            view.madvise(MADV_POPULATE_READ)
        except OSError:
            return False
    return True


def _read_through(fd: int, offset: int, length: int, buffer: bytearray) -> None:
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - offset)]], offset)
        if n <= 0:
            return
        offset += n


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
