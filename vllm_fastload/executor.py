"""Executes a plan: a bounded number of chunks in flight, buffers from the pool, results in layer order, events.

Each chunk travels as a ``Delivery`` of its kind, all with one contract: ``start`` its reads,
``wait`` for them, ``deliver`` its tensors, and hand back what it holds (``held``, ``drain``):

- ``DirectDelivery``: the reads land in the caller's own tensors (``read_into``);
- ``BufferedDelivery``: the reads land in a pool buffer, the tensors are views of it;
- ``MappedDelivery``: no reads; the tensors are views of a private mapping of the file.

``PlanExecutor.run`` is the loop: the next chunk in flight (``ChunksInFlight``) -> check the
file did not change -> yield its tensors -> hand the previous chunk's buffer back -> when a layer
group's last chunk was consumed, fire its event.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_fastload import policy
from vllm_fastload.buffers import Buffer, BufferPool
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import CheckpointError, PlanError
from vllm_fastload.events import LoadProgress
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.plan import Chunk, LayerGroup, Plan, PlannedTensor
from vllm_fastload.readers import Call, FileWindow, Pending, ReadCall, Reader, RowsCall
from vllm_fastload.tensors import byte_view, torch_dtype, view_tensor

logger = logging.getLogger("vllm_fastload")

@dataclass(frozen=True, eq=False)  # identity: it holds tensors (no elementwise ==)
class Delivered:
    """What the executor yields: a planned tensor and its bytes as a tensor."""

    planned: PlannedTensor
    tensor: torch.Tensor


@dataclass(frozen=True)
class LoadStats:
    """What one execution did; adapters log it and benchmarks report it."""

    bytes_read: int = 0
    tensors: int = 0
    chunks: int = 0
    peak_buffer_bytes: int = 0
    buffers_handed_over: int = 0
    oversize_tensors: int = 0


class Delivery:
    """One chunk on its way to the caller (see the module docstring for the kinds)."""

    #: Handing this chunk over passes the previous chunk's buffer back to the pool (see ``run``).
    recycles: ClassVar[bool] = True
    #: The delivered tensors are views of the file itself: checked for changes again afterwards.
    views_file: ClassVar[bool] = False

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        #: Reads in flight; None once waited for (or where there are none).
        self.pending: Pending | None = None

    @property
    def read_bytes(self) -> int:
        """The bytes the chunk's reads move (or its views show)."""
        raise NotImplementedError

    def start(self, reader: Reader, sf: SafetensorsFile) -> None:
        """Start the chunk's reads, if it has any."""
        raise NotImplementedError

    def wait(self, stall_s: float | None = None) -> None:
        """Wait for the chunk's reads (``stall_s``: see ``Pending.wait``); an I/O error from the
        reader (which knows only offsets) gets the tensors' names."""
        if self.pending is None:
            return
        try:
            self.pending.wait(stall_s)
        except CheckpointError as exc:
            if exc.tensor is not None:
                raise
            names = list(dict.fromkeys(c.tensor.info.name for c in self.chunk.tensors))  # checkpoint names, not keys
            where = f" while reading {', '.join(names[:3])}{' and others' if len(names) > 3 else ''}"
            raise type(exc)(exc.reason + where, file=exc.file, tensor=names[0] if names else None) from exc
        self.pending = None

    def deliver(self) -> Iterator[Delivered]:
        """Yield each of the chunk's tensors with its bytes, in plan order."""
        raise NotImplementedError

    def held(self) -> Buffer | None:
        """The pool buffer to hand back once the caller has moved past this chunk; taken once."""
        return None

    def drain(self, pool: BufferPool, stall_s: float | None = None) -> None:
        """Stop: reads still running finish (or stall, see ``Pending.wait``), then what the chunk
        holds goes back to the pool (which reuses a buffer only once the caller holds no view of it)."""
        if self.pending is not None:
            self.pending.wait_quietly(stall_s)
            self.pending = None
        buf = self.held()
        if buf is not None:
            pool.release(buf)


