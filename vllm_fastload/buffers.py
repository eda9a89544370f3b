"""Read buffers that are reused, bounded by the memory budget, and never pulled from under a caller.

Reusing buffers matters (filling fresh memory is several times slower than filling touched
memory), but reusing one while the caller still holds a tensor that views it is the classic
loader bug: the caller's tensor silently changes. So before a buffer is reused we ask torch
how many tensors still reference its storage. A returned buffer that is still referenced is
parked, not reused: it comes back into use once every view of it is gone (the caller copied and
dropped, or a loop variable was rebound later than we looked), and it is handed over to the
caller (freed when they drop it, leaving the pool and the budget) only when the budget needs
its room while views of it are still alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_fastload import policy
from vllm_fastload.sizes import round_up

ALLOC_GRANULE = 2 << 20
#: Rounding used instead of ALLOC_GRANULE when the budget is too small for such granules.
SMALL_GRANULE = 4096


def storage_references(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s memory, torch's own count."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@dataclass(eq=False)  # identity: list.remove() must never compare tensors elementwise
class Buffer:
    tensor: torch.Tensor
    baseline: int   # reference count when only the pool holds it

    @property
    def capacity(self) -> int:
        return self.tensor.numel()


class BufferPool:
    """Hands out buffers of at least N bytes; total bytes held never exceed ``budget``."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], budget: int, min_size: int) -> None:
        self._allocate = allocate
        self.budget = budget
        self.min_size = min_size
        self.held = 0          # bytes of all buffers the pool owns (free or lent to the executor)
        self.peak = 0
        self.handed_over = 0   # buffers given up because the caller kept a view
        self._free: list[Buffer] = []
        self._kept: list[Buffer] = []   # returned while still referenced; counted in ``held``
        self._lock = threading.Lock()

    def _size_for(self, nbytes: int) -> int:
        """Round to the allocation granule, or to a page where the granules would crowd the budget.

        The executor keeps several chunks in flight, each in its own buffer: rounding a 256 KiB
        chunk up to a 2 MiB granule in a 2 MiB budget would leave room for one buffer only.
        """
        size = round_up(nbytes, ALLOC_GRANULE)
        return size if size * policy.BUFFERS_IN_USE <= self.budget else round_up(nbytes, SMALL_GRANULE)

    def _reclaim(self) -> None:
        """Move parked buffers whose views are all gone back to the free list (lock held)."""
        still: list[Buffer] = []
        for b in self._kept:
            (self._free if storage_references(b.tensor) <= b.baseline else still).append(b)
        self._kept = still

    def try_acquire(self, nbytes: int) -> Buffer | None:
        """A buffer, or None if the budget is exhausted by buffers in use."""
        with self._lock:
            self._reclaim()
            fitting = [b for b in self._free if b.capacity >= nbytes]
            if fitting:
                best = min(fitting, key=lambda b: b.capacity)
                self._free.remove(best)
                return best
            size = self._size_for(max(nbytes, self.min_size))
            if self.held + size > self.budget:
                size = self._size_for(nbytes)
            # Drop idle buffers that are too small until the new one fits, then give up
            # (hand over) parked buffers the caller still references, oldest first.
            self._free.sort(key=lambda b: b.capacity)
            while self.held + size > self.budget and (self._free or self._kept):
                if self._free:
                    self.held -= self._free.pop(0).capacity
                else:
                    self.held -= self._kept.pop(0).capacity
                    self.handed_over += 1
            if self.held + size > self.budget:
                return None
            self.held += size
        tensor = self._allocate(size)
        buf = Buffer(tensor, storage_references(tensor))
        # _allocate may round up; account for what we really hold.
        with self._lock:
            self.held += buf.capacity - size
            self.peak = max(self.peak, self.held)
        return buf

    def allocate_oversize(self, nbytes: int) -> Buffer:
        """A one-off buffer outside the budget, for a single tensor larger than the budget."""
        tensor = self._allocate(nbytes)
        return Buffer(tensor, -1)

    def release(self, buf: Buffer) -> None:
        """Return a buffer whose reads are complete.

        Unreferenced, it is free for reuse at once; still referenced by a caller's tensor, it is
        parked until those views are gone, or handed over to the caller when the budget needs
        its room first (see ``try_acquire``). Either way it is never overwritten while viewed.
        """
        if buf.baseline < 0:
            return  # oversize: never pooled
        kept = storage_references(buf.tensor) > buf.baseline
        with self._lock:
            (self._kept if kept else self._free).append(buf)

    def discard(self, buf: Buffer) -> None:
        """Forget a buffer without reusing it (its contents are unknown after an error)."""
        if buf.baseline >= 0:
            with self._lock:
                self.held -= buf.capacity

    def clear(self) -> None:
        """Forget every idle buffer; parked ones still referenced go with their holders."""
        with self._lock:
            self._reclaim()
            self.handed_over += len(self._kept)
            for b in self._free + self._kept:
                self.held -= b.capacity
            self._free.clear()
            self._kept.clear()
