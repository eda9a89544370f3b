"""Clearing the shared-memory files killed vLLM-CPU workers leave behind (``tools.processes``)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

from vllm_fastload.tools.processes import remove_cpu_shm

LOG = ("(Worker_TP0 pid=1) INFO [parallel_state.py:1] world_size=2 rank=0 local_rank=0 "
       "distributed_init_method=tcp://127.0.0.1:41234 backend=gloo\n")


def _segments(directory, ident: str) -> list:
    files = [directory / f"{ident}-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]
    for f in files:
        f.write_bytes(b"\0" * 4096)
    return files


def test_removes_the_files_of_the_logged_start_only(tmp_path):
    ours, other = _segments(tmp_path, "41234"), _segments(tmp_path, "41236")
    unrelated = tmp_path / "psm_41234"
    unrelated.write_bytes(b"x")
    assert sorted(remove_cpu_shm(LOG, shm_dir=tmp_path)) == sorted(ours)
    assert not any(f.exists() for f in ours)
    assert all(f.exists() for f in other) and unrelated.exists()


def test_removes_a_logged_start_s_files_even_while_a_worker_on_its_way_out_maps_them(tmp_path):
    mapped, opened = _segments(tmp_path, "41234")
    # One process keeps one file mapped (its descriptor closed, as vLLM-CPU's manager does) and
    # the other open; the sweep without a log leaves both, the ended start's removal does not.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(mapped)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
        f"g = open({str(opened)!r}, 'rb')\n"
        "print('ready', flush=True); m[0]; time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert remove_cpu_shm(min_age_s=0, shm_dir=tmp_path) == []
        assert mapped.exists() and opened.exists()
        assert sorted(remove_cpu_shm(LOG, shm_dir=tmp_path)) == sorted([mapped, opened])
        assert holder.poll() is None  # its mapping outlives the name
    finally:
        holder.kill()
        holder.wait()


def test_without_a_log_removes_unused_files_older_than_the_age_given(tmp_path):
    old, young = _segments(tmp_path, "41234"), _segments(tmp_path, "41236")
    hour_ago = time.time() - 3600
    for f in old:
        os.utime(f, (hour_ago, hour_ago))
    assert sorted(remove_cpu_shm(min_age_s=60, shm_dir=tmp_path)) == sorted(old)
    assert all(f.exists() for f in young)
    with open(young[0], "r+b") as f, mmap.mmap(f.fileno(), 0):  # this process's own mapping counts too
        assert remove_cpu_shm(min_age_s=0, shm_dir=tmp_path) == [young[1]]
