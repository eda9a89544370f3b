"""Clearing the shared-memory files killed vLLM-CPU workers leave behind (``tools.processes``, and
the tests' own guard in ``tests/cpu_shm.py``)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

from tests.cpu_shm import remove_stale_cpu_shm
from vllm_fastload.tools.processes import cpu_shm_idents, remove_cpu_shm

#: The line each rank logs as it joins its group (vLLM's ``init_distributed_environment``).
LOG = ("(Worker_TP0 pid=1) INFO 11-26 11:44:04 [parallel_state.py:1823] world_size=2 rank=0 local_rank=0 "
       "distributed_init_method=tcp://127.0.0.1:41234 backend=gloo\n")
IDENTS = cpu_shm_idents(LOG)


def _segments(directory, ident: str) -> list:
    files = [directory / f"{ident}-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]
    for f in files:
        f.write_bytes(b"\0" * 4096)
    return files


def test_idents_are_formed_as_vllm_cpu_forms_them():
    def idents(method: str) -> set[str]:
        return cpu_shm_idents(f"rank=0 distributed_init_method={method} backend=gloo")

    assert idents("tcp://127.0.0.1:41234") == {"41234"}
    assert idents("tcp://[::1]:41234") == {"41234"}
    assert idents("tcp://[2001:db8::1234]:41234") == {"41234"}
    assert idents("file:///tmp/tmp-abc_1") == {"tmp-abc_1"}
    assert idents("env://") == set() and cpu_shm_idents("no init method here") == set()


def test_removes_the_files_of_the_logged_start_only(tmp_path):
    ours, other = _segments(tmp_path, "41234"), _segments(tmp_path, "412340")
    assert sorted(remove_cpu_shm(IDENTS, ended=time.time(), shm_dir=tmp_path)) == sorted(ours)
    assert not any(f.exists() for f in ours)
    assert all(f.exists() for f in other)


def test_keeps_the_files_of_a_later_start_that_drew_the_same_port(tmp_path):
    ended = time.time()
    time.sleep(0.05)
    later = _segments(tmp_path, "41234")
    assert remove_cpu_shm(IDENTS, ended=ended, shm_dir=tmp_path) == []
    assert all(f.exists() for f in later)


def test_an_ended_start_s_files_go_even_while_a_worker_on_its_way_out_maps_them(tmp_path):
    mapped, opened = _segments(tmp_path, "41234")
    # One process keeps one file mapped (its descriptor closed, as vLLM-CPU's manager does) and
    # the other open: the sweep of earlier starts' files leaves both, an ended start's removal not.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(mapped)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
        f"g = open({str(opened)!r}, 'rb')\n"
        "print('ready', flush=True); sys.stdin.readline(); m[0] = 7; print(m[0], flush=True)\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert remove_stale_cpu_shm(min_age_s=0, shm_dir=tmp_path) == []
        assert mapped.exists() and opened.exists()
        assert sorted(remove_cpu_shm(IDENTS, ended=time.time(), shm_dir=tmp_path)) == sorted([mapped, opened])
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "7"  # its mapping outlives the name
    finally:
        holder.kill()
        holder.wait()


def test_the_sweep_removes_unused_files_older_than_the_age_given(tmp_path):
    old, young = _segments(tmp_path, "41234"), _segments(tmp_path, "41236")
    hour_ago = time.time() - 3600
    for f in old:
        os.utime(f, (hour_ago, hour_ago))
    assert sorted(remove_stale_cpu_shm(min_age_s=60, shm_dir=tmp_path)) == sorted(old)
    assert all(f.exists() for f in young)
    with open(young[0], "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    try:  # mapped by this process, its descriptor closed
        assert remove_stale_cpu_shm(min_age_s=0, shm_dir=tmp_path) == [young[1]]
    finally:
        mapping.close()
