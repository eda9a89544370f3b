"""The machine's state, measured beside every benchmark result.

On a VM the same load can take 1 s or 4 s depending on how fast fresh memory is (freed guest
memory goes back to the host, and touching it again is slow) and how fast the disk is that
minute. A result printed without these two numbers cannot be compared with any
other, so both benchmarks print them above their tables.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_fastload.bench.cache import evict
from vllm_fastload.readers import direct, memory

__all__ = ["MachineState", "first_touch_gbps", "release_memory"]


def first_touch_gbps(nbytes: int = 512 << 20) -> float:
    """GB/s at which this process faults in memory nobody has touched yet (one madvise)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = memoryview(region)
        import ctypes

        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        start = time.perf_counter()
        if not memory.populate(address, nbytes):  # no MADV_POPULATE_WRITE: touch every page instead
            for at in range(0, nbytes, mmap.PAGESIZE):
                view[at] = 1
        seconds = time.perf_counter() - start
        del view
        return nbytes / seconds / 1e9
    finally:
        region.close()


def release_memory(gib: float, wait_s: float = 60.0) -> float:
    """Touch ``gib`` GiB of fresh memory, free it and wait for the VM to report it to its host.

    Afterwards fresh memory is slow to touch again, as on a freshly started VM, where the
    cold-start claims must hold too. Returns the GB/s of the touch (itself a state reading).
    """
    speed = first_touch_gbps(int(gib * (1 << 30)))
    time.sleep(wait_s)
    return speed


def disk_read_gbps(paths: Sequence[str], threads: int = 4, piece: int = 8 << 20) -> float:
    """Cold sequential read GB/s of the files' disk: evicted first, then read in parallel with
    O_DIRECT (buffered where the filesystem refuses it) into reused buffers."""
    evict(paths)
    tasks: list[tuple[int, int, int, bool]] = []
    fds: list[int] = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        fds.append(fd)
        opened = direct.open_direct(fd)
        if opened is not None:
            fds.append(opened.fd)
        size = os.fstat(fd).st_size
        for off in range(0, size, piece):
            tasks.append((opened.fd if opened else fd, off, min(piece, size - off), opened is not None))
    local = threading.local()

    def read(task: tuple[int, int, int, bool]) -> int:
        fd, off, n, aligned = task
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(mmap.mmap(-1, piece + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        length = -(-n // 4096) * 4096 if aligned else n
        return os.preadv(fd, [buf[:length]], off)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, tasks))
        return total / (time.perf_counter() - start) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


@dataclass
class MachineState:
    """First-touch and disk speeds sampled during one benchmark run."""

    first_touch: list[float] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)

    def sample_memory(self) -> float:
        value = first_touch_gbps()
        self.first_touch.append(value)
        return value

    def sample_disk(self, paths: Sequence[str]) -> float:
        value = disk_read_gbps(paths)
        self.disk.append(value)
        return value

    def summary(self) -> str:
        def span(values: list[float]) -> str:
            if not values:
                return "not measured"
            return (f"median {statistics.median(values):.2f} GB/s "
                    f"(min {min(values):.2f}, max {max(values):.2f}, n={len(values)})")

        return (f"machine state: first touch of fresh memory {span(self.first_touch)}; "
                f"cold sequential read of the checkpoint's disk {span(self.disk)}")

    def as_dict(self) -> dict[str, list[float]]:
        return {"first_touch_gbps": self.first_touch, "disk_read_gbps": self.disk}
