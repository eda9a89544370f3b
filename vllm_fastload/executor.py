"""Executes a plan: bounded read-ahead, buffers from the pool, results in layer order, events.

One generator drives everything, so the order of side effects is easy to follow:
submit chunks ahead while the budget allows -> wait for the next chunk -> check the file did
not change -> yield its tensors -> (caller asks for more) -> release the buffer -> when a
layer group's last tensor was consumed, fire its event.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vllm_fastload.buffers import Buffer, BufferPool
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import CheckpointError, PlanError
from vllm_fastload.events import LoadProgress
from vllm_fastload.plan import Chunk, LayerGroup, Plan, PlannedTensor
from vllm_fastload.readers import Pending, Reader
from vllm_fastload.tensors import byte_view, torch_dtype, view_tensor

logger = logging.getLogger("vllm_fastload")


@dataclass
class _InFlight:
    chunk: Chunk
    buffer: Buffer | None
    pending: Pending
    #: Where the chunk is delivered as views of a mapping (see ``_mapped``): its bytes, and the
    #: file offset of the first.
    mapped: tuple[torch.Tensor, int] | None = None


@dataclass
class LoadStats:
    """What one execution did; adapters log it and benchmarks report it."""

    bytes_read: int = 0
    tensors: int = 0
    chunks: int = 0
    peak_buffer_bytes: int = 0
    buffers_handed_over: int = 0
    oversize_tensors: int = 0


def _after_consumer_work(chunk: Chunk, buf: Buffer | None) -> None:
    """Let GPU work the caller queued finish before device memory is (re)filled.

    The cuda reader writes from its own stream and kvikio by DMA, neither ordered after the
    caller's stream. A view the caller dropped may still be read by work it queued there
    (``param.copy_(view)`` returns before the copy runs), a freshly allocated buffer may be a
    block the caching allocator recycled from such a view, and a ``read_into`` destination may
    still have queued writes. Host memory needs nothing.
    """
    target = buf.tensor if buf is not None else next((t.dest for t, _ in chunk.tensors), None)
    if isinstance(target, torch.Tensor) and target.is_cuda:
        stream = torch.cuda.current_stream(target.device)
        # query() first: synchronize() gives up the GIL, and with the reader's threads busy this
        # thread waits to get it back (up to 5 ms) even when the stream has nothing queued.
        if not stream.query():
            stream.synchronize()


def _direct_calls(chunk: Chunk) -> list:
    """The read calls of a chunk read straight into the caller's tensors."""
    calls: list = []
    for t, _ in chunk.tensors:
        dest = byte_view(t.dest)
        if dest.numel() != t.needed_bytes:
            raise PlanError(f"a read of {t.needed_bytes} bytes was given a {dest.numel()}-byte destination",
                            file=t.info.file, tensor=t.key)
        if t.rows is not None:
            calls.append((t.rows, dest))  # one call per sliced tensor, not one per row
            continue
        pos = 0
        for offset, length in t.ranges:
            calls.append((offset, length, dest[pos:pos + length]))
            pos += length
    return calls


def _direct_bytes(chunk: Chunk) -> int:
    return sum(t.read_bytes for t, _ in chunk.tensors)


def _mapped(reader: Reader, sf, chunk: Chunk) -> tuple[torch.Tensor, int] | None:
    """The chunk's bytes where a buffered chunk can be handed out as views of a mapping of the
    file instead of read into a buffer (the reader decides: cached, local, mappable); None to read
    it. Each tensor must be one aligned range of the file (row slices read segment by segment are
    not laid out in the file as the caller sees them), and no two may overlap: views of one
    mapping share memory, so writing into one would change the other, where reads into a buffer
    give each request its own bytes."""
    ranges = []
    for t, _ in chunk.tensors:
        try:
            itemsize = torch_dtype(t).itemsize
        except Exception:  # a dtype torch cannot hold: its error belongs to its delivery, not here
            return None
        if len(t.ranges) != 1 or t.ranges[0][0] % itemsize:
            return None
        ranges.append(t.ranges[0])
    ranges.sort()
    if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(ranges)):
        return None
    return reader.mapped(sf, ranges)


