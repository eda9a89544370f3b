"""Facts about the machine a load runs on: the memory limits over this process, the filesystem a
file lives on, the CPUs this thread may use.

Read here and nowhere else, and decided on elsewhere (``policy``: e.g. ``early_reads_memory`` picks
the limit that decides, ``filesystem_defaults`` what a network filesystem changes). Standard
library only, importing nothing from the package but through it: the early-reads process (a bare
``python -I -S``, ``early.child``) imports it too.

**Memory.** Page cache a process reads in is charged to its memory cgroup, so the room early reads
have is the least of: the machine's ``MemAvailable``, and the headroom under each cgroup limit that
applies. A limit can be set in several places:

- cgroup v2 (``memory.max``): on the process's own group and on each of its ancestors, found
  through the process's path in ``/proc/self/cgroup`` below the mount point; a container in its
  own cgroup namespace sees its group as the mount's root (the namespace root), a Slurm job or a
  systemd service sees its group somewhere below;
- cgroup v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``): likewise on the group and its
  ancestors while they account hierarchically (``memory.use_hierarchy``); a limit set above what
  the namespace shows still appears in the group's ``memory.stat`` as
  ``hierarchical_memory_limit``.

**Filesystems.** A network filesystem answers each request after a round trip, so what is fast on
a local disk (a page-cache probe, row-by-row reads of a column slice, few large requests) can be
slow there. The type comes from ``/proc/mounts`` (the longest mount point that contains the file's
real path, the rule the kernel itself uses); no system call that could hang on a dead server is
made.

**CPUs.** vLLM-CPU binds each worker to its own cores: what the calling thread may use is what
counts, not the machine's count; and a CPU quota (a Kubernetes CPU limit: cgroup v1
``cpu.cfs_quota_us``, v2 ``cpu.max``, on the process's group or an ancestor) gives its processes
time for no more CPUs than it says, however many they may run on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

#: At or above this, a cgroup "limit" means none (v1 writes ``PAGE_COUNTER_MAX`` pages, about 2**63).
NO_LIMIT = 1 << 62
GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryLimit:
    """One limit and the bytes free under it now."""

    #: "machine", "cgroup v1" or "cgroup v2".
    kind: str
    #: The cgroup's path as ``/proc/self/cgroup`` spells it ("" for the machine); a v1 limit set
    #: above the visible tree is "above <top>".
    where: str
    #: The limit in bytes (the machine: ``MemTotal``).
    limit: int
    #: Bytes that may still be filled under it: the limit less the usage (the machine:
    #: ``MemAvailable``).
    free: int

    def describe(self) -> str:
        """E.g. "cgroup v1 memory limit 6.00 GiB at /job/7, 5.1 GiB free under it"."""
        if self.kind == "machine":
            return f"the machine's available memory (MemAvailable), {self.free / GiB:.1f} GiB"
        if self.where.startswith("above"):
            return (f"{self.kind} memory limit {self.limit / GiB:.2f} GiB set {self.where}, "
                    f"at most {self.free / GiB:.1f} GiB free under it")
        return (f"{self.kind} memory limit {self.limit / GiB:.2f} GiB at {self.where}, "
                f"{self.free / GiB:.1f} GiB free under it")


def memory_limits(root: str = "/") -> list[MemoryLimit]:
    """The machine's available memory and every cgroup memory limit over this process (``root``:
    where ``/proc`` and the cgroup mounts are found, for tests over a directory laid out like them)."""
    proc = os.path.join(root, "proc")
    limits = [_machine(proc)]
    mounts = _cgroup_mounts(os.path.join(proc, "self", "mountinfo"))
    paths = _cgroup_paths(os.path.join(proc, "self", "cgroup"))
    for mount_root, mount_point, version in mounts:
        path = paths.get("v2" if version == 2 else "memory")
        if path is not None:
            levels = _levels(os.path.join(root, mount_point.lstrip("/")), mount_root, path)
            limits += _v2_limits(levels) if version == 2 else _v1_limits(levels)
    return limits


def meminfo(key: str, proc: str = "/proc") -> int:
    """A ``/proc/meminfo`` field in bytes (0 where it is not there)."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _machine(proc: str) -> MemoryLimit:
    return MemoryLimit("machine", "", meminfo("MemTotal", proc), meminfo("MemAvailable", proc))


def _cgroup_mounts(mountinfo: str, controller: str = "memory") -> list[tuple[str, str, int]]:
    """``(root, mount point, version)`` of the cgroup mounts of ``controller``: v1 hierarchies with
    it, and cgroup2 (whose controllers are checked per group: ``memory.max``, ``cpu.max``)."""
    mounts = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, options = line.split(" - ", 1)[1].partition(" ")
        super_options = options.split()[-1].split(",") if options.split() else []
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            mounts.append((root, point, 2))
        elif fstype == "cgroup" and controller in super_options:
            mounts.append((root, point, 1))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path with its octal escapes (``\\040`` for a space) undone."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def cgroup_path(controller: str) -> str | None:
    """This process's group in the v1 hierarchy of ``controller`` (None: no such hierarchy holds it)."""
    return _cgroup_paths("/proc/self/cgroup", controller).get(controller)