class DirectDelivery(Delivery):
    """Reads straight into the caller's tensors (``PlannedTensor.dest``): no buffer."""

    recycles = False

    def __init__(self, chunk: Chunk, calls: list[Call]) -> None:
        super().__init__(chunk)
        self.calls = calls

    @property
    def read_bytes(self) -> int:
        return _direct_bytes(self.chunk)

    def start(self, reader: Reader, sf: SafetensorsFile) -> None:
        _after_consumer_work(self.chunk, None)
        self.pending = reader.submit(sf, self.calls)

    def deliver(self) -> Iterator[Delivered]:
        for c in self.chunk.tensors:
            assert isinstance(c.tensor.dest, torch.Tensor)
            yield Delivered(c.tensor, c.tensor.dest)


class BufferedDelivery(Delivery):
    """Reads into a pool buffer; the caller gets views of it."""

    def __init__(self, chunk: Chunk, buffer: Buffer) -> None:
        super().__init__(chunk)
        self.buffer: Buffer | None = buffer

    @property
    def read_bytes(self) -> int:
        return sum(op.length for op in self.chunk.ops)

    def start(self, reader: Reader, sf: SafetensorsFile) -> None:
        assert self.buffer is not None
        _after_consumer_work(self.chunk, self.buffer)
        into = self.buffer.tensor
        calls: list[Call] = [RowsCall(op.rows, into[op.buf_offset:op.buf_offset + op.length]) if op.rows is not None
                             else ReadCall(op.file_offset, op.length, into[op.buf_offset:op.buf_offset + op.length])
                             for op in self.chunk.ops]
        self.pending = reader.submit(sf, calls)

    def deliver(self) -> Iterator[Delivered]:
        assert self.buffer is not None
        for c in self.chunk.tensors:
            pos, t = c.buf_offset, c.tensor
            yield Delivered(t, view_tensor(self.buffer.tensor[pos:pos + t.read_bytes], t))

    def held(self) -> Buffer | None:
        buf, self.buffer = self.buffer, None
        return buf


class MappedDelivery(Delivery):
    """No reads: the caller gets views of a private mapping of the file (``Reader.mapped``)."""

    views_file = True

    def __init__(self, chunk: Chunk, window: FileWindow) -> None:
        super().__init__(chunk)
        self.window = window

    @property
    def read_bytes(self) -> int:
        return _direct_bytes(self.chunk)

    def start(self, reader: Reader, sf: SafetensorsFile) -> None:
        # The pages are brought in on the reader's threads, where a failing disk, a file cut short
        # or a stalled read is an error naming the file (or a stall past the deadline), not a
        # SIGBUS or a hang in the caller's copy out of the views.
        self.pending = reader.populate_mapped(sf, self.window)

    def deliver(self) -> Iterator[Delivered]:
        for c in self.chunk.tensors:
            t = c.tensor
            offset = t.ranges[0].offset - self.window.first
            yield Delivered(t, view_tensor(self.window.tensor[offset:offset + t.read_bytes], t))


def _after_consumer_work(chunk: Chunk, buf: Buffer | None) -> None:
    """Let GPU work the caller queued finish before device memory is (re)filled.

    The cuda reader writes from its own stream and kvikio by DMA, neither ordered after the
    caller's stream. A view the caller dropped may still be read by work it queued there
    (``param.copy_(view)`` returns before the copy runs), a freshly allocated buffer may be a
    block the caching allocator recycled from such a view, and a ``read_into`` destination may
    still have queued writes. Host memory needs nothing.
    """
    target = buf.tensor if buf is not None else next((c.tensor.dest for c in chunk.tensors), None)
    if isinstance(target, torch.Tensor) and target.is_cuda:
        stream = torch.cuda.current_stream(target.device)
        # query() first: synchronize() gives up the GIL, and with the reader's threads busy this
        # thread waits to get it back even when the stream has nothing queued.
        if not stream.query():
            stream.synchronize()


def _direct_calls(chunk: Chunk) -> list[Call]:
    """The read calls of a chunk read straight into the caller's tensors."""
    calls: list[Call] = []
    for c in chunk.tensors:
        t = c.tensor
        assert isinstance(t.dest, torch.Tensor)
        dest = byte_view(t.dest)
        if dest.numel() != t.needed_bytes:
            raise PlanError(f"a read of {t.needed_bytes} bytes was given a {dest.numel()}-byte destination",
                            file=t.info.file, tensor=t.key)
        if t.rows is not None:
            calls.append(RowsCall(t.rows, dest))  # one call per sliced tensor, not one per row
            continue
        pos = 0
        for offset, length in t.ranges:
            calls.append(ReadCall(offset, length, dest[pos:pos + length]))
            pos += length
    return calls


