"""The faults operators meet, in real vLLM starts (the OpenAI server, its public entry point):

- a cgroup v1 memory limit: the server in a group limited to 6 GiB, a 3.4 GB checkpoint; early
  reads are refused, and the log line names the limit (the decision is made in the server's own
  process, before any engine or worker exists: the start is ended once it is logged);
- a disk error mid-load at TP=2, through the fault filesystem (``tests/faultfs.py``): the server
  exits non-zero naming the file and offset, within a bound, leaving no process behind;
- a start killed while the early reads and the ranks' reads run (one worker SIGKILLed; the server
  SIGTERMed): no fastload process, marks directory or shared-memory file is left behind, and the
  next start on the machine loads exactly what vLLM's default loader loads.

To have the reads surely under way when the kill comes, without a checkpoint of many GB, the
killed starts read the checkpoint from a disk of its own (an ext4 image on a loop device) that a
cgroup v1 ``blkio`` group throttles for the server and everything it starts (a slow disk, made by
the kernel): the early reads and the ranks' reads then take minutes, and the next start, outside
the group, reads it at full speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import cgroups, faultfs
from tests.cpu_shm import files_in_use
from vllm_fastload.bench.cache import evict
from vllm_fastload.tools.checkpoints import PRESETS, write_random_checkpoint
from vllm_fastload.tools.processes import cpu_shm_idents, remove_logged_cpu_shm
from vllm_fastload.tools.servers import free_port
from vllm_fastload.tools.vllm_server import SMALL_MODEL_FLAGS, vllm_env

from .conftest import run_scenario


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path for a server's TMPDIR: vLLM makes its ZMQ sockets there,
    whose paths may not exceed 107 bytes (a test's ``tmp_path`` can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="fl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

pytestmark = pytest.mark.vllm

GiB = 1 << 30
#: The longest a start may take to fail or to end once told to (a hang fails the test instead).
EXIT_BOUND_S = 120
#: How long a stopped start gets between SIGTERM and SIGKILL (systemd's TimeoutStopSec, 90 s by
#: default). A rank in a read of the throttled disk outlasts any such grace, so a short one tests
#: the same: what SIGTERM ends at once, and what SIGKILL leaves behind.
STOP_GRACE_S = 15


def _server(model: Path, tp: int, log: Path, tmpdir: Path, groups: list[Path] | None = None,
            extra: str | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server with fastload, in a session of its own (its processes share it), with
    a private TMPDIR (so the marks directory its early reads make is this start's)."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(free_port()), "--tensor-parallel-size", str(tp), "--load-format", "fastload",
           *SMALL_MODEL_FLAGS]
    if extra:
        cmd += ["--model-loader-extra-config", extra]
    env = vllm_env(tp, TMPDIR=str(tmpdir), VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen(cgroups.in_group(groups, cmd) if groups else cmd, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in the log (exit {proc.poll()}):\n{log.read_text(errors='replace')[-5000:]}")


def _session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` still running (zombies aside)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(pid))
    return pids


def _session(sid: int) -> list[str]:
    """The processes of session ``sid`` still running, with their command lines."""
    left = []
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            left.append(f"{pid} {cmdline[:200]}")
    return left


def _held_shm(sid: int) -> set[str]:
    """The files in /dev/shm that the processes of session ``sid`` have open or mapped: the start's
    own (other programs on the machine may make and remove theirs meanwhile)."""
    return {f.removeprefix("/dev/shm/").removesuffix(" (deleted)") for f in files_in_use(_session_pids(sid))
            if f.startswith("/dev/shm/")}


def _wait_watching(proc: subprocess.Popen, timeout: float, held: set[str]) -> int:
    """``proc.wait(timeout)``, adding what its session holds in /dev/shm to ``held`` meanwhile."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        held |= _held_shm(proc.pid)
        time.sleep(0.2)
    return proc.wait(timeout=max(0.0, deadline - time.monotonic()))


