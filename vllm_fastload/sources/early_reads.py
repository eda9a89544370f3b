"""Early reads: bring local checkpoint files into the page cache, in the background, while the
engine is still starting, and keep them there until the loads that need them are done.

The reads run in a process of their own (this file, run as a script: standard library only), at
idle CPU priority (Linux ``SCHED_IDLE``): reading early must not slow the start-up it overlaps
with, which on a machine with few cores is CPU-bound. A thread at idle priority in the starting
process would share that process's GIL, and a starved thread holding the GIL stops every other
thread with it: the process that starts vLLM would wait on the idle CPU time it gave away. The
starting process keeps one thread that waits on the reading process's log lines (relayed to its
logger) and its end.

Each file is mapped and populated 16 MiB at a time (``madvise(MADV_POPULATE_READ)``: the kernel
reads the pages in, nothing is copied into the process), and each page is touched once (see
``_Mapping``); ``posix_fadvise(WILLNEED)`` alone reads only a few percent of a large file. Reading
stops as soon as a load begins (it reads the rest itself). The mappings stay until the loads have
ended (``LoadMarks``; or ``hold_s`` runs out, memory runs low, or the starting process ends),
because a host that reclaims idle page cache on its own (such as DAMON's ``pageout`` scheme) takes
only pages that no process maps: read and dropped, a checkpoint could be partly gone before the
workers ask for it. Mapped pages are still page cache, which memory pressure can reclaim (after
unmapped page cache); they show in the reading process's RSS while held. Where the kernel lacks
``MADV_POPULATE_READ`` (before Linux 5.14) each chunk is read through one small reused buffer
instead, and nothing is held. A file that cannot be read is skipped: the loader reads it at load
time and reports what is wrong. The caller bounds it by memory: the files are read only if they
fit in a share of the memory available now (``available_memory``).
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("vllm_fastload")


def available_memory() -> int:
    """Bytes this process could fill with page cache without evicting what others use: the
    kernel's ``MemAvailable``, lowered to the cgroup's headroom where a memory limit is set
    (page cache counts against a container's limit)."""
    available = _meminfo("MemAvailable")
    limit, used = _cgroup("memory.max"), _cgroup("memory.current")
    if limit is not None and used is not None:
        available = min(available, max(limit - used, 0))
    return available


def start_reading(paths: Sequence[str], *, limit: int, hold: LoadMarks | None = None,
                  hold_s: float = 0.0) -> ReadingProcess | None:
    """Start reading ``paths`` into the page cache in a process of its own, if together they fit
    in ``limit`` bytes; None (and nothing done) otherwise.

    With ``hold``, the process stops reading when a load begins, and keeps the files mapped until
    every load it expects has ended (looked for every ``POLL_S``), ``hold_s`` seconds have passed
    since the reads ended, memory runs low, or this process ends (its exit ends the reading process
    too); then it unmaps them, removes the marks and ends."""
    total = sum(os.path.getsize(p) for p in paths)
    if total > limit:
        logger.info("fastload: no early reads: the checkpoint (%.2f GB) exceeds the share of available memory "
                    "early reads may fill (%.2f GB); it is read at load time", total / 1e9, limit / 1e9)
        return None
    if not sys.executable:
        logger.info("fastload: no early reads: no Python interpreter to run them in (sys.executable is empty)")
        return None
    from vllm_fastload import policy  # here: the reading process runs this file without the package

    request = {"paths": list(paths), "total": total, "hold_s": hold_s, "low_memory": policy.EARLY_READS_LOW_MEMORY,
               "marks": None if hold is None else [hold.directory, hold.expected], "parent": os.getpid()}
    # -I -S: no site-packages, no environment, not even this file's directory on the path: a bare
    # interpreter that starts in milliseconds and imports only the standard library. Its output and
    # errors come back here, to be logged; the request goes in on stdin (no limit on its length).
    process = subprocess.Popen([sys.executable, "-I", "-S", __file__], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True)
    assert process.stdin is not None
    with process.stdin:
        try:
            process.stdin.write(json.dumps(request).encode())
        except BrokenPipeError:
            pass  # it ended at once: its status is logged
    reads = ReadingProcess(process, hold)
    reads.start()
    atexit.register(reads.end)
    return reads


class ReadingProcess(threading.Thread):
    """The reading process, seen from the process that started it: a daemon thread that logs what
    the process reports (through this process's logger) and ends when the process has ended."""

    def __init__(self, process: subprocess.Popen[bytes], hold: LoadMarks | None) -> None:
        super().__init__(name="fastload-early-reads", daemon=True)
        self.process = process
        self._hold = hold
        self._ending = False
        self._starter = os.getpid()

    @property
    def pid(self) -> int:
        """The reading process's id."""
        return self.process.pid

    def run(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout:
            for line in self.process.stdout:
                try:
                    message, args = json.loads(line)
                    logger.info(message, *args)
                except (ValueError, TypeError):  # not a report: an error the process printed
                    logger.info("fastload: early reads: %s", line.decode(errors="replace").rstrip())
        status = self.process.wait()
        if status and not self._ending:
            logger.info("fastload: early reads: the reading process ended with status %d", status)
        if self._hold is not None:
            self._hold.remove()

    def end(self) -> None:
        """End the reading process (the starting process is exiting: nothing will load from what
        it holds), and remove the marks. Nothing in a process forked from the starting one, which
        inherits its exit handlers."""
        if os.getpid() != self._starter:
            return
        if self.process.poll() is None:
            self._ending = True
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._hold is not None:
            self._hold.remove()


#: Bytes populated at a time (between two looks for a load that has begun).
CHUNK = 16 << 20
MADV_POPULATE_READ = 22  # Linux 5.14
#: Seconds between two looks for the loads' marks.
POLL_S = 0.2


def _serve(request: dict[str, Any]) -> None:
    """The reading process: read, report, hold, report, end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C ends the process that started it, then this one
    _run_when_idle()
    parent = request["parent"]
    start = time.perf_counter()
    paths, total = request["paths"], request["total"]
    hold = None if request["marks"] is None else LoadMarks(request["marks"][1], directory=request["marks"][0])
    held: list[_Mapping] = []
    why = "every load it was read for has ended"

    def orphaned() -> bool:
        return bool(os.getppid() != parent)

    try:
        stop = orphaned if hold is None else (lambda: orphaned() or hold.started())
        held, read, files, stopped = _read_in(paths, hold=hold is not None, stop=stop)
        if stopped:
            _report("fastload: early reads: stopped after %.2f s, when the load began; %.2f of %.2f GB read early",
                    time.perf_counter() - start, read / 1e9, total / 1e9)
        else:
            _report("fastload: early reads: %d of %d files in the page cache after %.2f s", files, len(paths),
                    time.perf_counter() - start)
        _run_normally()  # only sleeps and lists a directory from now on: let it notice the marks on time
        deadline = time.monotonic() + request["hold_s"]
        while hold is not None and held and not hold.all_done():
            if time.monotonic() >= deadline:
                why = f"not every load it was read for ended within {request['hold_s']:.0f} s"
                break
            if _memory_low(request["low_memory"]):
                why = "memory ran low"
                break
            if orphaned():
                why = "the process that started it ended"
                break
            time.sleep(POLL_S)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        why = f"{type(exc).__name__}: {exc}"
    finally:
        for mapping in held:
            mapping.close()
        if hold is not None:
            _report("fastload: early reads: files released after %.2f s, %d of %d loads done (%s)",
                    time.perf_counter() - start, hold.done(), hold.expected, why)
            hold.remove()


def _report(message: str, *args: Any) -> None:
    """A line for the starting process's log (nothing if it is gone). Unbuffered: nothing is left
    to flush, and fail, at exit."""
    try:
        os.write(sys.stdout.fileno(), (json.dumps([message, args]) + "\n").encode())
    except OSError:
        pass


def _run_when_idle() -> None:
    """Run this process only on CPU time nothing else wants (Linux ``SCHED_IDLE``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _run_normally() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # without the privilege to (RLIMIT_NICE): it notices marks when idle time allows


def _memory_low(share: float) -> bool:
    return available_memory() < share * _meminfo("MemTotal")


def _read_in(paths: list[str], *, hold: bool = False,
             stop: Callable[[], bool] | None = None) -> tuple[list[_Mapping], int, int, bool]:
    """Read ``paths`` into the page cache, a chunk at a time, until ``stop()`` says to stop: the
    mappings of the files when ``hold`` (else none), the bytes read, the files read whole, and
    whether it stopped.

    Stopping matters once a load has begun: it reads what it needs itself, in its own order, and
    reading the same bytes here would only make the two share the disk."""
    held: list[_Mapping] = []
    buffer: bytearray | None = None  # set once the kernel cannot populate mappings
    read = files = 0
    stopped = False
    for path in paths:
        if stop is not None and (stopped or stop()):
            stopped = True
            break
        mapping = None
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size and buffer is None:
                    mapping = _Mapping(f.fileno(), size)
                for offset in range(0, size, CHUNK):
                    if stop is not None and offset and stop():
                        stopped = True
                        break
                    length = min(CHUNK, size - offset)
                    if mapping is not None and not mapping.populate(offset, length):
                        mapping.close()
                        mapping, buffer = None, bytearray(8 << 20)
                    if mapping is None and buffer is not None:  # (one of the two always is set here)
                        _read_through(f.fileno(), offset, length, buffer)
                    read += length
                else:
                    files += 1
        except (OSError, ValueError):  # ValueError: mmap of a file that shrank since its size was read
            pass  # the loader reads this file at load time and says what is wrong with it
        if mapping is not None and hold:
            held.append(mapping)
        elif mapping is not None:
            mapping.close()
    return held, read, files, stopped


class _Mapping:
    """A read-only shared mapping of a whole file. (Python's ``mmap.madvise`` keeps the GIL while
    the kernel reads: harmless in the reading process, which has one thread.)"""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)

    def populate(self, offset: int, length: int) -> bool:
        """Read a chunk into the page cache and touch each of its pages once; False where the
        kernel cannot populate a mapping (before Linux 5.14).

        The touch (one byte read per page) is for hosts that back a VM's memory lazily: there the
        first CPU access to a page the disk filled costs a fault in the hypervisor, which makes a
        later copy out of the page cache several times slower; touched here, that cost is paid
        while vLLM starts instead of in the load."""
        try:
            self._map.madvise(MADV_POPULATE_READ, offset, length)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        with memoryview(self._map) as view, view[offset:offset + length:mmap.PAGESIZE] as pages:
            pages.tobytes()
        return True

    def close(self) -> None:
        self._map.close()


def _read_through(fd: int, offset: int, length: int, buffer: bytearray) -> None:
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - offset)]], offset)
        if n <= 0:
            return
        offset += n


