"""What else the machine does while a start is measured (``vllm-fastload bench --machine``).

Early reads win on CPU time the engine's start-up leaves idle; these states take it away, as
users' nodes do: ``quiet`` (nothing else), ``busy`` (a CPU-bound job beside the start: one
spinning process per CPU it may run on, at normal priority) and ``quota`` (the start in a cgroup
whose CPU quota is 1.5 CPUs, or ``quota=N``: what a Kubernetes CPU limit sets; an idle-priority
process in the group spends the quota too). Each start gets the state afresh, so that the loaders
of one repetition meet the same machine.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vllm_fastload import machine

#: The CFS period a quota is set in (the kernel's default).
PERIOD_US = 100_000
_V1 = Path("/sys/fs/cgroup/cpu")
_count = itertools.count()


@dataclass(frozen=True)
class MachineLoad:
    """One machine state (see the module's docstring)."""

    kind: Literal["quiet", "busy", "quota"] = "quiet"
    #: The quota, in CPUs (``quota`` only).
    cpus: float = 1.5

    @classmethod
    def parse(cls, text: str) -> MachineLoad:
        """``quiet``, ``busy``, ``quota`` or ``quota=N`` (N CPUs, more than 0)."""
        kind, _, value = text.strip().partition("=")
        if kind in ("quiet", "busy") and not value:
            return cls(kind)  # type: ignore[arg-type]
        if kind == "quota":
            try:
                cpus = float(value) if value else 1.5
            except ValueError:
                cpus = 0.0
            if cpus > 0:
                return cls("quota", cpus)
        raise ValueError(f"--machine {text!r}: expected quiet, busy, quota or quota=N (N CPUs, more than 0)")

    @property
    def name(self) -> str:
        """The state as ``--machine`` takes it, for file names and tables."""
        return f"quota={self.cpus:g}" if self.kind == "quota" else self.kind

    def describe(self) -> str:
        """The state in words, for the run's header."""
        if self.kind == "busy":
            return f"busy: {machine.usable_cpus()} spinning processes beside each start, one per CPU"
        if self.kind == "quota":
            return f"quota: each start in a cgroup limited to {self.cpus:g} CPUs (CFS quota per {PERIOD_US} us period)"
        return "quiet: nothing else running"

    @contextlib.contextmanager
    def around(self) -> Iterator[Contention]:
        """The state around one start: a ``Contention`` whose ``prefix`` the start's command runs
        behind (a quota's group is entered by it) and which counts what the group was throttled."""
        if self.kind == "busy":
            with _spinners(machine.usable_cpus()):
                yield Contention()
        elif self.kind == "quota":
            with _quota_group(self.cpus) as group:
                yield group
        else:
            yield Contention()


@dataclass(frozen=True)
class Contention:
    """One start's state: the command prefix that enters it, and (a quota) the group's ``cpu.stat``."""

    prefix: tuple[str, ...] = ()
    group: Path | None = None

    def throttled_s(self) -> float | None:
        """Seconds the group's processes were held back by the quota (None: no quota)."""
        if self.group is None:
            return None
        stat = _cpu_stat(self.group)
        if "throttled_usec" in stat:  # cgroup v2
            return stat["throttled_usec"] / 1e6
        return stat.get("throttled_time", 0) / 1e9


@contextlib.contextmanager
def _spinners(count: int) -> Iterator[None]:
    """``count`` processes that keep a CPU busy each, ended afterwards."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(count)]
    try:
        time.sleep(0.2)  # running before the start begins
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@contextlib.contextmanager
def _quota_group(cpus: float) -> Iterator[Contention]:
    """A new cgroup with a CPU quota of ``cpus`` (v1's ``cpu`` controller, else v2's ``cpu.max``
    below the unified hierarchy's root), removed afterwards with whatever still runs in it."""
    name = f"fastload-bench-{os.getpid()}-{next(_count)}"
    quota = int(cpus * PERIOD_US)
    if _V1.is_dir():
        group = _V1 / _own_v1_path() / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        root = _v2_root()
        group = root / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    procs = group / "cgroup.procs"
    # The start's first process enters the group before it execs, so that all it starts is inside.
    prefix = ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs))
    try:
        yield Contention(prefix=prefix, group=group)
    finally:
        for _ in range(50):
            pids = [int(p) for p in procs.read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        group.rmdir()


def _own_v1_path() -> str:
    """This process's group in the v1 ``cpu`` hierarchy, relative to its root."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path.lstrip("/")
    return ""


def _v2_root() -> Path:
    """The cgroup2 mount, where a child group can have a CPU quota; SystemExit saying why not."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if " - cgroup2 " in line:
            root = Path(line.split()[4])
            if "cpu" in (root / "cgroup.subtree_control").read_text().split():
                return root
            try:
                (root / "cgroup.subtree_control").write_text("+cpu")
                return root
            except OSError as exc:
                raise SystemExit(f"--machine quota: cannot enable the cpu controller below {root} ({exc})") from None
    raise SystemExit("--machine quota: no cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu and no cgroup2 mount")


def _cpu_stat(group: Path) -> dict[str, int]:
    """The group's ``cpu.stat`` as numbers."""
    out = {}
    for line in (group / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out
