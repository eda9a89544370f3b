"""How the ranks' loads tell the reading process that they began and ended.

The reading process stops reading when the first load begins (the load reads what is missing
itself, in its own order) and holds what it read until every load of the node has ended. The
loads run in other processes (the engine's workers), which inherit the path of a directory in
which each leaves a mark as its load begins and one as it ends (``MARKS_ENV``). Standard library
only: the reading process (``early.child``) imports it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

#: Inherited by the processes the engine starts: the directory in which each rank's load leaves
#: its marks as it begins and ends.
MARKS_ENV = "_FASTLOAD_EARLY_READS_MARKS"
#: The marks directories' names: the prefix, then the id of the process that started the reads.
MARKS_PREFIX = "fastload-loads-"


class LoadMarks:
    """The marks directory, seen by the process that reads early: how many loads have begun and ended."""

    def __init__(self, expected: int, *, directory: str | None = None) -> None:
        self.expected = max(expected, 1)
        self.directory = directory or tempfile.mkdtemp(prefix=f"{MARKS_PREFIX}{os.getpid()}-")

    @staticmethod
    def remove_stale() -> list[str]:
        """Remove the marks directories of starts whose process is gone (killed: no exit handler
        removed them); returns them."""
        removed = []
        for name in os.listdir(tempfile.gettempdir()):
            pid = name[len(MARKS_PREFIX):].partition("-")[0]
            if name.startswith(MARKS_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                path = os.path.join(tempfile.gettempdir(), name)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

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


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a rank's load: early reads stop as it begins (the load reads the rest in its own
    order), and need not hold what they read for it once it ends, done or failed."""
    load_begins()
    try:
        yield
    finally:
        load_ends()


def load_begins() -> None:
    """Called by the loader as this rank's load begins: early reads stop reading (the load reads
    the rest itself) and hold what they read."""
    _mark(ended=False)


def load_ends() -> None:
    """Called by the loader when this rank's load ends (done or failed): the early reads it was
    started for need not stay mapped for it any longer."""
    _mark(ended=True)


def _mark(*, ended: bool) -> None:
    directory = os.environ.get(MARKS_ENV)
    if directory:
        mark_load(directory, ended=ended)
