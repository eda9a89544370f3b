"""What else the machine does while a start is measured (``vllm-fastload bench --machine``), and
the memory the start takes.

Early reads win on CPU time the engine's start-up leaves idle; these states take it away, as
users' nodes do: ``quiet`` (nothing else), ``busy`` (a CPU-bound job beside the start: one
spinning process per CPU it may run on, at normal priority) and ``quota`` (the start in a cgroup
whose CPU quota is 1.5 CPUs, or ``quota=N``: what a Kubernetes CPU limit sets; an idle-priority
process in the group spends the quota too). Each start gets the state afresh, so that the loaders
of one repetition meet the same machine.

Every start also runs in a memory cgroup of its own, without a limit, whose peak is what the
start held at its highest: its processes' memory and the page cache they read in (what a
container's memory limit counts), where cgroups can be made here.
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
_CGROUP = Path("/sys/fs/cgroup")
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
        behind (it enters the start's groups) and which reads what the groups counted."""
        with contextlib.ExitStack() as stack:
            if self.kind == "busy":
                stack.enter_context(_spinners(machine.usable_cpus()))
            cpu = stack.enter_context(_Group.made("cpu", {"cpu.cfs_period_us": str(PERIOD_US),
                                                          "cpu.cfs_quota_us": str(int(self.cpus * PERIOD_US))},
                                                  {"cpu.max": f"{int(self.cpus * PERIOD_US)} {PERIOD_US}"})
                                      ) if self.kind == "quota" else None
            memory = None
            if _Group.possible("memory"):
                with contextlib.suppress(OSError):  # (memory is measured where it can be, never required)
                    memory = stack.enter_context(_Group.made("memory", {}, {}))
            groups = [g for g in (cpu, memory) if g is not None]
            # The start's first process enters its groups before it execs, so that all it starts is inside.
            prefix = ("sh", "-c", 'for g in $0; do echo $$ > "$g" || exit 1; done; exec "$@"',
                      " ".join(str(g.procs) for g in groups)) if groups else ()
            yield Contention(prefix=prefix, cpu=cpu, memory=memory)


@dataclass(frozen=True)
class Contention:
    """One start's state: the command prefix that enters its groups, and the groups."""

    prefix: tuple[str, ...] = ()
    cpu: _Group | None = None
    memory: _Group | None = None

    def throttled_s(self) -> float | None:
        """Seconds the start's processes were held back by the quota (None: no quota)."""
        return None if self.cpu is None else machine.throttled_s(str(self.cpu.path))

    def memory_peak(self) -> int | None:
        """The most memory the start's group held at once, page cache included (None: no group)."""
        if self.memory is None:
            return None
        return self.memory.number("memory.max_usage_in_bytes" if self.memory.version == 1 else "memory.peak")


@dataclass(frozen=True)
class _Group:
    """A cgroup made for one start, of one controller."""

    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    @staticmethod
    def possible(controller: str) -> bool:
        """Whether a group of ``controller`` can be made here (root, and a hierarchy that has it)."""
        if os.geteuid() != 0:
            return False
        if (_CGROUP / controller).is_dir():
            return True
        unified = _CGROUP / "cgroup.controllers"
        return unified.exists() and controller in unified.read_text().split()

    @classmethod
    @contextlib.contextmanager
    def made(cls, controller: str, v1: dict[str, str], v2: dict[str, str]) -> Iterator[_Group]:
        """A new group of ``controller`` below this process's own (v1; else below the unified
        hierarchy's root, v2) with the files ``v1`` or ``v2`` written; removed afterwards, with
        whatever still runs in it."""
        name = f"fastload-bench-{os.getpid()}-{next(_count)}"
        if (_CGROUP / controller).is_dir():
            own = (machine.cgroup_path(controller) or "").lstrip("/")
            group, settings = cls(_CGROUP / controller / own / name, 1), v1
        elif _Group.possible(controller):
            subtree = _CGROUP / "cgroup.subtree_control"
            if controller not in subtree.read_text().split():
                subtree.write_text(f"+{controller}")
            group, settings = cls(_CGROUP / name, 2), v2
        else:
            raise SystemExit(f"bench: cannot make a cgroup with the {controller} controller here (needs root and "
                             f"a cgroup v1 {controller} hierarchy or the controller in cgroup v2)")
        group.path.mkdir()
        try:
            for file, value in settings.items():
                (group.path / file).write_text(value)
            yield group
        finally:
            group._remove()

    def number(self, file: str) -> int | None:
        """A one-number file of the group (None: not there)."""
        try:
            return int((self.path / file).read_text().strip())
        except (OSError, ValueError):
            return None

    def _remove(self) -> None:
        for _ in range(50):
            pids = [int(p) for p in self.procs.read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.path.rmdir()


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
