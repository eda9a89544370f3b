"""Real SGLang servers: ``python -m sglang.launch_server --load-format fastload``, started as a user
starts it, against the same start with ``--load-format auto`` (SGLang's default loader).

On checkpoints the tests write (a dense Llama at TP=1, a Mixtral MoE at TP=2, where its experts
and attention are split between the ranks; ranks in scheduler processes of their own, gloo between them),
on SGLang's CPU engine: each pair of starts must give the same greedy output ids through
``/generate``; the fastload start must log fastload's rank line from every scheduler, its early
reads once per launch (SGLang's ``resolve_once`` hook runs in every process that publishes the
arguments; only the guard in ``model/early.py`` keeps the reads to one), and those reads must end
when the loads have. A checkpoint fastload refuses (a tensor of the wrong dtype) ends the start: the
``CheckpointError`` naming the file and tensor in the server's log, a non-zero exit soon after, no
process of the server left running. Each start costs tens of seconds, so each is asserted on at
once.

No quantized checkpoint is served here: SGLang's CPU engine runs quantized layers (GPTQ, AWQ,
compressed-tensors, FP8) only through its CPU kernels (tests/sglang/test_sglang_zoo.py compares
their weights in-process instead). The stubs in tests/sglang/stubs (conftest.py) stand in for
what SGLang imports from those kernels as it starts; each stub raises when called, so a server
that answers ``/generate`` here has called none of them (SGLang's torch-native attention and MoE
run the dense and the MoE model).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from tests.sglang.server import SglangTestServer
from tests.vllm.conftest import rewrite
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.servers import ServerExited
from vllm_fastload.tools.sglang_server import SMALL_MODEL_FLAGS, sglang_env

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

#: Two prompts in one batch (token ids; the test models have 500 tokens), 8 greedy tokens each.
PROMPTS = [[1, 5, 7, 9], [3, 2, 8, 4, 6, 11, 13, 400]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-server")
    return {"dense": write_checkpoint(root / "llama", "tiny-llama", files=2),
            "moe": write_checkpoint(root / "mixtral", "tiny-mixtral", files=2)}


def _serve(model: Path, load_format: str, tp: int, log: Path) -> tuple[list[list[int]], str]:
    """Start, generate, stop: the output ids and the server's log."""
    with SglangTestServer(model, ["--load-format", load_format, *SMALL_MODEL_FLAGS], tp=tp, log_path=log,
                          env=sglang_env(tp, FASTLOAD_PROGRESS="false")) as server:
        ids = server.generate(PROMPTS)
    return ids, server.log_text()


@pytest.mark.parametrize(("model", "tp"), [("dense", 1), ("moe", 2)])
def test_a_server_started_with_fastload_answers_as_with_sglangs_default_loader(models, tmp_path, model, tp):
    auto_ids, auto_log = _serve(models[model], "auto", tp, tmp_path / "auto.log")
    ids, log = _serve(models[model], "fastload", tp, tmp_path / "fastload.log")

    assert len(ids) == len(PROMPTS) and all(len(i) == 8 for i in ids)
    assert ids == auto_ids
    # The plugin is loaded, but does nothing for another load format: none of fastload's lines.
    assert not re.search(r"fastload(:| rank \d)", auto_log), auto_log[-4000:]
    for rank in range(tp):  # every scheduler loaded its rank with fastload, by its plan
        line = next((ln for ln in log.splitlines() if f"fastload rank {rank}/{tp}: read" in ln), None)
        assert line is not None, f"no fastload line from rank {rank}:\n{log[-4000:]}"
        if tp > 1:
            assert f"TP{rank}" in line  # logged by that rank's scheduler process
            share = float(line.split("checkpoint (", 1)[1].split(",", 1)[0])
            assert share < 0.8  # its own part of the checkpoint, not all of it
    assert log.count("Load weight end.") == tp
    # Early reads: started once per launch (the launcher's resolve_once; the schedulers' own calls
    # find the guard set), and let go once every rank of this node has loaded.
    assert log.count("into the page cache while SGLang starts") == 1, log[-4000:]
    assert f"{tp} of {tp} loads done" in log


def test_a_bad_checkpoint_ends_the_start_naming_file_and_tensor(tmp_path):
    """The checkpoint's k_proj has the wrong dtype (int32 for bfloat16, which no loader may cast):
    fastload's ``CheckpointError`` on a rank ends the start at TP=2 (the other rank too), and nothing
    of the server keeps running."""
    k = "model.layers.0.self_attn.k_proj.weight"
    whole = write_checkpoint(tmp_path / "llama", "tiny-llama", files=1, index=False)
    broken = rewrite(whole, tmp_path / "broken", lambda t: t.__setitem__(
        k, torch.zeros(t[k].shape, dtype=torch.int32)))
    server = SglangTestServer(broken, ["--load-format", "fastload", *SMALL_MODEL_FLAGS], tp=2,
                              log_path=tmp_path / "server.log", startup_timeout=300)
    try:
        with pytest.raises(ServerExited):
            server.start()
        assert server.proc is not None and server.proc.returncode != 0
        log = server.log_text()
        error_at = _logged_at(log, lambda line: "CheckpointError" in line and k in line and str(broken) in line)
        assert error_at is not None, log[-4000:]
        # It ends soon after the rank's error, not at a collective's or a watchdog's timeout.
        assert server.exited_at is not None and server.exited_at - error_at < 60
        deadline = time.monotonic() + 10  # what its launcher killed last may still be on its way out
        while server.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.leftovers() == []
    finally:
        server.stop()


def _logged_at(log: str, wanted) -> float | None:
    """When SGLang logged the first line ``wanted`` accepts: the time stamp of that line, or of the
    last stamped line before it (a traceback's lines carry none); None if no line is wanted."""
    stamp = None
    for line in log.splitlines():
        match = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
        if match:
            stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
        if wanted(line):
            return stamp
    return None