def _wait_naming_tensors(item: _InFlight) -> None:
    """Wait for a chunk; an I/O error from the reader (which knows only offsets) gets the tensor's name."""
    try:
        item.pending.wait()
    except CheckpointError as exc:
        if exc.tensor is not None:
            raise
        names = list(dict.fromkeys(t.info.name for t, _ in item.chunk.tensors))  # checkpoint names, not keys
        where = f" while reading {', '.join(names[:3])}{' and others' if len(names) > 3 else ''}"
        raise type(exc)(exc.reason + where, file=exc.file, tensor=names[0] if names else None) from exc


class PlanExecutor:
    def __init__(self, checkpoint: Checkpoint, reader: Reader, pool: BufferPool, config: FastloadConfig) -> None:
        self.checkpoint = checkpoint
        self.reader = reader
        self.pool = pool
        self.config = config
        # Reads in flight beyond the one being consumed. Each needs its own buffer, and a new
        # buffer is fresh memory (the slowest thing to fill on our VMs), while two chunks ahead
        # already keep every thread busy: each chunk is split into read_size pieces.
        self.max_in_flight = 3
        self.stats = LoadStats()

    def run(self, plan: Plan, progress: LoadProgress | None = None,
            on_layer_end: Callable[[LayerGroup], object] | None = None,
            ) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        """Yield ``(planned tensor, tensor)`` in plan order.

        For buffered chunks the tensor is a view into a pool buffer: valid as long as the
        caller holds it, never overwritten while held (see ``buffers``); or, where the reader maps
        the chunk (``Reader.mapped``), a view of a private, copy-on-write mapping of the file. For direct chunks it
        is the caller's own destination, already filled.
        """
        chunks = plan.chunks
        # Direct chunks' read calls are made before the first read starts: made between reads,
        # each tensor op waits for the GIL behind the reader's threads (on an H200 host this
        # took a quarter of a warm TP=2 rank-1 load's 86 ms on the loading thread).
        prepared = {i: _direct_calls(chunk) for i, chunk in enumerate(chunks) if chunk.direct}
        in_flight: deque[_InFlight] = deque()
        next_index = 0

        def room_for(chunk: Chunk) -> bool:
            if len(in_flight) < self.max_in_flight:
                return True
            # Beyond that, only chunks read straight into the caller's tensors (no buffer), as far
            # ahead as the reader asks for to keep its threads busy.
            if self.reader.direct_read_ahead <= 0 or not chunk.direct or not all(
                    item.chunk.direct for item in in_flight):
                return False
            ahead = sum(_direct_bytes(item.chunk) for item in in_flight)
            return ahead + _direct_bytes(chunk) <= self.reader.direct_read_ahead

        def fill() -> None:
            nonlocal next_index
            while next_index < len(chunks) and room_for(chunks[next_index]):
                chunk = chunks[next_index]
                buf = None
                window = None if chunk.direct else _mapped(self.reader, self.checkpoint.files[chunk.file], chunk)
                if window is not None:
                    in_flight.append(_InFlight(chunk, None, Pending([]), window))
                    self.stats.bytes_read += sum(t.read_bytes for t, _ in chunk.tensors)
                    self.stats.chunks += 1
                    next_index += 1
                    continue
                if not chunk.direct:
                    buf = self.pool.try_acquire(chunk.nbytes)
                    if buf is None:
                        if in_flight:
                            return  # wait for a buffer to come back
                        buf = self._oversize(chunk)
                _after_consumer_work(chunk, buf)
                in_flight.append(_InFlight(chunk, buf, self._submit(chunk, buf, prepared.pop(next_index, None))))
                next_index += 1

        # A buffer goes back to the pool one chunk late: when the caller asks for the next
        # item, its loop variable still holds the previous tensor, so only after a further
        # chunk can "still referenced" be told apart from "kept on purpose". (The pool parks a
        # buffer that is still referenced and re-checks it later, so being early is safe too.)
        previous: Buffer | None = None
        item: _InFlight | None = None
        handed_over_before = self.pool.handed_over
        try:
            for group in plan.groups:
                for _ in group.chunks:
                    fill()
                    item = in_flight.popleft()
                    _wait_naming_tensors(item)
                    item.pending = None
                    if self.config.check_file_changes:
                        self.checkpoint.files[item.chunk.file].check_unchanged()
                    yield from self._deliver(item)
                    if item.mapped is not None and self.config.check_file_changes:
                        # Views show the file while the caller copies them: a change made
                        # meanwhile is caught here, before the next chunk.
                        self.checkpoint.files[item.chunk.file].check_unchanged()
                    if item.buffer is not None or item.mapped is not None:
                        if previous is not None:
                            self.pool.release(previous)
                        previous, item.buffer = item.buffer, None
                    item = None
                if on_layer_end is not None:
                    on_layer_end(group)
                if progress is not None:
                    progress.layer_done(group.key.layer, group.key.name, len(group.tensors), group.read_bytes)
        finally:
            if previous is not None:
                self.pool.release(previous)
            # The chunk being delivered when the caller stopped (break, exception) or that
            # failed: its buffer goes back too, or the pool would count it as held forever.
            if item is not None:
                in_flight.appendleft(item)
            self._drain(in_flight)
            self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, self.pool.peak)
            self.stats.buffers_handed_over = self.pool.handed_over - handed_over_before

    def _oversize(self, chunk: Chunk) -> Buffer:
        names = ", ".join(t.key for t, _ in chunk.tensors)
        logger.warning("fastload: %s needs %.1f MB at once, more than fits in memory_budget (%.1f MB) "
                       "beside the buffer still in use; reading it into a one-off buffer",
                       names, chunk.nbytes / 1e6, self.pool.budget / 1e6)
        self.stats.oversize_tensors += len(chunk.tensors)
        return self.pool.allocate_oversize(chunk.nbytes)

    def _submit(self, chunk: Chunk, buf: Buffer | None, direct_calls: list | None) -> Pending:
        """Start a chunk's reads: ``direct_calls`` (made by ``_direct_calls``) for a direct chunk,
        else one call per op into ``buf``."""
        sf = self.checkpoint.files[chunk.file]
        if chunk.direct:
            calls = direct_calls
            self.stats.bytes_read += _direct_bytes(chunk)
        else:
            calls = [(op.rows, buf.tensor[op.buf_offset:op.buf_offset + op.length]) if op.rows is not None else
                     (op.file_offset, op.length, buf.tensor[op.buf_offset:op.buf_offset + op.length])
                     for op in chunk.ops]
            self.stats.bytes_read += sum(op.length for op in chunk.ops)
        self.stats.chunks += 1
        return self.reader.submit(sf, calls)

    def _deliver(self, item: _InFlight) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        for t, pos in item.chunk.tensors:
            self.stats.tensors += 1
            if item.chunk.direct:
                yield t, t.dest
            elif item.mapped is not None:
                window, first = item.mapped
                offset = t.ranges[0][0] - first
                yield t, view_tensor(window[offset:offset + t.read_bytes], t)
            else:
                yield t, view_tensor(item.buffer.tensor[pos:pos + t.read_bytes], t)

    def _drain(self, in_flight: deque[_InFlight]) -> None:
        """Stop cleanly: reads still running must finish before their buffers are reused or freed.

        Once every read of a chunk has finished (``Pending.wait`` waits for all of them, even
        after an error) its buffer goes back to the pool, which reuses it only if the caller
        holds no view of it.
        """
        while in_flight:
            item = in_flight.popleft()
            try:
                if item.pending is not None:
                    item.pending.wait()
            except Exception:
                pass
            if item.buffer is not None:
                self.pool.release(item.buffer)
                item.buffer = None
