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
under a mapping is ``SIGBUS``, which ends the process, where a read would raise an error naming
the file. On a local disk that holds for a disk failing or the file cut short while mapped, as it
does for safetensors' mapping.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch

from vllm_fastload.libc import MAP_FAILED, keeping_gil
from vllm_fastload.plan import Rows
from vllm_fastload.readers.base import FileWindow
from vllm_fastload.sources.fstype import filesystem_type, is_network


def copy_rows(fd: int, path: str, rows: Rows, view: memoryview) -> bool:
    """Copy ``rows`` packed into ``view`` out of a read-only mapping of ``fd`` (the file at ``path``).

    Returns False, having copied nothing, where the file is on a network filesystem, cannot be
    mapped or ends before the slice: the caller then reads it, and those reads report a short file
    as a clear error, where touching a mapped page past the end would kill the process with
    ``SIGBUS``. (A local file cut short, or a disk failing, during the copy itself still would, as
    it would for safetensors' own mapped loading, vLLM's default; ``check_file_changes`` catches a
    file changed between chunks.)
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
        _strided_copy(mapping, rows.offset - start, rows, view)
    finally:
        mapping.close()
    return True


@functools.lru_cache(maxsize=256)
def _local(path: str) -> bool:
    return not is_network(filesystem_type(path))


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