def _direct_bytes(chunk: Chunk) -> int:
    """The bytes of a chunk's tensors (as read into their own tensors, or shown by a mapping)."""
    return sum(c.tensor.read_bytes for c in chunk.tensors)


def _mapped(reader: Reader, sf: SafetensorsFile, chunk: Chunk) -> FileWindow | None:
    """The chunk's bytes where a buffered chunk can be handed out as views of a mapping of the
    file instead of read into a buffer (the reader decides: cached, local, mappable); None to read
    it. Each tensor must be one aligned range of the file (row slices read segment by segment are
    not laid out in the file as the caller sees them), and no two may overlap: views of one
    mapping share memory, so writing into one would change the other, where reads into a buffer
    give each request its own bytes."""
    ranges = []
    for c in chunk.tensors:
        t = c.tensor
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


class ChunksInFlight:
    """The chunks submitted ahead of the one being delivered: ``policy.CHUNKS_IN_FLIGHT``, and
    beyond that chunks read into the caller's own tensors as far ahead as the reader asks for
    (``Reader.direct_in_flight``), or an object store's link wants (``policy.direct_reads_ahead``)."""

    def __init__(self, executor: PlanExecutor, chunks: Sequence[Chunk]) -> None:
        self.executor = executor
        self.chunks = chunks
        self.next_index = 0
        self.in_flight: deque[Delivery] = deque()
        # Direct chunks' read calls are made before the first read starts: made between reads,
        # each tensor op waits for the GIL behind the reader's threads.
        self.prepared = {i: _direct_calls(chunk) for i, chunk in enumerate(chunks) if chunk.direct}

    def next(self) -> Delivery:
        """The next chunk, its reads done (later chunks submitted first)."""
        self._fill()
        item = self.in_flight.popleft()
        try:
            item.wait(self.executor.config.stall_timeout_s)
        except BaseException:
            self.in_flight.appendleft(item)  # drained with the rest
            raise
        return item

    def drain(self, pool: BufferPool) -> None:
        """Wait for every read still in flight and hand their buffers back."""
        while self.in_flight:
            self.in_flight.popleft().drain(pool, self.executor.config.stall_timeout_s)

    def _room_for(self, chunk: Chunk) -> bool:
        if len(self.in_flight) < policy.CHUNKS_IN_FLIGHT:
            return True
        remote = self.executor.checkpoint.files[chunk.file].fd is None
        ahead_limit = policy.direct_reads_ahead(reader_ahead=self.executor.reader.direct_in_flight, remote=remote)
        if ahead_limit <= 0 or not chunk.direct or not all(item.chunk.direct for item in self.in_flight):
            return False
        ahead = sum(_direct_bytes(item.chunk) for item in self.in_flight)
        return ahead + _direct_bytes(chunk) <= ahead_limit

    def _fill(self) -> None:
        while self.next_index < len(self.chunks) and self._room_for(self.chunks[self.next_index]):
            item = self._start(self.chunks[self.next_index])
            if item is None:
                return  # wait for a buffer to come back
            self.in_flight.append(item)
            self.next_index += 1

    def _start(self, chunk: Chunk) -> Delivery | None:
        """The chunk's delivery, its reads started; None: no buffer free until one comes back."""
        ex = self.executor
        sf = ex.checkpoint.files[chunk.file]
        delivery = self._delivery(chunk, sf)
        if delivery is None:
            return None
        delivery.start(ex.reader, sf)
        ex.count_chunk(delivery.read_bytes)
        return delivery

    def _delivery(self, chunk: Chunk, sf: SafetensorsFile) -> Delivery | None:
        ex = self.executor
        if chunk.direct:
            return DirectDelivery(chunk, self.prepared.pop(self.next_index))
        window = _mapped(ex.reader, sf, chunk)
        if window is not None:
            return MappedDelivery(chunk, window)
        buf = ex.pool.try_acquire(chunk.nbytes)
        if buf is None:
            if self.in_flight:
                return None
            buf = ex._oversize(chunk)
        return BufferedDelivery(chunk, buf)