def _cgroup_paths(cgroup: str, controller: str = "memory") -> dict[str, str]:
    """The process's cgroup path per hierarchy: "v2" for the unified one, ``controller`` for v1's."""
    paths = {}
    try:
        with open(cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths["v2"] = path
        elif controller in controllers.split(","):
            paths[controller] = path
    return paths


def _levels(top: str, mount_root: str, path: str) -> list[tuple[str, str]]:
    """The process's group and each of its ancestors up to the mount at ``top`` (which shows the
    hierarchy from ``mount_root``), nearest first, each as ``(directory, path as /proc/self/cgroup
    names it)``. Where the path lies outside what the mount shows (a cgroup namespace's root, a
    path from another namespace), the mount's top alone: the namespace root."""
    base = mount_root.rstrip("/")
    parts = path[len(base):].strip("/").split("/") if path == base or path.startswith(base + "/") else None
    if not parts or parts == [""] or not os.path.isdir(os.path.join(top, *parts)):
        return [(top, mount_root)]
    return [(os.path.join(top, *parts[:n]), "/".join([base, *parts[:n]]) or "/") for n in range(len(parts), -1, -1)]


def _read_int(directory: str, name: str) -> int | None:
    """A number from a cgroup file; None where it is absent or not a number ("max": no limit)."""
    try:
        with open(os.path.join(directory, name)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _v2_limits(levels: list[tuple[str, str]]) -> list[MemoryLimit]:
    """v2: ``memory.max`` against ``memory.current`` on the group and every ancestor that has them
    (the root has neither, nor has a group whose parent does not enable the memory controller)."""
    limits = []
    for directory, shown in levels:
        limit, used = _read_int(directory, "memory.max"), _read_int(directory, "memory.current")
        if limit is not None and used is not None and limit < NO_LIMIT:
            limits.append(MemoryLimit("cgroup v2", shown, limit, max(limit - used, 0)))
    return limits


def _v1_limits(levels: list[tuple[str, str]]) -> list[MemoryLimit]:
    """v1: ``memory.limit_in_bytes`` against ``memory.usage_in_bytes`` on the group and its
    ancestors, while each parent counts its children's usage (``memory.use_hierarchy``); then the
    group's ``hierarchical_memory_limit`` (``memory.stat``) where it is lower than all of those: a
    limit set above the visible tree, whose usage is at least the visible top's."""
    limits = []
    for i, (directory, shown) in enumerate(levels):
        if i and _read_int(directory, "memory.use_hierarchy") == 0:
            break  # this parent does not charge its children's usage against its own limit
        limit, used = _read_int(directory, "memory.limit_in_bytes"), _read_int(directory, "memory.usage_in_bytes")
        if limit is not None and used is not None and limit < NO_LIMIT:
            limits.append(MemoryLimit("cgroup v1", shown, limit, max(limit - used, 0)))
    hierarchical = _stat(levels[0][0], "hierarchical_memory_limit")
    if hierarchical is not None and hierarchical < NO_LIMIT and all(hierarchical < m.limit for m in limits):
        top, shown_top = levels[-1]
        used = _read_int(top, "memory.usage_in_bytes") or 0
        limits.append(MemoryLimit("cgroup v1", f"above {shown_top}", hierarchical, max(hierarchical - used, 0)))
    return limits


def _stat(directory: str, key: str) -> int | None:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


#: Filesystem types (as /proc/mounts spells them) whose reads cross a network.
NETWORK = frozenset({
    "nfs", "nfs4", "lustre", "ceph", "fuse.ceph", "fuse.ceph-fuse", "cifs", "smb3", "9p", "fuse.sshfs",
    "glusterfs", "fuse.glusterfs", "beegfs", "gpfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3",
    "fuse.juicefs", "fuse.rclone", "virtiofs", "weka", "wekafs",
})


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem that holds ``path`` (e.g. ``ext4``, ``fuse.sshfs``, ``nfs4``);
    ``""`` where ``/proc/mounts`` cannot be read (not Linux)."""
    resolved = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return ""
    return fstype


def is_network(fstype: str) -> bool:
    """Whether reads on this filesystem type cross a network."""
    return fstype in NETWORK or fstype.startswith("nfs")


@dataclass(frozen=True)
class CpuQuota:
    """A cgroup's CPU quota: at most ``cpus`` CPUs' worth of time for its processes together."""

    #: "cgroup v1" or "cgroup v2".
    kind: str
    #: The cgroup's path as ``/proc/self/cgroup`` spells it.
    where: str
    cpus: float
    #: The group's directory, where its ``cpu.stat`` counts the time the quota held it back.
    directory: str

    def describe(self) -> str:
        """E.g. "cgroup v2 CPU quota of 1.50 CPUs at /kubepods/pod7"."""
        return f"{self.kind} CPU quota of {self.cpus:.2f} CPUs at {self.where}"


def throttled_s(directory: str) -> float | None:
    """Seconds a cgroup's CPU quota has held its processes back so far (``cpu.stat``: v2
    ``throttled_usec``, v1 ``throttled_time`` in ns); None where the group does not say."""
    try:
        with open(os.path.join(directory, "cpu.stat")) as f:
            stat = dict(line.split(None, 1) for line in f if line.strip())
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat["throttled_time"]) / 1e9
    except (OSError, KeyError, ValueError):
        return None


def cpu_quota(root: str = "/") -> CpuQuota | None:
    """The lowest CPU quota over this process (its group's or an ancestor's: cgroup v1
    ``cpu.cfs_quota_us`` per ``cpu.cfs_period_us``, v2 ``cpu.max``); None where none is set
    (``root``: as for ``memory_limits``)."""
    proc = os.path.join(root, "proc")
    paths = _cgroup_paths(os.path.join(proc, "self", "cgroup"), "cpu")
    quotas = []
    for mount_root, mount_point, version in _cgroup_mounts(os.path.join(proc, "self", "mountinfo"), "cpu"):
        path = paths.get("v2" if version == 2 else "cpu")
        if path is None:
            continue
        for directory, shown in _levels(os.path.join(root, mount_point.lstrip("/")), mount_root, path):
            cpus = _v2_quota(directory) if version == 2 else _v1_quota(directory)
            if cpus is not None:
                quotas.append(CpuQuota(f"cgroup v{version}", shown, cpus, directory))
    return min(quotas, key=lambda q: q.cpus, default=None)


def _v1_quota(directory: str) -> float | None:
    quota, period = _read_int(directory, "cpu.cfs_quota_us"), _read_int(directory, "cpu.cfs_period_us")
    return quota / period if quota is not None and period else None  # (-1, no quota, is not a number here)


def _v2_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
    except OSError:
        return None
    return int(quota) / int(period) if quota.isdigit() and period.isdigit() and int(period) else None


def usable_cpus() -> int:
    """CPUs the calling thread may run on, and no more than a CPU quota over it gives time for
    (rounded up: 1.5 CPUs' worth of time keeps two threads running part of the time)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    quota = cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota.cpus)))


def cpu_count(cpus: Sequence[int] | None) -> int:
    """CPUs a reader's threads may run on: ``cpus`` where given, else the calling thread's."""
    return len(cpus) if cpus else usable_cpus()


@dataclass(frozen=True)
class CpuTime:
    """CPU time spent so far on some CPUs, split by whom: what ``policy.starved_reads`` compares
    between two looks."""

    #: Seconds those CPUs have run anything (neither idle nor waiting for a disk), since boot.
    busy_s: float
    #: Seconds the processes of one start (a process and its descendants) have run, their ended
    #: children's included.
    start_s: float


def cpu_time(start: int, *, leave_out: int, cpus: Collection[int] | None = None,
             proc: str = "/proc") -> CpuTime | None:
    """The CPU time of ``cpus`` (the calling thread's where None), and of process ``start`` with its
    descendants but for ``leave_out`` and its own; None where the kernel does not say
    (``/proc/stat``, ``/proc/<pid>/stat``)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        wanted = set(os.sched_getaffinity(0) if cpus is None else cpus)
        busy = _busy_ticks(os.path.join(proc, "stat"), wanted)
        tree = _tree_ticks(proc, start, leave_out)
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    return None if busy is None or tree is None else CpuTime(busy / tick, tree / tick)


def _busy_ticks(stat: str, cpus: set[int]) -> int | None:
    """Ticks ``cpus`` ran anything: every ``/proc/stat`` field of each but idle and iowait (guest
    time is counted in user time already, so those two fields are left out too)."""
    total, seen = 0, 0
    with open(stat) as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
                continue
            fields = [int(v) for v in rest.split()]
            total += sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
            seen += 1
    return total if seen else None


def _tree_ticks(proc: str, root: int, leave_out: int) -> int | None:
    """Ticks ``root`` and its descendants have run (ended children reaped by them included), but for
    ``leave_out`` and its descendants; None where ``root`` is gone."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat")) as f:
                text = f.read()
        except OSError:
            continue  # ended while listed
        fields = text[text.rindex(")") + 2:].split()  # the name, in parentheses, may hold anything
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    if root not in ticks:
        return None
    total = 0
    for pid, spent in ticks.items():
        ancestor = pid
        while ancestor not in (root, leave_out, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            total += spent
    return total