def _end(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """End a start that is no longer needed, and everything of its session."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _assert_nothing_left(proc: subprocess.Popen, tmpdir: Path, log: Path, held: set[str],
                         early_reads_terminated: bool = False) -> None:
    """No process of the start's session, no marks directory of its early reads, and none of the
    files in /dev/shm its processes were seen to hold (``held``) but vLLM-CPU's own shared memory of
    its workers (named by the start's log, vLLM's to clean: the tests remove those as every start
    ends). The reading process ends by a signal only where the start's whole process group was
    sent one (``early_reads_terminated``)."""
    deadline = time.monotonic() + 10
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session(proc.pid), f"left running: {_session(proc.pid)}\n{log.read_text(errors='replace')[-3000:]}"
    assert not list(tmpdir.glob("fastload-loads-*")), list(tmpdir.iterdir())
    text = log.read_text(errors="replace")
    vllms = cpu_shm_idents(text)
    left = sorted(f for f in held & set(os.listdir("/dev/shm"))
                  if not any(f.startswith(ident + "-") for ident in vllms))
    if early_reads_terminated:
        # The signal reached Python's multiprocessing resource tracker of vLLM's processes too,
        # which would have unlinked their shared memory (psm_*) and semaphores (sem.mp-*): those
        # are vLLM's, left as a killed service leaves them; fastload makes nothing in /dev/shm.
        orphans = [f for f in left if f.startswith(("psm_", "sem.mp-"))]
        for name in orphans:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
        left = [f for f in left if f not in orphans]
    assert not left, f"left in /dev/shm: {left}"
    remove_logged_cpu_shm(log)
    ended = re.findall(r"fastload: early reads: the reading process ended with status (-?\d+)", text)
    assert ended == ([str(-signal.SIGTERM)] if early_reads_terminated and ended else []), ended


@pytest.mark.skipif(cgroups.v1_reason() is not None, reason=str(cgroups.v1_reason()))
def test_a_cgroup_v1_limit_of_6_gib_stops_early_reads_of_a_3_4_gb_checkpoint(tmp_path: Path):
    """The checkpoint's bytes are a hole (``sparse``): only its size matters before the ranks load,
    and the start is ended as soon as the decision is logged."""
    spec = dataclasses.replace(PRESETS["bench-llama"], layers=36)
    model = write_random_checkpoint(tmp_path / "llama-3.4g", spec, files=4, sparse=True)
    log = tmp_path / "server.log"
    with cgroups.v1_group(6 * GiB) as group:
        proc = _server(model, 1, log, tmp_path / "tmp", groups=[group])
        try:
            line = _wait_for(log, r"fastload: (no )?early reads: [^\n]*", proc, timeout=240).group(0)
        finally:
            _end(proc)
    shown = "/" + str(group.relative_to(cgroups.V1_MEMORY))
    assert line.startswith("fastload: no early reads: the checkpoint (3.43 GB) exceeds the "), line
    assert f"of the free memory under the lowest limit: cgroup v1 memory limit 6.00 GiB at {shown}, " in line, line


@pytest.fixture
def llama_copy(checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the tests' small Llama (two shards), for a start to read through the fault filesystem."""
    return Path(shutil.copytree(checkpoints["llama-gqa"], tmp_path / "source"))


@pytest.mark.skipif(faultfs.why_not() is not None, reason=str(faultfs.why_not()))
def test_an_io_error_mid_load_ends_a_tp2_start_naming_the_file_and_offset(llama_copy: Path, tmp_path: Path,
                                                                          short_tmp: Path):
    """EIO for the reads of one page of a weight that rank 0 reads (its rows of layer 1's
    gate_proj): the start fails within a bound, the server exits non-zero, and the log names the
    error, the file and the offset; nothing of the start is left running."""
    import vllm_fastload

    tensor = "model.layers.1.mlp.gate_proj.weight"
    with vllm_fastload.open(str(llama_copy)) as ckpt:
        info = ckpt.info(tensor)
    file = Path(info.file).name
    log, fslog, tmpdir = tmp_path / "server.log", tmp_path / "faultfs.log", short_tmp / "tmp"
    with faultfs.mounted(llama_copy, tmp_path / "mount", faultfs.Fault("eio", file, info.start + 64), fslog) as mount:
        started, held = time.monotonic(), set()
        proc = _server(mount, 2, log, tmpdir)
        try:
            code = _wait_watching(proc, 300, held)
        finally:
            _end(proc)
        took = time.monotonic() - started
        text = log.read_text(errors="replace")
        assert faultfs.fired(fslog), text[-3000:]
        assert code != 0, text[-3000:]
        _assert_nothing_left(proc, tmpdir, log, held)
    assert took < 300
    failure = re.search(r"ReadError: [^\n]*Input/output error[^\n]*", text)
    assert failure, text[-5000:]
    assert f"file '{mount / file}'" in failure.group(0) and "at offset" in failure.group(0), failure.group(0)


#: Bytes per second the killed starts may read from the checkpoint's disk: slow enough that the
#: early reads of the 0.8 MB checkpoint (over three minutes) cannot finish before a slow start's
#: ranks begin their loads, which then wait on the disk too.
THROTTLE_BPS = 4 << 10


def slow_disk_reason() -> str | None:
    """Why a throttled disk cannot be made here; None where it can."""
    missing = [tool for tool in ("losetup", "mkfs.ext4", "mount", "umount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (util-linux, e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control)"
    return cgroups.v1_reason("blkio")


@contextlib.contextmanager
def _slow_disk(checkpoint: Path, work: Path) -> Iterator[tuple[Path, Path]]:
    """A copy of ``checkpoint`` on a disk of its own (an ext4 image on a loop device), and a blkio
    group whose reads from that disk are throttled to ``THROTTLE_BPS``: the engine's own files
    (its libraries, on another disk) are read at full speed, the checkpoint slowly."""
    image, mountpoint = work / "disk.img", work / "disk"
    with image.open("wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    loop = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True,
                          text=True).stdout.strip()
    try:
        mountpoint.mkdir()
        subprocess.run(["mount", loop, str(mountpoint)], check=True)
        try:
            model = Path(shutil.copytree(checkpoint, mountpoint / checkpoint.name))
            os.sync()
            device = (Path("/sys/block") / Path(loop).name / "dev").read_text().strip()
            with cgroups.v1_group(None, controller="blkio") as group:
                (group / "blkio.throttle.read_bps_device").write_text(f"{device} {THROTTLE_BPS}")
                yield model, group
        finally:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def _unthrottle(group: Path) -> None:
    """Lift the read limits of the blkio group ``group`` (a limit of 0 is none)."""
    limits = group / "blkio.throttle.read_bps_device"
    for line in limits.read_text().split("\n"):
        if line.strip():
            limits.write_text(f"{line.split()[0]} 0")


def _killed_start(model: Path, slow: Path, tmp_path: Path, short_tmp: Path, name: str, kill: str) -> str:
    """A TP=2 start of ``model`` (on the slow disk, evicted from the page cache first) by a server
    in the throttled group ``slow``, killed once both ranks have begun their loads: ``worker``
    SIGKILLs rank 1's process; ``server`` stops the start as systemd stops a service
    (``KillMode=control-group``): SIGTERM to every process of it, SIGKILL to what is left after
    ``STOP_GRACE_S``. Returns its log, having checked that nothing of it is left."""
    evict(sorted(str(p) for p in model.glob("*.safetensors")))
    log, tmpdir, held = tmp_path / f"{name}.log", short_tmp / name, set()
    proc = _server(model, 2, log, tmpdir, groups=[slow])
    escalated = False
    try:
        _wait_for(log, r"fastload: early reads: \d+ checkpoint files", proc, timeout=240)
        deadline = time.monotonic() + 240
        while len(begun := list(tmpdir.glob("fastload-loads-*/begun-*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            held |= _held_shm(proc.pid)
            time.sleep(0.1)
        time.sleep(1.0)  # the ranks are reading: at THROTTLE_BPS their reads take minutes
        held |= _held_shm(proc.pid)
        assert held, "no file in /dev/shm seen held by the start (vLLM-CPU's workers map theirs there)"
        reading = [p for p in _session(proc.pid) if "vllm_fastload.early.child" in p]
        assert reading, f"the early reads had ended before the kill: {_session(proc.pid)}"
        killed_at = time.monotonic()
        if kill == "worker":
            os.kill(max(int(p.name.split("-")[1]) for p in begun), signal.SIGKILL)
            code = _wait_watching(proc, EXIT_BOUND_S, held)
            assert time.monotonic() - killed_at < EXIT_BOUND_S
        else:
            # (vLLM 0.32's server alone, sent SIGTERM while its engine starts, finishes starting.)
            os.killpg(proc.pid, signal.SIGTERM)
            # fastload's reading process ends at once, whatever vLLM's processes still do: a rank
            # in a read of the throttled disk exits only once that read returns.
            while any("vllm_fastload.early.child" in p for p in _session(proc.pid)):
                assert time.monotonic() - killed_at < 10, f"the early reads outlived SIGTERM: {_session(proc.pid)}"
                time.sleep(0.1)
            try:
                code = proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                escalated = True
                os.killpg(proc.pid, signal.SIGKILL)
                # A process dies of SIGKILL only once its read of the disk returns: the throttle
                # goes, as a slow disk would answer in the end.
                _unthrottle(slow)
                code = proc.wait(timeout=30)
    finally:
        _end(proc, signal.SIGKILL)
    if escalated:  # the server ran no exit handler: what the next start does with marks left behind
        # (the reading process, which got SIGTERM too, removes them itself as it ends)
        subprocess.run([sys.executable, "-c", "from vllm_fastload.early.marks import LoadMarks\n"
                        "LoadMarks.remove_stale()"], env={**os.environ, "TMPDIR": str(tmpdir)}, check=True)
    _assert_nothing_left(proc, tmpdir, log, held, early_reads_terminated=kill == "server")
    assert code != 0 if kill == "worker" else code in (0, -signal.SIGTERM, 1, -signal.SIGKILL), code
    return log.read_text(errors="replace")


@pytest.mark.skipif(slow_disk_reason() is not None, reason=str(slow_disk_reason()))
def test_killed_starts_leave_nothing_behind_and_the_next_start_is_exact(checkpoints, scenarios, tmp_path: Path,
                                                                        short_tmp: Path):
    with _slow_disk(checkpoints["llama-gqa"], tmp_path) as (model, slow):
        _killed_start(model, slow, tmp_path, short_tmp, "worker-killed", "worker")
        _killed_start(model, slow, tmp_path, short_tmp, "server-terminated", "server")
        # The next start, outside the throttled group: what the killed ones left must not change it.
        fast = run_scenario(tmp_path, "after-the-kills", model, "fastload", 2)
    ref = scenarios.get("llama-gqa", checkpoints["llama-gqa"], "safetensors", 2)
    assert "error" not in fast and "error" not in ref, (fast.get("error"), ref.get("error"), fast["log"][-3000:])
    for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"], strict=True)):
        assert got == want, f"rank {rank}: {[n for n in want if got.get(n) != want[n]]}"
    assert fast["tokens"] == ref["tokens"]
