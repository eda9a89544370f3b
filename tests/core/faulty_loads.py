"""Loads through the fault filesystem, one process per reading path (``test_faults``): each fault in
turn is mounted over a fresh copy of the checkpoint and the checkpoint loaded through it, and one
JSON line per fault says what the load raised and when. A process of its own, so that a load that
ends the process (``SIGBUS``) or hangs is seen as such, and so that a thread stuck in a stalled
read must not keep it from exiting.

    python faulty_loads.py CHECKPOINT WORKDIR PATH FAULT...   (PATH: "direct" or "mapped")
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faultfs import Fault, fired, mounted

#: Small chunks, so that a file is several chunks and a fault falls mid-load.
CONFIG = {"progress": False, "aggregate_size": 2 << 20, "read_size": 1 << 20, "memory_budget": 32 << 20,
          "stall_timeout_s": 2}
#: The file the faults hit, and where in it (past its first chunks).
FILE = "model-00002-of-00002.safetensors"


def load(path: Path, how: str, outcome: dict) -> None:
    """The whole checkpoint, as each path reads it: ``direct``: ``read_into`` the caller's tensors
    (O_DIRECT where the file is not cached); ``mapped``: ``iter_tensors`` with ``direct_io``
    never (every chunk handed out as views of a mapping, copied out as an engine's
    ``load_weights`` copies them). After a stalled read, the same open checkpoint still reads a
    tensor of the other file exactly (with a new reader: ``outcome["after_stall"]``)."""
    import torch
    from safetensors.torch import load_file

    import vllm_fastload
    from vllm_fastload.errors import StalledReadError

    config = {**CONFIG, "direct_io": "never"} if how == "mapped" else CONFIG
    with vllm_fastload.open(str(path), config=config) as ckpt:
        try:
            if how == "direct":
                ckpt.read_into({name: torch.empty(ckpt.info(name).shape, dtype=torch.bfloat16)
                                for name in ckpt.keys()})
            else:
                for _, tensor in ckpt.iter_tensors():
                    tensor.clone()
        except StalledReadError:
            want = load_file(str(path / "model-00001-of-00002.safetensors"))
            name = sorted(want)[0]
            outcome["after_stall"] = bool(torch.equal(ckpt.get_tensor(name), want[name]))
            raise


def main() -> None:
    checkpoint, work, how, kinds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    assert "stall" not in kinds[:-1], "the stalled mount is left in place: it comes last"
    offset = (checkpoint / FILE).stat().st_size * 3 // 5
    for kind in kinds:
        source = work / f"{how}-{kind}-source"
        shutil.copytree(checkpoint, source)
        log = work / f"{how}-{kind}.log"
        mount_point = work / f"{how}-{kind}-mount"
        stack = contextlib.ExitStack()
        mount = stack.enter_context(mounted(source, mount_point, Fault(kind, FILE, offset), log))
        start = time.monotonic()
        outcome: dict = {"error": None}
        try:
            load(mount, how, outcome)
        except Exception as exc:
            outcome.update(error=type(exc).__name__, message=str(exc), file=getattr(exc, "file", None),
                           bases=[c.__name__ for c in type(exc).__mro__])
        outcome.update(kind=kind, seconds=time.monotonic() - start, fired=fired(log), offset=offset,
                       mount=str(mount))
        if kind != "stall":  # a stalled mount stays: this process must exit with a thread stuck in it
            stack.close()
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
