"""Host memory for reads: buffers of their own mappings, and fresh destination memory faulted in
with one call before reading into it.

A read into memory nobody has touched yet takes a page fault per 4 KiB page inside the read,
which in a VM can cost more than the copy itself; one ``madvise(MADV_POPULATE_WRITE)`` call
(Linux >= 5.14) faults the same pages in with far fewer traps. Only pages that lie wholly inside
a range about to be overwritten are touched, so what ends up in memory is the same; memory that
is already resident (a reused buffer) is left alone, since walking it again costs time for
nothing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType

import torch

from vllm_fastload import policy
from vllm_fastload.libc import releasing_gil
from vllm_fastload.readers.threads import run_on
from vllm_fastload.sizes import round_up

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23

def allocate_host(nbytes: int, hugepages: bool) -> torch.Tensor:
    """A uint8 CPU tensor backed by its own anonymous mapping (freed when the tensor is).

    Its length is ``nbytes`` rounded up to whole huge pages, or to whole pages below one huge
    page (so that a small memory budget is not overrun by the rounding).
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    granule = HUGE_PAGE if nbytes >= HUGE_PAGE else mmap.PAGESIZE
    size = round_up(nbytes, granule)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: still correct, only slower to fill
    return torch.frombuffer(region, dtype=torch.uint8)


#: False once the kernel refused MADV_POPULATE_WRITE (older than 5.14): not asked again.
_supported = True


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages wholly inside ``[address, address + nbytes)`` if they look fresh.

    Returns whether it did. Advice only: any failure leaves the reads to fault as usual.
    """
    lo = round_up(address, PAGE)
    hi = (address + nbytes) // PAGE * PAGE
    if not _supported or hi - lo < policy.MIN_POPULATE_BYTES:
        return False
    libc = releasing_gil()
    if libc is None:
        return False
    if _resident(libc, lo) and _resident(libc, hi - PAGE):
        return False
    return _madvise_populate(libc, lo, hi - lo)


def _resident(libc: ctypes.CDLL, page: int) -> bool:
    vec = ctypes.c_ubyte(0)
    if libc.mincore(page, PAGE, ctypes.byref(vec)) != 0:
        return True  # cannot tell: treat as in use
    return bool(vec.value & 1)


def _madvise_populate(libc: ctypes.CDLL, start: int, length: int) -> bool:
    global _supported
    if libc.madvise(start, length, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _supported = False  # kernel older than 5.14: stop asking
    return False


class Prefault:
    """Faults in the fresh pages of ``tensors``, in order, on a background thread, while the
    caller goes on to fill them (``with Prefault(params): model.load_weights(...)``).

    For a caller that overwrites memory it does not hand to fastload (vLLM's ``load_weights``
    copies each tensor into its parameter): faulted in ahead by one call per tensor, the copy
    then runs at memory speed instead of trapping once per page. It changes no byte, only when
    pages become resident; a tensor the caller reaches first is left alone (``populate`` skips
    resident memory). Host memory only; other tensors are passed over.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], cpus: Sequence[int] | None = None) -> None:
        self._cpus = cpus
        self._tensors = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous() and t.numel()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastload-prefault", daemon=True)
        #: Regions faulted in (for tests and logs).
        self.faulted = 0

    def _run(self) -> None:
        run_on(self._cpus)
        for t in self._tensors:
            if self._stop.is_set():
                return
            self.faulted += populate(t.data_ptr(), t.numel() * t.element_size())

    def __enter__(self) -> Prefault:
        if self._tensors:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._tensors = []
