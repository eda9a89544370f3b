"""The interface every reader backend implements, and the pieces they share."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import StalledReadError
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.plan import ByteRange, Rows
from vllm_fastload.policy import Backend, DecisionLog
from vllm_fastload.readers import threads as reader_threads
from vllm_fastload.readers.threads import ReaderThreads, thread_pool


class ReadCall(NamedTuple):
    """``length`` bytes at file ``offset`` into ``dest``, a uint8 1-D view of exactly ``length`` bytes."""

    offset: int
    length: int
    dest: torch.Tensor


class RowsCall(NamedTuple):
    """A slice's ``rows`` into ``dest``: the segments land packed one after another in a uint8 1-D
    view of exactly ``rows.seg * rows.count`` bytes."""

    rows: Rows
    dest: torch.Tensor


#: What a reader is asked to do.
Call = ReadCall | RowsCall


@dataclass(frozen=True, eq=False)  # identity: it holds a tensor (no elementwise ==)
class FileWindow:
    """Bytes of a file as a uint8 tensor over a mapping of it, whose views may be handed out
    instead of reading them (``Reader.mapped``)."""

    tensor: torch.Tensor
    #: The file offset of the tensor's first byte.
    first: int


class Pending:
    """Reads in flight; ``wait()`` returns when every byte has landed (or raises the first error)."""

    def __init__(self, futures: Sequence[Future[Any]], on_done: Callable[[], object] | None = None) -> None:
        self._futures = list(futures)
        self._on_done = on_done

    def wait_quietly(self, stall_s: float | None = None) -> None:
        """Wait for every read and drop their errors: for cleaning up after another error."""
        try:
            self.wait(stall_s)
        except BaseException:
            pass

    def wait(self, stall_s: float | None = None) -> None:
        """Wait for every read, even after one failed, then raise the first error.

        Returning early on the first error would leave other reads still writing into a buffer
        the caller is about to give up. The exception: a read that made no progress for
        ``stall_s`` seconds (``StalledReadError``), which may never return; its buffer must not
        be used again (the caller gives up its reader and buffers, see ``FastCheckpoint``).
        """
        first: BaseException | None = None
        try:
            for fut in self._futures:
                try:
                    _result(fut, stall_s)
                except StalledReadError:
                    raise
                except BaseException as exc:
                    if first is None:
                        first = exc
            if first is not None:
                raise first
            if self._on_done is not None:
                self._on_done()
        finally:
            self._futures = []
            self._on_done = None
            first = None  # no reference cycle through the traceback


#: Seconds between two looks for a stalled read while waiting.
STALL_POLL_S = 1.0


def _result(fut: Future[Any], stall_s: float | None) -> Any:
    """``fut.result()``; with ``stall_s``, a ``StalledReadError`` once a reader thread's read has
    made no progress for that long (``threads.stalled``)."""
    if stall_s is None:
        return fut.result()
    while True:
        try:
            return fut.result(timeout=min(STALL_POLL_S, stall_s))
        except FutureTimeout:
            stuck = reader_threads.stalled(stall_s)
            if stuck is not None:
                raise _stall_error(stuck, stall_s) from None


def _stall_error(stuck: reader_threads.Activity, stall_s: float) -> StalledReadError:
    waited = time.monotonic() - stuck.since
    what = "a read" if stuck.offset is None else f"a read of {stuck.length} bytes at offset {stuck.offset}"
    return StalledReadError(f"{what} made no progress for {waited:.0f} s (stall_timeout_s is {stall_s:g} s): the "
                            "storage stopped answering; the load is given up", file=stuck.file)


class Reader(ABC):
    """Moves byte ranges of a file into buffers on one device."""

    #: Which backend it is (set by each concrete reader).
    name: ClassVar[Backend]
    #: Whether ``submit`` takes ``RowsCall`` as such (gaps included); other readers get them
    #: expanded into one ``ReadCall`` per row, and are never given rows with ``gaps``.
    reads_rows: bool = False

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._pool: ReaderThreads | None = None
        #: The reader's decisions, each logged once per outcome (``policy.DecisionLog``).
        self.decisions = DecisionLog()

    @property
    def staging_bytes(self) -> int:
        """Memory the reader itself holds (e.g. pinned staging), counted against the budget."""
        return 0

    @property
    def direct_in_flight(self) -> int:
        """Bytes of reads into the caller's own tensors worth queueing beyond the executor's
        ``policy.CHUNKS_IN_FLIGHT`` chunks (0: those keep this reader's threads busy)."""
        return 0

    @abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``self.device``, ready to be filled."""

    @abstractmethod
    def submit(self, sf: SafetensorsFile, calls: Sequence[Call]) -> Pending:
        """Start reading ``calls`` from ``sf``; return a handle to wait on."""

    def mapped(self, sf: SafetensorsFile, ranges: Sequence[ByteRange]) -> FileWindow | None:
        """Bytes of the file covering ``ranges`` over a mapping whose views may be handed out
        instead of reading them; None: read them. Only a reader whose destination is host memory
        can say yes (see ``HostReader``)."""
        return None

    def populate_mapped(self, sf: SafetensorsFile, window: FileWindow) -> Pending | None:
        """Start bringing the pages of a ``mapped`` window into memory, so
        that an I/O error there is an error and not a signal in the caller; None: nothing to do."""
        return None

    def threads(self) -> ReaderThreads:
        if self._pool is None:
            self._pool = thread_pool(self.config.threads, f"fastload-{self.name}", self.config.cpus)
        return self._pool

    def batches(self, calls: Sequence[Call], piece: int,
                bounded: bool = False) -> list[list[Call]]:
        """Split big calls into ``piece``-sized reads and group small ones, ~``piece`` bytes per task.

        Big reads are split so all threads work on them; tiny strided segments are grouped
        so a task is not scheduled per 2 KiB read. Rows are split into runs of whole rows
        (or into single rows for readers without ``reads_rows``). ``bounded``: no task may
        hold more than ``piece`` bytes (a staging slot), so rows wider than a piece are read
        like long ranges, in pieces.
        """
        tasks: list[list[Call]] = []
        current: list[Call] = []
        filled = 0

        def add(call: Call, nbytes: int) -> None:
            nonlocal current, filled
            if filled + nbytes > piece and current:
                tasks.append(current)
                current, filled = [], 0
            current.append(call)
            filled += nbytes

        for call in calls:
            if isinstance(call, RowsCall) and self.reads_rows and not (bounded and call.rows.bytes_per_row > piece):
                rows, dest = call
                per = max(1, piece // rows.bytes_per_row)
                for first in range(0, rows.count, per):
                    part = rows.split(first, min(per, rows.count - first))
                    add(RowsCall(part, dest[first * rows.seg:(first + part.count) * rows.seg]), part.read_bytes)
                continue
            for offset, length, dest in self.plain_calls([call]):
                for done in range(0, length, piece):
                    n = min(piece, length - done)
                    add(ReadCall(offset + done, n, dest[done:done + n]), n)
        if current:
            tasks.append(current)
        return tasks

    @staticmethod
    def plain_calls(calls: Sequence[Call]) -> list[ReadCall]:
        """Rows as one ``ReadCall`` per row (gaps not read), for readers without ``reads_rows``."""
        out: list[ReadCall] = []
        for call in calls:
            if isinstance(call, RowsCall):
                rows, dest = call
                out += [ReadCall(offset, length, dest[i * length:(i + 1) * length])
                        for i, (offset, length) in enumerate(rows.ranges())]
            else:
                out.append(call)
        return out

    def close(self) -> None:
        """Ends the threads, waiting for them (not for one stuck in a read: see ``threads``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
