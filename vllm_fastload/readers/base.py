"""The interface every reader backend implements, and the pieces they share."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import ReadError
from vllm_fastload.format import SafetensorsFile

#: (file offset, length, destination): a uint8 1-D view of exactly ``length`` bytes.
ReadCall = tuple[int, int, torch.Tensor]


class Pending:
    """Reads in flight; ``wait()`` returns when every byte has landed (or raises the first error)."""

    def __init__(self, futures: Sequence[Future], on_done=None) -> None:
        self._futures = list(futures)
        self._on_done = on_done

    def wait(self) -> None:
        """Wait for every read, even after one failed, then raise the first error.

        Returning early on the first error would leave other reads still writing into a buffer
        the caller is about to give up.
        """
        first: BaseException | None = None
        try:
            for fut in self._futures:
                try:
                    fut.result()
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


class Reader(ABC):
    """Moves byte ranges of a file into buffers on one device."""

    name: str = "?"
    #: Default for ``strided_min_skip``: skipping fewer bytes per row than this is cheaper
    #: to read through (one extra read call costs about as much as reading this many bytes).
    default_strided_min_skip: int = 4096

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._pool: ThreadPoolExecutor | None = None

    @property
    def staging_bytes(self) -> int:
        """Memory the reader itself holds (e.g. pinned staging), counted against the budget."""
        return 0

    @abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``self.device``, ready to be filled."""

    @abstractmethod
    def submit(self, sf: SafetensorsFile, calls: Sequence[ReadCall]) -> Pending:
        """Start reading ``calls`` from ``sf``; return a handle to wait on."""

    def threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix=f"fastload-{self.name}")
        return self._pool

    def batches(self, calls: Sequence[ReadCall], piece: int) -> list[list[ReadCall]]:
        """Split big calls into ``piece``-sized reads and group small ones, ~``piece`` bytes per task.

        Big reads are split so all threads work on them; tiny strided segments are grouped
        so a task is not scheduled per 2 KiB read.
        """
        tasks: list[list[ReadCall]] = []
        current: list[ReadCall] = []
        filled = 0
        for offset, length, dest in calls:
            done = 0
            while done < length:
                n = min(piece, length - done)
                if filled + n > piece and current:
                    tasks.append(current)
                    current, filled = [], 0
                current.append((offset + done, n, dest[done:done + n]))
                filled += n
                done += n
        if current:
            tasks.append(current)
        return tasks

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def pread_into(fd: int, path: str, offset: int, view: memoryview) -> None:
    """Fill ``view`` from ``offset``: retry short reads and EINTR; EOF or EIO raise ReadError."""
    wanted = len(view)
    done = 0
    while done < wanted:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise ReadError(f"read of {wanted} bytes at offset {offset} failed after {done} bytes: "
                            f"{exc.strerror}", file=path) from exc
        if n == 0:
            raise ReadError(f"unexpected end of file at offset {offset + done} (wanted {wanted} bytes "
                            f"from offset {offset}); the file was truncated", file=path)
        done += n
