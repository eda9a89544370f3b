"""Memory limits wherever they are set (``machine.memory_limits``), and the early reads' decision
from the lowest of them (``policy.early_reads_memory``).

Real cgroups where this machine can make them: v1 memory groups below the test's own group
(nested ones, and one seen from inside its own cgroup namespace, as a container sees it). cgroup
v2 memory groups need the memory controller on the unified hierarchy; where it is bound to v1
(a hybrid host) the v2 test says so, and v2's reading is covered by tests over a directory laid
out as cgroupfs and /proc are (``root=``), each said so in its name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import vllm_fastload
from tests import cgroups
from vllm_fastload import policy
from vllm_fastload.machine import MemoryLimit, memory_limits
from vllm_fastload.tools.checkpoints import PRESETS, write_random_checkpoint

GiB = 1 << 30
MEMINFO = "MemTotal:       24000000 kB\nMemFree:        20000000 kB\nMemAvailable:   21000000 kB\n"


def _layout(root: Path, *, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A directory laid out as /proc and the cgroup mounts are: ``files`` by path below ``root``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(MEMINFO)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _cgroups(limits: list[MemoryLimit]) -> list[tuple[str, str, int, int]]:
    return [(m.kind, m.where, m.limit, m.free) for m in limits if m.kind != "machine"]


def test_cgroupfs_layout_v2_a_slurm_job_below_the_root(tmp_path: Path):
    """v2 parsing over a laid-out directory: a job's limit two levels above the process's own group
    (whose memory.max is "max"), the root without memory files."""
    job = "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7"
    root = _layout(tmp_path, cgroup="0::/system.slice/slurmstepd.scope/job_7/step_0\n",
                   mountinfo="30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
                   files={f"{job}/memory.max": f"{6 * GiB}\n", f"{job}/memory.current": f"{GiB}\n",
                          f"{job}/step_0/memory.max": "max\n", f"{job}/step_0/memory.current": "4096\n",
                          "sys/fs/cgroup/cgroup.controllers": "cpu memory\n"})
    limits = memory_limits(str(root))
    assert limits[0] == MemoryLimit("machine", "", 24000000 * 1024, 21000000 * 1024)
    assert _cgroups(limits) == [("cgroup v2", "/system.slice/slurmstepd.scope/job_7", 6 * GiB, 5 * GiB)]
    assert limits[1].describe() == ("cgroup v2 memory limit 6.00 GiB at /system.slice/slurmstepd.scope/job_7, "
                                    "5.0 GiB free under it")


def test_cgroupfs_layout_v2_a_container_at_its_namespace_root(tmp_path: Path):
    """v2 parsing over a laid-out directory: the container's group is the mount's top ("0::/")."""
    root = _layout(tmp_path, cgroup="0::/\n", mountinfo="30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                   files={"sys/fs/cgroup/memory.max": f"{4 * GiB}\n", "sys/fs/cgroup/memory.current": f"{3 * GiB}\n"})
    assert _cgroups(memory_limits(str(root))) == [("cgroup v2", "/", 4 * GiB, GiB)]


def test_cgroupfs_layout_v2_a_path_outside_the_namespace_is_the_namespace_root(tmp_path: Path):
    root = _layout(tmp_path, cgroup="0::/../../other\n",
                   mountinfo="30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                   files={"sys/fs/cgroup/memory.max": f"{2 * GiB}\n", "sys/fs/cgroup/memory.current": "0\n"})
    assert _cgroups(memory_limits(str(root))) == [("cgroup v2", "/", 2 * GiB, 2 * GiB)]


def test_cgroupfs_layout_v1_hierarchy_up_to_a_parent_that_does_not_count_its_children(tmp_path: Path):
    """v1 over a laid-out directory: limits on the group and its parent count; the grandparent's
    does not (its use_hierarchy is 0); unlimited levels (PAGE_COUNTER_MAX) are no limit."""
    base = "sys/fs/cgroup/memory"
    unlimited = "9223372036854771712\n"
    files = {f"{base}/memory.limit_in_bytes": unlimited, f"{base}/memory.usage_in_bytes": "0\n",
             f"{base}/a/memory.limit_in_bytes": f"{GiB}\n", f"{base}/a/memory.usage_in_bytes": "0\n",
             f"{base}/a/memory.use_hierarchy": "0\n",
             f"{base}/a/b/memory.limit_in_bytes": f"{8 * GiB}\n", f"{base}/a/b/memory.usage_in_bytes": f"{2 * GiB}\n",
             f"{base}/a/b/memory.use_hierarchy": "1\n",
             f"{base}/a/b/c/memory.limit_in_bytes": f"{6 * GiB}\n", f"{base}/a/b/c/memory.usage_in_bytes": f"{GiB}\n",
             f"{base}/a/b/c/memory.use_hierarchy": "1\n",
             f"{base}/a/b/c/memory.stat": f"cache 0\nhierarchical_memory_limit {6 * GiB}\n"}
    root = _layout(tmp_path, cgroup="12:pids:/a\n4:memory:/a/b/c\n0::/\n",
                   mountinfo=("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                              "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"),
                   files=files)
    assert _cgroups(memory_limits(str(root))) == [("cgroup v1", "/a/b/c", 6 * GiB, 5 * GiB),
                                                  ("cgroup v1", "/a/b", 8 * GiB, 6 * GiB)]


def test_cgroupfs_layout_v1_container_mounted_at_its_own_group(tmp_path: Path):
    """v1 over a laid-out directory: a container without a cgroup namespace, whose mount shows its
    group (/docker/abc) as the top; a limit above it shows only as hierarchical_memory_limit."""
    base = "sys/fs/cgroup/memory"
    root = _layout(tmp_path, cgroup="4:memory:/docker/abc\n",
                   mountinfo="35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
                   files={f"{base}/memory.limit_in_bytes": "9223372036854771712\n",
                          f"{base}/memory.usage_in_bytes": f"{GiB}\n",
                          f"{base}/memory.stat": f"hierarchical_memory_limit {3 * GiB}\n"})
    limits = memory_limits(str(root))
    assert _cgroups(limits) == [("cgroup v1", "above /docker/abc", 3 * GiB, 2 * GiB)]
    assert limits[1].describe() == ("cgroup v1 memory limit 3.00 GiB set above /docker/abc, "
                                    "at most 2.0 GiB free under it")


def test_the_lowest_headroom_decides_and_half_of_it_may_be_filled():
    machine = MemoryLimit("machine", "", 24 * GiB, 20 * GiB)
    job = MemoryLimit("cgroup v1", "/job", 6 * GiB, 5 * GiB)
    decision = policy.early_reads_memory(3 * GiB, [machine, job])
    assert decision == policy.EarlyReadsMemory(fits=False, limit=job, allowed=int(2.5 * GiB))
    assert policy.early_reads_memory(2 * GiB, [machine, job]).fits
    assert policy.early_reads_memory(2 * GiB, [machine]).limit is machine


#: Run by a bare interpreter (``-I -S``), as the early-reads process imports the module: through
#: the package's empty root, with only the package's parent directory on the path.
_PRINT_LIMITS = f"""
import json, sys
sys.path.insert(0, {str(Path(vllm_fastload.__file__).parent.parent)!r})
from vllm_fastload import machine
print(json.dumps([[m.kind, m.where, m.limit, m.free, m.describe()] for m in machine.memory_limits()]))
"""


def _limits_in(group: Path, *, code: str = _PRINT_LIMITS, wrap: list[str] | None = None) -> list[list]:
    out = cgroups.run_in_group(group, [*(wrap or []), sys.executable, "-I", "-S", "-c", code], capture_output=True,
                               text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _shown(group: Path) -> str:
    return "/" + str(group.relative_to(cgroups.V1_MEMORY))


@pytest.mark.skipif(cgroups.v1_reason() is not None, reason=str(cgroups.v1_reason()))
def test_a_real_v1_group_limit_is_seen_from_inside_it():
    with cgroups.v1_group(3 * GiB) as group:
        limits = _limits_in(group)
    v1 = [m for m in limits if m[0] == "cgroup v1"]
    assert v1[0][1:3] == [_shown(group), 3 * GiB], limits
    assert 0 < v1[0][3] <= 3 * GiB
    assert v1[0][4].startswith(f"cgroup v1 memory limit 3.00 GiB at {_shown(group)}, ")


@pytest.mark.skipif(cgroups.v1_reason() is not None, reason=str(cgroups.v1_reason()))
def test_a_real_v1_limit_set_on_a_parent_group_is_seen_from_a_child_group():
    with cgroups.v1_group(2 * GiB) as parent, cgroups.v1_group(None, parent=parent) as child:
        limits = _limits_in(child)
    assert [m[1:3] for m in limits if m[0] == "cgroup v1"] == [[_shown(parent), 2 * GiB]], limits


@pytest.mark.skipif(cgroups.v1_reason() is not None or shutil.which("unshare") is None,
                    reason=str(cgroups.v1_reason() or "util-linux's unshare is not installed"))
def test_a_real_v1_limit_seen_from_a_cgroup_namespace_as_a_container_sees_it():
    """In its own cgroup and mount namespace, with the memory hierarchy mounted there, a process
    sees its group as the root ("4:memory:/") and its parent's limit not at all, but in
    ``hierarchical_memory_limit``."""
    mount = f"umount {cgroups.V1_MEMORY} && mount -t cgroup -o rw,memory cgroup {cgroups.V1_MEMORY} && exec \"$@\""
    wrap = ["unshare", "--cgroup", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
    with cgroups.v1_group(2 * GiB) as parent, cgroups.v1_group(None, parent=parent) as child:
        limits = _limits_in(child, wrap=wrap)
    v1 = [m for m in limits if m[0] == "cgroup v1"]
    assert [m[1:3] for m in v1] == [["above /", 2 * GiB]], limits


@pytest.mark.skipif(cgroups.v2_reason() is not None, reason=str(cgroups.v2_reason()))
def test_a_real_v2_group_limit_is_seen_from_inside_it():
    mount = cgroups.v2_mount()
    assert mount is not None
    control = mount / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")
    group = mount / f"fastload-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.max").write_text(str(3 * GiB))
        limits = _limits_in(group)
    finally:
        cgroups.remove_v2(group)
    assert next(m[1:3] for m in limits if m[0] == "cgroup v2") == [f"/{group.name}", 3 * GiB], limits


_EARLY = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from vllm_fastload.model import EarlyStart, start_early_reads
for path in sys.argv[1:]:
    start_early_reads("the engine", lambda: EarlyStart(path, {}, local_ranks=1))
"""


