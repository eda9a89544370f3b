"""``host``: threaded reads straight into host memory (the GIL is released during reads).

How each chunk is read is ``policy.chunk_read``'s decision, from probes of the page cache
(``pagecache.cached_calls``, ``pagecache.has_holes``) and whether the file opens with O_DIRECT;
in short:
- cached: ``preadv`` copies out of the page cache (row slices: a strided copy out of a mapping of
  the file, see ``mapped``), on no more threads than CPUs (it is CPU work);
- not cached: ``O_DIRECT`` reads into reused per-thread buffers and one copy into the
  destination (see ``direct``), on every thread (they wait on the disk). Where O_DIRECT does
  not work, buffered reads with ``POSIX_FADV_WILLNEED`` advice instead.

Buffers are anonymous mappings (``memory.allocate_host``; transparent huge pages only with
``hugepages``). The executor
reuses buffers, so most reads land in memory that is already touched; memory that is not (a vLLM
parameter read into directly) is faulted in first by ``memory.populate``.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from vllm_fastload import machine, policy
from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.plan import ByteRange, Rows
from vllm_fastload.policy import ChunkRead, MapChunk
from vllm_fastload.readers import direct, mapped, pagecache
from vllm_fastload.readers.base import Call, FileWindow, Pending, Reader, RowsCall
from vllm_fastload.readers.direct import DirectFile
from vllm_fastload.readers.memory import allocate_host, populate
from vllm_fastload.readers.pagecache import Probed, advise, advise_rows, cached_calls, has_holes, span
from vllm_fastload.readers.remote import submit_to_source
from vllm_fastload.readers.threads import ReaderThreads, reading, thread_pool
from vllm_fastload.sources.local import IOV_MAX, pread_into, preadv_into
from vllm_fastload.tensors import host_bytes

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class _OpenFile:
    """A descriptor of an open file, and the file's inode: a descriptor number that is reused for
    another file never finds what was kept for the old one."""

    fd: int
    inode: int

    @classmethod
    def of(cls, fd: int) -> _OpenFile:
        return cls(fd, os.fstat(fd).st_ino)


class HostReader(Reader):
    name = "host"
    #: Its plans are exact (``policy.reader_strided_min_skip``): see ``read_rows``.
    reads_rows = True

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._copy_pool: ReaderThreads | None = None
        self.bounce_size = _bounce_size(config)
        self.decisions.note("O_DIRECT buffer per thread", self.bounce_size, direct_io=config.direct_io,
                            memory_budget=int(config.memory_budget), threads=config.threads)
        #: A buffered descriptor's O_DIRECT twin, or None where O_DIRECT fails.
        self._direct: dict[_OpenFile, DirectFile | None] = {}
        #: Buffered descriptors whose read-ahead is off (see ``_no_readahead``).
        self._random: set[_OpenFile] = set()

    @property
    def staging_bytes(self) -> int:
        return self.config.threads * self.bounce_size

    def allocate(self, nbytes: int) -> torch.Tensor:
        return allocate_host(nbytes, self.config.hugepages)

    def submit(self, sf: SafetensorsFile, calls: Sequence[Call]) -> Pending:
        facts = _ChunkFacts(self, sf, calls)
        how = policy.chunk_read(facts, direct_io=self.config.direct_io, copiers=self._copier_count,
                                threads=self.config.threads)
        self.decisions.note("host reader chunk", how, **facts.known())
        if how is ChunkRead.REMOTE:
            # While the requests wait on the store, the destinations' fresh pages are faulted in
            # on the reader's threads, not one trap per page in the store client's loop as each
            # response is copied in. No byte changes (see ``memory.populate``).
            self.threads().submit(_populate_batch, [call.dest for call in calls])
            return submit_to_source(sf, calls)
        assert sf.fd is not None
        if how is ChunkRead.CACHED_PREFAULTED:
            return self._submit_cached(sf, calls, self._copiers())
        pool, task = self.threads(), _read_batch
        if how is ChunkRead.CACHED:
            # Each copier faults in its own destinations as it goes: on one CPU, threads faulting
            # ahead of it would only take turns with it there.
            pool, task = self._copiers(), functools.partial(_read_batch, cached=True)
        elif how in (ChunkRead.HOLES, ChunkRead.BUFFERED):
            advise(sf.fd, calls)
        else:
            rows = [call.rows for call in calls if isinstance(call, RowsCall)]
            if rows:
                self._no_readahead(sf.fd)
            for r in rows:
                advise_rows(sf.fd, r, ahead=True)  # now, so the disk works ahead of the threads
            opened = facts.opened
            assert opened is not None  # DIRECT only for a file that opened with O_DIRECT
            pool, task = self.threads(), functools.partial(_read_batch_direct, opened, self.bounce_size)
        futures = [pool.submit(task, sf.fd, sf.path, batch) for batch in self.batches(calls, self.config.read_size)]
        return Pending(futures)

    def mapped(self, sf: SafetensorsFile, ranges: Sequence[ByteRange]) -> FileWindow | None:
        """Cached ranges, mostly cached ones, and with ``direct_io`` "never" also ranges not
        cached (``policy.map_chunk``); the missing pages are advised to the kernel now (the
        caller's copy then waits for the disk where it gets ahead of it)."""
        if not ranges:
            return None
        fd = -1 if sf.fd is None else sf.fd
        calls: list[Probed] = list(ranges)
        start, end = span(ranges)
        facts = _MapFacts(fd, calls, start, end)
        how = policy.map_chunk(facts, map_cached=self.config.map_cached, remote=sf.fd is None,
                               direct_io=self.config.direct_io)
        self.decisions.note("host reader mapping", how, map_cached=self.config.map_cached,
                            direct_io=self.config.direct_io, **facts.known())
        if how is MapChunk.READ:
            return None
        window = mapped.file_window(fd, sf.path, start, end)
        if window is not None and how is MapChunk.MAP_ADVISED:
            advise(fd, calls)
        return window

    def populate_mapped(self, sf: SafetensorsFile, window: FileWindow) -> Pending | None:
        """Where pages of the window are not in the page cache (the disk must be read): they are
        brought in on the reader's threads, a ``read_size`` piece each (see ``mapped.populate``).
        A window wholly in the page cache needs no read that could fail or stall, and mapping its
        pages ahead would only add to the caller's copy."""
        piece, length, first = int(self.config.read_size), window.tensor.numel(), window.first
        if sf.fd is None:
            return None
        if not policy.bring_in_mapped(wholly_cached=mapped.wholly_cached(sf.fd, first, first + length)):
            return None
        return Pending([self.threads().submit(mapped.populate, window.tensor, sf.path, done, min(piece, length - done),
                                              first + done) for done in range(0, length, piece)])

    def _submit_cached(self, sf: SafetensorsFile, calls: Sequence[Call],
                       copiers: ReaderThreads) -> Pending:
        """Copies out of the page cache on the copier threads (several CPUs, fewer than
        ``threads``); the destinations' fresh pages are faulted in ahead of them on all threads,
        since faulting in fresh memory waits on the hypervisor where the VM hands freed memory
        back to its host, while the copy itself is CPU work."""
        futures = []
        for batch in self.batches(calls, self.config.read_size):
            faulted = self.threads().submit(_populate_batch, [call.dest for call in batch])
            futures.append(copiers.submit(_after, faulted, _read_batch, sf.fd, sf.path, batch, True))
        return Pending(futures)

    def _no_readahead(self, fd: int) -> None:
        """Turns off the kernel's read-ahead on the buffered descriptor (``POSIX_FADV_RANDOM``)
        once O_DIRECT carries the contiguous reads: it is left with row slices, whose pages are
        advised exactly, and read-ahead on a miss would fetch the other ranks' bytes too."""
        key = _OpenFile.of(fd)
        if key in self._random:
            return
        self._random.add(key)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except (OSError, AttributeError):
            pass  # advice only

    def _direct_fd(self, fd: int) -> DirectFile | None:
        if not self.bounce_size:
            return None
        key = _OpenFile.of(fd)
        if key not in self._direct:
            self._direct[key] = direct.open_direct(fd)
        return self._direct[key]

    @functools.cached_property
    def _copier_count(self) -> int:
        """Threads that copy out of the page cache (``policy.copier_count``)."""
        cpus = machine.cpu_count(self.config.cpus)
        count = policy.copier_count(self.config.threads, cpus)
        self.decisions.note("copier threads", count, threads=self.config.threads, cpus=cpus)
        return count

    def _copiers(self) -> ReaderThreads:
        if self._copy_pool is None:
            if self._copier_count >= self.config.threads:
                return self.threads()
            self._copy_pool = thread_pool(self._copier_count, "fastload-copy", self.config.cpus)
        return self._copy_pool

    def close(self) -> None:
        super().close()
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        for opened in self._direct.values():
            if opened is not None:
                os.close(opened.fd)
        self._direct.clear()
        self._random.clear()


class _ChunkFacts:
    """What ``policy.chunk_read`` may ask of a chunk, each probed on first access."""

    def __init__(self, reader: HostReader, sf: SafetensorsFile, calls: Sequence[Call]) -> None:
        self._reader, self._fd, self._calls = reader, sf.fd, calls
        self._known: dict[str, bool] = {"remote": sf.fd is None}

    @property
    def remote(self) -> bool:
        return self._known["remote"]

    def _probe(self, name: str, probe: Callable[[int], bool]) -> bool:
        if name not in self._known:
            assert self._fd is not None
            self._known[name] = probe(self._fd)
        return self._known[name]

    @property
    def cached(self) -> bool:
        return self._probe("cached", lambda fd: cached_calls(fd, self._calls))

    @property
    def holes(self) -> bool:
        return self._probe("holes", lambda fd: has_holes(fd, self._calls))

    @property
    def direct_ok(self) -> bool:
        return self._probe("direct_ok", lambda fd: self.opened is not None)

    @functools.cached_property
    def opened(self) -> DirectFile | None:
        """The O_DIRECT descriptor, or None."""
        assert self._fd is not None
        return self._reader._direct_fd(self._fd)

    def known(self) -> dict[str, bool]:
        """The facts probed so far (for the decision's log line)."""
        return dict(self._known)


class _MapFacts:
    """What ``policy.map_chunk`` may ask of a chunk, each probed on first access."""

    def __init__(self, fd: int, calls: Sequence[Probed], start: int, end: int) -> None:
        self._fd, self._calls, self._start, self._end = fd, calls, start, end
        self._known: dict[str, object] = {}

    @property
    def cached(self) -> bool:
        if "cached" not in self._known:
            self._known["cached"] = cached_calls(self._fd, self._calls)
        return bool(self._known["cached"])

    @property
    def cached_share(self) -> float | None:
        if "cached_share" not in self._known:
            self._known["cached_share"] = pagecache.cached_share(self._fd, self._start, self._end)
        share = self._known["cached_share"]
        return share if isinstance(share, float) else None

    def known(self) -> dict[str, object]:
        return dict(self._known)


def _bounce_size(config: FastloadConfig) -> int:
    """Per-thread O_DIRECT buffer (``policy.bounce_size``); 0: no O_DIRECT."""
    return policy.bounce_size(direct_io=config.direct_io, memory_budget=int(config.memory_budget),
                              threads=config.threads, read_size=int(config.read_size),
                              max_alignment=max(direct.ALIGNMENTS))


def _populate_batch(dests: list[torch.Tensor]) -> None:
    for dest in dests:
        populate(dest.data_ptr(), dest.numel() * dest.element_size())
    dests.clear()  # see _read_batch


def _after(first: Future[Any], task: Callable[..., None], *args: Any) -> None:
    """Runs ``task`` once the future ``first`` is done (its error, if any, is ``task``'s too)."""
    first.result()
    task(*args)


def _read_batch(fd: int, path: str, batch: list[Call], cached: bool = False) -> None:
    view: memoryview | None = None
    dest: torch.Tensor | None = None
    try:
        for call in batch:
            dest = call.dest
            view = host_bytes(dest)
            populate(dest.data_ptr(), len(view))
            reading(path, call.rows.offset if isinstance(call, RowsCall) else call.offset, len(view))
            if isinstance(call, RowsCall):
                read_rows(fd, path, call.rows, view, cached)
            else:
                pread_into(fd, path, call.offset, view)
    finally:
        # Drop our views of the buffer before the future completes: the worker thread keeps
        # its task (and so ``batch``) a moment longer, an error's traceback keeps this frame,
        # and the buffer pool must not mistake either for a caller still holding the buffer.
        batch.clear()
        view = dest = None


def _read_batch_direct(opened: DirectFile, bounce_size: int, fd: int, path: str, batch: list[Call]) -> None:
    """Like ``_read_batch``, contiguous ranges through O_DIRECT (see ``direct``); slices along a
    later dim through the page cache with advice for exactly their pages. A file that turns
    out not to allow O_DIRECT is read buffered."""
    call: Call | None = None
    try:
        bounce = direct.bounce_for_thread(bounce_size)
        for i, call in enumerate(batch):
            if isinstance(call, RowsCall):
                _read_batch(fd, path, [call])  # advised at submit (see ``advise_rows``)
                continue
            reading(path, call.offset, call.length)
            try:
                direct.read_into(opened.fd, opened.align, path, call.offset, call.dest, bounce)
            except direct.DirectUnsupported:
                advise(fd, batch[i:])  # read-ahead may be off on this descriptor
                _read_batch(fd, path, batch[i:])
                return
    finally:
        batch.clear()  # see _read_batch
        call = None


_scratch = threading.local()


def read_rows(fd: int, path: str, rows: Rows, view: memoryview, cached: bool = False) -> None:
    """Read ``rows`` packed into ``view``. Where ``cached``: copied out of a mapping of the file
    (``mapped.copy_rows``); otherwise, or where the file cannot be mapped, through the gaps (one
    ``preadv`` per batch of rows) where ``policy.read_through_gaps`` says so, else with a call per
    row."""
    if cached and rows.count > 1 and mapped.copy_rows(fd, path, rows, view):
        return
    if not cached:
        advise_rows(fd, rows)  # what other ranks have not fetched yet (see ``row_pages``)
    seg, stride, gap = rows.seg, rows.stride, rows.stride - rows.seg
    if policy.read_through_gaps(planned=rows.gaps, gap=gap, count=rows.count, cached=cached, page=PAGE):
        # One preadv per batch of rows; every gap lands in the same scratch buffer.
        sink = getattr(_scratch, "sink", None)
        if sink is None or len(sink) < gap:
            sink = _scratch.sink = memoryview(bytearray(max(gap, 4096)))
        sink = sink[:gap]
        per = IOV_MAX // 2
        for first in range(0, rows.count, per):
            last = min(first + per, rows.count)
            iov = []
            for i in range(first, last):
                iov.append(view[i * seg:(i + 1) * seg])
                iov.append(sink)
            iov.pop()
            preadv_into(fd, path, rows.offset + first * stride, iov)
        return
    # A call per row: keep the loop tight (a row's read itself takes microseconds).
    offset, preadv = rows.offset, os.preadv
    for i in range(rows.count):
        part, at = view[i * seg:(i + 1) * seg], offset + i * stride
        try:
            if preadv(fd, [part], at) == seg:
                continue
        except OSError:
            pass
        pread_into(fd, path, at, part)  # short read or error: the careful path retries or reports it
