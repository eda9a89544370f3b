"""The C library calls fastload makes through ctypes (``mmap``, ``munmap``, ``madvise``, ``mincore``),
declared once for every layer that needs them.

Two handles on the same library. ``releasing_gil()`` for calls that may wait on the disk or fault
in much memory (populating a mapping): the process's other threads run meanwhile. ``keeping_gil()``
for calls of microseconds (mapping a chunk, asking whether one page is cached): giving the GIL up and
taking it back behind busy reader threads can cost the calling thread milliseconds per call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import TypeVar

#: What ``mmap`` returns on failure, as ``ctypes.c_void_p`` converts it.
MAP_FAILED = ctypes.c_void_p(-1).value

_Lib = TypeVar("_Lib", bound=ctypes.CDLL)


@functools.cache
def releasing_gil() -> ctypes.CDLL | None:
    """The C library, its calls releasing the GIL; None where it cannot be loaded."""
    return _declared(ctypes.CDLL)


@functools.cache
def keeping_gil() -> ctypes.PyDLL | None:
    """The C library, its calls keeping the GIL; None where it cannot be loaded."""
    return _declared(ctypes.PyDLL)


def _declared(kind: type[_Lib]) -> _Lib | None:
    try:
        lib = kind(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return lib