class PlanExecutor:
    def __init__(self, checkpoint: Checkpoint, reader: Reader, pool: BufferPool, config: FastloadConfig) -> None:
        self.checkpoint = checkpoint
        self.reader = reader
        self.pool = pool
        self.config = config
        # What ``stats`` reports, counted as the execution goes.
        self._bytes_read = self._tensors = self._chunks = self._oversize_tensors = 0
        self._peak = self._handed_over = 0

    @property
    def stats(self) -> LoadStats:
        """What the execution did so far (all of it once ``run`` has ended)."""
        return LoadStats(bytes_read=self._bytes_read, tensors=self._tensors, chunks=self._chunks,
                         peak_buffer_bytes=self._peak, buffers_handed_over=self._handed_over,
                         oversize_tensors=self._oversize_tensors)

    def count_chunk(self, read_bytes: int) -> None:
        """A chunk's reads started (or its views made)."""
        self._bytes_read += read_bytes
        self._chunks += 1

    def run(self, plan: Plan, progress: LoadProgress | None = None,
            on_layer_end: Callable[[LayerGroup], object] | None = None) -> Iterator[Delivered]:
        """Yield each planned tensor with its bytes (``Delivered``), in plan order.

        For buffered chunks the tensor is a view into a pool buffer: valid as long as the caller
        holds it, never overwritten while held (see ``buffers``); for mapped chunks a view of a
        private, copy-on-write mapping of the file; for direct chunks the caller's own
        destination, already filled.

        A buffer goes back to the pool one chunk late: when the caller asks for the next item,
        its loop variable still holds the previous tensor, so only after a further chunk can
        "still referenced" be told apart from "kept on purpose". (The pool parks a buffer that is
        still referenced and re-checks it later, so being early is safe too.)
        """
        ahead = ChunksInFlight(self, plan.chunks)
        previous: Buffer | None = None
        current: Delivery | None = None
        handed_over_before = self.pool.handed_over
        try:
            for group in plan.groups:
                for _ in group.chunks:
                    current = ahead.next()
                    self._check_unchanged(current.chunk)
                    for delivered in current.deliver():
                        self._tensors += 1
                        yield delivered
                    if current.views_file:
                        # Views show the file while the caller copies them: a change made
                        # meanwhile is caught here, before the next chunk.
                        self._check_unchanged(current.chunk)
                    if current.recycles:
                        if previous is not None:
                            self.pool.release(previous)
                        previous = current.held()
                    current = None
                self._layer_done(group, progress, on_layer_end)
        finally:
            if previous is not None:
                self.pool.release(previous)
            # The chunk being delivered when the caller stopped (break, exception) or that
            # failed: its buffer goes back too, or the pool would count it as held forever.
            if current is not None:
                current.drain(self.pool, self.config.stall_timeout_s)
            ahead.drain(self.pool)
            self._peak = max(self._peak, self.pool.peak)
            self._handed_over = self.pool.handed_over - handed_over_before

    def _check_unchanged(self, chunk: Chunk) -> None:
        if self.config.check_file_changes:
            self.checkpoint.files[chunk.file].check_unchanged()

    @staticmethod
    def _layer_done(group: LayerGroup, progress: LoadProgress | None,
                    on_layer_end: Callable[[LayerGroup], object] | None) -> None:
        if on_layer_end is not None:
            on_layer_end(group)
        if progress is not None:
            progress.layer_done(group.key.layer, group.key.name, len(group.tensors), group.read_bytes)

    def _oversize(self, chunk: Chunk) -> Buffer:
        names = ", ".join(c.tensor.key for c in chunk.tensors)
        logger.warning("fastload: %s needs %.1f MB at once, more than fits in memory_budget (%.1f MB) "
                       "beside the buffer still in use; reading it into a one-off buffer",
                       names, chunk.nbytes / 1e6, self.pool.budget / 1e6)
        self._oversize_tensors += len(chunk.tensors)
        return self.pool.allocate_oversize(chunk.nbytes)
