"""Storage failing under an engine-free load: through a real FUSE filesystem (``tests/faultfs.py``)
that passes a checkpoint through and, mid-load, returns EIO for the reads of one page, stalls a
read there for good, cuts the file short there, or renames a new copy over it. Every one ends the
load with a ``CheckpointError`` naming the file (and the offset where one is known) within a bound,
on both reading paths: ``read_into`` (O_DIRECT into the caller's tensors) and ``iter_tensors``
handing out views of mappings of the file (``map_cached``, ``direct_io`` never). Never a hang,
never a ``SIGBUS``, and a process with a thread stuck in a stalled read still exits.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import faultfs
from vllm_fastload.tools.checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(faultfs.why_not() is not None, reason=str(faultfs.why_not()))

RUNNER = Path(__file__).with_name("faulty_loads.py")
#: The stall last: its mount is left stalled while the runner exits (a thread stuck in a read).
KINDS = ["eio", "shrink", "replace", "stall"]
#: What each fault must raise (by class name, the error or one of its bases), and what the
#: message must say besides the file.
EXPECTED = {
    "eio": ("ReadError", "Input/output error|could not be read (an I/O error)"),
    "stall": ("StalledReadError", "made no progress for"),
    "shrink": ("CheckpointError", ""),
    # Through FUSE a descriptor's attributes are looked up by name, so the new copy's mtime shows
    # ("file changed while loading"); on a local disk the descriptor keeps the old file, and the
    # name's other inode shows ("replaced while loading", test below).
    "replace": ("FileChangedError", "while loading"),
}
#: Seconds each load may take to fail: the stall's 2 s deadline and its poll, with room for a busy machine.
BOUND_S = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "demo", "demo", files=2)


@pytest.mark.parametrize("how", ["direct", "mapped"])
def test_every_fault_ends_the_load_with_an_error_naming_the_file(how: str, checkpoint: Path, tmp_path: Path):
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), str(checkpoint), str(tmp_path), how, *KINDS],
                              capture_output=True, text=True, timeout=len(KINDS) * BOUND_S + 60)
    finally:  # the runner exits with its stalled mount in place
        faultfs.unmount(tmp_path / f"{how}-stall-mount", tmp_path / f"{how}-stall.log")
    assert proc.returncode != -signal.SIGBUS, f"the load ended the process with SIGBUS:\n{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}{proc.stderr[-3000:]}"
    outcomes = {o["kind"]: o for o in map(json.loads, proc.stdout.splitlines())}
    assert sorted(outcomes) == sorted(KINDS), proc.stdout
    for kind, outcome in outcomes.items():
        error, words = EXPECTED[kind]
        assert outcome["fired"], f"{kind}: the fault never fired: {outcome}"
        assert outcome["error"] is not None, f"{kind}: the load succeeded: {outcome}"
        assert error in outcome["bases"] and "CheckpointError" in outcome["bases"], outcome
        assert outcome["file"] == f"{outcome['mount']}/model-00002-of-00002.safetensors", outcome
        assert any(w in outcome["message"] for w in words.split("|")), outcome
        assert outcome["seconds"] < BOUND_S, outcome
    assert outcomes["stall"]["after_stall"] is True, outcomes["stall"]  # a new reader, not the stuck one
    for kind in ("eio", "stall"):  # the offset of the failing read is known: it is in the message
        assert "at offset " in outcomes[kind]["message"], outcomes[kind]


def test_a_new_copy_renamed_over_a_local_file_mid_load_is_refused(checkpoint: Path, tmp_path: Path):
    """On a local disk the open descriptor still reads the old file, whole and consistent, but the
    checkpoint is no longer what was opened (another rank opening it now reads the new one)."""
    import shutil

    import torch

    import vllm_fastload
    from vllm_fastload.errors import FileChangedError

    local = tmp_path / "ckpt"
    shutil.copytree(checkpoint, local)
    name = "model-00002-of-00002.safetensors"
    with vllm_fastload.open(str(local), config={"progress": False, "aggregate_size": 2 << 20,
                                                "read_size": 1 << 20}) as ckpt:
        shutil.copyfile(local / name, local / f"{name}.new")
        (local / f"{name}.new").rename(local / name)
        with pytest.raises(FileChangedError, match="replaced while loading") as caught:
            ckpt.read_into({key: torch.empty(ckpt.info(key).shape, dtype=torch.bfloat16) for key in ckpt.keys()})
    assert caught.value.file == str(local / name)


_STARTER = """
import sys
from vllm_fastload.early import marks, process
reads = process.start_reading([sys.argv[1]], limit=1 << 40, hold=marks.LoadMarks(1), hold_s=600)
print(reads.pid, flush=True)
sys.stdin.readline()  # killed by the test meanwhile
"""


def test_early_reads_stuck_in_a_stalled_read_end_with_the_process_that_started_them(checkpoint: Path,
                                                                                     tmp_path: Path):
    """The reading process blocked for good in a read (the page at the start of the file stalls)
    never gets to look for its parent: the kernel ends it when its starter is killed."""
    log = tmp_path / "faultfs.log"
    name = "model-00001-of-00002.safetensors"
    with faultfs.mounted(checkpoint, tmp_path / "mount", faultfs.Fault("stall", name, 0), log) as mount:
        starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(mount / name)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        try:
            pid = int(starter.stdout.readline())
            deadline = time.monotonic() + 30
            while not faultfs.fired(log) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert faultfs.fired(log), "the early reads never reached the stalled page"
        finally:
            starter.kill()
            starter.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the reading process outlived its starter, stuck in the stalled read"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
