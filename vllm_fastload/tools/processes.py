"""Stopping the processes the tests and benchmarks start (s3rver, moto, sshd, vLLM), and clearing
what a killed vLLM worker leaves behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

#: vLLM-CPU's parallel workers share memory through files in /dev/shm named
#: "<ident>-<group>-[<ranks>]-cpushm_<rank>", the ident being the port of the distributed init
#: method (its file name for a ``file://`` method). A worker that is killed (Ray's shutdown kills
#: its actors) leaves them behind, and a later start that draws the same port fails with "create
#: shm in SHMManager failed. errno: 17" (the file exists).
SHM_DIR = Path("/dev/shm")
#: The line each vLLM rank logs as it joins the group, with the init method its files are named by.
DIST_INIT_METHOD = re.compile(r"distributed_init_method=(\S+)")


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


def session_processes(sid: int) -> list[str]:
    """The processes of session ``sid`` (a process started with ``start_new_session=True`` leads
    one; what it starts stays in it unless it starts a session of its own) still running, each as
    ``"pid command"``; zombies (ended, not yet reaped) are left out."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{pid} {command}")
    return found


def stop_session(sid: int, timeout: float = 10) -> None:
    """SIGTERM every process of session ``sid`` (``session_processes``), SIGKILL what is left after
    ``timeout`` s: also the processes its leader left behind when it ended."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(line.split()[0]) for line in session_processes(sid)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:  # ended meanwhile
                pass
        deadline = time.monotonic() + timeout
        while pids and session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.1)


def cpu_shm_idents(log: str) -> set[str]:
    """The idents of the shared-memory files of the starts ``log`` records, formed as vLLM-CPU's
    worker forms them (``VLLM_DIST_IDENT``)."""
    idents = set()
    for method in DIST_INIT_METHOD.findall(log):
        if method.startswith("file://"):
            idents.add(os.path.basename(method.removeprefix("file://")))
        elif method.startswith("tcp://"):
            idents.add(method.rsplit(":", 1)[-1])
    idents.discard("")
    return idents


def remove_cpu_shm(idents: Iterable[str], ended: float, *, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the shared-memory files named by ``idents`` (``cpu_shm_idents``) of starts that ended
    at ``ended`` (``time.time()``). Files changed after that belong to a later start that drew the
    same port and are kept; a worker of the ended start still on its way out keeps its mapping, only
    the name goes. Returns the files removed."""
    idents = set(idents)
    return _remove([f for f in shm_dir.glob("*-cpushm_*")
                    if any(f.name.startswith(ident + "-") for ident in idents) and _mtime(f) <= ended])


def remove_logged_cpu_shm(log: Path) -> list[Path]:
    """Remove the shared-memory files of the starts whose log is ``log``, which have just ended
    (``remove_cpu_shm``): what their killed workers left, on which a later start that drew the same
    port would fail."""
    return remove_cpu_shm(cpu_shm_idents(log.read_text(errors="replace")), ended=time.time())


def _remove(files: list[Path]) -> list[Path]:
    removed = []
    for f in files:
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
