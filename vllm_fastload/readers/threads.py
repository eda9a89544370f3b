"""The readers' threads: where they run, what each is reading, and a read that stalls.

Where: vLLM-CPU binds a rank's main thread to a single core, and a thread starts with the CPUs of
the thread that creates it, so a pool created there would copy on one core whatever the rank owns.
``FastloadConfig.cpus`` names the CPUs instead; each pool thread moves itself there when it starts
and ends with its pool, so nothing stays on those CPUs after the load.

Stalls: a read from a disk that stopped answering (a dead device, a network filesystem whose
server is gone, a FUSE daemon that hangs) blocks its thread in the kernel, and no call can take it
back. So each thread notes what it reads (``reading``) and since when, a waiter asks ``stalled``
whether some read has made no progress for longer than it allows, and fails the load naming it.
The threads are daemon threads, so a process whose read is stuck can still exit; a pool with a
stuck thread is shut down without waiting for it (``ReaderThreads.shutdown``).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm_fastload")


@dataclass(frozen=True)
class Activity:
    """What a reader thread is reading, and since when (``time.monotonic``)."""

    since: float
    file: str | None = None
    offset: int | None = None
    length: int | None = None


#: Thread ident -> what that reader thread is reading now (absent: idle).
_running: dict[int, Activity] = {}
#: Thread idents found stalled: their pools no longer wait for them.
_stuck: set[int] = set()


def reading(file: str, offset: int, length: int) -> None:
    """Notes, on a reader thread, the read it starts now (elsewhere: nothing)."""
    ident = threading.get_ident()
    if ident in _running:
        _running[ident] = Activity(time.monotonic(), file, offset, length)


def stalled(limit_s: float) -> Activity | None:
    """The read of some reader thread of this process that has made no progress for over
    ``limit_s`` seconds (the oldest), or None. Its thread is written off: no pool waits for it any
    more. (Any reader's thread: loads in one process share the storage they would stall on.)"""
    now = time.monotonic()
    found = None
    for ident, activity in list(_running.items()):
        if now - activity.since > limit_s and (found is None or activity.since < found.since):
            found = activity
            _stuck.add(ident)
    return found


class ReaderThreads(Executor):
    """A pool of ``threads`` daemon threads that note when each task starts (``reading`` refines
    it); like ``ThreadPoolExecutor``, but a thread stuck in a read keeps neither the process nor
    the pool's ``shutdown`` waiting."""

    def __init__(self, threads: int, name: str, initializer: Callable[[], object] | None = None) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, args=(initializer,), name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        self._started = False
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True
            self._tasks.put((future, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return future

    def _work(self, initializer: Callable[[], object] | None) -> None:
        if initializer is not None:
            initializer()
        while True:
            item = self._tasks.get()
            if item is None:
                return
            _run(*item)
            item = None  # nothing of the task outlives it here (buffers are reference counted)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if cancel_futures or not started:
            self._cancel_queued()
        for _ in self._threads:
            self._tasks.put(None)
        if wait and started:
            for thread in self._threads:
                if thread.ident not in _stuck:
                    thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One task on a pool thread, noted in ``_running`` while it runs."""
    if not future.set_running_or_notify_cancel():
        return
    ident = threading.get_ident()
    _running[ident] = Activity(time.monotonic())
    try:
        result = fn(*args)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)
    finally:
        _running.pop(ident, None)
        _stuck.discard(ident)


def thread_pool(threads: int, name: str, cpus: Sequence[int] | None) -> ReaderThreads:
    """A pool whose threads run on ``cpus`` (None: wherever the creating thread may run)."""
    return ReaderThreads(threads, name, initializer=(lambda: run_on(cpus)) if cpus else None)


def run_on(cpus: Sequence[int] | None) -> None:
    """Moves the calling thread (only it) onto ``cpus``; None: leaves it where it is."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # none of them allowed here (a cgroup's cpuset): stay put
        logger.warning("fastload: reader threads stay on CPUs %s, not %s: %s",
                       sorted(os.sched_getaffinity(0)), cpus, exc)
