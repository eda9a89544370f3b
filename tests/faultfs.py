"""A FUSE filesystem for the tests that passes a real directory through and fails one file on cue,
as a failing disk or a sync tool would: EIO for reads that touch a chosen offset, a read there
that never returns (a stalled disk or server), the file cut short there, or a new copy renamed
over it (the old one stays readable through descriptors already open, as on a local disk).

Run as a process of its own (``mounted``), through libfuse 3 by the ``mfusepy`` binding, in the
foreground and multithreaded, so that one stalled read does not hold the others up. Attributes
and names are not cached by the kernel (``attr_timeout=0``, ``entry_timeout=0``) and inode
numbers are the real files' (``use_ino``), so a file replaced or cut short shows at once, as a
local filesystem shows it. Each fault fires from the first read that reaches its offset; a line
``fault <kind> <file> <offset>`` in the log says when.

    python faultfs.py SOURCE MOUNTPOINT FAULT_JSON LOG
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

#: How long a stalled read blocks: longer than any bound the loader may set (it is ended by the unmount).
STALL_S = 3600.0
PAGE = 4096


@dataclass(frozen=True)
class Fault:
    """What goes wrong, where: ``kind`` is "eio", "stall", "shrink" or "replace"."""

    kind: str
    file: str
    offset: int


def why_not() -> str | None:
    """Why a FUSE filesystem cannot be mounted here; None where it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (the fuse3 package)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"the mfusepy binding cannot load libfuse 3: {exc}"
    return None


@contextlib.contextmanager
def mounted(source: Path, mountpoint: Path, fault: Fault | None, log: Path) -> Iterator[Path]:
    """``source`` seen through the fault filesystem at ``mountpoint`` while the block runs; then
    unmounted, which also ends any read it stalls (the reader gets an error)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    spec = json.dumps(asdict(fault) if fault else None)
    proc = subprocess.Popen([sys.executable, __file__, str(source), str(mountpoint), spec, str(log)],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), start_new_session=True)
    with log.open("a") as f:
        f.write(f"pid {proc.pid}\n")  # for ``unmount`` where the block is left without ending it
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fault filesystem did not mount: {log.read_text(errors='replace')}")
            time.sleep(0.05)
        yield mountpoint
    finally:
        unmount(mountpoint, log)
        proc.wait(timeout=30)


def unmount(mountpoint: Path, log: Path) -> None:
    """Unmount and end the daemon (its id from ``log``). Lazily: a mount with a stalled read is
    busy; ending the daemon then fails what it left pending."""
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("pid "):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(line.split()[1]), signal.SIGKILL)


def fired(log: Path) -> list[str]:
    """The faults the filesystem reports having fired."""
    return [line for line in log.read_text(errors="replace").splitlines() if line.startswith("fault ")]


def _serve(source: str, mountpoint: str, spec: str, log: str) -> None:
    import mfusepy

    fault = Fault(**json.loads(spec)) if json.loads(spec) else None

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.guard = threading.Lock()
            self.done = False

        def _full(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def getattr(self, path: str, fh: int | None = None) -> dict:
            try:
                st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno) from None
            keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks")
            attrs = {key: getattr(st, key) for key in keys}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._full(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(self._full(path))

        def open(self, path: str, flags: int) -> int:
            try:
                return os.open(self._full(path), os.O_RDONLY)
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno) from None

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict:
            st = os.statvfs(source)
            return {key: getattr(st, key) for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                                      "f_files", "f_ffree", "f_favail", "f_namemax")}

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if fault is not None and path.lstrip("/") == fault.file and self._reaches(offset, size):
                self._fire(offset, size)
            return os.pread(fh, size, offset)

        def _reaches(self, offset: int, size: int) -> bool:
            """EIO and stalls hit the reads that touch the page at the offset (a bad sector);
            the file changes on the first read that reaches the offset."""
            assert fault is not None
            if fault.kind in ("eio", "stall"):
                return offset < fault.offset + PAGE and offset + size > fault.offset
            return offset + size > fault.offset

        def _fire(self, offset: int, size: int) -> None:
            assert fault is not None
            with self.guard:
                first, self.done = not self.done, True
            if first:
                with open(log, "a") as f:
                    f.write(f"fault {fault.kind} {fault.file} {fault.offset} (a read of {size} at {offset})\n")
            if fault.kind == "eio":
                raise mfusepy.FuseOSError(errno.EIO)
            if fault.kind == "stall":
                time.sleep(STALL_S)
            elif first and fault.kind == "shrink":
                os.truncate(self._full(fault.file), fault.offset)
            elif first and fault.kind == "replace":
                new = self._full(fault.file) + ".new"
                shutil.copyfile(self._full(fault.file), new)
                os.rename(new, self._full(fault.file))

    mfusepy.FUSE(Passthrough(), mountpoint, foreground=True, ro=True, use_ino=True, attr_timeout=0,
                 entry_timeout=0, negative_timeout=0, fsname="faultfs", subtype="faultfs")


if __name__ == "__main__":
    _serve(*sys.argv[1:5])