@pytest.mark.skipif(cgroups.v1_reason() is not None, reason=str(cgroups.v1_reason()))
def test_early_reads_in_a_real_v1_group_go_by_its_limit(tmp_path: Path):
    """The decision the engines' adapters make as they start (``early.decide.start``), in a
    process of a group limited to 1 GiB: a 1.67 GB checkpoint exceeds half of what is free under
    it, and the log line names the limit; a 0.06 GB one fits, and its line names the limit too."""
    big = write_random_checkpoint(tmp_path / "big", PRESETS["bench-llama"], files=2, sparse=True)
    small = write_random_checkpoint(tmp_path / "small", PRESETS["demo"], files=1, sparse=True)
    with cgroups.v1_group(GiB) as group:
        run = cgroups.run_in_group(group, [sys.executable, "-c", _EARLY, str(big), str(small)], capture_output=True,
                                   text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    limit = f"cgroup v1 memory limit 1.00 GiB at {_shown(group)}, "
    assert "fastload: no early reads: the checkpoint (1.67 GB) exceeds the " in run.stdout, run.stdout
    assert f"(50% of the free memory under the lowest limit: {limit}" in run.stdout, run.stdout
    assert "fastload: early reads: 1 checkpoint files (0.06 GB) into the page cache while the engine starts " \
           f"(the lowest memory limit: {limit}" in run.stdout, run.stdout


def test_memory_limits_of_this_process_include_the_machine():
    limits = memory_limits()
    assert limits[0].kind == "machine" and 0 < limits[0].free <= limits[0].limit
    assert all(m.free <= m.limit for m in limits)
