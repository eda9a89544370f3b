"""Real memory cgroups for the tests: a v1 group made below the test process's own, with a limit,
and processes started inside it; removed again afterwards (its processes ended first).

Making groups needs root and a writable cgroup v1 memory hierarchy (``v1_reason`` says what is
missing where they cannot be made). cgroup v2 groups with the memory controller need the
controller on the unified hierarchy (``v2_reason``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

V1 = Path("/sys/fs/cgroup")
V1_MEMORY = V1 / "memory"
_count = itertools.count()


def own_v1_group(controller: str = "memory") -> Path | None:
    """This process's group directory in the v1 hierarchy of ``controller`` (None where there is none)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            group = V1 / controller / path.lstrip("/")
            return group if group.is_dir() else None
    return None


def v1_reason(controller: str = "memory") -> str | None:
    """Why a v1 group of ``controller`` cannot be made here; None where it can."""
    group = own_v1_group(controller)
    if group is None:
        return f"no cgroup v1 {controller} hierarchy at {V1 / controller} holds this process"
    if not os.access(group, os.W_OK):
        return f"cannot make cgroups below {group} (needs root)"
    return None


def v2_mount() -> Path | None:
    """The cgroup2 mount point, if any."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if " - cgroup2 " in line:
            return Path(line.split()[4])
    return None


def v2_reason() -> str | None:
    """Why a cgroup v2 group with a memory limit cannot be made here; None where it can."""
    mount = v2_mount()
    if mount is None:
        return "no cgroup2 filesystem is mounted"
    controllers = (mount / "cgroup.controllers").read_text().split()
    if "memory" not in controllers:
        return (f"the cgroup2 hierarchy at {mount} offers only {controllers or 'no controllers'}: the memory "
                f"controller is bound to the cgroup v1 hierarchy at {V1_MEMORY} (a controller serves one "
                "hierarchy at a time), so no v2 group here can have a memory limit")
    if not os.access(mount, os.W_OK):
        return f"cannot make cgroups below {mount} (needs root)"
    return None


@contextlib.contextmanager
def v1_group(limit: int | None, parent: Path | None = None, controller: str = "memory") -> Iterator[Path]:
    """A new v1 group of ``controller`` (below ``parent``, else below this process's own group),
    for memory with ``memory.limit_in_bytes`` = ``limit`` (None: none). On exit, every process
    still in it is killed and it is removed."""
    base = parent or own_v1_group(controller)
    assert base is not None, v1_reason()
    group = base / f"fastload-test-{os.getpid()}-{next(_count)}"
    group.mkdir()
    try:
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        _remove(group)


def remove_v2(group: Path) -> None:
    """Remove a group (v1 or v2) and the groups below it, killing what still runs in them."""
    _remove(group)


def _remove(group: Path) -> None:
    for child in [p for p in group.iterdir() if p.is_dir()]:
        _remove(child)
    deadline = time.monotonic() + 30
    while True:
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def in_group(group: Path | list[Path], cmd: list[str]) -> list[str]:
    """``cmd`` run as a process of ``group`` (or of each group, one per hierarchy) from its first
    instruction (a shell moves itself in, then becomes ``cmd``)."""
    moves = " && ".join(f'echo $$ > "{g}/cgroup.procs"' for g in (group if isinstance(group, list) else [group]))
    return ["sh", "-c", f'{moves} && exec "$@"', "sh", *cmd]


def run_in_group(group: Path, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(in_group(group, cmd), **kwargs)
