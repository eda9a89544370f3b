"""CPU quotas over the process (``machine.cpu_quota``) and the CPUs it counts for
(``machine.usable_cpus``): in a real cgroup v1 cpu group made here, and cgroup v2 over a directory
laid out as cgroupfs and /proc are (``root=``; the unified hierarchy here has no cpu controller),
each said so in its name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fastload.bench.contention import MachineLoad
from vllm_fastload.machine import CpuQuota, CpuTime, cpu_quota, cpu_time

from .test_bench_contention import _quota_reason
from .test_memory_limits import _layout

MOUNTS_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTS_V1 = "31 23 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"


def test_cgroupfs_layout_v2_the_lowest_quota_of_the_group_and_its_ancestors(tmp_path: Path):
    pod = "sys/fs/cgroup/kubepods/pod7"
    root = _layout(tmp_path, cgroup="0::/kubepods/pod7/ctr\n", mountinfo=MOUNTS_V2,
                   files={f"{pod}/cpu.max": "250000 100000\n", f"{pod}/ctr/cpu.max": "max 100000\n",
                          "sys/fs/cgroup/kubepods/cpu.max": "800000 100000\n"})
    assert cpu_quota(str(root)) == CpuQuota("cgroup v2", "/kubepods/pod7", 2.5, str(root / pod))
    assert cpu_quota(str(root)).describe() == "cgroup v2 CPU quota of 2.50 CPUs at /kubepods/pod7"


def test_cgroupfs_layout_v2_and_v1_without_a_quota(tmp_path: Path):
    v2 = _layout(tmp_path / "a", cgroup="0::/\n", mountinfo=MOUNTS_V2, files={"sys/fs/cgroup/cpu.max": "max 100000\n"})
    v1 = _layout(tmp_path / "b", cgroup="3:cpu,cpuacct:/job\n", mountinfo=MOUNTS_V1,
                 files={"sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n",
                        "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(str(v2)) is None and cpu_quota(str(v1)) is None


def test_cgroupfs_layout_v1_a_quota_on_the_group(tmp_path: Path):
    root = _layout(tmp_path, cgroup="3:cpu,cpuacct:/docker/abc\n", mountinfo=MOUNTS_V1,
                   files={"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "75000\n",
                          "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "50000\n"})
    assert cpu_quota(str(root)) == CpuQuota("cgroup v1", "/docker/abc", 1.5,
                                            str(root / "sys/fs/cgroup/cpu,cpuacct/docker/abc"))


PROBE = "from vllm_fastload import machine; import json; q = machine.cpu_quota(); " \
        "print(json.dumps([q and q.cpus, q and q.kind, machine.usable_cpus()]))"


@pytest.mark.skipif(_quota_reason() is not None, reason=str(_quota_reason()))
@pytest.mark.parametrize(("cpus", "usable"), [(1.5, 2), (0.5, 1)])
def test_a_process_in_a_real_quota_group_counts_the_cpus_it_gives(cpus: float, usable: int):
    """A process started in a cgroup with a quota (made as ``bench --machine quota`` makes it)
    finds the quota and counts the CPUs it gives time for, rounded up, no more than it may run on."""
    with MachineLoad("quota", cpus).around() as state:
        out = subprocess.run([*state.prefix, sys.executable, "-c", PROBE], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    found, kind, counted = json.loads(out)
    assert found == pytest.approx(cpus) and kind.startswith("cgroup v")
    assert counted == min(usable, len(os.sched_getaffinity(0)))


def _proc(root: Path, stat: str, processes: dict[int, tuple[str, int, int]]) -> str:
    """A /proc of ``stat`` and one ``<pid>/stat`` per process: (name, parent, ticks split over utime,
    stime, cutime, cstime)."""
    (root / "stat").parent.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(stat)
    for pid, (name, parent, ticks) in processes.items():
        (root / str(pid)).mkdir()
        fields = ["S", str(parent)] + ["0"] * 9 + [str(ticks - 3), "1", "1", "1"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")
    return str(root)


def test_cpu_time_of_a_start_and_of_its_cpus_from_proc(tmp_path: Path):
    """The CPUs' busy time is every field but idle and iowait, of the CPUs asked for only; the
    start's is its own and its descendants' but for the reading process's subtree."""
    stat = ("cpu  900 0 900 9000 900 0 0 0 0 0\n"
            "cpu0 100 10 50 5000 400 5 5 30 7 0\n"
            "cpu1 300 0 100 4000 500 0 0 0 0 0\n"
            "intr 12345\n")
    proc = _proc(tmp_path / "proc", stat, {
        1: ("init", 0, 10), 40: ("start (a) b)", 1, 500), 41: ("scheduler", 40, 200), 42: ("reads", 40, 50),
        43: ("its child", 42, 70), 44: ("grandchild", 41, 30), 50: ("other job", 1, 9000)})
    spent = cpu_time(40, leave_out=42, cpus=[0], proc=proc)
    assert spent == CpuTime(busy_s=(100 + 10 + 50 + 5 + 5 + 30) / os.sysconf("SC_CLK_TCK"),
                            start_s=(500 + 200 + 30) / os.sysconf("SC_CLK_TCK"))
    both = cpu_time(40, leave_out=42, cpus=[0, 1], proc=proc)
    assert both is not None and both.busy_s == (200 + 400) / os.sysconf("SC_CLK_TCK")
    assert cpu_time(77, leave_out=42, cpus=[0], proc=proc) is None  # the start has ended
    assert cpu_time(40, leave_out=42, cpus=[5], proc=proc) is None  # no such CPU


#: A process that spends one second of CPU time and ends.
SPIN = "import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass"


def test_cpu_time_of_a_real_start_counts_its_children_and_not_others():
    """A busy child of this process counts as its start's time; a busy process that is not its
    descendant (its parent ended at once) counts only in the CPUs' busy time."""
    before = cpu_time(os.getpid(), leave_out=-1)
    own = subprocess.Popen([sys.executable, "-c", SPIN])
    orphaned = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {SPIN!r}])"
    other = subprocess.Popen([sys.executable, "-c", orphaned], stdout=subprocess.PIPE)
    assert other.stdout is not None
    other.wait()
    other.stdout.read()  # its orphaned child held the pipe until it ended
    own.wait()  # (reaped: the child's time moves into this process's cutime)
    after = cpu_time(os.getpid(), leave_out=-1)
    assert before is not None and after is not None
    assert 0.95 <= after.start_s - before.start_s <= 1.7, (before, after)  # one spinner's second, and starting two
    assert after.busy_s - before.busy_s >= 1.9, (before, after)
