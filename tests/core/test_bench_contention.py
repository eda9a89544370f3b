"""The machine states ``vllm-fastload bench --machine`` measures starts in (``bench.contention``),
made for real: spinning processes beside a command, and a cgroup with a CPU quota around it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_fastload import machine
from vllm_fastload.bench.contention import PERIOD_US, MachineLoad

from ..cgroups import v1_reason


def test_states_are_parsed_and_named():
    assert MachineLoad.parse("quiet") == MachineLoad()
    assert MachineLoad.parse("busy").kind == "busy"
    assert MachineLoad.parse("quota") == MachineLoad("quota", 1.5)
    assert MachineLoad.parse("quota=0.5").name == "quota=0.5"
    for bad in ("loud", "quota=0", "quota=x", "busy=2"):
        with pytest.raises(ValueError, match="expected quiet, busy, quota or quota=N"):
            MachineLoad.parse(bad)


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have run."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def test_busy_keeps_every_cpu_busy_while_the_start_runs_and_stops_after():
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    with MachineLoad.parse("busy").around() as state:
        assert state.cpu is None and state.throttled_s() is None
        spinners = [int(p) for p in os.listdir("/proc") if p.isdigit() and p not in before
                    and "while True: pass" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert len(spinners) == machine.usable_cpus()
        start = [_cpu_seconds([pid]) for pid in spinners]
        time.sleep(1.0)
        ran = [_cpu_seconds([pid]) - s for pid, s in zip(spinners, start)]
        assert all(r >= 0.1 for r in ran), ran  # each spins (beside whatever else the machine runs)
    for pid in spinners:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _quota_reason() -> str | None:
    """Why no group with a CPU quota can be made here (None: it can)."""
    from vllm_fastload.bench.contention import _Group

    return None if _Group.possible("cpu") else f"no cpu cgroup can be made here (needs root and the controller; " \
        f"{v1_reason('cpu')})"


@pytest.mark.skipif(_quota_reason() is not None, reason=str(_quota_reason()))
def test_quota_holds_the_command_and_all_it_starts_to_the_quota():
    """A command behind the state's prefix (two spinning processes, as an engine's would) gets
    0.5 CPUs in all, the group counts how long it was held back, and the group goes afterwards."""
    spin = [sys.executable, "-c", "import multiprocessing as m, time\n"
            "def spin():\n    while True: pass\n"
            "if __name__ == '__main__':\n"
            "    ps = [m.Process(target=spin, daemon=True) for _ in range(2)]\n"
            "    [p.start() for p in ps]; time.sleep(2.0)"]
    with MachineLoad.parse("quota=0.5").around() as state:
        assert state.cpu is not None and state.cpu.path.is_dir()
        group = state.cpu.path
        quota = group / ("cpu.cfs_quota_us" if (group / "cpu.cfs_quota_us").exists() else "cpu.max")
        assert quota.read_text().split()[0] == str(PERIOD_US // 2)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        subprocess.run([*state.prefix, *spin], check=True, timeout=60)
        took = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        throttled = state.throttled_s()
    assert not group.exists()
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # the command and its children
    assert used <= 0.5 * took + 0.3, (used, took)  # two spinning CPUs' worth of demand, half a CPU given
    assert throttled is not None and throttled > 0, throttled  # held back by the quota, and counted


def _memory_reason() -> str | None:
    """Why no memory group can be made here (None: it can)."""
    from vllm_fastload.bench.contention import _Group

    return None if _Group.possible("memory") else "no memory cgroup can be made here (needs root and the controller)"


@pytest.mark.skipif(_memory_reason() is not None, reason=str(_memory_reason()))
def test_every_start_runs_in_a_memory_group_whose_peak_counts_what_it_held(tmp_path: Path):
    """Quiet too: the command's memory and the page cache it read in (a file out of the cache
    before) count in the group's peak, and the group goes afterwards."""
    from vllm_fastload.bench.cache import evict

    data = tmp_path / "data"
    data.write_bytes(os.urandom(1 << 20) * 64)
    os.sync()
    evict([str(data)])
    hold = f"b = b'x' * (200 << 20); open({str(data)!r}, 'rb').read()"
    with MachineLoad().around() as state:
        assert state.memory is not None and state.cpu is None
        group = state.memory.path
        subprocess.run([*state.prefix, sys.executable, "-c", hold], check=True, timeout=60)
        peak = state.memory_peak()
    assert not group.exists()
    assert peak is not None and peak >= (200 + 64 + 32) << 20, peak / 2**20  # the bytes, the file and its copy (part)
