"""The reading process, as the process that starts it sees it: started with its request, its
reports relayed to this process's log, ended with this process.

The reads run in a process of their own (``early.child``), not on a thread: a thread at idle
priority in the starting process would share that process's GIL, and a starved thread holding the
GIL stops every other thread with it: the process that starts vLLM would wait on the idle CPU time
it gave away. The starting process keeps one daemon thread that waits on the reading process's log
lines (relayed to its logger) and its end. The caller bounds the reads by memory: the files are
read only if they fit in the share of free memory it allows (``policy.early_reads_memory``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from vllm_fastload import policy
from vllm_fastload.early.marks import LoadMarks
from vllm_fastload.early.node_share import FileRanges

logger = logging.getLogger("vllm_fastload")

#: What the bare interpreter runs: the package's parent directory (its one argument) on the path,
#: then ``early.child``.
_CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from vllm_fastload.early.child import main; main()"
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_reading(paths: Sequence[str | FileRanges], *, limit: int, hold: LoadMarks | None = None,
                  hold_s: float = 0.0, starved_s: float | None = None,
                  pacing: policy.EarlyReadsPacing | None = None) -> ReadingProcess | None:
    """Start reading ``paths`` (each a whole file, or some ranges of one) into the page cache in a
    process of its own, if together they fit in ``limit`` bytes; None (and nothing done) otherwise.

    With ``hold``, the process stops reading when a load begins, and keeps the files mapped until
    every load it expects has ended (looked for every ``policy.EARLY_READS_POLL_S``), ``hold_s``
    seconds have passed since the reads ended, memory runs low, or this process ends (its exit ends
    the reading process too); then it unmaps them, removes the marks and ends.

    The process reads at idle CPU priority; with ``starved_s``, once it has waited that many seconds
    for a CPU (the CPUs have no idle time) while this process's own tree kept them busy, as a batch
    job instead (``policy.starved_reads``); with ``pacing`` of a group,
    it pauses while the CPU quota over that group holds it back (see ``early.child``)."""
    files = [p.path if isinstance(p, FileRanges) else p for p in paths]
    spans = {p.path: p.spans for p in paths if isinstance(p, FileRanges)}
    total = sum(p.nbytes if isinstance(p, FileRanges) else os.path.getsize(p) for p in paths)
    if total > limit:
        what = "this node's share of the checkpoint" if spans else "the checkpoint"
        logger.info("fastload: no early reads: %s (%.2f GB) exceeds the share of available memory "
                    "early reads may fill (%.2f GB); it is read at load time", what, total / 1e9, limit / 1e9)
        return None
    if not sys.executable:
        logger.info("fastload: no early reads: no Python interpreter to run them in (sys.executable is empty)")
        return None
    request = {"paths": files, "spans": spans, "total": total, "hold_s": hold_s,
               "low_memory": policy.EARLY_READS_LOW_MEMORY,
               "main_thread": threading.current_thread() is threading.main_thread(),
               "marks": None if hold is None else [hold.directory, hold.expected], "parent": os.getpid(),
               "starved_s": starved_s,
               "pacing": None if pacing is None or pacing.group is None else
               [pacing.group, pacing.pause_s, pacing.quota]}
    # -I -S: no site-packages, no environment, not even the current directory on the path: a bare
    # interpreter that starts in milliseconds and imports the standard library and, through the
    # package's empty root, the standard-library-only modules ``child`` runs. Its output and errors
    # come back here, to be logged; the request goes in on stdin (no limit on its length).
    process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, _PACKAGE_PARENT], stdin=subprocess.PIPE,
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