class LoadMarks:
    """How the process that reads early learns when the loads it reads for begin and end: a
    directory in which each loading process leaves a mark as its load begins and one as it ends
    (the loads run in other processes, which inherit the directory's path)."""

    def __init__(self, expected: int, *, directory: str | None = None) -> None:
        self.expected = max(expected, 1)
        self.directory = directory or tempfile.mkdtemp(prefix="fastload-loads-")

    def _count(self, kind: str) -> int:
        try:
            return sum(name.startswith(kind) for name in os.listdir(self.directory))
        except OSError:
            return 0

    def started(self) -> bool:
        """Whether a load has begun (True once the directory is gone)."""
        return self._count("begun-") > 0 or not os.path.isdir(self.directory)

    def done(self) -> int:
        """How many loads have ended."""
        return self._count("ended-")

    def all_done(self) -> bool:
        """Whether ``expected`` loads have ended (True once the directory is gone)."""
        return self.done() >= self.expected or not os.path.isdir(self.directory)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def mark_load(directory: str, *, ended: bool) -> None:
    """Leave this process's mark, its load begun or ended, in a ``LoadMarks`` directory (nothing
    if it is gone)."""
    try:
        with open(os.path.join(directory, f"{'ended' if ended else 'begun'}-{os.getpid()}"), "w"):
            pass
    except OSError:
        pass


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    return 0


def _cgroup(name: str) -> int | None:
    try:
        with open(f"/sys/fs/cgroup/{name}") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


if __name__ == "__main__":
    _serve(json.loads(sys.stdin.read()))
