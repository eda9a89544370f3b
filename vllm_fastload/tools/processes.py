"""Stopping the processes the tests and benchmarks start (s3rver, moto, sshd, vLLM), and clearing
what a killed vLLM worker leaves behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

#: vLLM-CPU's parallel workers share memory through files in /dev/shm named
#: "<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>", where the ident is the port of the
#: distributed init method. A worker that is killed (Ray's shutdown kills its actors) leaves them
#: behind, and a later start that draws the same port fails with "create shm in SHMManager failed.
#: errno: 17" (the file exists).
SHM_DIR = Path("/dev/shm")
#: How a vLLM log names the distributed init method, whose port is the segments' ident.
DIST_INIT_PORT = re.compile(r"distributed_init_method=tcp://\S+?:(\d+)\b")


def stop_process_group(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session=True``), SIGKILL
    it if it has not exited within ``timeout`` s; nothing if it is None or already gone."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def remove_cpu_shm(log: str | None = None, *, min_age_s: float = 0.0, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove vLLM-CPU's shared-memory files: those of the starts ``log`` records (call once they
    have ended: a worker still on its way out keeps its mapping, only the name goes), or with no
    log every such file older than ``min_age_s`` that no process maps or holds open (left by
    earlier starts). Returns the files removed."""
    if log is not None:
        idents = set(DIST_INIT_PORT.findall(log))
        stale = [f for f in shm_dir.glob("*-cpushm_*") if f.name.split("-", 1)[0] in idents]
    else:
        cutoff = time.time() - min_age_s
        stale = [f for f in shm_dir.glob("*-cpushm_*") if _mtime(f) < cutoff]
        if stale:
            used = _files_in_use()
            stale = [f for f in stale if str(f) not in used]
    removed = []
    for f in stale:
        try:
            f.unlink()
            removed.append(f)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def _files_in_use() -> set[str]:
    """Every file some process (that we may inspect) maps or holds open."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)  # address perms offset device inode [path]
                    if len(fields) == 6:
                        used.add(fields[5].rstrip())
            fds = f"/proc/{pid}/fd"
            for fd in os.listdir(fds):
                used.add(os.readlink(f"{fds}/{fd}"))
        except OSError:  # ended meanwhile, or not ours to inspect
            continue
    return used
