"""Pinned host slots between a file and the GPU: threads ``pread`` into a slot, and its bytes go
to the device on that thread's own stream.

Disk and PCIe overlap: while one slot's bytes travel to the device, other threads fill other
slots. A thread waits for its own copy before its slot goes back to the ring, so staging memory
is bounded by ``slots x slot size`` (a quarter of the memory budget). Each worker thread copies
on a stream of its own: on one shared stream a thread would also wait for every other thread's
queued copies.

Slices along a later dim (``Rows``) land packed in the slot, so each batch of rows is one copy to
the device rather than one per row.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from vllm_fastload import policy
from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Call, Reader, RowsCall
from vllm_fastload.readers.host import read_rows
from vllm_fastload.readers.pagecache import advise_rows, cached_calls
from vllm_fastload.sources.base import RangeInto
from vllm_fastload.sources.local import pread_into
from vllm_fastload.tensors import host_bytes


class StagedReader(Reader):
    """A reader onto a CUDA device whose reads, or some of them, go through ``PinnedStaging``:
    the device check, the staging's share of the budget and its reads in flight, device buffers."""

    reads_rows = True  # rows are packed into the slots

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        if device.type != "cuda":
            raise ValueError(f"the {self.name} backend needs a CUDA device, got {device}")
        self.staging = PinnedStaging(config, device)
        self.decisions.note("pinned staging", f"{self.staging.slots} slots of {self.staging.slot_size} bytes",
                            memory_budget=int(config.memory_budget), read_size=int(config.read_size),
                            threads=config.threads)

    @property
    def staging_bytes(self) -> int:
        return self.staging.staging_bytes

    @property
    def direct_in_flight(self) -> int:
        return self.staging.in_flight

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        super().close()
        self.staging.close()


@dataclass(frozen=True, eq=False)  # identity: it holds tensors (no elementwise ==)
class Slot:
    """A pinned staging slot, and a view of its bytes to read into."""

    tensor: torch.Tensor
    view: memoryview


@dataclass(frozen=True, eq=False)
class Staged:
    """Where one read call's bytes landed in a slot, and the destination they go on to."""

    #: Where they start in the slot.
    offset: int
    length: int
    dest: torch.Tensor


class PinnedStaging:
    """A ring of pinned slots and the per-thread streams that empty them onto ``device``.

    Slots are pinned on first use (pinning costs time, and a reader that stages only its row
    slices may never need one). A thread holds one slot at a time, so there are at most as many
    slots as threads.
    """

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        self.slot_size, self.slots = policy.staging_slots(memory_budget=int(config.memory_budget),
                                                          read_size=int(config.read_size), threads=config.threads)
        self.read_size = int(config.read_size)
        self.threads = config.threads
        self.device = device
        self._free: queue.Queue[Slot] = queue.Queue()
        self._made = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []

    @property
    def staging_bytes(self) -> int:
        return self.slots * self.slot_size

    @property
    def in_flight(self) -> int:
        """Queued work beyond the executor's chunks in flight (``policy.staging_in_flight``): a
        few large chunks are few tasks for many threads."""
        return policy.staging_in_flight(threads=self.threads, slot_size=self.slot_size)

    def start(self, reader: Reader, sf: SafetensorsFile, calls: Sequence[Call]) -> list[Future[None]]:
        """Start reading ``calls`` through the slots on ``reader``'s threads (rows advised to the
        kernel now); a future per batch, done when its bytes are on the device."""
        rows = [call.rows for call in calls if isinstance(call, RowsCall)]
        cached = False
        if rows and sf.fd is not None:
            cached = cached_calls(sf.fd, calls)
            for r in rows if not cached else ():
                advise_rows(sf.fd, r, ahead=True)  # the disk works ahead of the row-by-row reads
        pool = reader.threads()
        return [pool.submit(self._stage, sf, batch, cached)
                for batch in reader.batches(calls, self.slot_size, bounded=True)]

    def _slot(self) -> Slot:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < self.slots
            self._made += make
        if not make:
            return self._free.get()
        try:
            slot = torch.empty(self.slot_size, dtype=torch.uint8, pin_memory=True)
        except BaseException:
            with self._lock:
                self._made -= 1  # or a later task would wait forever for a slot never made
            raise
        return Slot(slot, host_bytes(slot))

    def _use_own_stream(self) -> None:
        """Make a stream of this worker thread's own its current stream (once per thread)."""
        if getattr(self._local, "stream", None) is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            torch.cuda.set_stream(stream)
            with self._lock:
                self._streams.append(stream)

    def _stage(self, sf: SafetensorsFile, batch: list[Call], cached: bool) -> None:
        slot = self._slot()
        placed: list[Staged] | None = None
        staged: Staged | None = None
        try:
            placed = fill_slot(sf, slot.view, batch, cached, self.read_size)
            self._use_own_stream()
            for staged in placed:
                staged.dest.copy_(slot.tensor[staged.offset:staged.offset + staged.length], non_blocking=True)
        finally:
            # This thread's copies only (other threads keep reading into other slots meanwhile),
            # and after an error too: no copy may still run once the slot is reused or the task
            # has failed.
            stream = getattr(self._local, "stream", None)
            if stream is not None:
                stream.synchronize()
            self._free.put(slot)
            # See host._read_batch: no view of the buffer outlives the task, nor an error's traceback.
            batch.clear()
            placed = staged = None

    def close(self) -> None:
        for stream in self._streams:
            stream.synchronize()


def fill_slot(sf: SafetensorsFile, slot: memoryview, batch: Sequence[Call],
              cached: bool = False, read_size: int = 1 << 62) -> list[Staged]:
    """Read a batch packed into ``slot``; return where each call's bytes landed in it.

    A local file is read with ``pread`` calls of at most ``read_size``; rows copied out of a
    mapping where the file is ``cached``, else with a call per row, or one ``preadv`` per batch of
    rows through the gaps where the plan says so (see ``host.read_rows``). An object gets one
    submission to its source, rows as one range per row (neighbouring ranges share a GET).
    """
    placed: list[Staged] = []
    ranges: list[RangeInto] = []
    used = 0
    call: Call | None = None
    dest: torch.Tensor | None = None
    view: memoryview | None = None
    try:
        for call in batch:
            if isinstance(call, RowsCall):
                rows, dest = call
                length = rows.seg * rows.count
                view = slot[used:used + length]
                if sf.fd is None:
                    ranges += [RangeInto(offset, view[i * seg:(i + 1) * seg])
                               for i, (offset, seg) in enumerate(rows.ranges())]
                else:
                    read_rows(sf.fd, sf.path, rows, view, cached)
            else:
                offset, length, dest = call
                view = slot[used:used + length]
                if sf.fd is None:
                    ranges.append(RangeInto(offset, view))
                else:
                    for done in range(0, length, read_size):
                        pread_into(sf.fd, sf.path, offset + done, view[done:done + read_size])
            placed.append(Staged(used, length, dest))
            used += length
        if ranges:
            sf.source.submit_ranges_into(ranges).result()
        return placed
    except BaseException:
        placed.clear()  # an error's traceback keeps this frame: it must not keep the destinations
        raise
    finally:
        ranges.clear()
        call = dest = view = None
