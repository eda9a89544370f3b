"""Reads that bypass the page cache (``O_DIRECT``) through reused aligned buffers.

Why: on a cold cache a buffered read makes the kernel allocate a page-cache page for every
4 KiB, and the copy out of it is the first time the CPU touches that page. In a VM whose
free memory goes back to the host (free page reporting), that first touch is a trip to the
hypervisor, many times slower than copying out of a warm cache. Read with ``O_DIRECT``,
the device writes into a buffer this thread has used before, and the one copy left is the
one into the destination, which every loader pays. It also leaves the page cache alone:
no read-ahead past what this rank needs, no pages the load never uses again.

``O_DIRECT`` wants the file offset, the length and the memory address aligned to the
device's block size. Tensors are not aligned, so every read covers the aligned range
around the bytes wanted, into a per-thread buffer, and copies the wanted part out.

Only contiguous ranges are read this way. A slice along a later dim (a row-parallel
weight's columns) is thousands of small segments interleaved with other ranks' segments:
as one O_DIRECT read each they are bound by the device's operations per second, and reading
the gaps too doubles those bytes for every rank. Through the page cache, ranks on one machine share the pages.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from dataclasses import dataclass

import torch

from vllm_fastload.errors import ReadError
from vllm_fastload.readers.memory import populate
from vllm_fastload.sizes import round_up

#: Alignments tried, smallest first: 512 suits most devices, 4096 the rest.
ALIGNMENTS = (512, 4096)


class DirectUnsupported(Exception):
    """This file cannot be read with O_DIRECT here (filesystem or alignment): read it buffered."""


@dataclass(frozen=True)
class DirectFile:
    """A second descriptor of an open file, with ``O_DIRECT``."""

    fd: int
    #: What offsets, lengths and buffer addresses must be multiples of.
    align: int


def open_direct(fd: int) -> DirectFile | None:
    """A second descriptor of the same open file with ``O_DIRECT``, and the alignment it needs.

    Opened through ``/proc/self/fd`` so that it is the very inode ``fd`` has (a file replaced
    on disk since cannot sneak in). None where O_DIRECT does not work (tmpfs, some FUSE
    filesystems, no /proc): those files are read through the page cache as before.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    probe = _aligned_buffer(max(ALIGNMENTS))
    for align in ALIGNMENTS:
        try:
            os.preadv(dfd, [memoryview(probe)[:align]], align)
            return DirectFile(dfd, align)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                break
    os.close(dfd)
    return None


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (an mmap is page aligned, more than any device needs)."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class Bounce:
    """One thread's aligned read buffer, touched once and reused for every read it makes."""

    def __init__(self, nbytes: int) -> None:
        self.region = _aligned_buffer(nbytes)
        self.view = memoryview(self.region)
        self.tensor = torch.frombuffer(self.region, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()

    def __len__(self) -> int:
        return len(self.view)


_local = threading.local()


def bounce_for_thread(nbytes: int) -> Bounce:
    buf = getattr(_local, "bounce", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.bounce = Bounce(nbytes)
    return buf


def read_aligned(dfd: int, path: str, start: int, end: int, into: memoryview) -> int:
    """Read the aligned file range ``[start, end)`` into ``into``; return the bytes that exist.

    Fewer than ``end - start`` only at the end of the file (whose size need not be aligned).
    """
    want = end - start
    done = 0
    while done < want:
        try:
            n = os.preadv(dfd, [into[done:want]], start + done)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.EINVAL and done == 0:
                raise DirectUnsupported(exc.strerror) from exc
            raise ReadError(f"direct read of {want} bytes at offset {start} failed after {done} bytes: "
                            f"{exc.strerror}", file=path) from exc
        if n == 0:
            break
        done += n
        if n % 512:
            break  # an unaligned count only comes at the end of the file
    return done


def _need(path: str, got: int, first: int, wanted: int, offset: int) -> None:
    if got < first + wanted:
        raise ReadError(f"unexpected end of file at offset {offset + max(0, got - first)} (wanted {wanted} bytes "
                        f"from offset {offset}); the file was truncated", file=path)


def read_into(dfd: int, align: int, path: str, offset: int, dest: torch.Tensor, bounce: Bounce) -> None:
    """Fill the uint8 tensor ``dest`` with the file bytes at ``offset``, through ``bounce``."""
    length = dest.numel()
    populate(dest.data_ptr(), length)
    room = len(bounce) - align  # a piece never needs more than its length plus one block of slack
    done = 0
    while done < length:
        at = offset + done
        start = at - at % align
        n = min(length - done, room - (at - start))
        end = round_up(at + n, align)
        got = read_aligned(dfd, path, start, end, bounce.view)
        _need(path, got, at - start, n, at)
        ctypes.memmove(dest.data_ptr() + done, bounce.address + (at - start), n)
        done += n
