"""``LocalSource``: a local file held open by its descriptor, so every read sees one inode.

The host reader issues ``preadv`` on ``fd`` itself (threads, page-cache probes, huge
pages); the other methods are for everything else: header parsing, the GPU readers'
staging and callers that only know the ``Source`` interface.
"""

from __future__ import annotations

import os
import stat as stat_module
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from vllm_fastload.errors import FileChangedError, HeaderError, MissingFileError, ReadError, TruncatedFileError
from vllm_fastload.sources.base import RangeInto


@dataclass(frozen=True)
class FileIdentity:
    """What we compare to notice a file that changes while we read it."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


class LocalSource:
    """One local file, open for reading, pinned to the size and mtime it had when opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = open_for_read(self.path)
        try:
            self.identity = FileIdentity.of(os.fstat(self._fd))
        except OSError as exc:
            os.close(self._fd)
            raise MissingFileError(f"cannot stat file: {exc.strerror}", file=self.path) from exc

    @property
    def uri(self) -> str:
        return self.path

    @property
    def size(self) -> int:
        return self.identity.size

    @property
    def fd(self) -> int:
        """The descriptor (-1 once closed)."""
        return self._fd

    def __repr__(self) -> str:
        return f"LocalSource({self.path!r}, size={self.size}, fd={self._fd})"

    def read_exact(self, offset: int, length: int, what: str) -> bytes:
        """``length`` bytes at ``offset`` for parsing: a short file is a ``TruncatedFileError`` naming ``what``."""
        return pread_exact(self._fd, length, offset, self.path, what)

    def read_into(self, offset: int, view: memoryview, *, tensor: str | None = None) -> None:
        """Fill ``view`` from ``offset``; EOF or EIO raise ``ReadError``."""
        try:
            pread_into(self._fd, self.path, offset, memoryview(view).cast("B"))
        except ReadError as exc:
            if tensor is None:
                raise
            raise ReadError(exc.reason, file=self.path, tensor=tensor) from exc

    def submit_ranges_into(self, ranges: Sequence[RangeInto], *,
                           tensor: str | None = None) -> Future[None]:
        """Read the ranges now (a local read does not wait on a network); a completed future."""
        future: Future[None] = Future()
        try:
            for offset, view in ranges:
                self.read_into(offset, view, tensor=tensor)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    def check_unchanged(self) -> None:
        """Raise FileChangedError if the file was modified since it was opened, or another file
        now has its name.

        A file replaced by renaming a new copy over it (as sync tools and downloaders do) stays
        readable through the descriptor held here, but the checkpoint is no longer what was
        opened: another rank, or a retry, opening it now would read the other file."""
        try:
            held = os.fstat(self._fd)
            named = os.stat(self.path)
        except FileNotFoundError as exc:
            raise FileChangedError("the file was removed while loading; refusing to load a checkpoint that is no "
                                   "longer there", file=self.path) from exc
        except OSError as exc:
            raise FileChangedError(f"cannot stat file: {exc.strerror}", file=self.path) from exc
        now = FileIdentity.of(held)
        if (named.st_ino, named.st_dev) != (held.st_ino, held.st_dev):
            raise FileChangedError("the file was replaced while loading (another file was renamed to its name); "
                                   "refusing to load bytes of a file that is no longer the checkpoint's",
                                   file=self.path)
        if now.size != self.identity.size or now.mtime_ns != self.identity.mtime_ns:
            raise FileChangedError(
                f"file changed while loading (size {self.identity.size} -> {now.size}, "
                f"mtime_ns {self.identity.mtime_ns} -> {now.mtime_ns}); refusing to use "
                "bytes that may be a mix of old and new contents",
                file=self.path,
            )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_for_read(path: str) -> int:
    """An O_RDONLY descriptor; a missing file or a directory is a ``MissingFileError``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise MissingFileError("file does not exist", file=path) from exc
    except OSError as exc:
        raise MissingFileError(f"cannot open file: {exc.strerror}", file=path) from exc
    if stat_module.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise MissingFileError("expected a .safetensors file, found a directory", file=path)
    return fd


def pread_exact(fd: int, length: int, offset: int, path: str, what: str) -> bytes:
    """Header bytes: an I/O error is a ``HeaderError``, EOF a ``TruncatedFileError`` naming ``what``."""
    try:
        data = os.pread(fd, length, offset)
    except OSError as exc:
        raise HeaderError(f"cannot read {what}: {exc.strerror}", file=path) from exc
    # A regular file returns short only at EOF; loop anyway for exotic filesystems.
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise TruncatedFileError(
                f"file ends inside the {what} (wanted {length} bytes at offset {offset}, "
                f"got {len(data)})", file=path)
        data += more
    return data


#: Most buffers one ``preadv`` takes (1024 on Linux).
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024


def pread_into(fd: int, path: str, offset: int, view: memoryview) -> None:
    """Fill ``view`` from ``offset``: retry short reads and EINTR; EOF or EIO raise ReadError."""
    preadv_into(fd, path, offset, [view])


def preadv_into(fd: int, path: str, offset: int, views: list[memoryview]) -> None:
    """Fill ``views`` (in order) from the file bytes starting at ``offset``, like ``pread_into``.

    ``views`` is consumed: after a short read its first entries are dropped or narrowed.
    """
    wanted = sum(len(v) for v in views)
    done = 0
    first = 0
    while done < wanted:
        try:
            n = os.preadv(fd, views[first:first + IOV_MAX], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise ReadError(f"read of {wanted} bytes at offset {offset} failed after {done} bytes: "
                            f"{exc.strerror}", file=path) from exc
        if n == 0:
            raise ReadError(f"unexpected end of file at offset {offset + done} (wanted {wanted} bytes "
                            f"from offset {offset}); the file was truncated", file=path)
        done += n
        # Step past what arrived: whole views, then the start of a partly filled one.
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]
