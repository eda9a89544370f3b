"""Early reads (``vllm_fastload.early``): a file evicted from the page cache is in it afterwards,
by either way in (mapping populated, or read through a buffer on kernels without
``MADV_POPULATE_READ``), it stays mapped in the reading process (its own, at idle priority) until
every expected load (each in its own process) has left its mark, the hold runs out or the process
that started it ends, and nothing is read when the files do not fit the memory limit."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_fastload import policy
from vllm_fastload.bench.cache import evict
from vllm_fastload.bench.contention import MachineLoad
from vllm_fastload.early import child, process
from vllm_fastload.early import marks as early_marks
from vllm_fastload.plan import ByteRange
from vllm_fastload.readers.pagecache import is_cached

from .test_bench_contention import _quota_reason

SIZE = (3 * policy.EARLY_READS_CHUNK) // 2 + 12345  # two chunks, the last one partial and not page-aligned


def _cached_share(path: Path, samples: int = 64) -> float:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(is_cached(fd, [size * i // samples]) for i in range(samples)) / samples
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path: Path) -> Path:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(os.urandom(1 << 20) * (SIZE >> 20) + os.urandom(SIZE % (1 << 20)))
    os.sync()
    evict([str(path)])
    if _cached_share(path) > 0.5:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED (tmpfs?)")
    return path


def test_early_reads_bring_the_file_into_the_page_cache(cold_file: Path):
    reads = process.start_reading([str(cold_file)], limit=SIZE)
    assert reads is not None and reads.daemon
    reads.join(timeout=60)
    assert not reads.is_alive() and reads.process.returncode == 0
    assert _cached_share(cold_file) == 1.0


def test_a_kernel_that_cannot_populate_mappings_reads_through_a_buffer(cold_file: Path, monkeypatch):
    monkeypatch.setattr(child._Mapping, "populate", lambda self, offset, length: False)
    assert child._read_in([str(cold_file)], hold=True) == ([], SIZE, 1, False)
    assert _cached_share(cold_file) == 1.0


def test_files_larger_than_the_limit_are_left_alone(cold_file: Path, caplog):
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        assert process.start_reading([str(cold_file)], limit=SIZE - 1) is None
    assert "no early reads" in caplog.text and "read at load time" in caplog.text
    assert _cached_share(cold_file) < 0.5


def test_a_file_that_cannot_be_read_is_skipped(cold_file: Path, tmp_path: Path):
    """No exception (the loader reports a missing file at load time), and the next file is read."""
    held, read, files, stopped = child._read_in([str(tmp_path / "gone.safetensors"), str(cold_file)])
    assert (held, read, files, stopped) == ([], SIZE, 1, False)
    assert _cached_share(cold_file) == 1.0


def _drop(path: Path, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_chunk_with_reclaimed_pages_is_told_from_a_cached_one(cold_file: Path):
    from vllm_fastload.readers import host

    child._read_in([str(cold_file)])
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        calls = [ByteRange(0, SIZE)]
        assert host.cached_calls(fd, calls) and not host.has_holes(fd, calls)
        _drop(cold_file, SIZE // 4, SIZE // 8)  # a hole in the middle, ends still cached
        assert host.cached_calls(fd, calls) and host.has_holes(fd, calls)
    finally:
        os.close(fd)


def test_a_tensor_with_reclaimed_pages_is_read_exactly(tmp_path: Path, monkeypatch):
    """A checkpoint read into the page cache early, then partly reclaimed: every byte still right,
    read through the path for chunks with holes."""
    import torch
    from safetensors.torch import load_file, save_file

    import vllm_fastload
    from vllm_fastload.readers import host

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(1536, 1024), "b": torch.randn(1024)}, str(path))
    os.sync()
    evict([str(path)])
    child._read_in([str(path)])
    size = path.stat().st_size
    _drop(path, size // 8, size // 16)
    holes = []
    original = host.has_holes
    monkeypatch.setattr(host, "has_holes", lambda fd, calls: holes.append(original(fd, calls)) or holes[-1])
    want = load_file(str(path))
    _drop(path, size // 8, size // 16)  # safetensors' read filled it again
    dests = {name: torch.empty_like(t) for name, t in want.items()}
    with vllm_fastload.open(str(path), config={"progress": False}) as ckpt:
        ckpt.read_into(dests)
    assert any(holes)
    for name, t in want.items():
        assert torch.equal(dests[name], t), name


def _mapped(path: Path, pid: int | str = "self") -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip().endswith(str(path)) for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return False


def _mark_from_another_process(directory: str) -> None:
    code = f"from vllm_fastload.early.marks import mark_load; mark_load({directory!r}, ended=True)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _wait(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_files_stay_mapped_until_every_load_has_left_its_mark(cold_file: Path, caplog):
    """Mapped page cache is what a host's proactive reclaim (DAMON ``pageout`` of unmapped page
    cache) leaves alone: the reading process holds the mapping while the loads are still to come."""
    marks = early_marks.LoadMarks(2)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        reads = process.start_reading([str(cold_file)], limit=SIZE, hold=marks, hold_s=120)
        assert reads is not None
        assert _wait(lambda: "files in the page cache" in caplog.text)
        assert _cached_share(cold_file) == 1.0
        _mark_from_another_process(marks.directory)
        time.sleep(4 * policy.EARLY_READS_POLL_S)
        assert reads.is_alive() and _mapped(cold_file, reads.pid), "released after one of two loads"
        _mark_from_another_process(marks.directory)
        reads.join(timeout=30)
    assert not reads.is_alive() and reads.process.returncode == 0  # ended: nothing of it is mapped
    assert not os.path.exists(marks.directory)
    assert "2 of 2 loads done (every load it was read for has ended)" in caplog.text


@pytest.mark.parametrize("cause", ["deadline", "memory"])
def test_the_hold_ends_without_marks_at_its_deadline_or_when_memory_runs_low(cold_file: Path, caplog, monkeypatch,
                                                                            cause: str):
    if cause == "memory":
        monkeypatch.setattr(policy, "EARLY_READS_LOW_MEMORY", 1.0)  # whatever is available counts as low
    marks = early_marks.LoadMarks(1)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        reads = process.start_reading([str(cold_file)], limit=SIZE, hold=marks,
                                     hold_s=0.5 if cause == "deadline" else 120)
        assert reads is not None
        reads.join(timeout=60)
    assert not reads.is_alive() and reads.process.returncode == 0
    assert not os.path.exists(marks.directory)
    why = "not every load it was read for ended within 0 s" if cause == "deadline" else "memory ran low"
    assert f"0 of 1 loads done ({why})" in caplog.text
    early_marks.mark_load(marks.directory, ended=True)  # a load ending after the release: no error


def test_the_reads_run_in_a_process_of_their_own_on_idle_cpu_time(cold_file: Path, caplog):
    """No thread of the process that starts vLLM runs at idle priority (one starved while holding
    that process's GIL would stop every other thread with it, and the start with them), and none of
    it maps the files (vLLM forks its engine core on GPUs: a child would inherit the mappings)."""
    marks = early_marks.LoadMarks(1)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        reads = process.start_reading([str(cold_file)], limit=SIZE, hold=marks, hold_s=120)
        assert reads is not None
        assert _wait(lambda: "files in the page cache" in caplog.text)
        assert reads.pid != os.getpid() and _mapped(cold_file, reads.pid) and not _mapped(cold_file)
        assert _policy(reads.pid) == os.SCHED_IDLE or _cached_share(cold_file) == 1.0  # idle while it reads
        assert all(_policy(int(tid)) != os.SCHED_IDLE for tid in os.listdir("/proc/self/task"))
        early_marks.mark_load(marks.directory, ended=True)
        reads.join(timeout=30)
    assert not reads.is_alive() and reads.process.returncode == 0


#: Busy processes that leave no idle CPU time: twice as many as CPUs (``_CPUS``), so that none is
#: idle for a moment while the kernel moves one between CPUs.
_CPUS = len(os.sched_getaffinity(0))
_BUSY = 2 * _CPUS


def test_reads_with_no_idle_cpu_time_read_on_as_a_batch_job(cold_file: Path, caplog):
    """Where the start-up keeps every CPU busy (SGLang's; here this process's own busy children),
    reads at idle priority would get no CPU time until the load; with ``starved_s`` they leave idle
    priority once they have waited that long for a CPU, and finish. (Without it they stay at idle
    priority: the test above.)"""
    # Where the kernel shares CPU time between process sessions (``setsid``) before the processes in
    # them (autogroups), the busy processes outrun whatever else runs beside the test only from
    # sessions of their own, and the reads wait for a CPU only behind busy processes of their own
    # session: so three per CPU run in new sessions, and one per CPU in the reading process's.
    busy = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True, start_new_session=n >= _CPUS)
            for n in range(4 * _CPUS)]
    try:
        for hog in busy:  # every CPU busy before the reads start, or they may finish first
            assert hog.stdout is not None and hog.stdout.readline() == "spinning\n"
        with caplog.at_level(logging.INFO, logger="vllm_fastload"):
            reads = process.start_reading([str(cold_file)], limit=SIZE, starved_s=0.5)
            assert reads is not None
            reads.join(timeout=300)  # (starved in a busy session, a chunk at idle priority takes seconds)
    finally:
        for hog in busy:
            hog.kill()
            hog.wait()
    assert not reads.is_alive() and reads.process.returncode == 0
    assert "no idle CPU time for them" in caplog.text
    assert "reading on as a batch job: the start's own processes keep the CPUs busy" in caplog.text
    assert "1 of 1 files in the page cache" in caplog.text
    assert _cached_share(cold_file) == 1.0


#: A process that keeps a CPU busy, started so that it is not this one's descendant (its parent
#: ends at once): another job on the node. It prints its id; its output pipe closes as it ends.
OTHER_JOB = ("import subprocess, sys\n"
             "p = subprocess.Popen([sys.executable, '-c', \"print('spinning', flush=True)\\nwhile True: pass\"])\n"
             "print(p.pid, flush=True)")


def test_reads_starved_by_other_work_stay_at_idle_priority(cold_file: Path, caplog):
    """Where other work keeps every CPU busy (a job beside the start, none of its processes), a
    share for the reads would come out of the start's too: starved, they stay at idle priority,
    say why, and read on only as that work leaves time (here once it has ended)."""
    jobs = [subprocess.Popen([sys.executable, "-c", OTHER_JOB], stdout=subprocess.PIPE, text=True)
            for _ in range(_BUSY)]
    pids = []
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        try:
            for job in jobs:
                assert job.stdout is not None
                pids.append(int(job.stdout.readline()))
                assert job.stdout.readline() == "spinning\n"  # every CPU busy before the reads start
            reads = process.start_reading([str(cold_file)], limit=SIZE, starved_s=0.5)
            assert reads is not None
            assert _wait(lambda: "no idle CPU time for them" in caplog.text, timeout=120), caplog.text
        finally:
            for pid in pids:
                os.kill(pid, 9)
            for job in jobs:
                job.wait()
        reads.join(timeout=60)
    assert not reads.is_alive() and reads.process.returncode == 0
    assert "reading on at idle priority only: other work keeps the CPUs busy" in caplog.text
    assert "batch job" not in caplog.text
    other = re.search(r"the start's processes ran ([\d.]+) CPU s, other work ([\d.]+)\)", caplog.text)
    assert other and float(other.group(2)) > float(other.group(1)), caplog.text
    assert "1 of 1 files in the page cache" in caplog.text
    assert _cached_share(cold_file) == 1.0


#: Run inside a group with a CPU quota: spinning processes of the group (at normal priority, as an
#: engine's start-up) for ``argv[2]`` seconds, and, once the quota has held the group back, early
#: reads of ``argv[1]`` paced as a start's are.
PACED = r"""
import logging, subprocess, sys, time
from vllm_fastload import machine, policy
from vllm_fastload.early import process
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
quota = machine.cpu_quota()
spin = [subprocess.Popen([sys.executable, "-c", f"import time\nend = time.time() + {sys.argv[2]}\n"
                          "while time.time() < end: pass"]) for _ in range(3)]
held = machine.throttled_s(quota.directory)
deadline = time.monotonic() + 10
while machine.throttled_s(quota.directory) <= held and time.monotonic() < deadline:
    time.sleep(0.05)
reads = process.start_reading([sys.argv[1]], limit=1 << 40, starved_s=0.1, pacing=policy.early_reads_pacing(quota))
reads.join(timeout=120)
[p.wait() for p in spin]
print("returncode", reads.process.returncode, flush=True)
"""


@pytest.mark.skipif(_quota_reason() is not None, reason=str(_quota_reason()))
def test_reads_under_a_cpu_quota_pause_while_it_holds_the_start_back(tmp_path: Path):
    """In a group whose quota (0.2 CPUs) three spinning processes spend by themselves, reads that
    have left idle priority (as under SGLang, ``starved_s``) would take their share of it; paced,
    they wait until the quota stops holding the group back (the spinners end after 5 s), then read
    the file whole. The reads begin once the quota has held the group back, and the file is many
    chunks: the reads look between two, and under that quota each chunk takes CFS periods."""
    cold_file = tmp_path / "large.safetensors"
    cold_file.write_bytes(os.urandom(1 << 20) * 192)
    os.sync()
    evict([str(cold_file)])
    with MachineLoad("quota", 0.2).around() as state:
        run = subprocess.run([*state.prefix, sys.executable, "-c", PACED, str(cold_file), "5"], capture_output=True,
                             text=True, timeout=180)
    assert "returncode 0" in run.stdout, run.stdout + run.stderr
    paused = re.search(r"early reads: paused ([\d.]+) s in all while the cgroup v\d CPU quota of 0.20 CPUs at (\S+) "
                       r"held the start back", run.stdout)
    assert paused, run.stdout
    assert float(paused.group(1)) >= policy.EARLY_READS_QUOTA_PAUSE_S, run.stdout
    assert "1 of 1 files in the page cache" in run.stdout, run.stdout
    assert _cached_share(cold_file) == 1.0


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except ProcessLookupError:  # a thread that has just ended
        return None


def test_a_reading_process_that_dies_is_reported_and_its_marks_removed(cold_file: Path, caplog):
    marks = early_marks.LoadMarks(1)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        reads = process.start_reading([str(cold_file)], limit=SIZE, hold=marks, hold_s=120)
        assert reads is not None
        assert _wait(lambda: "files in the page cache" in caplog.text)
        reads.process.kill()
        reads.join(timeout=30)
    assert not reads.is_alive()
    assert "the reading process ended with status -9" in caplog.text
    assert not os.path.exists(marks.directory)


_ORPHAN = """
import sys
from vllm_fastload.early import marks as early_marks, process
marks = early_marks.LoadMarks(1)
reads = process.start_reading([sys.argv[1]], limit=1 << 40, hold=marks, hold_s=600)
print(reads.pid, marks.directory, flush=True)
sys.stdin.readline()  # ended by the test, marks never left
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_reading_process_ends_with_the_process_that_started_it(cold_file: Path, tmp_path: Path):
    """A start killed (no exit handlers run) before any rank loaded: nothing is left running or
    mapped, also while the files are held (the kernel ends the reading process with its starter),
    and the next start removes the marks directory the killed one could not."""
    script = tmp_path / "starter.py"
    script.write_text(_ORPHAN)
    starter = subprocess.Popen([sys.executable, str(script), str(cold_file)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        pid, directory = starter.stdout.readline().split()
        assert _wait(lambda: _cached_share(cold_file) == 1.0)
        time.sleep(2 * policy.EARLY_READS_POLL_S)  # holding now
        assert _mapped(cold_file, pid)
    finally:
        starter.kill()
        starter.wait(timeout=30)
    assert _wait(lambda: not _running(int(pid)), timeout=10), "the reading process outlived its starter"
    assert directory in early_marks.LoadMarks.remove_stale()
    assert not os.path.exists(directory)


def test_the_reading_process_ends_when_the_starting_process_exits(cold_file: Path, tmp_path: Path):
    """An exit (vLLM stopped before every rank loaded) ends the hold at once, marks removed."""
    script = tmp_path / "starter.py"
    script.write_text(_ORPHAN.replace("sys.stdin.readline()", "sys.exit()"))
    out = subprocess.run([sys.executable, str(script), str(cold_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, directory = out.stdout.split()
    assert _wait(lambda: not _running(int(pid)), timeout=10), "the reading process outlived its starter"
    assert not os.path.exists(directory)


def test_nothing_is_held_when_the_files_do_not_fit(cold_file: Path):
    marks = early_marks.LoadMarks(1)
    threads = set(threading.enumerate())
    assert process.start_reading([str(cold_file)], limit=SIZE - 1, hold=marks, hold_s=60) is None
    assert set(threading.enumerate()) <= threads
    marks.remove()


def test_reads_stop_when_a_load_begins(tmp_path: Path, caplog):
    """A load that begins before the early reads are done reads the rest itself: the early reads
    stop at the next chunk and hold what they read."""
    files = []
    for i in range(3):
        path = tmp_path / f"shard{i}.safetensors"
        path.write_bytes(os.urandom(policy.EARLY_READS_CHUNK + 4096))
        files.append(str(path))
    os.sync()
    evict(files)
    if any(_cached_share(Path(f)) > 0.5 for f in files):
        pytest.skip("this filesystem keeps the files cached after POSIX_FADV_DONTNEED (tmpfs?)")
    marks = early_marks.LoadMarks(1)
    asked = []

    def stop() -> bool:  # the load begins once the first chunk of the first file is read
        asked.append(True)
        if len(asked) == 2:
            early_marks.mark_load(marks.directory, ended=False)
        return marks.started()

    held, read, done, stopped = child._read_in(files, hold=True, stop=stop)
    try:
        assert stopped and read == policy.EARLY_READS_CHUNK and done == 0
        assert len(held) == 1
        assert _cached_share(Path(files[0])) >= 0.9
        assert all(_cached_share(Path(f)) < 0.5 for f in files[1:])
    finally:
        for view in held:
            view.close()
        marks.remove()


@pytest.mark.parametrize("spans,ranges", [
    (None, [(0, (40 << 20) + 777)]),
    ([(5000, (3 << 20) + 100), (8 << 20, 40 << 20)], [(4096, (3 << 20) + 4096), (8 << 20, 40 << 20)]),
])
def test_chunks_are_as_large_as_asked_at_each_step_and_cover_the_ranges_exactly(spans, ranges):
    """While the reads may yet leave idle priority they look between small chunks, then between
    large ones: the chunk is asked for at each step, and the pieces cover each range (widened to
    whole pages) exactly once, in order."""
    given: list[int] = []

    def chunk() -> int:
        given.append(policy.early_reads_chunk(looking=len(given) < 5))
        return given[-1]

    pieces = list(child._pieces((40 << 20) + 777, spans, chunk))
    assert given[:5] == [policy.EARLY_READS_STARVED_CHUNK] * 5 and set(given[5:]) == {policy.EARLY_READS_CHUNK}
    assert all(length <= size for (_, length), size in zip(pieces, given))
    merged: list[tuple[int, int]] = []
    for offset, length in pieces:
        if merged and merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], offset + length)
        else:
            assert not merged or merged[-1][1] < offset  # in order, never twice
            merged.append((offset, offset + length))
    assert merged == ranges


def test_the_chunk_is_small_only_while_the_reads_may_leave_idle_priority():
    assert policy.early_reads_chunk(looking=True) == policy.EARLY_READS_STARVED_CHUNK < policy.EARLY_READS_CHUNK
    assert policy.early_reads_chunk(looking=False) == policy.EARLY_READS_CHUNK


def test_the_checkpoint_share_in_the_page_cache_is_what_the_rank_line_reports(tmp_path: Path):
    """``FastCheckpoint.cached_share()`` (no names): the share of all the files' bytes in the page
    cache, which the vLLM rank logs as its load begins: low after an eviction, half once one of
    two equal files is read early, all once both are."""
    import torch
    from safetensors.torch import save_file

    import vllm_fastload

    paths = [tmp_path / f"model-{i}.safetensors" for i in range(2)]
    for i, path in enumerate(paths):
        save_file({f"w{i}": torch.randn(1024, 1024)}, str(path))
    os.sync()
    evict([str(p) for p in paths])
    if any(_cached_share(p) > 0.5 for p in paths):
        pytest.skip("this filesystem keeps the files cached after POSIX_FADV_DONTNEED (tmpfs?)")
    with vllm_fastload.open(str(tmp_path), config={"progress": False}) as ckpt:
        if ckpt.cached_share() is None:
            pytest.skip("mincore cannot be asked truthfully here")
        assert ckpt.cached_share() < 0.1
        child._read_in([str(paths[0])])
        assert ckpt.cached_share() == pytest.approx(0.5, abs=0.05)
        child._read_in([str(paths[1])])
        assert ckpt.cached_share() == 1.0
