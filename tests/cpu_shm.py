"""Clearing the vLLM-CPU shared-memory files that killed workers of earlier starts left behind,
before a test session starts vLLM: the tests' own guard (``tools.processes`` clears what each
start leaves as it ends)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from vllm_fastload.tools.processes import SHM_DIR, _mtime, _remove


def remove_stale_cpu_shm(min_age_s: float, *, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the shared-memory files earlier starts left: unchanged for ``min_age_s`` and mapped
    or held open by no process. Returns the files removed."""
    cutoff = time.time() - min_age_s
    stale = [f for f in shm_dir.glob("*-cpushm_*") if _mtime(f) < cutoff]
    if stale:
        used = files_in_use()
        stale = [f for f in stale if str(f) not in used]
    return _remove(stale)


def files_in_use(pids: Iterable[int | str] | None = None) -> set[str]:
    """Every file the processes ``pids`` (default: every process we may inspect) map or hold open."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")) if pids is None else pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)  # address perms offset device inode [path]
                    if len(fields) == 6:
                        used.add(fields[5].rstrip())
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # ended meanwhile, or not ours to inspect
            continue
        for fd in fds:
            try:
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                pass
    return used
