"""Bytes already in the page cache, taken out of a mapping of the file instead of read.

Two uses. ``copy_rows``: row slices copied out of a shared mapping.

A strided copy out of a mapping moves only the rank's own bytes and costs no Python per row, where
reading through the gaps moves the other ranks' bytes too and builds two iovecs per row, and a
call per row costs Python and a system call for every row.

``file_window``: a chunk of the file as a tensor over a private mapping, so that ``iter_tensors`` can
hand out tensors as views of the page cache, as safetensors' own ``safe_open`` does (vLLM's
default loader), instead of copying each into a read buffer first: the caller's copy is then the
only one. The host reader maps chunks that are (mostly) cached, and with ``direct_io`` "never"
also cold chunks, after advising them (see ``HostReader.mapped``).

Only on local filesystems: where the bytes cross a network, an I/O error or a change on the server
under a mapping is ``SIGBUS``, which ends the process, where a read would raise an error naming the
file. On a local disk, where some of a range's pages are not in the page cache (the disk must be
read), they are brought in before anyone copies out of them (``populate``, ``MADV_POPULATE_READ``,
on the reader's threads): a page that cannot be read (a failing disk) or that lies past the end of a
file cut short fails that call with an error, which becomes a ``ReadError`` naming the file and
offset. A range wholly in the page cache (a sample of its pages) is copied out as it is: there is no
read to fail, and mapping its pages ahead only adds to the copy. What no check can catch is the file
cut short in the moment between that and the copy: touching a page past the new end then raises
``SIGBUS``, which ends the process, as it does for safetensors' own mapping (a signal handler cannot
resume a copy inside C code). ``check_file_changes`` notices a change made earlier.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch

from vllm_fastload import machine, policy
from vllm_fastload.errors import ReadError
from vllm_fastload.libc import MAP_FAILED, keeping_gil, releasing_gil
from vllm_fastload.plan import Rows
from vllm_fastload.readers import pagecache
from vllm_fastload.readers.base import FileWindow
from vllm_fastload.readers.memory import MADV_POPULATE_READ
from vllm_fastload.readers.threads import reading


def copy_rows(fd: int, path: str, rows: Rows, view: memoryview) -> bool:
    """Copy ``rows`` packed into ``view`` out of a read-only mapping of ``fd`` (the file at ``path``).

    Returns False, having copied nothing, where the file is on a network filesystem, cannot be
    mapped, ends before the slice, or a page of it cannot be brought in (``populate``): the caller
    then reads it, and those reads report a short file or an I/O error as a clear error, where
    touching such a page would kill the process with ``SIGBUS``. (A local file cut short during
    the copy itself still would, see the module docstring.)
    """
    if not _local(path):
        return False
    start = rows.offset - rows.offset % mmap.ALLOCATIONGRANULARITY
    end = rows.offset + rows.span
    try:
        if os.fstat(fd).st_size < end:
            return False
        mapping = mmap.mmap(fd, end - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
    except (OSError, ValueError):
        return False
    try:
        try:
            # A page the probe took for cached but is not gets read alone, without read-around
            # pulling in the other ranks' bytes around it.
            mapping.madvise(mmap.MADV_RANDOM)
        except (OSError, AttributeError):
            pass
        if (policy.bring_in_mapped(wholly_cached=wholly_cached(fd, rows.offset, end))
                and not _populated(_address(mapping), end - start)):
            return False
        _strided_copy(mapping, rows.offset - start, rows, view)
    finally:
        mapping.close()
    return True


def _address(mapping: mmap.mmap) -> int:
    """Where a (read-only) mapping starts in memory; no view of it outlives the call."""
    first = np.frombuffer(mapping, dtype=np.uint8, count=1)
    try:
        return int(first.ctypes.data)
    finally:
        del first


@functools.lru_cache(maxsize=256)
def _local(path: str) -> bool:
    return not machine.is_network(machine.filesystem_type(path))


def _strided_copy(mapping: mmap.mmap, first: int, rows: Rows, view: memoryview) -> None:
    whole: np.ndarray[Any, Any] | None = None
    source: np.ndarray[Any, Any] | None = None
    packed: np.ndarray[Any, Any] | None = None
    try:
        whole = np.frombuffer(mapping, dtype=np.uint8, count=rows.span, offset=first)
        source = np.lib.stride_tricks.as_strided(whole, shape=(rows.count, rows.seg),
                                                 strides=(rows.stride, 1), writeable=False)
        whole = None
        packed = np.frombuffer(view, dtype=np.uint8, count=rows.count * rows.seg).reshape(rows.count, rows.seg)
        np.copyto(packed, source)  # numpy releases the GIL for the copy
    finally:
        # No array may still view the mapping when it closes, not even from an error's traceback.
        whole = source = packed = None


def wholly_cached(fd: int, start: int, end: int) -> bool:
    """Whether a sample of the range's pages (``policy.HOLE_SAMPLES``) finds every one in the page
    cache: then copying out of a mapping of it reads nothing from the disk."""
    return pagecache.cached_share(fd, start, end, samples=policy.HOLE_SAMPLES) == 1.0


def _populated(address: int, length: int) -> bool:
    """Brings a mapped range's pages in (``MADV_POPULATE_READ``); False where one cannot be read
    or lies past the end of the file (the kernel answers EFAULT where touching it would raise
    ``SIGBUS``). True also where the kernel cannot populate (before Linux 5.14): the copy faults
    the pages in as before."""
    libc = releasing_gil()
    if libc is None or libc.madvise(address, length, MADV_POPULATE_READ) == 0:
        return True
    return ctypes.get_errno() == errno.EINVAL


def populate(window: torch.Tensor, path: str, start: int, length: int, file_offset: int) -> None:
    """Bring ``length`` bytes from ``start`` of a ``file_window`` (file offset ``file_offset``)
    into memory, on a reader thread; a page that cannot be read, or lies past the end of the
    file, is a ``ReadError`` naming the file and offset, instead of a ``SIGBUS`` in whoever
    copies out of it later."""
    reading(path, file_offset, length)
    if _populated(window.data_ptr() + start, length):
        return
    error = ctypes.get_errno()
    why = ("a page of it could not be read (an I/O error), or lies past the end of the file (it was cut short)"
           if error == errno.EFAULT else os.strerror(error))
    raise ReadError(f"reading {length} bytes at offset {file_offset} through a mapping of the file failed: {why}",
                    file=path)


def file_window(fd: int, path: str, start: int, end: int) -> FileWindow | None:
    """Bytes ``[start, end)`` of the file at ``path`` (open as ``fd``), or a little more, as a uint8
    CPU tensor over a private mapping; None where the file is on a network filesystem (see above),
    shorter than ``end`` or cannot be mapped.

    Private and writable: a caller that writes into a view gets its own copy of those pages, and
    the file never changes; pages nobody wrote show the file as it is (as safetensors' mapping
    does). The mapping lives as long as any tensor that views it, and covers only the chunk at
    hand, so the pages it maps count in the process's memory only while the caller holds tensors
    in them. It is made through libc, not Python's ``mmap``, which keeps a duplicate of the file
    descriptor open per mapping (a caller keeping 2000 chunks' tensors would run out of them).
    """
    libc = keeping_gil()
    if libc is None or not _local(path) or end <= start:
        return None
    first = start - start % mmap.ALLOCATIONGRANULARITY
    length = end - first
    try:
        if os.fstat(fd).st_size < end:
            return None
    except OSError:
        return None
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, first)
    if address is None or address == MAP_FAILED:
        return None
    memory = (ctypes.c_ubyte * length).from_address(address)
    weakref.finalize(memory, libc.munmap, address, length)  # when the last view is gone
    return FileWindow(torch.frombuffer(memory, dtype=torch.uint8), first)
