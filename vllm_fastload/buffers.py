"""Read buffers that are reused, bounded by the memory budget, and never pulled from under a caller.

Reusing buffers matters (filling fresh memory is several times slower than filling touched
memory), but reusing one while the caller still holds a tensor that views it is the classic
loader bug: the caller's tensor silently changes. So before a buffer is reused we ask torch
how many tensors still reference its storage; if the caller kept any, the buffer is handed
over to the caller (it is freed when they drop it) and leaves the pool and the budget.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

ALLOC_GRANULE = 2 << 20


def storage_references(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s memory, torch's own count."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@dataclass
class Buffer:
    tensor: torch.Tensor
    baseline: int   # reference count when only the pool holds it

    @property
    def capacity(self) -> int:
        return self.tensor.numel()


def _round_up(n: int) -> int:
    return -(-n // ALLOC_GRANULE) * ALLOC_GRANULE


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
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int) -> Buffer | None:
        """A buffer, or None if the budget is exhausted by buffers in use."""
        with self._lock:
            fitting = [b for b in self._free if b.capacity >= nbytes]
            if fitting:
                best = min(fitting, key=lambda b: b.capacity)
                self._free.remove(best)
                return best
            size = _round_up(max(nbytes, self.min_size))
            if self.held + size > self.budget:
                size = _round_up(nbytes)
            # Drop idle buffers that are too small until the new one fits.
            self._free.sort(key=lambda b: b.capacity)
            while self.held + size > self.budget and self._free:
                self.held -= self._free.pop(0).capacity
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
        """Return a buffer; if the caller still references it, let it go with the caller."""
        if buf.baseline < 0:
            return  # oversize: never pooled
        kept = storage_references(buf.tensor) > buf.baseline
        with self._lock:
            if kept:
                self.held -= buf.capacity
                self.handed_over += 1
            else:
                self._free.append(buf)

    def discard(self, buf: Buffer) -> None:
        """Forget a buffer without reusing it (its contents are unknown after an error)."""
        if buf.baseline >= 0:
            with self._lock:
                self.held -= buf.capacity

    def clear(self) -> None:
        with self._lock:
            for b in self._free:
                self.held -= b.capacity
            self._free.clear()
